"""Contact-map head as one fused CUDA kernel (KernelBench format: defines `ModelNew`).

Drop-in replacement for `reference/contact_map.py`'s `Model`:

    x[b,i,j,c]  = LayerNorm_c(pair[b,i,j,:])                   gamma, beta, eps from `layer_norm`
    s[b,i,j,c]  = (x[b,i,j,c] + x[b,j,i,c]) / 2                symmetric in (i, j)
    h1[b,i,j,h] = relu(sum_c W1[h,c] s[b,i,j,c] + b1[h])       mlp[0]: pair_dim -> hidden_dim
    h2[b,i,j,g] = relu(sum_h W2[g,h] h1[b,i,j,h] + b2[g])      mlp[2]: hidden_dim -> hidden_dim
    out[b,i,j]  = sigmoid(sum_g w3[g] h2[b,i,j,g] + b3)        mlp[4]: hidden_dim -> 1

Tensors: pair (B, N, N, pair_dim) float32 on a CUDA device (any strides); out (B, N, N) float32,
same device. Parameters: the reference's, read at every call (a later `load_state_dict` or in-place
update takes effect), all float32 on the input's device.

How it runs: s is symmetric, so out is exactly symmetric (out[b,i,j] == out[b,j,i] bit for bit). One
persistent kernel (v1-v9; v10's, v11's, v13's, v14's, v17's, v19's and v20's differences are in the variant list below) walks the
tiles (b, I, J) with I <= J of 8 x 8 positions: it copies the tile
x[b, I, J, :] and its mirror x[b, J, I, :] into shared memory (cp.async, 16-byte copies when
pair_dim % 4 == 0), computes the LayerNorm statistics of each vector by the corrected two-pass
algorithm (Chan, Golub & LeVeque 1983: a first mean m, then with d = x - m, mean = m + sum d / C and
var = (sum d^2 - (sum d)^2 / C) / C: stable for any offset, exact on rows of one value), builds s (64 pairs x
pair_dim; v1-v3: its transpose) in shared memory, runs the MLP as two matrix products against
weights staged once per block in shared memory, and writes both out[b,i,j] and out[b,j,i]. Each input element is read from
device memory once, each unordered pair {i, j} off the diagonal tiles is computed once, and nothing
but the output is written.

Precision: fp32 inputs, outputs, LayerNorm and accumulation (no fast-math). The tensor-core variants
(v5 and later) run the two products in split TF32 ("3xTF32": each fp32 operand x = hi + lo, both TF32,
and a*b ~ hi*hi + hi*lo + lo*hi; CUTLASS ships the same scheme as its fp32-accurate tensor-core GEMM),
promoting short partial sums into an fp32 accumulator by ordinary adds (the tensor cores' own
accumulation truncates): v5-v9 every k step's hi*hi, v10-v20 every 16 k. Measured against an
fp64 evaluation on the H200 (harness, every distribution, max over the trials): v20 (default) 0.08x the fp32
PyTorch reference's own max error at crop, 0.05x at batch, 0.08x at long and 0.05x at awkward_129 (its own
kernel; the reference's worst trial is the +100 offset input, 2.0e-6 at crop, where v20 has 1.5e-7), at most
about 1.1x in any single trial at those shapes (x100 at crop: 1.4e-7 against 1.3e-7; v19 had 1.1e-7 there),
elsewhere v19's (2026-12-01, fifteenth
session's device runs 5-7, four harness runs); v19, v17, v14 and v13
(the same arithmetic: bit-identical outputs) 0.52x the fp32 PyTorch reference's own max error at crop,
0.49x at batch, 0.50x at long and 0.32x at awkward_129 (their own kernel), and where they run v11's
kernel (pair_dim <= 64) 0.73x at seed and 0.41x at awkward_37, v9's (N < 8) 1.14x at N = 1
(awkward_1) (2026-12-01, thirteenth session's device runs 2, 4 and 6, all three variants checked; v19 in the
fourteenth session's run 7, twice: the same err64 columns as v17's); v11 and v10 (the same arithmetic: bit-identical outputs) 0.73x at seed,
0.52x at crop, 0.49x at batch, 0.50x at long, 0.41x at awkward_37, 1.14x at N = 1 and 0.32x at
awkward_129 (tenth session's device run 4); v10 and v11 at most 1.67x over
37 more shape/distribution checks of run 3 with a scratch script (not in the repository), not the harness
(x100, +100 offset and uniform inputs included; the worst at one 8 x 8 tile, errors <= 2.1e-7).
A NaN in the input gives NaN at the same outputs as the reference (the ReLUs are max.NaN, which keeps
NaN). On a row of one constant value the centred values are exactly 0 (the corrected two-pass; in v20
within the rounding of d r, about 2^-24 of it: 1e-11 at values near 10, a review's float32 simulation). The
plain two-pass mean used until the tenth session, a rounded sum times a rounded 1 / pair_dim, missed
the value by an ulp there, and rstd = 1 / sqrt(eps) turned that into up to 160x the reference's error
at pair_dim 48 / 80. Known exceptions, found by review helpers' own scripts (not the harness), v9
alike: up to 4.2x at some tiny shapes (N <= 17: pair_dim 96, N = 15, hidden_dim 1: 1.75e-7 against
4.1e-8; errors <= 4.1e-7; v9 up to 4.4x; tenth session), 2.9x with per-row offsets of +-1000 (v9 2.3x;
ninth session, before the corrected statistics), and at |x - mean| above ~1e19 (values near 1e25)
sum d^2 overflows, so rows there give NaN (the fp32 reference has NaN there too, at other positions).

Variants (`ModelNew.VARIANTS`, selected by `model.variant`, default the first):
    "v20" (default; Hopper) v19 with each side's LayerNorm term (x - mean) rstd / 2 computed as one
          FFMA per channel, fmaf(d, r, -delta r), from the d = x - m that the statistics' second pass
          already computes (m: its first pass's mean; delta = sum d / C, the corrected two-pass's
          correction of m) instead of a subtraction from the mean and a multiply: per input value the
          statistics, terms and split take 7 instructions instead of 8 (the kernel's FP instructions
          1993 -> 1855 at hidden 32). The mean (near the offset at offset inputs) is never rounded,
          so v20 is more accurate there (see Precision); elsewhere its errors are v19's within
          +-30%. Harness, H200, 2026-12-01 (fifteenth session, device runs
          5-7, four harness runs on two machine leases): crop 0.03283-0.03307, batch 0.07482-0.07523,
          long 0.3477-0.3506 ms per call. Against v19 in the same runs (a scratch script, not the
          harness: the harness's flushed loop per call / over CUDA-graph replays) crop -4.1% /
          -3.2% and -3.8% / -3.4%, batch -0.3% / -0.5% and -0.3% / -0.6%, long -3.5% / -3.3% and
          -2.7% / -3.0%. Runs where v10 runs (else what v9 runs; `last_variant` says "v20"); at
          pair_dim <= 64 it runs v11's kernel.
    "v19" (Hopper) v17 with the tiles handed out at run time: each block's first two tiles
          are fixed, every later one goes to whichever block's producer asks next (an atomic counter
          that the params kernel zeroes on each call), so blocks whose copies land sooner take more
          tiles. Also: the tile half's (x - mean) rstd / 2 is computed before the wait for the mirror
          half, and the tensor maps promote L2 requests to 128 bytes. Bit-identical to v17. Harness,
          H200, 2026-12-01 (fourteenth session, device run 7, two harness runs): crop 0.03429 /
          0.03443, batch 0.07598 / 0.07614, long 0.3636 / 0.3655 ms per call. Against v17 in the same
          run (a scratch script, not the harness: the harness's flushed loop per call / over CUDA-graph
          replays) crop -0.6% / +0.1%, batch -4.1% / -4.3%, long -3.4% / -3.4%. Runs where v10 runs
          (else what v9 runs; `last_variant` says "v19"); at pair_dim <= 64 it runs v11's kernel.
    "v17" (Hopper) v14 with its tile copies (TMA) marked L2 evict_first. Each input byte is
          read once, so its L2 lines are the first to be replaced when a later copy misses, and the
          other lines in L2 stay. The harness's flush leaves L2 full of dirty lines; without the hint
          the input's reads evict them, and their write-back competes with the reads. Bit-identical
          to v14. Harness, H200, 2026-12-01 (thirteenth session, device runs 2, 4 and 6): crop
          0.03475 / 0.03456 / 0.03472, batch 0.07918 / 0.07898 / 0.07971, long 0.3775 / 0.3695 /
          0.3742 ms per call. Against v14 in run 2
          (a scratch script, not the harness: the harness's flushed loop per call / over CUDA-graph
          replays, interleaved rounds) crop -1.4% / -2.1%, batch -3.2% / -3.4%, long +0.5% / +0.3%:
          long is bound by the consumers' arithmetic, not by memory. Runs where v10 runs (else what v9 runs;
          `last_variant` says "v17"); at pair_dim <= 64 it runs v11's kernel.
    "v14" (Hopper) v13 with the two consumer warpgroups' products (GEMM1 + GEMM2) taking
          turns (FlashAttention-3's ping-pong: named barriers), so that one warpgroup's products run
          while the other computes its statistics and s. Bit-identical to v13. Harness, H200,
          2026-12-01 (twelfth session, device run 8): crop 0.03544, batch 0.08237, long 0.3788 ms per
          call; in GPU time (CUDA graphs, L2 flushed, scratch timing, device runs 3, 4 and 7) 0.5-1.2%
          faster than v13 at crop, 2.2-4.0% at long, within 0.7% at batch. Runs where v10 runs (else
          what v9 runs; `last_variant` says "v14"); at pair_dim <= 64 it runs v11's kernel.
    "v13" (Hopper) v11 with less work per tile on the consumers' path: the producer
          thread walks the tiles incrementally and hands each tile's (b, I, J) over in shared memory
          (no per-tile division and square root by the consumers: ~700 cycles per tile in a clock64
          timeline), slots and parities tracked incrementally, the statistics' second pass as
          FFMA / FADD chains, the A fragments' lo parts unmasked, setmaxnreg 240 / 24. Harness, H200,
          2026-12-01 (eleventh session, device run 7): crop 0.03574, batch 0.08194, long 0.3810 ms
          per call (v11 in device run 4, batch still with 5 ring slots: 0.03973, 0.08616, 0.4285).
          Runs where v10 runs (else what v9 runs; `last_variant` says "v13"); at pair_dim <= 64 it
          runs v11's kernel.
    "v11" (Hopper) v10 with each tile's rows read from the ring slots once, into registers
          (128 per thread at pair_dim 128), the slots released at once, and the statistics and s
          computed from the registers (v10 reads every row twice from the slots, for the statistics
          and for s, and holds the slots until s is built). Harness, H200, 2026-12-01 (tenth
          session, device runs 4 and 5): crop 0.0392-0.0398, batch 0.0879, long 0.4273 ms per
          call against v10's 0.0398-0.0400, 0.0870 and 0.4392 in the same device runs: 2.7% faster
          at long, within 1-2% of v10 at crop and batch (before the eleventh session's shared-space
          loads and 4-slot ring). Runs where v10 runs (else what v9 runs; `last_variant` says "v11").
    "v10" (Hopper) both products on wgmma (m64nNk8 TF32, A from registers) in split TF32,
          GEMM1's accumulator chained in registers into GEMM2's A operand, the tiles brought in by
          the TMA engine (4-D tensor maps, boxes of 32 channels x 8 x 8 positions, 128-byte swizzle; a producer warp, a ring of
          mbarrier slots), two consumer warpgroups each on its own tile, the LayerNorm affine folded
          into W1 and b1 (a small per-call kernel packs the weights; the main kernel is launched as
          its programmatic dependent). Harness, H200, 2026-12-01: crop 0.0399, batch 0.0885, long
          0.4465 ms per call (v9: 0.084, 0.198, 1.136; 2.1-2.5x; ninth session). Runs where the extension was built
          with sm_90a code (9.0 in the arch list, or no list and an H100/H200: built as sm_90a),
          on a compute capability 9.0 GPU, at 32 <= pair_dim <= 128 with pair_dim % 16 == 0,
          hidden_dim <= 64, N >= 8 and a 16-byte aligned input; elsewhere it runs what v9 runs
          (`last_variant` says "v10").
    "v9"  v7 where hidden_dim <= 32 and one block fits per SM (batch; on the H200
          pair_dim >= 97 at hidden_dim 17-32, >= 113 at hidden_dim <= 16): the hidden units in 2
          column groups (at hidden_dim 17-32; v7 has 4, and 2 already at <= 16), so 8 of the 16
          warps are free during the first product and queue the first 64 rows of the next tile
          then (issuing a copy stalls the issuing warp for ~340 cycles); the other rows after it
          by all 16 warps. 0.198 against v7's 0.215 ms at batch (harness, H200, 2026-11-29; not
          timed at hidden_dim <= 16). Everywhere else it runs what v7 runs (`last_variant` says
          "v9").
    "v7"  v5 with 16 warps per tile (4 blocks of 16 pairs x 4 groups of the hidden units;
          the statistics, s build and copies spread over twice the threads) and the A operands
          split in 4 instructions instead of 9; at pair_dim <= 128 with the weights in shared
          memory (always at hidden_dim 65-128) the LayerNorm statistics and s in one pass over the
          tile, read once into registers (at hidden_dim <= 32 only where one block fits per SM,
          on the H200 pair_dim >= 97 at hidden_dim 17-32 and >= 113 at hidden_dim <= 16; where two
          fit, their 64-register budget allows it at pair_dim <= 64).
          1.24-1.32x faster than v5 at crop, batch and long (harness, H200, 2026-11-29). At
          hidden_dim > 128 it runs v5's kernel (16 warps would need more than the 128 registers per
          thread they may have; `last_variant` still says "v7").
    "v5"  the products on the tensor cores (mma.sync m16n8k8 TF32, sm_80+) in split TF32:
          8 warps = 4 blocks of 16 pairs x 2 halves of the hidden units, weights staged as split
          fragments. 1.05-1.22x faster than v3 at crop, batch and long (NOTES.md says why not more).
    "v3"  v2 with the FMA products software-pipelined: the shared-memory operands of the next 4
          values of k are loaded into registers while the current 4 are multiplied.
    "v2"   v1 with the LayerNorm statistics computed by two threads per vector (v1's one
          warp per vector ran 16 vectors in sequence, each ending in two dependent 5-step shuffle
          reductions), coalesced weight staging, and per-row instead of per-copy index arithmetic
          in the tile loader.
    "v1"  the first version (fp32 FMA products, 4 pairs x hidden/16 outputs per thread), kept as a
          second opinion for the tests and the harness.

Limits: pair_dim up to 256 and hidden_dim up to 256 (larger raises a clear error). hidden_dim is
zero-padded to 16/32/64/128/256 inside the kernel. The weights are staged in shared memory when
they fit beside the tile (227 KB per block on the H200; v5, v7, v9: pair_dim <= 248 / 208 / 144 / 40 at
hidden_dim <= 16 / 32 / 64 / 128, never above 128; v1-v3: <= 256 / 244 / 200 / 120); otherwise they
are read through the L1 cache: correct but slower. Forward only: `.backward()` through it raises.
Float32 only. Needs an sm_80+ GPU (cp.async, TF32 mma.sync); built for whatever TORCH_CUDA_ARCH_LIST
names (9.0 as sm_90a, for v10, v11, v13, v14, v17, v19 and v20; no list and no GPU: 9.0).

Run: `python harness.py contact_map` (checks against the reference in fp32 and fp64, then times it
against eager PyTorch and torch.compile). The first import compiles the CUDA source (about 2 minutes
on a GPU machine's 16 cores, up to 5 on a 2-core laptop or CI runner);
later imports load it from PyTorch's extension cache. Set CONTACT_MAP_VERBOSE=1 to see the compiler
output, including `ptxas -v` register and spill counts.
"""
import hashlib
import os
import re
import sys

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cmath>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace contact_map {

// =============================================================================================
// Helpers
// =============================================================================================
constexpr int TILE = 8;                  // a tile is 8 x 8 positions (i in I-tile, j in J-tile)
constexpr int PAIRS = TILE * TILE;       // 64 pairs per tile
constexpr int LDP = PAIRS + 4;           // row stride (floats) of the pair-minor matrices s^T, h1^T
constexpr int THREADS = 256;
constexpr int TH_H = 16;                 // GEMM layout: 16 threads along hidden ...
constexpr int TH_P = THREADS / TH_H;     // ... times 16 threads along pairs,
constexpr int RM = PAIRS / TH_P;         // each owning 4 consecutive pairs
constexpr int MAX_PAIR_DIM = 256;
constexpr int MAX_HIDDEN = 256;

__host__ __device__ inline int cdiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ inline int round_up(int a, int b) { return cdiv(a, b) * b; }

// Error-message pieces as std::string. Streaming integers or shapes through c10::str from this
// nvcc-compiled file crashed inside libstdc++ on the torch 2.11 GPU image (seen 2026-11-29), so
// messages are built from std::to_string instead.
template <typename T>
inline std::string num(T v) { return std::to_string(v); }
inline std::string shape_str(c10::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Asynchronous global -> shared copies (sm_80+). src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(float* smem, const float* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// s = (LN(va) + LN(vb)) / 2 per component: va, vb the raw values of x[b,i,j] and x[b,j,i] at the
// same 4 channels, (ma, ra) and (mb, rb) their rows' mean and 1 / std, gg and be gamma and beta.
// One expression for every variant (v1-v3 build s^T, v5 build_s, v7 stats_build_fused).
__device__ __forceinline__ float4 sym_ln4(float4 va, float4 vb, float ma, float ra, float mb, float rb, float4 gg,
                                          float4 be) {
  float4 o;
  o.x = 0.5f * (((va.x - ma) * ra * gg.x + be.x) + ((vb.x - mb) * rb * gg.x + be.x));
  o.y = 0.5f * (((va.y - ma) * ra * gg.y + be.y) + ((vb.y - mb) * rb * gg.y + be.y));
  o.z = 0.5f * (((va.z - ma) * ra * gg.z + be.z) + ((vb.z - mb) * rb * gg.z + be.z));
  o.w = 0.5f * (((va.w - ma) * ra * gg.w + be.w) + ((vb.w - mb) * rb * gg.w + be.w));
  return o;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ReLU that keeps NaN (fmaxf(NaN, 0) is 0; torch.relu gives NaN): max.NaN (sm_80+), one instruction.
__device__ __forceinline__ float relu(float v) {
  float r;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(r) : "f"(v));
  return r;
}

// LayerNorm statistics by the corrected two-pass algorithm (Chan, Golub & LeVeque 1983): with the first
// pass's mean m and d = x - m over the C valid channels, d1 = sum d, d2 = sum d^2:
// mean = m + d1 / C, var = (d2 - d1^2 / C) / C. The correction absorbs the rounding of m, which a
// plain two-pass keeps: on a row of one value at C = 48 or 80, m = sum * (1 / C) misses the value by an
// ulp and rstd = 1 / sqrt(eps) turned that into 160x the reference's error (ninth session's review).
__device__ __forceinline__ void ln_stats(float m, float d1, float d2, float inv_c, float eps, float& mean, float& rstd) {
  mean = m + d1 * inv_c;
  const float var = (d2 - d1 * d1 * inv_c) * inv_c;
  rstd = rsqrtf((var < 0.f ? 0.f : var) + eps);
}

// Hidden unit owned by register r of the thread at hidden-group hg (0..15), RH = HP / 16 units per
// thread. For RH >= 4 the units come in float4 groups interleaved across the 16 threads, so a
// warp's 16-byte weight loads cover one contiguous 256-byte run (no bank conflicts).
template <int RH>
__device__ __forceinline__ int hidden_of(int r, int hg) {
  if constexpr (RH >= 4) return ((r >> 2) * TH_H + hg) * 4 + (r & 3);
  else return hg * RH + r;
}

// w[r] = W^T[k][hidden_of(r, hg)] from a shared-memory matrix row `row` (HP floats, zero-padded).
template <int RH>
__device__ __forceinline__ void load_w_smem(const float* row, int hg, float (&w)[RH]) {
  if constexpr (RH >= 4) {
#pragma unroll
    for (int q = 0; q < RH / 4; ++q) {
      const float4 v = *reinterpret_cast<const float4*>(row + (q * TH_H + hg) * 4);
      w[4 * q + 0] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
    }
  } else if constexpr (RH == 2) {
    const float2 v = *reinterpret_cast<const float2*>(row + hg * 2);
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = row[hg];
  }
}

// Same values from the unpadded row-major global weight W (n_out x n_in): W^T[k][h] = W[h][k],
// zero outside (k < n_in, h < n_out). The fallback when the weights do not fit in shared memory.
template <int RH>
__device__ __forceinline__ void load_w_global(const float* __restrict__ W, int n_in, int n_out, int k,
                                              int hg, float (&w)[RH]) {
#pragma unroll
  for (int r = 0; r < RH; ++r) {
    const int h = hidden_of<RH>(r, hg);
    w[r] = (h < n_out && k < n_in) ? __ldg(W + static_cast<long long>(h) * n_in + k) : 0.f;
  }
}

// acc[m][r] += sum_{k < K} A[k][4*pg + m] * W^T[k][hidden_of(r, hg)]
// A: shared, K x LDP (pair-minor). W^T: shared K x HP when W_SMEM, else the global W (n_out x n_in).
template <int RH, bool W_SMEM>
__device__ __forceinline__ void mlp_gemm(const float* A, int K, const float* WT, int HP,
                                         const float* __restrict__ Wg, int n_in, int n_out, int pg,
                                         int hg, float (&acc)[RM][RH]) {
#pragma unroll 4
  for (int k = 0; k < K; ++k) {
    const float4 a = *reinterpret_cast<const float4*>(A + k * LDP + pg * RM);
    float w[RH];
    if constexpr (W_SMEM) load_w_smem<RH>(WT + k * HP, hg, w);
    else load_w_global<RH>(Wg, n_in, n_out, k, hg, w);
#pragma unroll
    for (int r = 0; r < RH; ++r) {
      acc[0][r] = fmaf(a.x, w[r], acc[0][r]);
      acc[1][r] = fmaf(a.y, w[r], acc[1][r]);
      acc[2][r] = fmaf(a.z, w[r], acc[2][r]);
      acc[3][r] = fmaf(a.w, w[r], acc[3][r]);
    }
  }
}

// v3: the same product with the operands of the next G values of k loaded into registers while
// the FMAs of the current G run (two named register buffers, so no run-time register indexing).
// In v2 the warps stalled on these shared-memory loads (ncu, crop: "short scoreboard" was 36% of
// the stall cycles at 2 warps per scheduler). K must be a multiple of G (CP and HP are multiples
// of 4).
template <int RH, bool W_SMEM>
__device__ __forceinline__ void mlp_gemm_pipelined(const float* A, int K, const float* WT, int HP,
                                                   const float* __restrict__ Wg, int n_in, int n_out,
                                                   int pg, int hg, float (&acc)[RM][RH]) {
  constexpr int G = RH <= 8 ? 4 : 2;  // k values per register buffer (register budget)
  float4 a0[G], a1[G];
  float w0[G][RH], w1[G][RH];
  auto load = [&](float4 (&a)[G], float (&w)[G][RH], int k0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      a[g] = *reinterpret_cast<const float4*>(A + (k0 + g) * LDP + pg * RM);
      if constexpr (W_SMEM) load_w_smem<RH>(WT + (k0 + g) * HP, hg, w[g]);
      else load_w_global<RH>(Wg, n_in, n_out, k0 + g, hg, w[g]);
    }
  };
  auto fma_group = [&](const float4 (&a)[G], const float (&w)[G][RH]) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int r = 0; r < RH; ++r) {
        acc[0][r] = fmaf(a[g].x, w[g][r], acc[0][r]);
        acc[1][r] = fmaf(a[g].y, w[g][r], acc[1][r]);
        acc[2][r] = fmaf(a[g].z, w[g][r], acc[2][r]);
        acc[3][r] = fmaf(a[g].w, w[g][r], acc[3][r]);
      }
  };
  load(a0, w0, 0);
  for (int k0 = 0; k0 < K; k0 += 2 * G) {
    load(a1, w1, k0 + G < K ? k0 + G : k0);  // past the end: reload (harmless, no branch)
    fma_group(a0, w0);
    if (k0 + G >= K) break;
    load(a0, w0, k0 + 2 * G < K ? k0 + 2 * G : k0);
    fma_group(a1, w1);
  }
}

// ---- split TF32 on the tensor cores (v5) ----------------------------------------------------
// x = hi + lo with hi = x rounded to TF32 (10 mantissa bits) and lo = (x - hi) rounded to TF32; x - hi
// is exact in fp32. a*b ~ hi_a*hi_b + hi_a*lo_b + lo_a*hi_b: the dropped lo_a*lo_b is ~2^-22 |a*b|.
// (The "3xTF32" scheme of CUTLASS's tfloat32x3 / big+small GEMMs.) On sm_90 cvt.rna.tf32.f32 is
// emulated (4 instructions with an Inf/NaN test), so a split costs 9 instructions.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}
// v7's split in 4 instructions: hi = x rounded to TF32 by adding half a TF32 ulp to the magnitude
// and clearing the low 13 bits (ties away from zero, as cvt.rna); lo = x - hi (exact in fp32)
// truncated to TF32 by clearing its low 13 bits (lo's error is then ~2^-21 |x| instead of ~2^-22,
// against 2^-24 for an fp32 rounding; the max errors: NOTES.md). Finite x only: within half a TF32
// ulp of FLT_MAX, hi becomes inf and the products NaN (cvt.rna.tf32 does the same); the operands
// here are LayerNorm and ReLU outputs and the weights. MASK_LO = false (v13's wgmma operands): lo
// keeps its low 13 bits, one LOP3 less. The tensor cores read the top 19 bits of a TF32 operand,
// which is the same truncation (with and without the mask, 10 of 10 outputs bit-identical on the
// H200: scratch build, eleventh session's device run 4).
template <bool MASK_LO = true>
__device__ __forceinline__ void split_tf32_fast(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
  if constexpr (MASK_LO) lo &= 0xffffe000u;
}
template <bool FAST>
__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (FAST) split_tf32_fast(x, hi, lo);
  else split_tf32(x, hi, lo);
}

// d += A(16 x 8, row-major) * B(8 x 8, column-major), TF32 inputs, fp32 accumulate (sm_80+).
// Fragments (g = lane / 4, t = lane % 4): a = {A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]},
// b = {B[t][g], B[t+4][g]}, d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// How the tensor-core kernel holds W^T (the B operand): split fragments in shared memory, or the
// global W read through L1 and split on the fly (when the weights do not fit beside the tile).
enum class WFormat { kSplit, kGlobal };

// Stage W1^T and W2^T (W1: H x C, W2: H x H, row-major, global) as split-TF32 B fragments in shared
// memory, W2's right after W1's: dst[(ks * NT + nt) * 32 + lane] = {hi W[n][k], hi W[n][k+4],
// lo W[n][k], lo W[n][k+4]} with n = 8 nt + g, k = 8 ks + t, zero outside (k < n_in, n < H); ks <
// CP / 8 for W1, then HP / 8 for W2; nt < NT = HP / 8. One 16-byte shared-memory load per lane per
// (k step, n tile) in the product, conflict-free. Both matrices in one loop, unrolled by 8, so that a
// thread's loads are in flight together (the prologue is a chain of dependent global round trips).
template <int HP, int NTHR>
__device__ __forceinline__ void stage_weight_fragments(const float* __restrict__ w1, const float* __restrict__ w2,
                                                       int C, int H, int CP, float* dst) {
  constexpr int NT = HP / 8;
  const int n1 = (CP / 8) * NT * 32, n_frag = n1 + (HP / 8) * NT * 32;
#pragma unroll 8
  for (int e = threadIdx.x; e < n_frag; e += NTHR) {
    const bool second = e >= n1;
    const float* W = second ? w2 : w1;
    const int n_in = second ? H : C, ee = second ? e - n1 : e;
    const int lane = ee & 31, f = ee >> 5;
    const int n = (f % NT) * 8 + (lane >> 2), k = (f / NT) * 8 + (lane & 3);
    const bool row_ok = n < H;
    const float v0 = row_ok && k < n_in ? __ldg(W + static_cast<long long>(n) * n_in + k) : 0.f;
    const float v1 = row_ok && k + 4 < n_in ? __ldg(W + static_cast<long long>(n) * n_in + k + 4) : 0.f;
    uint32_t h0, l0, h1, l1;
    split_tf32(v0, h0, l0);
    split_tf32(v1, h1, l1);
    reinterpret_cast<float4*>(dst)[e] =
        make_float4(__uint_as_float(h0), __uint_as_float(h1), __uint_as_float(l0), __uint_as_float(l1));
  }
}

// One warp: acc[nt] += A(16 rows, K) * W^T(K, 8 NTW columns starting at column 8 nt0), split TF32.
// A: shared, row-major with stride lda (lda = 4 mod 8: the scalar fragment loads are conflict-free),
// K a multiple of 8, zero-padded. W^T: split fragments Wf from stage_weight_fragments (NT n tiles per k
// step), or (kGlobal) the global W (n_out x n_in) read through L1 and split here.
// Accumulation: the big products hi*hi of each k step go into a zeroed register set that is then
// added to acc with an ordinary fp32 add (the tensor cores' internal accumulation truncates, so acc
// never passes through it: the promotion FP8 GEMMs use), so the rounding of acc is that of an fp32
// FMA loop. The small products lo*hi and hi*lo (~2^-11 of the big ones) accumulate on the tensor
// cores in two separate register sets over all of K (one set for 8+ n tiles per warp: registers;
// their truncation error is ~2^-33 relative) and are added at the end. Each mma depends on at most
// one earlier mma. (v5's first cut chained the three products of every k step into one set; this
// order was meant to shorten the dependency chains but measured ~5% slower: NOTES.md, to re-test.)
template <int NTW, WFormat WF, bool FAST>
__device__ __forceinline__ void tc_gemm(const float* A, int lda, int K, const void* Wf, int NT, int nt0,
                                        const float* __restrict__ Wg, int n_in, int n_out,
                                        float (&acc)[NTW][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float* ap = A + g * lda + t;
  float sm1[NTW][4], sm2[NTW][4];  // lo(A) hi(W), hi(A) lo(W)
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) sm1[nt][q] = sm2[nt][q] = 0.f;
#pragma unroll(NTW >= 8 ? 1 : 2)  // 2 k steps in flight, within the register budget
  for (int ks = 0; ks < K / 8; ++ks) {
    uint32_t ah[4], al[4];
    split<FAST>(ap[8 * ks], ah[0], al[0]);
    split<FAST>(ap[8 * ks + 8 * lda], ah[1], al[1]);
    split<FAST>(ap[8 * ks + 4], ah[2], al[2]);
    split<FAST>(ap[8 * ks + 8 * lda + 4], ah[3], al[3]);
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      uint32_t bh0, bh1, bl0, bl1;
      if constexpr (WF == WFormat::kSplit) {
        const float4 w = reinterpret_cast<const float4*>(Wf)[(ks * NT + nt0 + nt) * 32 + lane];
        bh0 = __float_as_uint(w.x); bh1 = __float_as_uint(w.y);
        bl0 = __float_as_uint(w.z); bl1 = __float_as_uint(w.w);
      } else {
        const int n = (nt0 + nt) * 8 + g, k = ks * 8 + t;
        const float v0 = n < n_out && k < n_in ? __ldg(Wg + static_cast<long long>(n) * n_in + k) : 0.f;
        const float v1 = n < n_out && k + 4 < n_in ? __ldg(Wg + static_cast<long long>(n) * n_in + k + 4) : 0.f;
        split<FAST>(v0, bh0, bl0);
        split<FAST>(v1, bh1, bl1);
      }
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mma_tf32(d, ah, bh0, bh1);
      mma_tf32(sm1[nt], al, bh0, bh1);
      if constexpr (NTW >= 8) mma_tf32(sm1[nt], ah, bl0, bl1);  // register budget: one set
      else mma_tf32(sm2[nt], ah, bl0, bl1);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] += d[q];
    }
  }
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[nt][q] += NTW >= 8 ? sm1[nt][q] : sm1[nt][q] + sm2[nt][q];
}

// Tile (I, J) as linear index u in [0, nT(nT+1)/2): u = J(J+1)/2 + I with I <= J. Below 2^31 tiles
// (every realistic input) in 32-bit arithmetic with a float square root (clock64 at batch: 905 cycles
// per tile with the 64-bit division and double square root, ~710 with this: NOTES.md); the loops
// correct the root's rounding either way.
__device__ __forceinline__ void decode_tile(long long t, long long tiles_per_b, int& b, int& I, int& J) {
  long long u, jj;
  if (t + tiles_per_b < (1ll << 31)) {
    const unsigned tu = static_cast<unsigned>(t), tpb = static_cast<unsigned>(tiles_per_b);
    const unsigned q = tu / tpb;
    b = static_cast<int>(q);
    u = tu - q * tpb;
    jj = static_cast<long long>((sqrtf(8.f * static_cast<float>(u) + 1.f) - 1.f) * 0.5f);
  } else {
    b = static_cast<int>(t / tiles_per_b);
    u = t - static_cast<long long>(b) * tiles_per_b;
    jj = static_cast<long long>((sqrt(8.0 * static_cast<double>(u) + 1.0) - 1.0) * 0.5);
  }
  while (jj * (jj + 1) / 2 > u) --jj;
  while ((jj + 1) * (jj + 2) / 2 <= u) ++jj;
  J = static_cast<int>(jj);
  I = static_cast<int>(u - jj * (jj + 1) / 2);
}

// decode_tile for t < 2^31 and row J < 46341 (jj (jj + 1) in int; the host checks both; v19's producer, in 24
// registers).
__device__ __forceinline__ void decode_tile32(unsigned t, unsigned tiles_per_b, int& b, int& I, int& J) {
  const unsigned q = t / tiles_per_b, u = t - q * tiles_per_b;
  int jj = static_cast<int>((sqrtf(8.f * static_cast<float>(u) + 1.f) - 1.f) * 0.5f);
  while (static_cast<unsigned>(jj * (jj + 1) / 2) > u) --jj;
  while (static_cast<unsigned>((jj + 1) * (jj + 2) / 2) <= u) ++jj;
  b = static_cast<int>(q);
  J = jj;
  I = static_cast<int>(u - static_cast<unsigned>(jj * (jj + 1) / 2));
}

// Rows row0..row1-1 of load_tile below (v2 and later: a warp copies whole rows, so the index
// arithmetic is per row), by nw warps of which the caller is warp wid. v5/v7 queue a tile in two
// halves, the mirror half after the first product (measured 3-5% faster than all at once: NOTES.md);
// v9 by the warps idle in the first product.
__device__ __forceinline__ void load_rows(const float* __restrict__ x, float* raw, int raw_ld, int b, int I,
                                          int J, int N, int C, bool vec, int row0, int row1, int wid, int nw) {
  const int per_row = vec ? C / 4 : C, lane = threadIdx.x & 31;
  for (int rr = row0 + wid; rr < row1; rr += nw) {
    const int p = rr & (PAIRS - 1);
    const int i = I * TILE + (p >> 3), j = J * TILE + (p & 7);
    const bool valid = i < N && j < N;
    const float* src = x + (rr < PAIRS ? (static_cast<long long>(b) * N + i) * N + j
                                       : (static_cast<long long>(b) * N + j) * N + i) * C;
    float* dst = raw + rr * raw_ld;
    if (vec) {
      for (int q = lane; q < per_row; q += 32) cp_async16(dst + 4 * q, valid ? src + 4 * q : x, valid);
    } else {
      for (int q = lane; q < per_row; q += 32) cp_async4(dst + q, valid ? src + q : x, valid);
    }
  }
}

// Queue the copies of tile (b, I, J) into shared memory:
//   raw[p]         = x[b, 8I+ti, 8J+tj, :]   (p = 8 ti + tj, rows 0..63)
//   raw[PAIRS + p] = x[b, 8J+tj, 8I+ti, :]   (the mirror, rows 64..127)
// Rows whose i or j is past N are zero-filled. Each row of x is C contiguous floats, so a warp's
// copies cover whole rows: coalesced. v1 walks flat (row, chunk) indices (two integer divisions
// per copy); v2 and later: load_rows.
template <int V, int NTHR = THREADS>
__device__ __forceinline__ void load_tile(const float* __restrict__ x, float* raw, int raw_ld, int b, int I,
                                          int J, int N, int C, bool vec) {
  if constexpr (V == 1) {
    const int per_row = vec ? C / 4 : C;
    for (int e = threadIdx.x; e < 2 * PAIRS * per_row; e += THREADS) {
      const int q = e % per_row, rr = e / per_row;
      const int p = rr % PAIRS, mirror = rr / PAIRS;
      const int i = I * TILE + (p >> 3), j = J * TILE + (p & 7);
      const bool valid = i < N && j < N;
      const long long row = mirror ? (static_cast<long long>(b) * N + j) * N + i
                                   : (static_cast<long long>(b) * N + i) * N + j;
      if (vec) cp_async16(raw + rr * raw_ld + 4 * q, valid ? x + row * C + 4 * q : x, valid);
      else cp_async4(raw + rr * raw_ld + q, valid ? x + row * C + q : x, valid);
    }
  } else {
    load_rows(x, raw, raw_ld, b, I, J, N, C, vec, 0, 2 * PAIRS, threadIdx.x >> 5, NTHR / 32);
  }
}

// dst[k][h] = W[h][k] for k < n_in, h < n_out; 0 elsewhere in the (kp x hp) shared matrix.
// W: (n_out, n_in) row-major in global memory. Reads coalesced along k, 4 loads in flight.
__device__ __forceinline__ void stage_transposed(const float* __restrict__ W, int n_in, int n_out,
                                                 float* dst, int kp, int hp) {
  const int n = n_in * n_out;
#pragma unroll 4
  for (int e = threadIdx.x; e < n; e += THREADS) dst[(e % n_in) * hp + e / n_in] = __ldg(W + e);
  for (int e = threadIdx.x; e < kp * hp; e += THREADS) {
    const int k = e / hp, h = e % hp;
    if (k >= n_in || h >= n_out) dst[e] = 0.f;
  }
}

// LayerNorm statistics of the 128 rows of raw (2 * PAIRS x raw_ld, zero beyond column C), two-pass
// (exact mean, then the mean of squared deviations: no cancellation at large offsets):
// stats[r] = mean, stats[2 * PAIRS + r] = 1 / sqrt(var + eps). nq = cdiv(C, 4) float4s per row.
// TPR = NTHR / 128 threads per vector (2 or 4), each summing every TPR-th float4 of the row,
// combined with shuffles. A warp holds 32 / TPR rows: lane l takes row l % (32 / TPR) of them and
// part l / (32 / TPR), so the 8 lanes of a quarter-warp read the same float4 column of 8 consecutive
// rows: conflict-free when raw_ld = 4 (mod 8) words (v5, v7: CP % 8 == 0), 2-way otherwise.
template <int NTHR = THREADS>
__device__ __forceinline__ void tile_stats(const float* raw, int raw_ld, int nq, int C, float inv_c,
                                           float eps, float* stats) {
  constexpr int TPR = NTHR / (2 * PAIRS), RPW = 32 / TPR;  // threads per row, rows per warp
  const int lane = threadIdx.x & 31;
  const int r = (threadIdx.x >> 5) * RPW + lane % RPW, part = lane / RPW;
  const float* row = raw + r * raw_ld;
  // Four partial sums per thread (this thread's float4s in turn): shorter rounding chains
  // than one running sum (v2/v3 had one: at N = 1 its error was 7x the fp32 reference's).
  float s4[4] = {0.f, 0.f, 0.f, 0.f};
  for (int q0 = part; q0 < nq; q0 += 4 * TPR) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int q = q0 + TPR * u;
      if (q < nq) {
        const float4 v = *reinterpret_cast<const float4*>(row + 4 * q);
        s4[u] += (v.x + v.y) + (v.z + v.w);  // padding columns are zero
      }
    }
  }
  float s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
#pragma unroll
  for (int o = RPW; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float mean = s * inv_c;
  float m4[4] = {0.f, 0.f, 0.f, 0.f}, e4[4] = {0.f, 0.f, 0.f, 0.f};
  for (int q0 = part; q0 < nq; q0 += 4 * TPR) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int q = q0 + TPR * u;
      if (q < nq) {
        const float4 v = *reinterpret_cast<const float4*>(row + 4 * q);
        const int c = 4 * q;                        // mask the padding: (0 - mean)^2 != 0
        const float dx = v.x - mean;
        const float dy = c + 1 < C ? v.y - mean : 0.f;
        const float dz = c + 2 < C ? v.z - mean : 0.f;
        const float dw = c + 3 < C ? v.w - mean : 0.f;
        m4[u] += (dx * dx + dy * dy) + (dz * dz + dw * dw);
        e4[u] += (dx + dy) + (dz + dw);
      }
    }
  }
  float m2 = (m4[0] + m4[1]) + (m4[2] + m4[3]), d1 = (e4[0] + e4[1]) + (e4[2] + e4[3]);
#pragma unroll
  for (int o = RPW; o < 32; o <<= 1) {
    m2 += __shfl_xor_sync(0xffffffffu, m2, o);
    d1 += __shfl_xor_sync(0xffffffffu, d1, o);
  }
  if (part == 0) {
    float mc, rs;
    ln_stats(mean, d1, m2, inv_c, eps, mc, rs);
    stats[r] = mc;
    stats[2 * PAIRS + r] = rs;
  }
}

// Parameters into shared memory, zero-padded: gamma, beta (CP); b1, b2, w3 (HP). Asynchronous
// (cp.async, zero-filled past C / H): they land with the first tile's copies, waited for with them.
template <int NTHR = THREADS>
__device__ __forceinline__ void stage_vectors(const float* __restrict__ ln_w, const float* __restrict__ ln_b,
                                              const float* __restrict__ b1, const float* __restrict__ b2,
                                              const float* __restrict__ w3, int C, int H, int CP, int HP,
                                              float* gam) {
  float *bet = gam + CP, *b1s = bet + CP, *b2s = b1s + HP, *w3s = b2s + HP;
  for (int c = threadIdx.x; c < CP; c += NTHR) {
    const bool ok = c < C;
    cp_async4(gam + c, ln_w + (ok ? c : 0), ok);
    cp_async4(bet + c, ln_b + (ok ? c : 0), ok);
  }
  for (int h = threadIdx.x; h < HP; h += NTHR) {
    const bool ok = h < H;
    cp_async4(b1s + h, b1 + (ok ? h : 0), ok);
    cp_async4(b2s + h, b2 + (ok ? h : 0), ok);
    cp_async4(w3s + h, w3 + (ok ? h : 0), ok);
  }
  cp_async_commit();
}

// Shared-memory layout of the kernel, in floats (every term a multiple of 4: 16-byte aligned).
struct Smem {
  int raw, st, w1t, w2t, vec, stats, total;
  __host__ __device__ Smem(int CP, int HP, bool w_smem) {
    raw = 2 * PAIRS * (CP + 4);                   // x tile and its mirror, rows padded by 4 floats
    st = (CP > HP ? CP : HP) * LDP;               // s^T (CP x 64), later h1^T (HP x 64)
    w1t = w_smem ? CP * HP : 0;                   // W1^T zero-padded
    w2t = w_smem ? HP * HP : 0;                   // W2^T zero-padded
    vec = 2 * CP + 3 * HP;                        // gamma, beta, b1, b2, w3 (zero-padded)
    stats = 4 * PAIRS;                            // mean, rstd of the 128 vectors
    total = raw + st + w1t + w2t + vec + stats;
  }
};

// =============================================================================================
// Kernels
// =============================================================================================
// Persistent; one 256-thread block per resident slot walks tiles (b, I <= J) with a stride of
// gridDim.x. Per tile: stats -> s^T -> prefetch next tile -> GEMM1 -> h1^T -> GEMM2 -> layer 3.
// Assumptions: C = pair_dim <= 256, CP = round_up(C, 4); H = hidden_dim <= HP (padded hidden);
// vec => C % 4 == 0 and x 16-byte aligned. Shared memory: Smem(CP, HP, W_SMEM).total floats.
template <int V, int HP, bool W_SMEM>
__global__ void __launch_bounds__(THREADS, 1)
contact_map_kernel(const float* __restrict__ x,       // (B, N, N, C)
                      float* __restrict__ out,           // (B, N, N)
                      const float* __restrict__ ln_w,    // (C)
                      const float* __restrict__ ln_b,    // (C)
                      const float* __restrict__ w1,      // (H, C)
                      const float* __restrict__ b1,      // (H)
                      const float* __restrict__ w2,      // (H, H)
                      const float* __restrict__ b2,      // (H)
                      const float* __restrict__ w3,      // (1, H)
                      const float* __restrict__ b3,      // (1)
                      float eps, int B, int N, int C, int H, int CP, bool vec) {
  constexpr int RH = HP / TH_H;
  extern __shared__ __align__(16) float smem[];
  const Smem L(CP, HP, W_SMEM);
  const int raw_ld = CP + 4;
  float* raw = smem;                      // 2*PAIRS x raw_ld
  float* st = raw + L.raw;                // max(CP, HP) x LDP
  float* w1t = st + L.st;                 // CP x HP
  float* w2t = w1t + L.w1t;               // HP x HP
  float* gam = w2t + L.w2t;               // CP
  float* bet = gam + CP;                  // CP
  float* b1s = bet + CP;                  // HP
  float* b2s = b1s + HP;                  // HP
  float* w3s = b2s + HP;                  // HP
  float* stats = w3s + HP;                // mean[128], rstd[128]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hg = tid & (TH_H - 1), pg = tid / TH_H;  // GEMM layout: a warp holds 2 pair groups
  const int nT = cdiv(N, TILE);
  const long long tiles_per_b = static_cast<long long>(nT) * (nT + 1) / 2;
  const long long total = static_cast<long long>(B) * tiles_per_b;

  // Zero the raw rows once: their padding columns (c >= C) are never copied into and must stay 0.
  for (int e = tid; e < L.raw; e += THREADS) raw[e] = 0.f;
  __syncthreads();  // the zeros must land before any cp.async writes the same rows

  long long t = blockIdx.x;
  if (t < total) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    load_tile<V>(x, raw, raw_ld, b, I, J, N, C, vec);
  }
  cp_async_commit();

  // Parameters, zero-padded, once per block (overlaps the first tile's copies).
  if constexpr (W_SMEM && V == 1) {
    // v1: walk W^T in shared-memory order; the global reads are strided by C (uncoalesced).
    for (int e = tid; e < CP * HP; e += THREADS) {
      const int k = e / HP, h = e % HP;
      w1t[e] = (k < C && h < H) ? __ldg(w1 + static_cast<long long>(h) * C + k) : 0.f;
    }
    for (int e = tid; e < HP * HP; e += THREADS) {
      const int k = e / HP, h = e % HP;
      w2t[e] = (k < H && h < H) ? __ldg(w2 + static_cast<long long>(h) * H + k) : 0.f;
    }
  } else if constexpr (W_SMEM) {
    // v2: coalesced global reads in W's own order, unrolled so that many are in flight; the
    // transposed shared-memory writes conflict, once per block. Padding written separately
    // (disjoint addresses: no barrier needed between the two loops).
    stage_transposed(w1, C, H, w1t, CP, HP);
    stage_transposed(w2, H, H, w2t, HP, HP);
  }
  stage_vectors(ln_w, ln_b, b1, b2, w3, C, H, CP, HP, gam);  // gam | bet | b1s | b2s | w3s
  const float bias3 = __ldg(b3);
  const float inv_c = 1.f / static_cast<float>(C);

  for (; t < total; t += gridDim.x) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    cp_async_wait_all();
    __syncthreads();  // this tile's copies (all threads') and the parameters are in shared memory

    // LayerNorm statistics of the 128 vectors, two-pass over shared memory (exact mean, then the
    // mean of squared deviations: no cancellation at large offsets).
    if constexpr (V == 1) {
      // v1: one warp per vector: 16 vectors per warp in sequence, each ending in two 5-step
      // shuffle reductions (a long dependent chain: measured ~4 us per tile).
      for (int r = warp; r < 2 * PAIRS; r += THREADS / 32) {
        const float* row = raw + r * raw_ld;
        float s = 0.f;
        for (int c = lane; c < C; c += 32) s += row[c];
        const float mean = warp_sum(s) * inv_c;
        float v = 0.f, e = 0.f;
        for (int c = lane; c < C; c += 32) {
          const float d = row[c] - mean;
          v = fmaf(d, d, v);
          e += d;
        }
        const float d2 = warp_sum(v), d1 = warp_sum(e);
        if (lane == 0) {
          float mc, rs;
          ln_stats(mean, d1, d2, inv_c, eps, mc, rs);
          stats[r] = mc;
          stats[2 * PAIRS + r] = rs;
        }
      }
    } else {
      tile_stats(raw, raw_ld, CP / 4, C, inv_c, eps, stats);
    }
    __syncthreads();  // statistics visible to all threads

    // s^T[c][p] = (LN(x[b,i,j])[c] + LN(x[b,j,i])[c]) / 2; thread: pair p = tid % 64, c in float4
    // steps of 4. Reads 16 B per row (conflict-free: row stride = 4 mod 32 words), writes one
    // column of s^T (consecutive p across the warp: conflict-free).
    {
      const int p = tid & (PAIRS - 1);
      const float ma = stats[p], mb = stats[PAIRS + p];
      const float ra = stats[2 * PAIRS + p], rb = stats[3 * PAIRS + p];
      const float* ra_row = raw + p * raw_ld;
      const float* rb_row = raw + (PAIRS + p) * raw_ld;
      for (int c4 = tid / PAIRS; c4 < CP / 4; c4 += THREADS / PAIRS) {
        const float4 va = *reinterpret_cast<const float4*>(ra_row + 4 * c4);
        const float4 vb = *reinterpret_cast<const float4*>(rb_row + 4 * c4);
        const float4 g = *reinterpret_cast<const float4*>(gam + 4 * c4);
        const float4 be = *reinterpret_cast<const float4*>(bet + 4 * c4);
        float* col = st + 4 * c4 * LDP + p;
        const float4 o = sym_ln4(va, vb, ma, ra, mb, rb, g, be);
        col[0 * LDP] = o.x;
        col[1 * LDP] = o.y;
        col[2 * LDP] = o.z;
        col[3 * LDP] = o.w;
      }
    }
    __syncthreads();  // s^T complete; the raw buffers are free for the next tile

    if (t + gridDim.x < total) {
      int nb, nI, nJ;
      decode_tile(t + gridDim.x, tiles_per_b, nb, nI, nJ);
      load_tile<V>(x, raw, raw_ld, nb, nI, nJ, N, C, vec);
    }
    cp_async_commit();

    // h1[p][h] = relu(sum_c s[p][c] W1[h][c] + b1[h])
    float acc[RM][RH];
#pragma unroll
    for (int m = 0; m < RM; ++m)
#pragma unroll
      for (int r = 0; r < RH; ++r) acc[m][r] = 0.f;
    if constexpr (V >= 3) mlp_gemm_pipelined<RH, W_SMEM>(st, CP, w1t, HP, w1, C, H, pg, hg, acc);
    else mlp_gemm<RH, W_SMEM>(st, CP, w1t, HP, w1, C, H, pg, hg, acc);
    __syncthreads();  // every thread is done reading s^T before h1^T overwrites it
#pragma unroll
    for (int r = 0; r < RH; ++r) {
      const int h = hidden_of<RH>(r, hg);
      const float bb = b1s[h];
      float4 v;
      v.x = relu(acc[0][r] + bb);
      v.y = relu(acc[1][r] + bb);
      v.z = relu(acc[2][r] + bb);
      v.w = relu(acc[3][r] + bb);
      *reinterpret_cast<float4*>(st + h * LDP + pg * RM) = v;  // padded units: relu(0 + 0) = 0
    }
    __syncthreads();  // h1^T complete

    // h2[p][g] = relu(sum_h h1[p][h] W2[g][h] + b2[g]); z[p] = sum_g w3[g] h2[p][g]
#pragma unroll
    for (int m = 0; m < RM; ++m)
#pragma unroll
      for (int r = 0; r < RH; ++r) acc[m][r] = 0.f;
    if constexpr (V >= 3) mlp_gemm_pipelined<RH, W_SMEM>(st, HP, w2t, HP, w2, H, H, pg, hg, acc);
    else mlp_gemm<RH, W_SMEM>(st, HP, w2t, HP, w2, H, H, pg, hg, acc);
    float z[RM];
#pragma unroll
    for (int m = 0; m < RM; ++m) {
      z[m] = 0.f;
#pragma unroll
      for (int r = 0; r < RH; ++r) {
        const int h = hidden_of<RH>(r, hg);
        z[m] = fmaf(w3s[h], relu(acc[m][r] + b2s[h]), z[m]);
      }
      // sum over the 16 hidden groups: lanes hg = 0..15 of this half-warp
#pragma unroll
      for (int o = TH_H / 2; o > 0; o >>= 1) z[m] += __shfl_xor_sync(0xffffffffu, z[m], o);
    }
    // out[b,i,j] = out[b,j,i] = sigmoid(z + b3). The next iteration's first barrier orders this
    // tile's reads of h1^T before the next s^T is written.
    if (hg == 0) {
#pragma unroll
      for (int m = 0; m < RM; ++m) {
        const int p = pg * RM + m;
        const int i = I * TILE + (p >> 3), j = J * TILE + (p & 7);
        if (i < N && j < N) {
          const float o = 1.f / (1.f + expf(-(z[m] + bias3)));
          out[(static_cast<long long>(b) * N + i) * N + j] = o;
          out[(static_cast<long long>(b) * N + j) * N + i] = o;
        }
      }
    }
  }
  cp_async_wait_all();  // no copy may be left in flight when the block exits
}

// ---- pieces of the tensor-core kernel (v5) ------------------------------------------------------
// s[p][c] = (LN(x[b,i,j])[c] + LN(x[b,j,i])[c]) / 2 (sym_ln4, as v1-v3 and v7) from the raw
// tile (rows p and PAIRS + p) and its statistics into act (PAIRS x lds, row-major). Consecutive
// threads take consecutive float4s of a row: conflict-free reads and writes when CP % 32 == 0
// (2-way at CP = 8, 16, 24, 48, ...: a quarter-warp then spans two rows).
template <int NTHR = THREADS>
__device__ __forceinline__ void build_s(const float* raw, int raw_ld, const float* stats, const float* gam,
                                        const float* bet, float* act, int lds, int nq) {
  for (int e = threadIdx.x; e < PAIRS * nq; e += NTHR) {
    const int p = e / nq, c = 4 * (e - p * nq);
    const float ma = stats[p], mb = stats[PAIRS + p];
    const float ra = stats[2 * PAIRS + p], rb = stats[3 * PAIRS + p];
    const float4 va = *reinterpret_cast<const float4*>(raw + p * raw_ld + c);
    const float4 vb = *reinterpret_cast<const float4*>(raw + (PAIRS + p) * raw_ld + c);
    const float4 gg = *reinterpret_cast<const float4*>(gam + c);
    const float4 be = *reinterpret_cast<const float4*>(bet + c);
    *reinterpret_cast<float4*>(act + p * lds + c) = sym_ln4(va, vb, ma, ra, mb, rb, gg, be);
  }
}

// v7 at pair_dim <= 64 M: the LayerNorm statistics and s in one pass, the raw tile read once into
// registers (tile_stats + build_s read it three times and pass the statistics through shared
// memory). Warp w owns pairs 4w..4w+3: their 8 rows (4 tile rows, 4 mirrors) x 4 lanes. Lane bits:
// k = lane & 3 (pair 4w + k), part P = ((lane >> 4) << 1) | ((lane >> 2) & 1), half = (lane >> 3) & 1
// (0: row p, 1: its mirror 64 + p; the partner lane is lane ^ 8). Lane P holds the float4s
// q = 16 m + 4 P + u (m < M, u < 4) of its row, so a quarter-warp (4 rows x 2 parts 16 words apart)
// reads 8 distinct 4-bank groups whenever raw_ld = 4 (mod 8). Same arithmetic as tile_stats (four
// partial sums, two-pass) and build_s; s for u < 2 is built by the half-0 lane (its own values and
// the mirror's from shared memory), for u >= 2 by the half-1 lane. Needs CP <= 64 M, 512 threads.
// M = 1 where the kernel runs 2 blocks per SM (64 registers per thread), else 2.
template <int M>
__device__ __forceinline__ void stats_build_fused(const float* raw, int raw_ld, int CP, int C, float inv_c,
                                                  float eps, const float* gam, const float* bet, float* act,
                                                  int lds) {
  const int lane = threadIdx.x & 31;
  const int k = lane & 3, half = (lane >> 3) & 1, P = ((lane >> 4) << 1) | ((lane >> 2) & 1);
  const int p = (threadIdx.x >> 5) * 4 + k;
  const int nq = CP / 4;  // columns C..CP-1 are zero in raw
  const float* row = raw + (half * PAIRS + p) * raw_ld;
  float4 v[M][4];
  float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int q = 16 * m + 4 * P + u;
      v[m][u] = q < nq ? *reinterpret_cast<const float4*>(row + 4 * q) : make_float4(0.f, 0.f, 0.f, 0.f);
      s4[u] += (v[m][u].x + v[m][u].y) + (v[m][u].z + v[m][u].w);
    }
  float sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  sum += __shfl_xor_sync(0xffffffffu, sum, 4);   // the 4 parts of the row
  sum += __shfl_xor_sync(0xffffffffu, sum, 16);
  const float mean1 = sum * inv_c;
  float m4[4] = {0.f, 0.f, 0.f, 0.f}, e4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = 4 * (16 * m + 4 * P + u);       // mask the padding: (0 - mean)^2 != 0
      const float dx = c < C ? v[m][u].x - mean1 : 0.f;
      const float dy = c + 1 < C ? v[m][u].y - mean1 : 0.f;
      const float dz = c + 2 < C ? v[m][u].z - mean1 : 0.f;
      const float dw = c + 3 < C ? v[m][u].w - mean1 : 0.f;
      m4[u] += (dx * dx + dy * dy) + (dz * dz + dw * dw);
      e4[u] += (dx + dy) + (dz + dw);
    }
  float m2 = (m4[0] + m4[1]) + (m4[2] + m4[3]), d1 = (e4[0] + e4[1]) + (e4[2] + e4[3]);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 4);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 16);
  d1 += __shfl_xor_sync(0xffffffffu, d1, 4);
  d1 += __shfl_xor_sync(0xffffffffu, d1, 16);
  float mean, rstd;
  ln_stats(mean1, d1, m2, inv_c, eps, mean, rstd);
  const float mean_o = __shfl_xor_sync(0xffffffffu, mean, 8), rstd_o = __shfl_xor_sync(0xffffffffu, rstd, 8);
  const float ma = half ? mean_o : mean, ra = half ? rstd_o : rstd;  // row p
  const float mb = half ? mean : mean_o, rb = half ? rstd : rstd_o;  // row 64 + p
  const float* other = raw + ((1 - half) * PAIRS + p) * raw_ld;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int uu = 0; uu < 2; ++uu) {
      const int q = 16 * m + 4 * P + 2 * half + uu;
      if (q < nq) {
        const float4 own = half ? v[m][2 + uu] : v[m][uu];  // static indices: no local memory
        const float4 oth = *reinterpret_cast<const float4*>(other + 4 * q);
        const float4 va = half ? oth : own, vb = half ? own : oth;
        const float4 gg = *reinterpret_cast<const float4*>(gam + 4 * q);
        const float4 be = *reinterpret_cast<const float4*>(bet + 4 * q);
        *reinterpret_cast<float4*>(act + p * lds + 4 * q) = sym_ln4(va, vb, ma, ra, mb, rb, gg, be);
      }
    }
}

// The MLP of one tile on the tensor cores, all NTHR threads; act holds s (PAIRS x lds) on entry.
// The warps are 4 row blocks of 16 pairs x NG column groups of the hidden units (v5: 8 warps, NG = 2;
// v7: 16 warps, NG = 4, or 2 at HP = 16 with the other 8 warps idle in the products; v9: NG = 2, the
// other 8 warps copy). GEMM1 -> h1 (written over s in act, PAIRS x ldh) -> GEMM2 -> layer 3:
// z[p] = sum_g w3[g] relu(h2[p][g] + b2[g]), the column groups' partial sums left in zpart[NG][PAIRS].
// idle_gemm1(w, nw) runs instead of GEMM1 in the warps outside the column groups (w: their index
// among those nw warps; v9: queue the next tile); after_gemm1() runs in every thread between the two
// products (v5/v7: queue the mirror half of the next tile). Returns after a barrier.
// PROD (v9): NG = 2 column groups; the idle warps queue the next tile's first kProdRows rows.
template <int HP, int NTHR, bool PROD = false>
struct TcLayout {
  static constexpr int NT = HP / 8;                                    // n tiles of 8 hidden units
  static constexpr int NG = PROD ? (NT < 2 ? NT : 2)                   // column groups
                                 : (NTHR / 128 < NT ? NTHR / 128 : NT);
  static constexpr int NTW = NT / NG;                                  // n tiles per warp
  static constexpr bool FAST = NTHR == 512;                            // v7, v9: 4-instruction split
};

template <int HP, WFormat WF, int NTHR, bool PROD, typename IdleGemm1, typename AfterGemm1>
__device__ __forceinline__ void mlp_tc(float* act, int lds, int CP, const void* w1f, const void* w2f,
                                       const float* __restrict__ w1, const float* __restrict__ w2, int C,
                                       int H, const float* b1s, const float* b2s, const float* w3s,
                                       float* zpart, IdleGemm1&& idle_gemm1, AfterGemm1&& after_gemm1) {
  using Lay = TcLayout<HP, NTHR, PROD>;
  constexpr int NT = Lay::NT, NG = Lay::NG, NTW = Lay::NTW;
  const int ldh = HP + 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int mt = warp & 3, cg = warp >> 2;  // row block, column group
  const bool active = cg < NG;

  // h1[p][h] = relu(sum_c s[p][c] W1[h][c] + b1[h]): rows 16 mt.., columns 8 (NTW cg + nt)..
  float acc[NTW][4];
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
  if (active)
    tc_gemm<NTW, WF, Lay::FAST>(act + 16 * mt * lds, lds, CP, w1f, NT, cg * NTW, w1, C, H, acc);
  else
    idle_gemm1(warp - 4 * NG, NTHR / 32 - 4 * NG);
  after_gemm1();
  __syncthreads();  // every warp is done reading s before h1 overwrites it
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int h = (cg * NTW + nt) * 8 + 2 * t4;
      const float bb0 = b1s[h], bb1 = b1s[h + 1];
      float* r0 = act + (16 * mt + g) * ldh + h;
      *reinterpret_cast<float2*>(r0) = make_float2(relu(acc[nt][0] + bb0), relu(acc[nt][1] + bb1));
      *reinterpret_cast<float2*>(r0 + 8 * ldh) =
          make_float2(relu(acc[nt][2] + bb0), relu(acc[nt][3] + bb1));
    }
  }
  __syncthreads();  // h1 complete (padded units: relu(0 + 0) = 0)

  // h2[p][g] = relu(sum_h h1[p][h] W2[g][h] + b2[g]); z[p] = sum_g w3[g] h2[p][g]
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
    tc_gemm<NTW, WF, Lay::FAST>(act + 16 * mt * ldh, ldh, HP, w2f, NT, cg * NTW, w2, H, H, acc);
    float z0 = 0.f, z1 = 0.f;  // rows g and g + 8 of this warp's row block
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int h = (cg * NTW + nt) * 8 + 2 * t4;
      z0 = fmaf(w3s[h], relu(acc[nt][0] + b2s[h]), z0);
      z0 = fmaf(w3s[h + 1], relu(acc[nt][1] + b2s[h + 1]), z0);
      z1 = fmaf(w3s[h], relu(acc[nt][2] + b2s[h]), z1);
      z1 = fmaf(w3s[h + 1], relu(acc[nt][3] + b2s[h + 1]), z1);
    }
    z0 += __shfl_xor_sync(0xffffffffu, z0, 1);  // sum over the quad (t4 = 0..3)
    z0 += __shfl_xor_sync(0xffffffffu, z0, 2);
    z1 += __shfl_xor_sync(0xffffffffu, z1, 1);
    z1 += __shfl_xor_sync(0xffffffffu, z1, 2);
    if (t4 == 0) {
      zpart[cg * PAIRS + 16 * mt + g] = z0;
      zpart[cg * PAIRS + 16 * mt + g + 8] = z1;
    }
  }
  __syncthreads();  // every column group's partial sums are in zpart
}

// out[b,i,j] = out[b,j,i] = sigmoid(z + b3) for the tile's valid pairs (threads 0..63); z is the sum
// of the NG column groups' partial sums.
template <int NG>
__device__ __forceinline__ void write_tile(float* __restrict__ out, const float* zpart, float bias3, int b,
                                           int I, int J, int N) {
  const int p = threadIdx.x;
  if (p < PAIRS) {
    const int i = I * TILE + (p >> 3), j = J * TILE + (p & 7);
    if (i < N && j < N) {
      float z = zpart[p] + zpart[PAIRS + p];
      if constexpr (NG == 4) z += zpart[2 * PAIRS + p] + zpart[3 * PAIRS + p];
      const float o = 1.f / (1.f + expf(-(z + bias3)));
      out[(static_cast<long long>(b) * N + i) * N + j] = o;
      out[(static_cast<long long>(b) * N + j) * N + i] = o;
    }
  }
}

// Shared-memory layout of the tensor-core kernel, in floats (every term a multiple of 4).
struct SmemTC {
  int raw, act, w1f, w2f, vec, stats, zpart, total;
  __host__ __device__ SmemTC(int CP, int HP, WFormat wf) {
    const int wmul = wf == WFormat::kSplit ? 2 : 0;  // hi and lo
    raw = 2 * PAIRS * (CP + 4);                   // x tile and its mirror, rows padded by 4 floats
    act = PAIRS * ((CP > HP ? CP : HP) + 4);      // s (64 x CP), later h1 (64 x HP), row-major
    w1f = wmul * CP * HP;                         // W1^T as B fragments
    w2f = wmul * HP * HP;                         // W2^T likewise
    vec = 2 * CP + 3 * HP;                        // gamma, beta, b1, b2, w3 (zero-padded)
    stats = 4 * PAIRS;                            // mean, rstd of the 128 vectors
    zpart = 4 * PAIRS;                            // layer-3 partial sums of up to 4 column groups
    total = raw + act + w1f + w2f + vec + stats + zpart;
  }
};

// v5 (NTHR = 256), v7 (NTHR = 512) and v9 (v7's with PROD): the tile walk, loader and statistics of
// v2/v3, the two products on the tensor cores in split TF32 (mlp_tc), weights staged once per block
// as split fragments. One raw buffer: the next tile's copies are queued once s is built (v5/v7: the
// mirror half after GEMM1; v9: rows 0..kProdRows-1 by the warps idle in GEMM1, the rest after it)
// and overlap the products.
// MINB: the blocks per SM the registers are budgeted for (__launch_bounds__): 2 (v5 at HP <= 64;
// v7 at HP <= 32 when two blocks' shared memory fits on an SM: 64 registers per thread at 512
// threads), else 1. kMinBlocksTC gives v5's and v7's default; v7's launcher picks 1 at HP <= 32
// when only one block fits anyway (batch: pair_dim 128, 146 KB), which lets the fused statistics
// pass (FM = 2) run there.
// Assumptions: C = pair_dim <= 256, CP = round_up(C, 8); H = hidden_dim <= HP (HP in 16..256, a
// power of two); vec => C % 4 == 0 and x 16-byte aligned. Shared memory: SmemTC(CP, HP, WF).total.
template <int HP, int NTHR>
constexpr int kMinBlocksTC = (NTHR == 256 && HP <= 64) || (NTHR == 512 && HP <= 32) ? 2 : 1;

// v9: the rows of the next tile that the producer warps queue during GEMM1 (batch, H200: 48 / 64 / 80 /
// 96 rows measured 0.200 / 0.196 / 0.200 / 0.205 ms; NOTES.md).
constexpr int kProdRows = 64;

template <int HP, WFormat WF, int NTHR, int MINB = kMinBlocksTC<HP, NTHR>, bool PROD = false>
__global__ void __launch_bounds__(NTHR, MINB)
contact_map_tc_kernel(const float* __restrict__ x,       // (B, N, N, C)
                      float* __restrict__ out,           // (B, N, N)
                      const float* __restrict__ ln_w,    // (C)
                      const float* __restrict__ ln_b,    // (C)
                      const float* __restrict__ w1,      // (H, C)
                      const float* __restrict__ b1,      // (H)
                      const float* __restrict__ w2,      // (H, H)
                      const float* __restrict__ b2,      // (H)
                      const float* __restrict__ w3,      // (1, H)
                      const float* __restrict__ b3,      // (1)
                      float eps, int B, int N, int C, int H, int CP, bool vec) {
  extern __shared__ __align__(16) float smem[];
  const SmemTC L(CP, HP, WF);
  const int raw_ld = CP + 4, lds = CP + 4;
  float* raw = smem;                                        // 2*PAIRS x raw_ld
  float* act = raw + L.raw;                                 // s: PAIRS x lds; h1: PAIRS x (HP + 4)
  float* w1f = act + L.act;                                 // (CP/8) x (HP/8) x 32 fragments
  float* w2f = w1f + L.w1f;                                 // (HP/8) x (HP/8) x 32
  float* gam = w2f + L.w2f;                                 // gamma, beta (CP), b1, b2, w3 (HP)
  float* stats = gam + L.vec;                               // mean[128], rstd[128]
  float* zpart = stats + L.stats;                           // [NG][64]

  const int tid = threadIdx.x;
  const int nT = cdiv(N, TILE);
  const long long tiles_per_b = static_cast<long long>(nT) * (nT + 1) / 2;
  const long long total = static_cast<long long>(B) * tiles_per_b;

  // Columns C..CP-1 of the raw rows are read (padding) but never copied into: zero them once. The
  // copies write columns < C only, so no barrier is needed between the two.
  const int pad = CP - C;
  for (int e = tid; e < 2 * PAIRS * pad; e += NTHR) raw[(e / pad) * raw_ld + C + e % pad] = 0.f;

  long long t = blockIdx.x;
  int b = 0, I = 0, J = 0;  // the tile being processed, decoded once (when its copies are queued)
  if (t < total) {
    decode_tile(t, tiles_per_b, b, I, J);
    load_tile<2, NTHR>(x, raw, raw_ld, b, I, J, N, C, vec);
  }
  cp_async_commit();

  stage_vectors<NTHR>(ln_w, ln_b, b1, b2, w3, C, H, CP, HP, gam);  // asynchronous, like the tile
  if constexpr (WF == WFormat::kSplit) {  // overlaps the first tile's copies
    stage_weight_fragments<HP, NTHR>(w1, w2, C, H, CP, w1f);  // w2f = w1f + L.w1f follows
  }
  const float bias3 = __ldg(b3);
  const float inv_c = 1.f / static_cast<float>(C);

  for (; t < total; t += gridDim.x) {
    cp_async_wait_all();
    __syncthreads();  // this tile's copies (all threads') and the parameters are in shared memory
    // v7: statistics and s fused at pair_dim <= 64 FM (with the weights from global memory that
    // happens only at HP = 128). FM = 2 needs more than 64 registers (it spilled 12 bytes there).
    constexpr int FM = MINB == 2 ? 1 : 2;
    bool fused = false;
    if constexpr (NTHR == 512 && (WF == WFormat::kSplit || HP == 128)) fused = CP <= 64 * FM;
    if (fused) {
      stats_build_fused<FM>(raw, raw_ld, CP, C, inv_c, eps, gam, gam + CP, act, lds);
    } else {
      tile_stats<NTHR>(raw, raw_ld, cdiv(C, 4), C, inv_c, eps, stats);
      __syncthreads();  // statistics visible to all threads
      build_s<NTHR>(raw, raw_ld, stats, gam, gam + CP, act, lds, CP / 4);
    }
    __syncthreads();  // s complete; the raw buffers are free for the next tile

    // The next tile's copies. v5/v7: by every thread in two halves, rows 0..63 now, the mirror rows
    // after GEMM1 (issued at once they took 3000-5000 cycles per tile at crop and batch; in halves
    // the loop is 3-5% faster). Issuing costs a warp ~340 cycles per 16-byte copy per thread
    // whatever the other warps do (NOTES.md), so v9 gives rows 0..kProdRows-1 to the 8 warps idle
    // in GEMM1 (about GEMM1's length at batch) and the rest to all 16 warps after it.
    const bool more = t + gridDim.x < total;
    int nb = 0, nI = 0, nJ = 0;
    if (more) decode_tile(t + gridDim.x, tiles_per_b, nb, nI, nJ);
    constexpr int row_split = PROD ? kProdRows : PAIRS;  // rows queued before / during GEMM1
    if (!PROD && more) load_rows(x, raw, raw_ld, nb, nI, nJ, N, C, vec, 0, PAIRS, threadIdx.x >> 5, NTHR / 32);
    mlp_tc<HP, WF, NTHR, PROD>(
        act, lds, CP, w1f, w2f, w1, w2, C, H, gam + 2 * CP, gam + 2 * CP + HP, gam + 2 * CP + 2 * HP, zpart,
        [&](int w, int nw) {
          if (PROD && more) load_rows(x, raw, raw_ld, nb, nI, nJ, N, C, vec, 0, row_split, w, nw);
        },
        [&] {
          if (more)
            load_rows(x, raw, raw_ld, nb, nI, nJ, N, C, vec, row_split, 2 * PAIRS, threadIdx.x >> 5, NTHR / 32);
          cp_async_commit();
        });
    // The next iteration's barriers order these reads of zpart before it is written again.
    write_tile<TcLayout<HP, NTHR, PROD>::NG>(out, zpart, bias3, b, I, J, N);
    b = nb; I = nI; J = nJ;
  }
  cp_async_wait_all();  // no copy may be left in flight when the block exits
}

// =============================================================================================
// v10 (Hopper, sm_90a): both products on wgmma, tiles by the TMA engine, one producer warp
// =============================================================================================
// Per block (one per SM, kV10Threads = 384 threads):
//   warpgroups 0, 1  consumers (setmaxnreg to kV10ConsumerRegs): warpgroup w takes the block's tiles
//                    w, w + 2, w + 4, ... (block-local order), one 64-pair tile at a time:
//                    statistics, s and its split into wgmma A fragments held in registers for all of
//                    K (then the tile's two ring slots are released), GEMM1 = m64nHPk8 wgmma with A
//                    from registers, GEMM1's accumulator turned in registers into GEMM2's A fragments,
//                    GEMM2, layer 3 and the output. The two warpgroups overlap each other's phases
//                    (v14, v17, v19, v20: their GEMM1 + GEMM2 take turns, named barriers 1 and 2).
//   warpgroup 2      producer (setmaxnreg down to kV10ProducerRegs); thread 288 copies the packed
//                    parameters (contact_map_v10_params_kernel's wpack, written by the same call just
//                    before: this kernel is its programmatic dependent and waits for it there only,
//                    griddepcontrol.wait) into shared memory on the `wbar` mbarrier; thread 256 queues every
//                    tile as two half tiles (the tile x[b, 8I.., 8J.., :] and its mirror
//                    x[b, 8J.., 8I.., :]) into a ring of R slots of 64 rows x KC channels: KC / 32
//                    tensor-map copies (box 32 channels x 8 x 8 positions, 128-byte swizzle; v17, v19, v20: L2 evict_first) per half,
//                    completing on the slot's `full` mbarrier; a consumer warp arrives on the slot's
//                    `empty` mbarrier once it has read it (4 arrivals free it). Slot use u counts the
//                    block's half tiles: slot u % R, mbarrier parity (u / R) & 1; tile q of the block
//                    uses u = 2q (tile) and 2q + 1 (mirror). R is 8 or 4, so that each slot serves one
//                    consumer warpgroup (launch_v10 says why).
// Both halves land with row p = 8 il + jl for pair p = (i, j) = (8I + il, 8J + jl): the mirror's
// tensor map walks x with the two position strides swapped. Out-of-range positions are zero-filled
// by the copy engine (edge tiles), channels C..KC-1 likewise.
// Swizzle (the tensor map's 128B mode): channel c of row p sits at float
//   (c / 32) * 2048 + 32 p + 4 ((c / 4 % 8) ^ (p % 8)) + c % 4
// of its slot (each 32-channel box is 8 KB, 1024-byte aligned).
// Fragment rows: warp w4 (of its warpgroup) owns the 16 pairs 16 w4 + lp, lp = v10_row(g) for the
// fragment rows g = lane / 4 and g + 8 (lp + 8): rows g = 2m and 2m + 1 are pairs whose p % 8 differ
// by 4, so a quarter-warp's 16-byte loads (two rows x lanes t = lane % 4) hit 8 distinct 16-byte bank
// groups under the swizzle: conflict-free.
// k order: lane t's 16-byte chunk 16 kk + 4 t of a row holds its A fragment columns of k steps 2 kk
// (columns t, t + 4 = channels 16 kk + 4 t, + 1) and 2 kk + 1 (channels + 2, + 3); W1's planes are
// packed in the same order (v10_k1). GEMM2's logical k (j, q) is hidden unit 8 j + 2 (q % 4) + q / 4
// (v10_k2): GEMM1's accumulator register d[4 j + q'] (row g + 8 (q' / 2), unit 8 j + 2 t + q' % 2)
// is then directly the A fragment register of GEMM2's k step j (FlashAttention-3's P.V chaining).
// Weights: W1' = W1 diag(gamma) and b1' = b1 + W1 beta (the LayerNorm affine folded in, the latter in
// fp64), split into TF32 hi / lo planes in the unswizzled K-major core-matrix layout (v10_woff), W2
// likewise with v10_k2's row order; packed per call by contact_map_v10_params_kernel, resident in
// shared memory for the block's life.
// Accumulation: per k step lo*hi, hi*lo, hi*hi on the tensor cores, into a fresh accumulator per
// kV10Promo k steps that is then added to an fp32 accumulator (alternating two, so that one chunk runs
// while the other is promoted); both products.
// Assumptions: C % 16 == 0, C <= KC (64 or 128), H <= HP (32 or 64); x 16-byte aligned, contiguous;
// sm_90a (elsewhere the kernel is a trap that the host never launches).
constexpr int kV10Threads = 384;
constexpr int kV10ConsumerRegs = 232, kV10ProducerRegs = 40;
// v13: 8 more registers per consumer thread (its producer's tile walk fits in 24; the FA3 split)
constexpr int kV13ConsumerRegs = 240, kV13ProducerRegs = 24;
static_assert(2 * 128 * kV10ConsumerRegs + 128 * kV10ProducerRegs <= kV10Threads * ((65536 / kV10Threads) & ~7),
              "setmaxnreg budget");
static_assert(2 * 128 * kV13ConsumerRegs + 128 * kV13ProducerRegs <= kV10Threads * ((65536 / kV10Threads) & ~7),
              "setmaxnreg budget");
constexpr int kV10MaxSlots = 8;  // 8 or 4 (launch_v10)

// Shared memory of v10 in bytes, from a 1024-byte aligned base: the ring, W1 and W2 planes, b1', b2,
// w3, v13's tile info, the mbarriers; plus 1024 for the alignment.
struct SmemV10 {
  int slot_floats, ring, w1, w2, vec, bars, total;
  __host__ __device__ SmemV10(int KC, int HP, int R) {
    slot_floats = PAIRS * KC;
    ring = 4 * R * slot_floats;
    w1 = 4 * 2 * HP * KC;
    w2 = 4 * 2 * HP * HP;
    vec = 4 * 3 * HP;
    bars = 16 * R + 8 * (2 * R + 1);  // v13's tile info (an int4 per slot), then the mbarriers
    total = ring + w1 + w2 + vec + bars + 1024;
  }
};

__host__ __device__ __forceinline__ int v10_row(int g) { return ((g & 1) << 2) | (g >> 1); }
// Physical channel of GEMM1's logical k = 8 ks + q (q < 8: fragment column).
__host__ __device__ __forceinline__ int v10_k1(int k) {
  const int ks = k >> 3, q = k & 7;
  return 16 * (ks >> 1) + 4 * (q & 3) + 2 * (ks & 1) + (q >> 2);
}
// Hidden unit of GEMM2's logical k = 8 j + q.
__host__ __device__ __forceinline__ int v10_k2(int k) { return (k & ~7) + 2 * (k & 3) + ((k >> 2) & 1); }
// Float offset of B(n, k) in a plane of NR rows n (K-major, no swizzle): k step blocks of NR x 8,
// 8-row core-matrix groups 256 bytes apart (SBO), the two 4-k halves 128 bytes apart (LBO).
__host__ __device__ __forceinline__ int v10_woff(int n, int k, int NR) {
  return (k >> 3) * (NR * 8) + (n >> 3) * 64 + ((k >> 2) & 1) * 32 + (n & 7) * 4 + (k & 3);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CM_WG_DEVICE 1
__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {  // until the phase of this parity completes
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}
// Named barriers 1, 2 of v14's, v17's, v19's and v20's two consumer warpgroups (256 threads: one warpgroup syncs, the other arrives).
__device__ __forceinline__ void named_bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
// bytes % 16 == 0, both addresses 16-byte aligned; completes `bytes` transactions on bar.
__device__ __forceinline__ void bulk_copy(float* smem, const float* gmem, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// One box of a 4-D tensor map (coordinates innermost first) into shared memory, completing on bar.
__device__ __forceinline__ void tma_load_4d(float* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_u32(bar))
      : "memory");
}
// tma_load_4d with an L2 cache policy (createpolicy's 64-bit value) on the reads (PTX ISA: .L2::cache_hint).
__device__ __forceinline__ void tma_load_4d(float* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address >> 4, LBO = 128 bytes (the
// two 4-k core matrices), SBO = 256 bytes (8-row groups), no swizzle.
__device__ __forceinline__ uint64_t v10_desc(const float* p) {
  return static_cast<uint64_t>((smem_u32(p) & 0x3ffff) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}
// d (64 x N, fp32, the warpgroup's accumulator fragment) = A (64 x 8, TF32 in registers) B^T (8 x N)
// + (acc ? d : 0), B K-major in shared memory. A fragment: a[0] row 16 (warp % 4) + lane / 4, column
// lane % 4; a[1] row + 8; a[2] column + 4; a[3] both. d[4 j + q]: row 16 (warp % 4) + lane / 4 + 8 (q / 2),
// column 8 j + 2 (lane % 4) + q % 2.
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int acc) {
  if constexpr (N == 64) {
@WGMMA_RS_64@
  } else {
    static_assert(N == 32, "wgmma_rs: N = 32 or 64");
@WGMMA_RS_32@
  }
}
template <int NACC>
__device__ __forceinline__ void wg_fence(float (&d)[NACC]) {  // CUTLASS's warpgroup_fence_operand
#pragma unroll
  for (int q = 0; q < NACC; ++q) asm volatile("" : "+f"(d[q])::"memory");
}
template <int KS>
__device__ __forceinline__ void wg_fence(uint32_t (&a)[KS][4]) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[ks][e])::"memory");
}
#endif

// One tile's LayerNorm statistics (consumer thread: pairs p0 = 16 w4 + v10_row(g), p1 = p0 + 8; rows r = 0, 1:
// the tile's rows p0, p1, r = 2, 3: the mirror's). Two-pass per row from registers (the lane's KC / 4
// values, the quad's sums by shuffles): the same arithmetic as v7's fused pass. Invalid pairs (edge
// tiles) get rstd = 0, so that their s is 0.
__device__ __forceinline__ float4 v10_chunk4(const float* base, int p, int kk, int t) {  // channels 16 kk + 4 t ..
  const int phys = (4 * (kk & 1) + t) ^ (p & 7);
  return reinterpret_cast<const float4*>(base)[(kk >> 1) * 512 + p * 8 + phys];
}
// One row's statistics from the lane's NK chunks (a quad holds the row; chunks >= nvalid are the
// zero-filled channels C..KC-1; FULL: C == KC, no such chunks): ln_stats' corrected two-pass. FULL
// is a template argument so that the full-width path has no per-chunk branch (a basic block per chunk
// would keep the compiler from interleaving the rows' independent sums). V13 (v13, NK >= 4): the four
// partial sums start from the first four chunks instead of 0 (no adds to 0), and the second pass sums
// d^2 and d as FFMA / FADD chains (12 instructions per chunk instead of 14; other rounding, same class).
// DX (v20, with V13): v's valid chunks are overwritten with d = x - m (m: the first pass's mean) and `mean` gets
// delta = d1 / C, the amount by which ln_stats' mean exceeds m, so that x - mean = d - delta (v20_term4).
template <int NK, bool FULL, bool V13 = false, bool DX = false>
__device__ __forceinline__ void v10_row_stats(float4 (&v)[NK], int nvalid, float inv_c, float eps, bool ok,
                                              float& mean, float& rstd) {
  static_assert(!DX || V13, "v20's statistics are v13's");
  static_assert(!V13 || NK >= 4, "v13's statistics start from four chunks");
  float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const float cs = (v[kk].x + v[kk].y) + (v[kk].z + v[kk].w);
    if (V13 && kk < 4) s4[kk] = cs;  // chunks 0..3 hold channels < 64 <= C (v13 runs at C > 64 only)
    else s4[kk & 3] += cs;
  }
  float sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  const float m = sum * inv_c;
  float m4[4] = {0.f, 0.f, 0.f, 0.f}, e4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    if (FULL || kk < nvalid) {  // channels >= C are zero-filled: (0 - mean)^2 must not count
      const float dx = v[kk].x - m, dy = v[kk].y - m, dz = v[kk].z - m, dw = v[kk].w - m;
      if constexpr (DX) v[kk] = make_float4(dx, dy, dz, dw);
      if constexpr (V13) {
        float& a = m4[kk & 3];
        float& e = e4[kk & 3];
        if (kk < 4) {
          a = dx * dx;
          e = (dx + dy) + (dz + dw);
        } else {
          a = fmaf(dx, dx, a);
          e = ((e + dx) + dy + dz) + dw;
        }
        a = fmaf(dw, dw, fmaf(dz, dz, fmaf(dy, dy, a)));
      } else {
        m4[kk & 3] += (dx * dx + dy * dy) + (dz * dz + dw * dw);
        e4[kk & 3] += (dx + dy) + (dz + dw);
      }
    }
  }
  float m2 = (m4[0] + m4[1]) + (m4[2] + m4[3]), d1 = (e4[0] + e4[1]) + (e4[2] + e4[3]);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 1);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 2);
  d1 += __shfl_xor_sync(0xffffffffu, d1, 1);
  d1 += __shfl_xor_sync(0xffffffffu, d1, 2);
  float rs;
  ln_stats(m, d1, m2, inv_c, eps, mean, rs);
  if constexpr (DX) mean = d1 * inv_c;
  rstd = ok ? rs : 0.f;
}
// v10: each row read from the slot for the statistics (and again for s, v10_build_kk).
template <int KC, bool FULL>
__device__ __forceinline__ void v10_stats(const float* tile, const float* mirror, int p0, int t, int C, float inv_c,
                                          float eps, bool ok0, bool ok1, float (&mean)[4], float (&rstd)[4]) {
  constexpr int NK = KC / 16;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float4 v[NK];
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) v[kk] = v10_chunk4(r < 2 ? tile : mirror, p0 + 8 * (r & 1), kk, t);
    v10_row_stats<NK, FULL>(v, C / 16, inv_c, eps, (r & 1) ? ok1 : ok0, mean[r], rstd[r]);
  }
}
// v11: the statistics of rows R0, R0 + 1 of v (one half: the tile's or the mirror's rows p0, p0 + 8), with
// one uniform branch on C == KC around both rows. DX (v20): v10_row_stats' DX (mean gets delta, v gets d).
template <int NK, int R0, bool V13 = false, bool DX = false>
__device__ __forceinline__ void v11_half_stats(float4 (&v)[4][NK], int C, float inv_c, float eps, bool ok0,
                                               bool ok1, float (&mean)[4], float (&rstd)[4]) {
  if (C == 16 * NK) {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r)
      v10_row_stats<NK, true, V13, DX>(v[r], NK, inv_c, eps, (r & 1) ? ok1 : ok0, mean[r], rstd[r]);
  } else {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r)
      v10_row_stats<NK, false, V13, DX>(v[r], C / 16, inv_c, eps, (r & 1) ? ok1 : ok0, mean[r], rstd[r]);
  }
}
// A fragments of k steps 2 kk and 2 kk + 1 (channels 16 kk + 4 t ..): s = ((xa - ma) ra + (xb - mb) rb) / 2
// with the LayerNorm affine folded into W1, split into TF32 hi (rounded) and lo (truncated), as v7's
// split_tf32_fast. Column t of k step 2 kk is channel + 0, column t + 4 channel + 1; k step 2 kk + 1: + 2, + 3.
// s of fragment row h (0: g, 1: g + 8) at chunk kk from the tile's and the mirror's 4 channels.
// One side's term (x - m) r of s, per channel; each product rounded on its own (no FMA contraction), so that
// s(i, j) == s(j, i) bit for bit.
__device__ __forceinline__ float4 v10_term4(const float4& x, float m, float r) {
  return make_float4(__fmul_rn(x.x - m, r), __fmul_rn(x.y - m, r), __fmul_rn(x.z - m, r), __fmul_rn(x.w - m, r));
}
// v20: the same term from the statistics' d = x - m and delta (v10_row_stats' DX) as one FFMA per channel,
// fmaf(d, r, -delta r): (d - delta) r with a single rounding (the arguments as v10_term4's, d for x and delta for
// the mean). Both sides of a pair and both roles of a position (tile row, mirror row) go through the same
// expression, so s(i, j) == s(j, i) still holds.
__device__ __forceinline__ float4 v20_term4(const float4& d, float delta, float r) {
  const float c = -delta * r;
  return make_float4(fmaf(d.x, r, c), fmaf(d.y, r, c), fmaf(d.z, r, c), fmaf(d.w, r, c));
}
// s = pa + pb from the two sides' terms, split into the A fragments of k steps 2 kk, 2 kk + 1 (fragment row h).
template <int KC, bool V13 = false>
__device__ __forceinline__ void v10_build4_s(const float4& pa, const float4& pb, int kk, int h,
                                             uint32_t (&ah)[KC / 8][4], uint32_t (&al)[KC / 8][4]) {
  split_tf32_fast<!V13>(__fadd_rn(pa.x, pb.x), ah[2 * kk][h], al[2 * kk][h]);
  split_tf32_fast<!V13>(__fadd_rn(pa.y, pb.y), ah[2 * kk][2 + h], al[2 * kk][2 + h]);
  split_tf32_fast<!V13>(__fadd_rn(pa.z, pb.z), ah[2 * kk + 1][h], al[2 * kk + 1][h]);
  split_tf32_fast<!V13>(__fadd_rn(pa.w, pb.w), ah[2 * kk + 1][2 + h], al[2 * kk + 1][2 + h]);
}
// s from the tile row's term pa (v10_term4, computed before the mirror lands in v19) and the mirror row vb.
template <int KC, bool V13 = false>
__device__ __forceinline__ void v10_build4_pre(const float4& pa, const float4& vb, float mb, float rb, int kk, int h,
                                               uint32_t (&ah)[KC / 8][4], uint32_t (&al)[KC / 8][4]) {
  v10_build4_s<KC, V13>(pa, v10_term4(vb, mb, rb), kk, h, ah, al);
}
template <int KC, bool V13 = false>
__device__ __forceinline__ void v10_build4(const float4& va, const float4& vb, float ma, float ra, float mb, float rb,
                                           int kk, int h, uint32_t (&ah)[KC / 8][4], uint32_t (&al)[KC / 8][4]) {
  v10_build4_pre<KC, V13>(v10_term4(va, ma, ra), vb, mb, rb, kk, h, ah, al);
}
template <int KC>
__device__ __forceinline__ void v10_build_kk(const float* tile, const float* mirror, int p0, int t, int kk,
                                             const float (&mean)[4], const float (&rstd)[4],
                                             uint32_t (&ah)[KC / 8][4], uint32_t (&al)[KC / 8][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // fragment rows g (h = 0) and g + 8
    const int p = p0 + 8 * h;
    v10_build4<KC>(v10_chunk4(tile, p, kk, t), v10_chunk4(mirror, p, kk, t), mean[h], 0.5f * rstd[h], mean[2 + h],
                   0.5f * rstd[2 + h], kk, h, ah, al);
  }
}

// v10's parameters, packed once per call into the layout the kernel keeps in shared memory (one bulk
// copy per block then): wpack = [W1' hi | W1' lo (HP x KC each, v10_woff order of rows n, logical k) |
// W2 hi | W2 lo (HP x HP) | b1' | b2 | w3 (HP each)], zero outside n < H, c < C. One thread per
// weight element, then one warp per hidden unit n for b1'[n] = b1[n] + sum_c W1[n][c] beta[c] (fp64).
template <int KC, int HP>
constexpr int kV10PackFloats = 2 * HP * KC + 2 * HP * HP + 3 * HP;
template <int KC, int HP>
__global__ void __launch_bounds__(256) contact_map_v10_params_kernel(
    const float* __restrict__ ln_w, const float* __restrict__ ln_b, const float* __restrict__ w1,
    const float* __restrict__ b1, const float* __restrict__ w2, const float* __restrict__ b2,
    const float* __restrict__ w3, int C, int H, float* __restrict__ wpack, int* __restrict__ tile_counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // v10's kernel may start its tile copies
#endif
  const int e = blockIdx.x * 256 + threadIdx.x;
  if (e == 0 && tile_counter != nullptr) *tile_counter = 0;  // v19's tile tickets (read after griddepcontrol.wait)
  float* w2p = wpack + 2 * HP * KC;
  float* vec = w2p + 2 * HP * HP;
  if (e < HP * KC) {
    const int n = e / KC, k = e % KC, c = v10_k1(k);
    const float v = n < H && c < C ? __ldg(w1 + static_cast<long long>(n) * C + c) * __ldg(ln_w + c) : 0.f;
    uint32_t hi, lo;
    split_tf32(v, hi, lo);
    wpack[v10_woff(n, k, HP)] = __uint_as_float(hi);
    wpack[HP * KC + v10_woff(n, k, HP)] = __uint_as_float(lo);
  } else if (e < HP * KC + HP * HP) {
    const int ee = e - HP * KC, n = ee / HP, k = ee % HP, h = v10_k2(k);
    const float v = n < H && h < H ? __ldg(w2 + static_cast<long long>(n) * H + h) : 0.f;
    uint32_t hi, lo;
    split_tf32(v, hi, lo);
    w2p[v10_woff(n, k, HP)] = __uint_as_float(hi);
    w2p[HP * HP + v10_woff(n, k, HP)] = __uint_as_float(lo);
  } else {
    const int n = (e - HP * KC - HP * HP) >> 5, lane = threadIdx.x & 31;  // whole warps (HP * KC + HP * HP % 32 == 0)
    if (n >= HP) return;
    double acc = 0.0;
    if (n < H)
      for (int c = lane; c < C; c += 32)
        acc += static_cast<double>(__ldg(w1 + static_cast<long long>(n) * C + c)) * static_cast<double>(__ldg(ln_b + c));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
      vec[n] = n < H ? static_cast<float>(static_cast<double>(__ldg(b1 + n)) + acc) : 0.f;
      vec[HP + n] = n < H ? __ldg(b2 + n) : 0.f;
      vec[2 * HP + n] = n < H ? __ldg(w3 + n) : 0.f;
    }
  }
}

#if defined(CM_WG_DEVICE)
// k steps per promotion (16 k): the tensor cores' own accumulation truncates, so each chunk of
// kV10Promo k steps (lo*hi, hi*lo, hi*hi each) goes into a fresh accumulator that is then added to acc
// in fp32. (64 k per chunk, as outer_wg, measured up to 3.1x the fp32 reference's max error against
// fp64 here; 16 k: at most 1.55x; scratch checks of device runs 1-2, NOTES.md.)
constexpr int kV10Promo = 2;
template <int NA>
__device__ __forceinline__ void v10_promote(float (&acc)[NA], float (&d)[NA], bool first) {
  wg_fence(d);
#pragma unroll
  for (int e = 0; e < NA; ++e) acc[e] = first ? d[e] : acc[e] + d[e];
}
template <int HP, int KS>
__device__ __forceinline__ void v10_chunk(float (&d)[HP / 2], const uint32_t (&ah)[KS][4], const uint32_t (&al)[KS][4],
                                          int c0, uint64_t dh, uint64_t dl) {
  constexpr uint64_t kStep = (HP * 8 * 4) >> 4;  // descriptor increment per k step (HP x 8 floats)
  wg_fence(d);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int i = 0; i < kV10Promo; ++i) {
    const int ks = c0 + i;
    wgmma_rs<HP>(d, al[ks], dh + ks * kStep, i == 0 ? 0 : 1);  // the small terms first
    wgmma_rs<HP>(d, ah[ks], dl + ks * kStep, 1);
    wgmma_rs<HP>(d, ah[ks], dh + ks * kStep, 1);
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// acc = A B^T over KS k steps: chunks alternate between d0 and d1, so that one is on the tensor cores
// while the other is promoted.
template <int HP, int KS>
__device__ __forceinline__ void v10_gemm(const uint32_t (&ah)[KS][4], const uint32_t (&al)[KS][4], uint64_t dh,
                                         uint64_t dl, float (&d0)[HP / 2], float (&d1)[HP / 2], float (&acc)[HP / 2]) {
  constexpr int NCH = KS / kV10Promo;
  static_assert(KS % kV10Promo == 0, "k steps per chunk");
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    if (c & 1) v10_chunk<HP, KS>(d1, ah, al, c * kV10Promo, dh, dl);
    else v10_chunk<HP, KS>(d0, ah, al, c * kV10Promo, dh, dl);
    if (c > 0) {
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // chunk c - 1 is done
      if ((c - 1) & 1) v10_promote(acc, d1, c == 1);
      else v10_promote(acc, d0, c == 1);
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  if ((NCH - 1) & 1) v10_promote(acc, d1, NCH == 1);
  else v10_promote(acc, d0, NCH == 1);
}
#endif

// V (the variant): 10: v10; 11 (v11): each tile's rows read from the slots once, into registers (128 at
// pair_dim 128): the slots are released before the statistics, which (and s) are then computed from the
// registers. v10 reads them twice from the slots (statistics, then s) and releases the slots after s.
// 13 (v13): v11, and
//   - the producer thread walks the tiles incrementally and writes each tile's (b, I, J) beside its slot
//     (tinfo), so that the consumers neither divide nor take a square root per tile (decode_tile: ~700
//     cycles per tile on the consumers' path, clock64 timeline of the eleventh session);
//   - the consumers track their slots and parities incrementally (no division by R);
//   - the statistics' sums start from the first four chunks and the second pass is FFMA / FADD chains
//     (v10_row_stats' V13), the A fragments' lo parts are not masked (split_tf32_fast<false>);
//   - setmaxnreg 240 / 24 (kV13ConsumerRegs).
// 14 (v14): v13 with the two consumer warpgroups' GEMM1 + GEMM2 taking turns (FlashAttention-3's ping-pong
//   schedule): warpgroup w waits on named barrier 1 + w before GEMM1 and, after GEMM2, arrives on the other's
//   barrier if the other has a next tile (t + gridDim.x < total). Warpgroup 1 grants warpgroup 0 the first
//   turn. So one warpgroup's products run while the other computes statistics and s; each barrier phase gets
//   exactly one sync (128 threads) and one arrive (128 threads): warpgroup 0 has as many tiles as warpgroup 1
//   or one more, and the arrivals counted above match the syncs in both cases.
// 17 (v17): v14 with the tile copies marked L2 evict_first (createpolicy.fractional.L2::evict_first, fraction
//   1.0). Every input byte is read once (the tile and its mirror are different bytes), so its L2 lines are
//   dead once they land in shared memory: with the hint, a later copy's miss replaces them rather than other
//   lines. Under the harness's flush, which leaves L2 full of dirty lines, those would otherwise be written
//   back during this kernel: the load-only build took 29.6 -> 26.1 us at crop (scratch, thirteenth session).
// 19 (v19): v17 with the tiles handed out by an atomic counter (tile_counter, zeroed by the params kernel): a
//   block's first two tiles are fixed, each later one is whichever is next when the producer takes its ticket,
//   so blocks whose copies land sooner take more tiles (v17's fixed share left the last tiles' arrival spread
//   over 63-70 us at batch: globaltimer stamps, fourteenth session). The consumers stop at a sentinel in the
//   tile info, the ping-pong arrivals are unconditional and the sentinels balance them. The tile half's
//   (x - mean) rstd / 2 is computed before the wait for the mirror (v10_build4_pre: the same operations), so
//   less work follows the last copy's arrival; the tensor maps promote L2 requests to 128 bytes. Same
//   arithmetic per tile as v17: bit-identical outputs.
// 20 (v20): v19 with each side's term (x - mean) rstd / 2 as one FFMA per channel: the statistics' second pass
//   leaves d = x - m (m: the first pass's mean) in the registers (v10_row_stats' DX) and the term is
//   fmaf(d, r, -delta r) with delta = d1 / C (v20_term4; ln_stats' mean is m + delta) instead of (x - mean) * r
//   (FADD + FMUL): 7 instructions per input value instead of 8 for the statistics, terms and split. Other
//   roundings than v19: the mean itself is never rounded.
// v13, v14, v17, v19 and v20 run at pair_dim > 64 only (KC == 128; the host sends smaller pair_dim to v11's kernel).
template <int KC, int HP, int V>
__global__ void __launch_bounds__(kV10Threads, 1)
contact_map_v10_kernel(const __grid_constant__ CUtensorMap tm_tile,    // x as (C, N (j), N (i), B)
                       const __grid_constant__ CUtensorMap tm_mirror,  // x as (C, N (i), N (j), B)
                       float* __restrict__ out,                        // (B, N, N)
                       const float* __restrict__ wpack,                // kV10PackFloats<KC, HP>
                       int* __restrict__ tile_counter,                 // v19: tickets handed out (0 at the start)
                       const float* __restrict__ b3,                   // (1)
                       float eps, int B, int N, int C, int H, int R) {
#if defined(CM_WG_DEVICE)
  constexpr bool V11 = V >= 11, V13 = V >= 13, PING_PONG = V >= 14, EVICT_FIRST = V >= 17, DYNAMIC = V >= 19,
                 FMA_TERMS = V >= 20;
  static_assert(V == 10 || V == 11 || V == 13 || V == 14 || V == 17 || V == 19 || V == 20,
                "contact_map_v10_kernel: V = 10, 11, 13, 14, 17, 19 or 20");
  static_assert(!V13 || KC == 128, "v13, v14, v17, v19, v20: pair_dim > 64");
  constexpr int KS1 = KC / 8, KS2 = HP / 8, NA = HP / 2, NK = KC / 16;
  constexpr int kConsumerRegs = V13 ? kV13ConsumerRegs : kV10ConsumerRegs;
  constexpr int kProducerRegs = V13 ? kV13ProducerRegs : kV10ProducerRegs;
  extern __shared__ __align__(16) float smem_raw[];
  const SmemV10 L(KC, HP, R);
  // the ring 1024-byte aligned (the 128-byte swizzle's atom), as an offset from smem_raw so that the compiler
  // keeps these pointers in the shared space (LDS; through an integer cast it emitted generic LD.E)
  float* sm = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) / 4;
  float* ring = sm;
  float* w1s = ring + L.ring / 4;     // hi plane, then lo plane: 2 x HP x KC
  float* w2s = w1s + L.w1 / 4;        // 2 x HP x HP
  float* vec = w2s + L.w2 / 4;        // b1' | b2 | w3 (HP each)
  int4* tinfo = reinterpret_cast<int4*>(vec + 3 * HP);  // v13: (b, I, J, 0) of the tile in slot s
  uint64_t* full = reinterpret_cast<uint64_t*>(tinfo + R);
  uint64_t* empty = full + R;
  uint64_t* wbar = empty + R;  // the parameters' bulk copies

  const int tid = threadIdx.x, wg = tid / 128;
  const int nT = cdiv(N, TILE);
  const long long tiles_per_b = static_cast<long long>(nT) * (nT + 1) / 2;
  const long long total = static_cast<long long>(B) * tiles_per_b;
  if (tid == 0) {
    for (int s = 0; s < R; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 4);
    }
    mbar_init(wbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  int pb = 0, pI = 0, pJ = 0;  // v13's producer: the block's first tile, decoded before setmaxnreg.dec
  if (V13 && !DYNAMIC && tid == 256 && blockIdx.x < total) decode_tile(blockIdx.x, tiles_per_b, pb, pI, pJ);
  __syncthreads();  // the mbarriers are initialised before anyone waits on them

  if (wg == 2) {  // producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid == 288) {  // the packed parameters (w1s, w2s, vec are contiguous), in pieces of <= 32 KB
      constexpr int bytes = 4 * kV10PackFloats<KC, HP>;
      // launched as a programmatic dependent of the params kernel: wait for its writes (the tile copies
      // by thread 256 do not depend on it)
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      mbar_expect_tx(wbar, bytes);
      for (int off = 0; off < bytes; off += 32768)
        bulk_copy(w1s + off / 4, wpack + off / 4, bytes - off < 32768 ? bytes - off : 32768, wbar);
    } else if (tid == 256) {
      const unsigned bytes = static_cast<unsigned>(4 * L.slot_floats);
      unsigned u = 0;
      uint64_t policy = 0;  // v17: the tiles' L2 lines evicted first (read once)
      if constexpr (EVICT_FIRST) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
      // half tile `mirror` of tile (b, I, J) into slot s: KC / 32 boxes completing on full[s]
      auto copy_half = [&](int s, bool mirror, int b, int I, int J) {
        mbar_expect_tx(full + s, bytes);
        float* dst = ring + s * L.slot_floats;
        const CUtensorMap* map = mirror ? &tm_mirror : &tm_tile;
#pragma unroll
        for (int box = 0; box < KC / 32; ++box) {
          if constexpr (EVICT_FIRST) tma_load_4d(dst + box * 2048, map, 32 * box, TILE * J, TILE * I, b, full + s, policy);
          else tma_load_4d(dst + box * 2048, map, 32 * box, TILE * J, TILE * I, b, full + s);
        }
      };
      if constexpr (DYNAMIC) {
        // v19: the block's tiles q = 0, 1 are blockIdx.x and blockIdx.x + gridDim.x, the later ones tickets from
        // tile_counter (t = 2 gridDim.x + ticket). Each ticket is taken two tiles ahead (tk0 for q + 1, tk1 for
        // q + 2), so that the atomic's round trip is over long before its use. Past the last tile, use 2q gets a
        // sentinel (b = -1, I = 1) for one consumer warpgroup and use 2q + 2 one (b = -1, I = 0) for the other,
        // each completing its slot's phase with a plain arrive. The slot ps = u % R, pw = (u / R) & 1 and
        // wrapped = u >= R of half-tile use u are kept incrementally, and the tile indices are 32-bit (the host
        // checks total < 2^31): with no division by R and no 64-bit division the walk fits the 24 registers of
        // kV13ProducerRegs.
        const unsigned total32 = static_cast<unsigned>(total), tpb32 = static_cast<unsigned>(tiles_per_b);
        int ps = 0;
        unsigned pw = 0;
        bool wrapped = false;
        auto next_slot = [&]() {
          if (++ps == R) {
            ps = 0;
            pw ^= 1;
            wrapped = true;
          }
        };
        auto wait_slot = [&]() {  // until the consumers have released slot ps's previous phase
          if (wrapped) mbar_wait(empty + ps, pw ^ 1);
        };
        unsigned t = blockIdx.x, tk0 = 0, tk1 = 0;
        for (unsigned q = 0;; ++q) {
          wait_slot();
          if (t >= total32) {
            tinfo[ps] = make_int4(-1, 1, 0, 0);  // the first sentinel (I = 1)
            mbar_arrive(full + ps);
            next_slot();
            next_slot();
            wait_slot();
            tinfo[ps] = make_int4(-1, 0, 0, 0);
            mbar_arrive(full + ps);
            break;
          }
          int b, I, J;
          decode_tile32(t, tpb32, b, I, J);
          tinfo[ps] = make_int4(b, I, J, 0);
          copy_half(ps, false, b, I, J);
          next_slot();
          wait_slot();
          copy_half(ps, true, b, I, J);
          next_slot();
          if (q == 0) {
            t = blockIdx.x + gridDim.x;
          } else {
            if (q == 1) {
              asm volatile("griddepcontrol.wait;\n" ::: "memory");  // tile_counter zeroed by the params kernel
              tk0 = static_cast<unsigned>(atomicAdd(tile_counter, 1));
            } else {
              tk0 = tk1;
            }
            tk1 = static_cast<unsigned>(atomicAdd(tile_counter, 1));
            t = 2u * gridDim.x + tk0;
          }
        }
      }
      for (long long t = blockIdx.x; !DYNAMIC && t < total; t += gridDim.x) {
        int b, I, J;
        if constexpr (V13) {
          b = pb;
          I = pI;
          J = pJ;
          // the next tile: t + gridDim.x, i.e. u = J (J + 1) / 2 + I (I <= J) advanced by gridDim.x,
          // row by row (row J holds J + 1 tiles), the next batch after row nT - 1
          pI += gridDim.x;
          while (pI > pJ) {
            pI -= pJ + 1;
            if (++pJ == nT) {
              pJ = 0;
              ++pb;
            }
          }
        } else {
          decode_tile(t, tiles_per_b, b, I, J);
        }
        for (int half = 0; half < 2; ++half, ++u) {
          const int s = static_cast<int>(u % R);
          if (u >= static_cast<unsigned>(R)) mbar_wait(empty + s, ((u / R) - 1) & 1);
          // (b, I, J) for the consumers, ordered before their reads by the arrive's release
          if (V13 && half == 0) tinfo[s] = make_int4(b, I, J, 0);
          copy_half(s, half != 0, b, I, J);
        }
      }
    }
    return;  // no block-wide barrier after this point
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));

  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3, w4 = (tid >> 5) & 3;
  const int p0 = 16 * w4 + v10_row(g);  // this thread's pairs: p0 (fragment row g) and p0 + 8 (row g + 8)
  const float inv_c = 1.f / static_cast<float>(C), bias3 = __ldg(b3);
  const uint64_t d1h = v10_desc(w1s), d1l = v10_desc(w1s + HP * KC);
  const uint64_t d2h = v10_desc(w2s), d2l = v10_desc(w2s + HP * HP);

  float d0[NA], d1[NA];  // wgmma accumulators (each chunk starts with scale-d 0; zeroed once so they are defined)
#pragma unroll
  for (int e = 0; e < NA; ++e) d0[e] = d1[e] = 0.f;
  bool staged = false;  // this thread has waited for the weights
  if constexpr (PING_PONG) {
    if (wg == 1) named_bar_arrive(1);  // warpgroup 0's products go first
  }
  unsigned q = wg;      // block-local tile index
  // v13: slot and parity of use u0 = 2q, kept incrementally (u0 advances by 4 per tile; launch_v10 makes R a
  // multiple of 4, so one wrap at most, but the two steps below hold for any R >= 2)
  int cs = static_cast<int>((2u * q) % R);
  unsigned cph = ((2u * q) / R) & 1;
  // v19: the tiles come from the producer's tickets; the loop ends at a sentinel (below)
  for (long long t = blockIdx.x + static_cast<long long>(wg) * gridDim.x; DYNAMIC || t < total;
       t += 2ll * gridDim.x, q += 2) {
    int b = 0, I = 0, J = 0;
    if constexpr (!V13) decode_tile(t, tiles_per_b, b, I, J);
    const unsigned u0 = 2 * q, u1 = 2 * q + 1;
    int s0, s1;
    unsigned ph0, ph1;
    if constexpr (V13) {
      s0 = cs;
      ph0 = cph;
      s1 = s0 + 1 == R ? 0 : s0 + 1;
      ph1 = s0 + 1 == R ? ph0 ^ 1 : ph0;
      cs += 4;
      if (cs >= R) {
        cs -= R;
        cph ^= 1;
      }
      if (cs >= R) {
        cs -= R;
        cph ^= 1;
      }
    } else {
      s0 = static_cast<int>(u0 % R);
      s1 = static_cast<int>(u1 % R);
      ph0 = (u0 / R) & 1;
      ph1 = (u1 / R) & 1;
    }
    const float* tl = ring + s0 * L.slot_floats;
    const float* mi = ring + s1 * L.slot_floats;
    if constexpr (V13) {  // the tile's coordinates from its producer
      mbar_wait(full + s0, ph0);
      const int4 ti = tinfo[s0];
      b = ti.x;
      I = ti.y;
      J = ti.z;
      if (DYNAMIC && b < 0) {  // v19's sentinel: the block's tiles are done (I = 1: the first of its two sentinels)
        if constexpr (PING_PONG) {
          // every tile's GEMM2 arrived on the other's barrier unconditionally: consume the arrival meant for this
          // warpgroup's next turn, and at the first sentinel give the other warpgroup the arrival that its own
          // sentinel (the second) will consume. Each barrier phase then gets one sync and one arrive.
          named_bar_sync(1 + wg);
          if (I != 0) named_bar_arrive(2 - wg);
        }
        break;
      }
    }
    const int i0 = TILE * I + (p0 >> 3), j0 = TILE * J + (p0 & 7);
    const int i1 = i0 + 1;  // p1 = p0 + 8: next tile row, same column
    const bool ok0 = i0 < N && j0 < N, ok1 = i1 < N && j0 < N;
    float mean[4], rstd[4];
    uint32_t ah[KS1][4], al[KS1][4];
    if constexpr (V11) {
      // ---- the 4 rows (tile p0, p0 + 8; mirror p0, p0 + 8) into registers, both slots released ----
      float4 v[4][NK];
      if constexpr (!V13) mbar_wait(full + s0, ph0);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        v[0][kk] = v10_chunk4(tl, p0, kk, t4);
        v[1][kk] = v10_chunk4(tl, p0 + 8, kk, t4);
      }
      // (v20: mean[] holds each row's delta, v the rows' d = x - m: v10_row_stats' DX)
      v11_half_stats<NK, 0, V13, FMA_TERMS>(v, C, inv_c, eps, ok0, ok1, mean, rstd);
      if constexpr (DYNAMIC) {  // v19: the tile half's (x - mean) rstd / 2 before the mirror's wait (v10_build4_pre)
#pragma unroll
        for (int kk = 0; kk < NK; ++kk)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if constexpr (FMA_TERMS) v[h][kk] = v20_term4(v[h][kk], mean[h], 0.5f * rstd[h]);
            else v[h][kk] = v10_term4(v[h][kk], mean[h], 0.5f * rstd[h]);
      }
      mbar_wait(full + s1, ph1);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        v[2][kk] = v10_chunk4(mi, p0, kk, t4);
        v[3][kk] = v10_chunk4(mi, p0 + 8, kk, t4);
      }
      __syncwarp();
      if (lane == 0) {  // this warp has read both slots
        mbar_arrive(empty + s0);
        mbar_arrive(empty + s1);
      }
      v11_half_stats<NK, 2, V13, FMA_TERMS>(v, C, inv_c, eps, ok0, ok1, mean, rstd);
      // ---- s split into A fragments for all of K ----
#pragma unroll
      for (int kk = 0; kk < NK; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if constexpr (FMA_TERMS)
            v10_build4_s<KC, V13>(v[h][kk], v20_term4(v[2 + h][kk], mean[2 + h], 0.5f * rstd[2 + h]), kk, h, ah, al);
          else if constexpr (DYNAMIC) v10_build4_pre<KC, V13>(v[h][kk], v[2 + h][kk], mean[2 + h], 0.5f * rstd[2 + h], kk, h, ah, al);
          else v10_build4<KC, V13>(v[h][kk], v[2 + h][kk], mean[h], 0.5f * rstd[h], mean[2 + h], 0.5f * rstd[2 + h], kk,
                              h, ah, al);
    } else {
      mbar_wait(full + s0, ph0);
      mbar_wait(full + s1, ph1);
      if (C == KC) v10_stats<KC, true>(tl, mi, p0, t4, C, inv_c, eps, ok0, ok1, mean, rstd);
      else v10_stats<KC, false>(tl, mi, p0, t4, C, inv_c, eps, ok0, ok1, mean, rstd);
      // ---- s split into A fragments for all of K (then both slots are free) ----
      // (building chunk kk while chunk kk - 1 ran on the tensor cores measured slower at long: 507 vs 493 us)
#pragma unroll
      for (int kk = 0; kk < KS1 / 2; ++kk) v10_build_kk<KC>(tl, mi, p0, t4, kk, mean, rstd, ah, al);
      __syncwarp();
      if (lane == 0) {  // this warp has read both slots
        mbar_arrive(empty + s0);
        mbar_arrive(empty + s1);
      }
    }
    // ---- GEMM1: h1 = s W1'^T ----
    if (!staged) {  // the parameters are in shared memory
      mbar_wait(wbar, 0);
      staged = true;
    }
    if constexpr (PING_PONG) named_bar_sync(1 + wg);  // this warpgroup's turn on the tensor cores
    float acc[NA];
    wg_fence(ah);
    wg_fence(al);
    v10_gemm<HP, KS1>(ah, al, d1h, d1l, d0, d1, acc);
    wg_fence(ah);  // the A registers stay live until every wgmma reading them has completed
    wg_fence(al);

    // ---- h1 = relu(acc + b1') in registers -> GEMM2's A fragments (v10_k2's order) ----
    uint32_t bh[KS2][4], bl[KS2][4];
#pragma unroll
    for (int j = 0; j < KS2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int unit = 8 * j + 2 * t4 + (e & 1);
        const float h = relu(acc[4 * j + e] + vec[unit]);
        const int slot = (e >> 1) | ((e & 1) << 1);  // d[4j + e]: row g + 8 (e / 2), unit + e % 2 -> a[(e/2) + 2 (e%2)]
        split_tf32_fast<!V13>(h, bh[j][slot], bl[j][slot]);
      }
    wg_fence(bh);
    wg_fence(bl);
    // ---- GEMM2: h2 = h1 W2^T (into acc) ----
    v10_gemm<HP, KS2>(bh, bl, d2h, d2l, d0, d1, acc);
    wg_fence(bh);
    wg_fence(bl);
    if constexpr (PING_PONG) {
      if (DYNAMIC || t + gridDim.x < total) named_bar_arrive(2 - wg);  // the other warpgroup's next tile: its turn
    }

    // ---- layer 3 and the output: z = sum_u w3[u] relu(h2[u] + b2[u]) ----
    float z0 = 0.f, z1 = 0.f;
#pragma unroll
    for (int j = 0; j < KS2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int unit = 8 * j + 2 * t4 + e;
        const float bb = vec[HP + unit], ww = vec[2 * HP + unit];
        z0 = fmaf(ww, relu(acc[4 * j + e] + bb), z0);
        z1 = fmaf(ww, relu(acc[4 * j + 2 + e] + bb), z1);
      }
    z0 += __shfl_xor_sync(0xffffffffu, z0, 1);
    z0 += __shfl_xor_sync(0xffffffffu, z0, 2);
    z1 += __shfl_xor_sync(0xffffffffu, z1, 1);
    z1 += __shfl_xor_sync(0xffffffffu, z1, 2);
    // lanes t4 = 0 / 1 write pair p0 / p1 (both orientations)
    if (t4 < 2) {
      const bool ok = t4 == 0 ? ok0 : ok1;
      if (ok) {
        const int i = t4 == 0 ? i0 : i1;
        const float o = 1.f / (1.f + expf(-((t4 == 0 ? z0 : z1) + bias3)));
        out[(static_cast<long long>(b) * N + i) * N + j0] = o;
        out[(static_cast<long long>(b) * N + j0) * N + i] = o;
      }
    }
  }
#else
  __trap();  // built without sm_90a: the host never launches this (v10_supported)
#endif
}

// =============================================================================================
// Launchers
// =============================================================================================
struct Args {
  const float *x, *ln_w, *ln_b, *w1, *b1, *w2, *b2, *w3, *b3;
  float* out;
  float eps;
  int B, N, C, H, CP;
  bool vec;
  int device;  // the input's CUDA device (current under the forward's CUDAGuard)
};

// A device's facts that every forward needs, queried once per device (four driver calls, ~1.5 us of host time
// per forward on the H200 machine's host otherwise; thirteenth session's profile).
struct DeviceFacts {
  int max_smem, num_sms, major, minor;
};
DeviceFacts device_facts(int device) {
  static std::mutex mu;
  static std::unordered_map<int, DeviceFacts> cache;
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  DeviceFacts f{};
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.num_sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, device));
  cache.emplace(device, f);
  return f;
}

// A kernel's MaxDynamicSharedMemorySize raised to at least `smem` on `device` (the current device, the caller's
// CUDAGuard), for every kernel of this file: cudaFuncSetAttribute only when a larger size than any set before is
// asked for (it took 1.9 us of every forward in the same profile). A larger limit also admits the smaller
// launches.
void ensure_max_dynamic_smem(const void* kernel, int device, int smem) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> set_to;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(kernel, device);
  const auto it = set_to.find(key);
  if (it != set_to.end() && it->second >= smem) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  set_to[key] = smem;
}

// Persistent launch of either kernel (same signature): as many blocks of `threads` threads as fit on
// the device, at most one per tile.
using KernelFn = void (*)(const float*, float*, const float*, const float*, const float*, const float*,
                          const float*, const float*, const float*, const float*, float, int, int, int, int,
                          int, bool);
int blocks_per_sm(KernelFn kernel, int device, int threads, size_t smem) {
  ensure_max_dynamic_smem(reinterpret_cast<const void*>(kernel), device, static_cast<int>(smem));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return per_sm;
}

// per_sm: the kernel's resident blocks per SM when the caller has just asked (blocks_per_sm, which
// also sets its shared-memory attribute), else 0 and it is asked here.
void launch_persistent(KernelFn kernel, int threads, size_t smem, const Args& a, cudaStream_t stream,
                       int num_sms, int per_sm = 0) {
  if (per_sm == 0) per_sm = blocks_per_sm(kernel, a.device, threads, smem);
  TORCH_CHECK(per_sm > 0, "contact_map: kernel does not fit on the device (", num(smem),
              " bytes of shared memory)");
  const int nT = cdiv(a.N, TILE);
  const long long tiles = static_cast<long long>(a.B) * nT * (nT + 1) / 2;
  const long long slots = static_cast<long long>(per_sm) * num_sms;
  const int grid = static_cast<int>(tiles < slots ? tiles : slots);
  kernel<<<grid, threads, smem, stream>>>(a.x, a.out, a.ln_w, a.ln_b, a.w1, a.b1, a.w2, a.b2, a.w3,
                                         a.b3, a.eps, a.B, a.N, a.C, a.H, a.CP, a.vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int V, int HP, bool W_SMEM>
void launch(const Args& a, cudaStream_t stream, int num_sms) {
  launch_persistent(contact_map_kernel<V, HP, W_SMEM>, THREADS, sizeof(float) * Smem(a.CP, HP, W_SMEM).total,
                    a, stream, num_sms);
}

template <int V, bool W_SMEM>
void dispatch_hidden(const Args& a, int HP, cudaStream_t s, int sms) {
  switch (HP) {
    case 16: launch<V, 16, W_SMEM>(a, s, sms); break;
    case 32: launch<V, 32, W_SMEM>(a, s, sms); break;
    case 64: launch<V, 64, W_SMEM>(a, s, sms); break;
    case 128: launch<V, 128, W_SMEM>(a, s, sms); break;
    default: launch<V, 256, W_SMEM>(a, s, sms); break;  // HP <= MAX_HIDDEN checked by forward()
  }
}

template <int V>
void dispatch(const Args& a, int HP, bool w_smem, cudaStream_t s, int sms) {
  if (w_smem) dispatch_hidden<V, true>(a, HP, s, sms);
  else dispatch_hidden<V, false>(a, HP, s, sms);
}

// v5 / v7 (contact_map_tc_kernel with 256 / 512 threads): weights as split fragments in shared memory
// when they fit beside the tile, else read from global memory.
// v7 at HP <= 32: the 2-blocks-per-SM build (64 registers) only where two blocks fit by shared memory,
// else the 1-block build with the fused statistics pass (MINB above).
// v9 (PROD): the producer-warp build where one block fits per SM; where two fit, v7's 2-block build
// (under 64 registers per thread the PROD build at HP = 32, 2 n tiles per warp, spilled 8 bytes).
template <int HP, WFormat WF, int NTHR, bool PROD = false>
void launch_tc(const Args& a, cudaStream_t stream, int num_sms) {
  const size_t smem = sizeof(float) * SmemTC(a.CP, HP, WF).total;
  if constexpr (kMinBlocksTC<HP, NTHR> == 2 && NTHR == 512) {
    const int per_sm = blocks_per_sm(contact_map_tc_kernel<HP, WF, NTHR, 2>, a.device, NTHR, smem);
    if (per_sm < 2)
      launch_persistent(contact_map_tc_kernel<HP, WF, NTHR, 1, PROD>, NTHR, smem, a, stream, num_sms);
    else
      launch_persistent(contact_map_tc_kernel<HP, WF, NTHR, 2>, NTHR, smem, a, stream, num_sms, per_sm);
  } else {
    launch_persistent(contact_map_tc_kernel<HP, WF, NTHR, kMinBlocksTC<HP, NTHR>, PROD>, NTHR, smem, a, stream,
                      num_sms);
  }
}

// v9's producer warps at HP <= 32 only: at HP = 64 (crop, long) NG = 2 takes half the warps out of
// products that are ~50% of the loop there, and measured 8-10% slower than v7 (NOTES.md).
constexpr int kProdMaxHP = 32;

// variant 5: v5 (256 threads); 7: v7 (512 threads); 9: v9 (v7 with producer warps at HP <= kProdMaxHP).
template <int HP, WFormat WF>
void launch_tc_variant(const Args& a, int variant, cudaStream_t s, int sms) {
  if (variant == 5) {
    launch_tc<HP, WF, 256>(a, s, sms);
  } else if constexpr (HP <= kProdMaxHP) {
    if (variant == 9) launch_tc<HP, WF, 512, true>(a, s, sms);
    else launch_tc<HP, WF, 512>(a, s, sms);
  } else {
    launch_tc<HP, WF, 512>(a, s, sms);
  }
}

template <WFormat WF>
void dispatch_tc_hidden(const Args& a, int HP, int variant, cudaStream_t s, int sms) {
  switch (HP) {
    case 16: launch_tc_variant<16, WF>(a, variant, s, sms); break;
    case 32: launch_tc_variant<32, WF>(a, variant, s, sms); break;
    case 64: launch_tc_variant<64, WF>(a, variant, s, sms); break;
    case 128: launch_tc_variant<128, WF>(a, variant, s, sms); break;
    // HP <= MAX_HIDDEN checked by forward(); at 256 the weights (>= 512 KB) never fit in shared memory,
    // and v7's 16 warps would need more than the 128 registers per thread they may have: v5's kernel
    // (also for v9).
    default: launch_tc<256, WFormat::kGlobal, 256>(a, s, sms); break;
  }
}

// v10's host side: sm_90a in this build and a compute capability 9.0 device; the shapes its tiles fit.
#if defined(CM_SM90A)
constexpr bool kBuiltSm90a = true;  // the build has sm_90a code (v10's wgmma)
#else
constexpr bool kBuiltSm90a = false;
#endif

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The driver's cuTensorMapEncodeTiled through the runtime (no -lcuda needed), looked up once.
EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q));
#endif
    TORCH_CHECK(q == cudaDriverEntryPointSuccess && p != nullptr,
                "contact_map: the CUDA driver has no cuTensorMapEncodeTiled (v10 needs CUDA 12+)");
    fn = reinterpret_cast<EncodeTiledFn>(p);
  }
  return fn;
}

// x (B, N, N, C) contiguous as a 4-D tensor map (C, N, N, B) with boxes of 32 channels x 8 x 8
// positions, 128-byte swizzle, zero fill out of range. Tile map: dimension 1 is x's j (stride C),
// dimension 2 its i (stride N C); mirror map: the two swapped, so that both land with row 8 il + jl.
// L2 promotion: 256 bytes for v10-v17, 128 bytes (a box row's size) for v19 and v20: at batch the load-only build took
// 72.67 -> 72.13 us per call and v19 75.94 -> 75.46 (fourteenth session, device run 6; none: 72.19 / 75.39).
CUtensorMap make_tile_map(const float* x, int B, int N, int C, bool mirror,
                          CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  CUtensorMap m;
  const cuuint64_t row = static_cast<cuuint64_t>(C) * 4, plane = static_cast<cuuint64_t>(N) * C * 4;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(C), static_cast<cuuint64_t>(N), static_cast<cuuint64_t>(N),
                              static_cast<cuuint64_t>(B)};
  const cuuint64_t strides[3] = {mirror ? plane : row, mirror ? row : plane, plane * N};
  const cuuint32_t box[4] = {32, TILE, TILE, 1}, elem[4] = {1, 1, 1, 1};
  const CUresult r = encode_tiled()(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, const_cast<float*>(x), dims, strides, box,
                                    elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "contact_map: cuTensorMapEncodeTiled failed with CUresult " + num(static_cast<int>(r)));
  return m;
}

// Where v10, v11, v13, v14, v17, v19 and v20 run (else they run v9): built with sm_90a, a compute capability 9.0 device, 32 <= C <= 128
// with C % 16 == 0, H <= 64, N >= 8 (a box never exceeds the tensor), x 16-byte aligned.
bool v10_supported(const Args& a, const DeviceFacts& dev) {
  if (!kBuiltSm90a) return false;
  return dev.major == 9 && dev.minor == 0 && a.C % 16 == 0 && a.C >= 32 && a.C <= 128 && a.H <= 64 && a.N >= TILE &&
         reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
}

// As many ring slots as fit (8 or 4: a multiple of 4); one block per SM, at most one per tile. V: the variant's
// build of the kernel (10, 11, 13, 14, 17, 19, 20).
template <int KC, int HP, int V>
void launch_v10(const Args& a, const torch::Tensor& wpack_buf, cudaStream_t stream, int num_sms, int max_smem) {
  // R a multiple of 4, so that every slot serves one warpgroup only (warpgroup w's uses u = 4k + 2w, 4k + 2w + 1):
  // a parity wait is safe only for a waiter that also waited on the slot's previous phase. At R = 5 a
  // warpgroup could find the other's earlier copy into the slot still in flight, read the parity of that
  // incomplete phase as its own completed one and read the slot early (seen in the eleventh session: wrong
  // outputs at batch, R = 5, in 6 of 300 back-to-back v13 calls).
  int R = kV10MaxSlots;
  while (R > 4 && SmemV10(KC, HP, R).total > max_smem) R -= 4;
  const int smem = SmemV10(KC, HP, R).total;
  TORCH_CHECK(smem <= max_smem, "contact_map: v10 needs " + num(smem) + " bytes of shared memory per block; this device allows " + num(max_smem));
  auto kernel = contact_map_v10_kernel<KC, HP, V>;
  ensure_max_dynamic_smem(reinterpret_cast<const void*>(kernel), a.device, smem);
  const CUtensorMapL2promotion promotion = V >= 19 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  const CUtensorMap mt = make_tile_map(a.x, a.B, a.N, a.C, false, promotion),
                    mm = make_tile_map(a.x, a.B, a.N, a.C, true, promotion);
  constexpr int pack_threads = HP * KC + HP * HP + 32 * HP;
  float* wpack = wpack_buf.data_ptr<float>();
  constexpr int counter_at = kV10PackFloats<128, 64>;  // after the largest pack: v19's tile counter
  TORCH_CHECK(wpack_buf.numel() >= counter_at + 4, "contact_map: internal error: v10 parameter buffer too small");
  int* tile_counter = V >= 19 ? reinterpret_cast<int*>(wpack + counter_at) : nullptr;
  contact_map_v10_params_kernel<KC, HP><<<cdiv(pack_threads, 256), 256, 0, stream>>>(
      a.ln_w, a.ln_b, a.w1, a.b1, a.w2, a.b2, a.w3, a.C, a.H, wpack, tile_counter);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int nT = cdiv(a.N, TILE);
  const long long tiles = static_cast<long long>(a.B) * nT * (nT + 1) / 2;
  // v19's and v20's producer counts tiles in 32 bits and decode_tile32 squares the tile row in int (either limit
  // means terabytes of input)
  TORCH_CHECK(V < 19 || (tiles < (1ll << 31) && nT <= 46340),
              "contact_map: v19 and v20 handle fewer than 2^31 tiles and N <= 370720, got " + num(tiles) + " tiles, N = " +
                  num(a.N));
  const int grid = static_cast<int>(tiles < num_sms ? tiles : num_sms);
  // a programmatic dependent launch: the kernel starts (barriers, the first tiles' copies) while the params
  // kernel runs, and waits for it (griddepcontrol.wait) only before copying wpack
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kV10Threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, mt, mm, a.out, static_cast<const float*>(wpack), tile_counter, a.b3, a.eps, a.B,
                                    a.N, a.C, a.H, R));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// wpack_buf: float32 scratch of at least kV10PackFloats<128, 64> + 4 elements on the input's device (v19's tile
// counter after the pack). V = 13, 14, 17, 19, 20 at pair_dim <= 64 run v11's kernel (v13's statistics start from four
// 16-channel chunks).
template <int V>
void dispatch_v10(const Args& a, const torch::Tensor& wpack_buf, cudaStream_t stream, int num_sms, int max_smem) {
  constexpr int V64 = V >= 13 ? 11 : V;
  const bool k64 = a.C <= 64, h32 = a.H <= 32;
  if (k64 && h32) launch_v10<64, 32, V64>(a, wpack_buf, stream, num_sms, max_smem);
  else if (k64) launch_v10<64, 64, V64>(a, wpack_buf, stream, num_sms, max_smem);
  else if (h32) launch_v10<128, 32, V>(a, wpack_buf, stream, num_sms, max_smem);
  else launch_v10<128, 64, V>(a, wpack_buf, stream, num_sms, max_smem);
}

void check_param(const torch::Tensor& p, const char* name, const torch::Tensor& x,
                 std::vector<int64_t> shape) {
  TORCH_CHECK(p.device() == x.device(), "contact_map: pair_repr is on ", x.device().str(),
              " but parameter ", name, " is on ", p.device().str(),
              "; move the module and the input to one device");
  TORCH_CHECK(p.scalar_type() == torch::kFloat32, "contact_map: parameter ", name,
              " must be float32, got ", c10::toString(p.scalar_type()));
  TORCH_CHECK(p.sizes() == c10::IntArrayRef(shape), "contact_map: parameter ", name, " has shape ",
              shape_str(p.sizes()), ", expected ", shape_str(shape));
}

// =============================================================================================
// Bound function
// =============================================================================================
torch::Tensor forward(torch::Tensor pair, torch::Tensor ln_w, torch::Tensor ln_b, double eps,
                      torch::Tensor w1, torch::Tensor b1, torch::Tensor w2, torch::Tensor b2,
                      torch::Tensor w3, torch::Tensor b3, int64_t variant) {
  TORCH_CHECK(pair.scalar_type() == torch::kFloat32, "contact_map: pair_repr must be float32, got ",
              c10::toString(pair.scalar_type()));
  TORCH_CHECK(pair.dim() == 4, "contact_map: pair_repr must be (B, N, N, pair_dim), got shape ",
              shape_str(pair.sizes()));
  const int64_t C = ln_w.numel(), H = b1.numel();
  TORCH_CHECK(pair.size(1) == pair.size(2) && pair.size(3) == C,
              "contact_map: pair_repr must be (B, N, N, pair_dim=", num(C), "), got shape ",
              shape_str(pair.sizes()));
  check_param(ln_w, "layer_norm.weight", pair, {C});
  check_param(ln_b, "layer_norm.bias", pair, {C});
  check_param(w1, "mlp.0.weight", pair, {H, C});
  check_param(b1, "mlp.0.bias", pair, {H});
  check_param(w2, "mlp.2.weight", pair, {H, H});
  check_param(b2, "mlp.2.bias", pair, {H});
  check_param(w3, "mlp.4.weight", pair, {1, H});
  check_param(b3, "mlp.4.bias", pair, {1});
  TORCH_CHECK(pair.is_cuda(), "contact_map: pair_repr must be a CUDA tensor, got a tensor on ",
              pair.device().str());
  TORCH_CHECK(C >= 1 && C <= MAX_PAIR_DIM, "contact_map: pair_dim must be in [1, ", num(MAX_PAIR_DIM),
              "], got ", num(C));
  TORCH_CHECK(H >= 1 && H <= MAX_HIDDEN, "contact_map: hidden_dim must be in [1, ", num(MAX_HIDDEN),
              "], got ", num(H));
  TORCH_CHECK((variant >= 1 && variant <= 3) || variant == 5 || variant == 7 || (variant >= 9 && variant <= 11) || variant == 13 || variant == 14 || variant == 17 || variant == 19 || variant == 20,
              "contact_map: unknown kernel variant ",
              num(variant));
  TORCH_CHECK(pair.size(1) < (1LL << 30) && pair.size(0) < (1LL << 31),
              "contact_map: B or N too large, got shape ", shape_str(pair.sizes()));

  const int64_t B = pair.size(0), N = pair.size(1);
  auto out = torch::empty({B, N, N}, pair.options());
  if (B == 0 || N == 0) return out;

  const c10::cuda::CUDAGuard guard(pair.device());
  auto x = pair.contiguous();
  auto w1c = w1.contiguous(), w2c = w2.contiguous(), w3c = w3.contiguous();
  auto lnw = ln_w.contiguous(), lnb = ln_b.contiguous(), b1c = b1.contiguous(),
       b2c = b2.contiguous(), b3c = b3.contiguous();

  Args a;
  a.x = x.data_ptr<float>(); a.out = out.data_ptr<float>();
  a.ln_w = lnw.data_ptr<float>(); a.ln_b = lnb.data_ptr<float>();
  a.w1 = w1c.data_ptr<float>(); a.b1 = b1c.data_ptr<float>();
  a.w2 = w2c.data_ptr<float>(); a.b2 = b2c.data_ptr<float>();
  a.w3 = w3c.data_ptr<float>(); a.b3 = b3c.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.B = static_cast<int>(B); a.N = static_cast<int>(N); a.C = static_cast<int>(C); a.H = static_cast<int>(H);
  a.CP = round_up(a.C, variant >= 5 ? 8 : 4);  // the tensor-core k step is 8
  a.vec = (C % 4 == 0) && (reinterpret_cast<uintptr_t>(a.x) % 16 == 0);

  int HP = 16;
  while (HP < H) HP *= 2;
  const int device = pair.get_device();
  a.device = device;
  const DeviceFacts dev = device_facts(device);
  const int max_smem = dev.max_smem, num_sms = dev.num_sms;
  const bool tc = variant >= 5;
  const size_t smem_w = sizeof(float) * Smem(a.CP, HP, true).total;
  const size_t smem_g = sizeof(float) * (tc ? SmemTC(a.CP, HP, WFormat::kGlobal).total
                                            : Smem(a.CP, HP, false).total);
  TORCH_CHECK(smem_g <= static_cast<size_t>(max_smem), "contact_map: pair_dim=", num(C),
              " needs ", num(smem_g), " bytes of shared memory per block; this device allows ",
              num(max_smem));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const bool w_smem = smem_w <= static_cast<size_t>(max_smem);
  const int tc_variant = variant >= 10 ? 9 : static_cast<int>(variant);  // v10-v20 outside their tiles: v9
  if (variant >= 10 && v10_supported(a, dev)) {
    // the packed parameters, then 4 floats whose first holds v19's tile counter (an int)
    const auto wpack = torch::empty({kV10PackFloats<128, 64> + 4}, pair.options());
    if (variant == 20) dispatch_v10<20>(a, wpack, stream, num_sms, max_smem);
    else if (variant == 19) dispatch_v10<19>(a, wpack, stream, num_sms, max_smem);
    else if (variant == 17) dispatch_v10<17>(a, wpack, stream, num_sms, max_smem);
    else if (variant == 14) dispatch_v10<14>(a, wpack, stream, num_sms, max_smem);
    else if (variant == 13) dispatch_v10<13>(a, wpack, stream, num_sms, max_smem);
    else if (variant == 11) dispatch_v10<11>(a, wpack, stream, num_sms, max_smem);
    else dispatch_v10<10>(a, wpack, stream, num_sms, max_smem);
  } else if (tc) {
    if (sizeof(float) * SmemTC(a.CP, HP, WFormat::kSplit).total <= static_cast<size_t>(max_smem))
      dispatch_tc_hidden<WFormat::kSplit>(a, HP, tc_variant, stream, num_sms);
    else
      dispatch_tc_hidden<WFormat::kGlobal>(a, HP, tc_variant, stream, num_sms);
  }
  else if (variant == 1) dispatch<1>(a, HP, w_smem, stream, num_sms);
  else if (variant == 2) dispatch<2>(a, HP, w_smem, stream, num_sms);
  else dispatch<3>(a, HP, w_smem, stream, num_sms);
  return out;
}

}  // namespace contact_map

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &contact_map::forward, "contact-map head forward (CUDA, fp32)");
}
"""



def _wgmma_rs(n):
    """Body of wgmma_rs<n>: the inline PTX of wgmma m64{n}k8 TF32 with A from the registers a[0..3],
    B by descriptor `db`, its n/2 accumulator operands spelled out."""
    nacc = n // 2
    regs = ", ".join(f"%{i}" for i in range(nacc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    a_ops = "{" + ", ".join(f"%{nacc + i}" for i in range(4)) + "}"
    ins = "".join(f'"r"(a[{i}]), ' for i in range(4)) + '"l"(db), "r"(acc)'
    return (f'    asm volatile("{{\\n .reg .pred p;\\n setp.ne.b32 p, %{nacc + 5}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 {{{regs}}}, {a_ops}, %{nacc + 4}, p, 1, 1;\\n}}\\n"\n'
            f"                 : {outs}\n"
            f"                 : {ins});")


CUDA_SRC = CUDA_SRC.replace("@WGMMA_RS_64@", _wgmma_rs(64)).replace("@WGMMA_RS_32@", _wgmma_rs(32))

def _gencode_flags():
    """nvcc -gencode flags: the architectures PyTorch would build for (TORCH_CUDA_ARCH_LIST as PyTorch
    reads it or, none set or "native", the visible GPUs' compute capabilities capped at the newest
    this PyTorch supports, the last with PTX), except that 9.0 gets sm_90a code: v10's, v11's, v13's, v14's, v17's, v19's and v20's wgmma and
    setmaxnreg exist only there, and sm_90a code runs on compute capability 9.0 devices as sm_90 code
    does. With no GPU to detect and no list (a CI machine, a laptop; PyTorch alone would fail there):
    9.0. Flags naming an arch replace PyTorch's own; TORCH_CUDA_ARCH_LIST itself is not changed.
    Returns [] for lists it cannot parse (names such as "Hopper"): PyTorch then builds as usual,
    without sm_90a (v10, v11, v13, v14, v17, v19 and v20 then run v9). The same function as outer_product_mean.py's: each kernel
    file stands alone (one file to drop in), so it is not shared."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if env and env != "native":
        archs = [a for a in env.replace(" ", ";").split(";") if a]
    elif not torch.cuda.is_available():
        archs = ["9.0"]
    else:
        sms = [int("".join(re.findall(r"\d+", a.split("_")[1]))) for a in torch.cuda.get_arch_list() if "sm_" in a]
        newest = max((sm // 10, sm % 10) for sm in sms)
        archs = sorted({"%d.%d" % min(newest, torch.cuda.get_device_capability(i))
                        for i in range(torch.cuda.device_count())})
        archs[-1:] = [a + "+PTX" for a in archs[-1:]]
    flags = []
    for a in archs:
        m = re.fullmatch(r"(\d+)\.(\d+)(a?)(\+PTX)?", a)
        if m is None:
            return []
        num, suffix = m.group(1) + m.group(2), m.group(3)
        if num == "90":
            suffix = "a"
        flags.append(f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}")
        if m.group(4):
            ptx = num if num == "90" else num + suffix
            flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return list(dict.fromkeys(flags))


def _build():
    """Compile CUDA_SRC with load_inline (cached by PyTorch under a name carrying the source hash)."""
    verbose = os.environ.get("CONTACT_MAP_VERBOSE", "") not in ("", "0")
    gencode = _gencode_flags()
    flags = (["-O3", "-lineinfo"] + gencode + (["-DCM_SM90A"] if any("code=sm_90a" in f for f in gencode) else [])
             + (["-Xptxas", "-v"] if verbose else []))
    digest = hashlib.sha1((CUDA_SRC + " ".join(flags)).encode()).hexdigest()[:12]
    name = f"contact_map_{digest}"
    try:
        from torch.utils.cpp_extension import _get_build_directory

        cached = os.path.exists(os.path.join(_get_build_directory(name, False), f"{name}.so"))
    except Exception:  # private helper moved: just say what may happen
        cached = False
    if not cached:
        print("building contact_map CUDA extension, about 2-5 minutes the first time ...",
              file=sys.stderr, flush=True)
    return load_inline(name=name, cpp_sources="", cuda_sources=CUDA_SRC, extra_cuda_cflags=flags,
                       verbose=verbose)


_ext = _build()

_VARIANT_IDS = {"v20": 20, "v19": 19, "v17": 17, "v14": 14, "v13": 13, "v11": 11, "v10": 10, "v9": 9, "v7": 7, "v5": 5, "v3": 3, "v2": 2, "v1": 1}  # first = default (the fastest)


class _ForwardOnly(torch.autograd.Function):
    """Runs the kernel inside autograd so that a later backward raises instead of dropping grads.

    The node's tensor inputs are exactly the kernel's arguments that require grad (`tracked`), so that any
    backward or `torch.autograd.grad` that asks for one of them reaches this node and raises; the kernel's
    arguments themselves travel in `args`."""

    @staticmethod
    def forward(ctx, args, *tracked):
        return _ext.forward(*args)

    @staticmethod
    def backward(ctx, grad_out):
        raise RuntimeError("contact_map.ModelNew is forward-only: its CUDA kernel has no backward. "
                           "Use reference/contact_map.py's Model to train.")


class ModelNew(nn.Module):
    """Contact-map head: pair (B, N, N, pair_dim) fp32 CUDA -> contact probabilities (B, N, N) fp32.

    Same submodules, names and creation order as the reference `Model` (so `load_state_dict` and
    seeding work identically). Raises RuntimeError for a CPU input, an input on another device than
    the parameters, a dtype other than float32, a shape other than (B, N, N, pair_dim), or
    pair_dim / hidden_dim above 256; `.backward()` through the output raises (forward-only).
    """

    VARIANTS = tuple(_VARIANT_IDS)

    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(
            nn.Linear(pair_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, 1),
        )
        self.variant = next(iter(_VARIANT_IDS))
        self.last_variant = None

    def _parameters_in_order(self):
        """(layer_norm, (gamma, beta, W1, b1, W2, b2, w3, b3)), read at every call.

        Through the modules' `_modules` / `_parameters` dicts: that is what `nn.Module.__getattr__` and
        `nn.Sequential.__getitem__` look up, at several times the cost (the attribute path took ~8 us of a
        call's host time on the CPU). A weight that is not a plain parameter (a parametrization) is not in
        those dicts: then the attribute path."""
        try:
            ln = self._modules["layer_norm"]
            mlp = self._modules["mlp"]._modules
            a, b, c, d = ln._parameters, mlp["0"]._parameters, mlp["2"]._parameters, mlp["4"]._parameters
            return ln, (a["weight"], a["bias"], b["weight"], b["bias"], c["weight"], c["bias"], d["weight"], d["bias"])
        except KeyError:
            ln, l1, l2, l3 = self.layer_norm, self.mlp[0], self.mlp[2], self.mlp[4]
            return ln, (ln.weight, ln.bias, l1.weight, l1.bias, l2.weight, l2.bias, l3.weight, l3.bias)

    def forward(self, pair_repr):
        vid = _VARIANT_IDS.get(self.variant)
        if vid is None:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {self.VARIANTS}")
        ln, params = self._parameters_in_order()
        args = (pair_repr, params[0], params[1], float(ln.eps), *params[2:], vid)
        tracked = [t for t in (pair_repr, *params) if t.requires_grad] if torch.is_grad_enabled() else ()
        out = _ForwardOnly.apply(args, *tracked) if tracked else _ext.forward(*args)
        object.__setattr__(self, "last_variant", self.variant)  # a plain attribute: skips nn.Module.__setattr__ (~1 us)
        return out
