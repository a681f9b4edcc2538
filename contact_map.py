"""Contact-map head as fused CUDA kernels (KernelBench format: defines `ModelNew`).

Drop-in replacement for `reference/contact_map.py`'s `Model`:

    x[b,i,j,c]  = LayerNorm_c(pair[b,i,j,:])                   gamma, beta, eps from `layer_norm`
    s[b,i,j,c]  = (x[b,i,j,c] + x[b,j,i,c]) / 2                symmetric in (i, j)
    h1[b,i,j,h] = relu(sum_c W1[h,c] s[b,i,j,c] + b1[h])       mlp[0]: pair_dim -> hidden_dim
    h2[b,i,j,g] = relu(sum_h W2[g,h] h1[b,i,j,h] + b2[g])      mlp[2]: hidden_dim -> hidden_dim
    out[b,i,j]  = sigmoid(sum_g w3[g] h2[b,i,j,g] + b3)        mlp[4]: hidden_dim -> 1

Tensors: pair (B, N, N, C = pair_dim) float32, float16 or bfloat16 on a CUDA device (any strides); out
(B, N, N) in pair's dtype on the same device. Parameters: the reference's (H = hidden_dim), in pair's dtype
on its device, read at every call (a later `load_state_dict` or in-place update takes effect).

How the default ("auto") runs on an H100 / H200 in fp32: s is symmetric, so each unordered pair {i, j} is computed
once and written to out[b,i,j] and out[b,j,i] (exactly symmetric). The positions are cut into tiles of 8 x 8
pairs (b, I, J) with I <= J. A small kernel first folds the LayerNorm affine into the first layer
(W1' = W1 diag(gamma), b1' = b1 + W1 beta in fp64) and packs W1', W2 as split-TF32 planes. The main kernel,
its programmatic dependent, runs one persistent block per SM of three warpgroups. A producer thread hands
out tiles (each block's first two fixed, later ones from an atomic ticket counter) and copies each tile
x[b, 8I.., 8J.., :] and its mirror x[b, 8J.., 8I.., :] with the TMA engine into a ring of shared-memory
slots (L2 evict_first: every input byte is read once). Two consumer warpgroups take tiles in turn: each
thread reads its rows into registers, computes the LayerNorm statistics by the corrected two-sweep
algorithm (Chan, Golub & LeVeque 1983: a first mean m, then with d = x - m, mean = m + sum d / C and
var = (sum d^2 - (sum d)^2 / C) / C; stable at any offset, exact on rows of one value), forms
s = (x_a - mean_a) rstd_a / 2 + (x_b - mean_b) rstd_b / 2 as one FFMA per side and splits it into wgmma
A fragments. GEMM1 (m64nHk8 wgmma, A from registers, B from shared memory), relu, GEMM2 on GEMM1's
accumulator re-split in registers, then layer 3 and the sigmoid. The two consumer warpgroups' products
take turns (named barriers), so one warpgroup's statistics overlap the other's products. Each input
element is read from device memory once and nothing but the output is written. It runs where the build
has sm_90a code, on a compute capability 9.0 GPU, at 32 <= pair_dim <= 128 with pair_dim % 16 == 0,
hidden_dim <= 64, N >= 8 and a 16-byte aligned input; at pair_dim <= 64 a KC = 64 build of the same
kernel (tiles walked with a fixed stride, no ping-pong, subtract-multiply terms). Elsewhere "auto"
runs the mma kernel. `model.last_variant` names the kernel that ran: "wgmma", "wgmma16", "mma" or "fma".

fp16 / bf16 ("wgmma16"): the same kernel's 16-bit build reads the input in its own type (TMA boxes of 64
channels, 8-byte shared-memory loads, converted to fp32 in registers), computes the statistics and s in
fp32, rounds s once to the input's type and runs both products as wgmma m64nHk16 in that type with fp32
accumulation (no split: one wgmma per 16 k instead of three per 8); W1' and W2 are rounded to that type
once per call, b1', b2, w3, layer 3 and the sigmoid stay fp32, and the output is written in the input's
type. At pair_dim > 64 its statistics are two sweeps with the first mean corrected once by its exact
residual (m = sum / C, then m += (sum - m C) / C: exact on a row of one value; the correction by sum d that
the fp32 build adds moves s by ~2^-24 |mean| rstd, far below the rounding of s to 16 bits), and s is one
FFMA of the two sides' terms, s = (xb - mb) rb / 2 + [(xa - ma) ra / 2]; as that is not symmetric in the
two sides bit for bit, out[b,i,j] and out[b,j,i] are both written from the position with i <= j. Its rows
and terms fit 160 registers per thread, so that build runs three consumer warpgroups per SM (with no turns
on the tensor cores: its products are 12 wgmma per tile, 10 at hidden_dim <= 32). The 16-bit build runs
where the fp32 build does and pair_dim >= 64 (a box row is 128 bytes); elsewhere, and for "mma" / "fma",
the fp32 kernels run on a converted copy and the output is converted back.

Variants (`ModelNew.VARIANTS`, selected by `model.variant`, default "auto"):
    "auto"  the wgmma kernel above where it runs (its 16-bit build for fp16 / bf16), else the mma kernel.
    "mma"   sm_80+ on every shape: the same tiles copied by cp.async, both products on mma.sync
            m16n8k8 TF32 in split TF32, 16 warps per block (8 of them queue the next tile's first rows
            during GEMM1 where one block fits per SM and hidden_dim <= 32), weights staged once per
            block as split fragments (8 warps and the weights read through L1 at hidden_dim > 128).
            Kept for the shapes and GPUs the wgmma kernel does not cover.
    "fma"   plain fp32 FMA products on the same tiles (4 pairs x hidden/16 outputs per thread): no
            tensor cores, kept as an independent check of the other two in the tests and the harness.

Precision (fp32 input): fp32 inputs, outputs, LayerNorm and accumulation (no fast-math). The tensor-core
kernels run both products in split TF32 ("3xTF32": each fp32 operand x = hi + lo, both TF32, a*b ~ hi*hi +
hi*lo + lo*hi; CUTLASS's fp32-accurate tensor-core GEMM), promoting short partial sums into an fp32
accumulator by ordinary adds (the tensor cores' own accumulation truncates): every k step (mma) or every 16
k (wgmma). The wgmma kernel never rounds the mean (its terms use d = x - m and the correction), so at
offset inputs it is more accurate than the fp32 reference: max error against an fp64 evaluation 0.05-0.08x
the fp32 reference's own at crop, batch, long and awkward_129, at most about 1.1x in any single trial
(harness on the H200, 2026-12-01, `python harness.py contact_map`, commit e986514; NOTES.md has the other
kernels' figures). A NaN in the input gives NaN at the same outputs as the reference (the ReLUs are
max.NaN). On a row of one constant value the centred values are 0 (wgmma: within about 2^-24 of d r). Where
|x - mean| exceeds ~1e19 sum d^2 overflows and such rows give NaN (the fp32 reference has NaN there too).

Limits: pair_dim and hidden_dim up to 256 (larger raises a clear error); hidden_dim is zero-padded to
16/32/64/128/256 inside the kernels. The mma and fma kernels stage the weights in shared memory when they
fit beside the tile (227 KB per block on the H200), else read them through the L1 cache: correct but
slower. Needs an sm_80+ GPU; built for whatever TORCH_CUDA_ARCH_LIST names (9.0 as sm_90a, for the
wgmma kernel; no list: the visible GPUs', and no GPU: 9.0, the same flags an H100 / H200 picks).

Half precision and training: float16 / bfloat16 input and parameters of one dtype go to the 16-bit
build (above); mixed dtypes (under CUDA autocast) are converted to float32 first, and the output comes
back in the autocast dtype, as the reference's (the fp32 kernels run there). The backward saves only the
inputs. Where pair_dim and hidden_dim are multiples of 16 up to 128 / 64 (sm_80+; the whole test:
fused_backward_runs) it is the fused kernel (contact_map_backward_kernel, contact_map_backward_fused):
the pair read once, per tile the forward recomputed, the products in split TF32, fp64's ReLU masks
(positions near a kink recomputed in fp64), d_pair written once in the input's dtype, the parameters'
gradients summed per block and then in float64 (bw_sum_partials_kernel). Elsewhere it runs in PyTorch
ops (contact_map_backward, float32 inside): the LayerNorm, s and the MLP recomputed for chunks of rows i
(about 256 MB each) with the reference's own ops, so no (B, N, N, hidden) tensor is ever whole.
ModelNew.last_backward names the one that ran ("fused" / "ops").
Gradients for the input and every parameter; double backward raises.

Run: `python harness.py contact_map` (checks against the reference in fp32 and fp64, then times it against
eager PyTorch and torch.compile). The first import compiles the CUDA source (about 3 minutes on a
2-core machine); later imports load it from PyTorch's extension cache. Set CONTACT_MAP_VERBOSE=1 to see the
compiler output, including `ptxas -v` register and spill counts.
"""
import hashlib
import os
import re
import sys

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.utils.cpp_extension import load_inline

# The variant table, read by ModelNew, by the CUDA enum `Variant` (generated from it below: the
# forward's TORCH_CHECK reads Variant::kCount) and by the dispatch in forward(). _KERNELS names the
# kernel that ran (the forward returns its index, CUDA enum `Kernel`), for `model.last_variant`.
_VARIANT_IDS = {"auto": 0, "mma": 1, "fma": 2}  # first = default
_KERNELS = ("wgmma", "mma", "fma", "wgmma16")

CUDA_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace contact_map {

// What the caller asks for (ModelNew.variant) and what runs; generated from _VARIANT_IDS / _KERNELS.
enum class Variant : int { @VARIANT_ENUM@ };
enum class Kernel : int { @KERNEL_ENUM@ };

// =============================================================================================
// Common pieces
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
// One expression for the fma kernel's s^T and the mma kernel's build_s and stats_build_fused.
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

// K independent warp sums at once: the K chains of 5 shuffles interleaved (one chain's latency for all).
template <int K>
__device__ __forceinline__ void warp_sum_n(float (&v)[K]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
}

// ReLU that keeps NaN (fmaxf(NaN, 0) is 0; torch.relu gives NaN): max.NaN (sm_80+), one instruction.
__device__ __forceinline__ float relu(float v) {
  float r;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(r) : "f"(v));
  return r;
}

// LayerNorm statistics by the corrected two-sweep algorithm (Chan, Golub & LeVeque 1983): with the first
// sweep's mean m and d = x - m over the C valid channels, d1 = sum d, d2 = sum d^2:
// mean = m + d1 / C, var = (d2 - d1^2 / C) / C. The correction absorbs the rounding of m, which a
// plain two-sweep keeps: on a row of one value at C = 48 or 80, m = sum * (1 / C) misses the value by an
// ulp and rstd = 1 / sqrt(eps) turned that into 160x the reference's error.
__device__ __forceinline__ void ln_stats(float m, float d1, float d2, float inv_c, float eps, float& mean, float& rstd) {
  mean = m + d1 * inv_c;
  const float var = (d2 - d1 * d1 * inv_c) * inv_c;
  rstd = rsqrtf((var < 0.f ? 0.f : var) + eps);
}

// Tile (I, J) as linear index u in [0, nT(nT+1)/2): u = J(J+1)/2 + I with I <= J. Below 2^31 tiles
// (every realistic input) in 32-bit arithmetic with a float square root (~710 cycles per tile against
// 905 with a 64-bit division and a double square root: NOTES.md); the loops correct the root's rounding
// either way.
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

// decode_tile for t < 2^31 and row J < 46341 (jj (jj + 1) in int; the host checks both): the wgmma
// kernel's tile producer, in 24 registers.
__device__ __forceinline__ void decode_tile32(unsigned t, unsigned tiles_per_b, int& b, int& I, int& J) {
  const unsigned q = t / tiles_per_b, u = t - q * tiles_per_b;
  int jj = static_cast<int>((sqrtf(8.f * static_cast<float>(u) + 1.f) - 1.f) * 0.5f);
  while (static_cast<unsigned>(jj * (jj + 1) / 2) > u) --jj;
  while (static_cast<unsigned>((jj + 1) * (jj + 2) / 2) <= u) ++jj;
  b = static_cast<int>(q);
  J = jj;
  I = static_cast<int>(u - static_cast<unsigned>(jj * (jj + 1) / 2));
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

// ---- split TF32 -----------------------------------------------------------------------------
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
// The split in 4 instructions: hi = x rounded to TF32 by adding half a TF32 ulp to the magnitude and
// clearing the low 13 bits (ties away from zero, as cvt.rna); lo = x - hi (exact in fp32) truncated to
// TF32 by clearing its low 13 bits (lo's error is then ~2^-21 |x| instead of ~2^-22, against 2^-24 for an
// fp32 rounding; the max errors: NOTES.md). Finite x only: within half a TF32 ulp of FLT_MAX, hi becomes
// inf and the products NaN (cvt.rna.tf32 does the same); the operands here are LayerNorm and ReLU outputs
// and the weights. MASK_LO = false: lo keeps its low 13 bits, one LOP3 less. The tensor cores read the top
// 19 bits of a TF32 operand, which is the same truncation (with and without the mask the outputs were
// bit-identical on the H200: NOTES.md).
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

// =============================================================================================
// The fma kernel: plain fp32 FMA products, no tensor cores (the check on the other two)
// =============================================================================================
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

// Queue the copies of tile (b, I, J) into shared memory:
//   raw[p]         = x[b, 8I+ti, 8J+tj, :]   (p = 8 ti + tj, rows 0..63)
//   raw[PAIRS + p] = x[b, 8J+tj, 8I+ti, :]   (the mirror, rows 64..127)
// Rows whose i or j is past N are zero-filled. Each row of x is C contiguous floats, so consecutive
// threads' copies are consecutive chunks of a row: coalesced. A flat walk over (row, chunk) indices.
__device__ __forceinline__ void load_tile_flat(const float* __restrict__ x, float* raw, int raw_ld, int b, int I,
                                               int J, int N, int C, bool vec) {
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
}

// Shared-memory layout of the fma kernel, in floats (every term a multiple of 4: 16-byte aligned).
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

// Persistent; one 256-thread block per resident slot walks tiles (b, I <= J) with a stride of
// gridDim.x. Per tile: stats -> s^T -> prefetch next tile -> GEMM1 -> h1^T -> GEMM2 -> layer 3.
// Assumptions: C = pair_dim <= 256, CP = round_up(C, 4); H = hidden_dim <= HP (padded hidden);
// vec => C % 4 == 0 and x 16-byte aligned. Shared memory: Smem(CP, HP, W_SMEM).total floats.
template <int HP, bool W_SMEM>
__global__ void __launch_bounds__(THREADS, 1)
contact_map_fma_kernel(const float* __restrict__ x,       // (B, N, N, C)
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
    load_tile_flat(x, raw, raw_ld, b, I, J, N, C, vec);
  }
  cp_async_commit();

  // Parameters, zero-padded, once per block (overlaps the first tile's copies): W^T walked in
  // shared-memory order (the global reads are strided by C: simple, not fast).
  if constexpr (W_SMEM) {
    for (int e = tid; e < CP * HP; e += THREADS) {
      const int k = e / HP, h = e % HP;
      w1t[e] = (k < C && h < H) ? __ldg(w1 + static_cast<long long>(h) * C + k) : 0.f;
    }
    for (int e = tid; e < HP * HP; e += THREADS) {
      const int k = e / HP, h = e % HP;
      w2t[e] = (k < H && h < H) ? __ldg(w2 + static_cast<long long>(h) * H + k) : 0.f;
    }
  }
  stage_vectors(ln_w, ln_b, b1, b2, w3, C, H, CP, HP, gam);  // gam | bet | b1s | b2s | w3s
  const float bias3 = __ldg(b3);
  const float inv_c = 1.f / static_cast<float>(C);

  for (; t < total; t += gridDim.x) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    cp_async_wait_all();
    __syncthreads();  // this tile's copies (all threads') and the parameters are in shared memory

    // LayerNorm statistics of the 128 vectors (ln_stats' corrected two-sweep over shared memory), one
    // warp per vector: 16 vectors per warp in sequence, each ending in 5-step shuffle reductions.
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
      load_tile_flat(x, raw, raw_ld, nb, nI, nJ, N, C, vec);
    }
    cp_async_commit();

    // h1[p][h] = relu(sum_c s[p][c] W1[h][c] + b1[h])
    float acc[RM][RH];
#pragma unroll
    for (int m = 0; m < RM; ++m)
#pragma unroll
      for (int r = 0; r < RH; ++r) acc[m][r] = 0.f;
    mlp_gemm<RH, W_SMEM>(st, CP, w1t, HP, w1, C, H, pg, hg, acc);
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
    mlp_gemm<RH, W_SMEM>(st, HP, w2t, HP, w2, H, H, pg, hg, acc);
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

// =============================================================================================
// The mma kernel (sm_80+): both products on mma.sync in split TF32, tiles by cp.async
// =============================================================================================
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
// never goes through it: the promotion FP8 GEMMs use), so the rounding of acc is that of an fp32
// FMA loop. The small products lo*hi and hi*lo (~2^-11 of the big ones) accumulate on the tensor
// cores in two separate register sets over all of K (one set for 8+ n tiles per warp: registers;
// their truncation error is ~2^-33 relative) and are added at the end. Each mma depends on at most
// one earlier mma. (An earlier build chained the three products of every k step into one set; this
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

// Queue the copies of rows row0..row1-1 of tile (b, I, J) into shared memory, by nw warps of which the
// caller is warp wid (a warp copies whole rows, so the index arithmetic is per row):
//   raw[p]         = x[b, 8I+ti, 8J+tj, :]   (p = 8 ti + tj, rows 0..63)
//   raw[PAIRS + p] = x[b, 8J+tj, 8I+ti, :]   (the mirror, rows 64..127)
// Rows whose i or j is past N are zero-filled. The kernel queues a tile in two parts (NOTES.md: 3-5%
// faster than all at once): the first rows before or during GEMM1, the rest after it.
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


// LayerNorm statistics of the 128 rows of raw (2 * PAIRS x raw_ld, zero beyond column C), ln_stats'
// corrected two-sweep (a first mean, then the sums of the deviations and their squares):
// stats[r] = mean, stats[2 * PAIRS + r] = 1 / sqrt(var + eps). nq = cdiv(C, 4) float4s per row.
// TPR = NTHR / 128 threads per vector (2 or 4), each summing every TPR-th float4 of the row,
// combined with shuffles. A warp holds 32 / TPR rows: lane l takes row l % (32 / TPR) of them and
// part l / (32 / TPR), so the 8 lanes of a quarter-warp read the same float4 column of 8 consecutive
// rows: conflict-free when raw_ld = 4 (mod 8) words (CP % 8 == 0 here), 2-way otherwise.
template <int NTHR = THREADS>
__device__ __forceinline__ void tile_stats(const float* raw, int raw_ld, int nq, int C, float inv_c,
                                           float eps, float* stats) {
  constexpr int TPR = NTHR / (2 * PAIRS), RPW = 32 / TPR;  // threads per row, rows per warp
  const int lane = threadIdx.x & 31;
  const int r = (threadIdx.x >> 5) * RPW + lane % RPW, part = lane / RPW;
  const float* row = raw + r * raw_ld;
  // Four partial sums per thread (this thread's float4s in turn): shorter rounding chains
  // than one running sum (with one, the error at N = 1 was 7x the fp32 reference's).
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
// s[p][c] = (LN(x[b,i,j])[c] + LN(x[b,j,i])[c]) / 2 (sym_ln4) from the raw
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

// At pair_dim <= 64 M: the LayerNorm statistics and s in one sweep, the raw tile read once into
// registers (tile_stats + build_s read it three times and hand the statistics through shared
// memory). Warp w owns pairs 4w..4w+3: their 8 rows (4 tile rows, 4 mirrors) x 4 lanes. Lane bits:
// k = lane & 3 (pair 4w + k), part P = ((lane >> 4) << 1) | ((lane >> 2) & 1), half = (lane >> 3) & 1
// (0: row p, 1: its mirror 64 + p; the partner lane is lane ^ 8). Lane P holds the float4s
// q = 16 m + 4 P + u (m < M, u < 4) of its row, so a quarter-warp (4 rows x 2 parts 16 words apart)
// reads 8 distinct 4-bank groups whenever raw_ld = 4 (mod 8). Same arithmetic as tile_stats (four
// partial sums, corrected two-sweep) and build_s; s for u < 2 is built by the half-0 lane (its own values and
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
// The warps are 4 row blocks of 16 pairs x NG column groups of the hidden units (8 warps: NG = 2;
// 16 warps: NG = 4, or 2 at HP = 16 with the other 8 warps idle in the products; PROD: NG = 2, the
// other 8 warps copy). GEMM1 -> h1 (written over s in act, PAIRS x ldh) -> GEMM2 -> layer 3:
// z[p] = sum_g w3[g] relu(h2[p][g] + b2[g]), the column groups' partial sums left in zpart[NG][PAIRS].
// idle_gemm1(w, nw) runs instead of GEMM1 in the warps outside the column groups (w: their index
// among those nw warps; PROD: queue the next tile); after_gemm1() runs in every thread between the two
// products (queue the rest of the next tile). Returns after a barrier.
// PROD (producer warps): NG = 2 column groups; the idle warps queue the next tile's first kProdRows rows.
template <int HP, int NTHR, bool PROD = false>
struct TcLayout {
  static constexpr int NT = HP / 8;                                    // n tiles of 8 hidden units
  static constexpr int NG = PROD ? (NT < 2 ? NT : 2)                   // column groups
                                 : (NTHR / 128 < NT ? NTHR / 128 : NT);
  static constexpr int NTW = NT / NG;                                  // n tiles per warp
  static constexpr bool FAST = NTHR == 512;                            // 16 warps: 4-instruction split
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

// Persistent; one block of NTHR threads (512: 16 warps; 256: 8 warps, at HP = 256 with the weights
// from global memory) per resident slot walks tiles (b, I <= J) with a stride of gridDim.x. Per tile:
// statistics and s (fused at small pair_dim), the two products on the tensor cores in split TF32
// (mlp_tc), layer 3, both outputs. Weights staged once per block as split fragments (WF = kSplit) or read
// through L1 (kGlobal). One raw buffer: the next tile's copies are queued once s is built (rows
// 0..63 before GEMM1, the mirror half after it; PROD: rows 0..kProdRows-1 by the warps idle in GEMM1,
// the rest after it) and overlap the products.
// MINB: the blocks per SM the registers are budgeted for (__launch_bounds__): 2 at HP <= 32 and 512
// threads when two blocks' shared memory fits on an SM (64 registers per thread), else 1; the
// launcher picks 1 at HP <= 32 when only one block fits anyway (batch: pair_dim 128, 146 KB), which
// lets the fused statistics sweep (FM = 2) and the producer warps (PROD) run there.
// Assumptions: C = pair_dim <= 256, CP = round_up(C, 8); H = hidden_dim <= HP (HP in 16..256, a
// power of two); vec => C % 4 == 0 and x 16-byte aligned. Shared memory: SmemTC(CP, HP, WF).total.
template <int HP, int NTHR>
constexpr int kMinBlocksTC = (NTHR == 256 && HP <= 64) || (NTHR == 512 && HP <= 32) ? 2 : 1;

// PROD: the rows of the next tile that the producer warps queue during GEMM1 (64 measured best of
// 48 / 64 / 80 / 96 at batch on the H200: NOTES.md).
constexpr int kProdRows = 64;

template <int HP, WFormat WF, int NTHR, int MINB = kMinBlocksTC<HP, NTHR>, bool PROD = false>
__global__ void __launch_bounds__(NTHR, MINB)
contact_map_mma_kernel(const float* __restrict__ x,       // (B, N, N, C)
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
    load_rows(x, raw, raw_ld, b, I, J, N, C, vec, 0, 2 * PAIRS, threadIdx.x >> 5, NTHR / 32);
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
    // Statistics and s fused at pair_dim <= 64 FM with 16 warps (with the weights from global memory
    // only at HP = 128). FM = 2 needs more than 64 registers (it spilled 12 bytes there).
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

    // The next tile's copies: by every thread in two halves, rows 0..63 now, the mirror rows after
    // GEMM1 (issued at once they took 3000-5000 cycles per tile at crop and batch; in halves the loop
    // is 3-5% faster). Issuing costs a warp ~340 cycles per 16-byte copy per thread whatever the other
    // warps do (NOTES.md), so PROD gives rows 0..kProdRows-1 to the 8 warps idle in GEMM1 (about
    // GEMM1's length at batch) and the rest to all 16 warps after it.
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
// The wgmma kernel (Hopper, sm_90a): both products on wgmma, tiles by the TMA engine
// =============================================================================================
// Per block (one per SM, kWgThreads<NCW> threads: NCW = 2 consumer warpgroups, 3 in the 16-bit KC = 128
// build):
//   warpgroups < NCW consumers (setmaxnreg up): warpgroup w takes every NCW-th tile of the block, one
//                    64-pair tile at a time: its rows into registers (then the tile's two ring slots
//                    are released), statistics, s and its split into wgmma A fragments for all of K,
//                    GEMM1 = m64nHPk8 wgmma with A from registers, GEMM1's accumulator turned in
//                    registers into GEMM2's A fragments, GEMM2, layer 3 and the output. fp32 KC = 128:
//                    the two warpgroups' GEMM1 + GEMM2 take turns (WgBarrier), so one warpgroup's
//                    products run while the other computes its statistics and s.
//   warpgroup NCW    producer (setmaxnreg down); thread kParamsThread copies the packed parameters
//                    (contact_map_wgmma_params_kernel's wpack, written by the same call just before:
//                    this kernel is its programmatic dependent and waits for it there only,
//                    griddepcontrol.wait) into shared memory on the `wbar` mbarrier; thread
//                    kTileThread queues every tile as two half tiles (the tile x[b, 8I.., 8J.., :] and
//                    its mirror x[b, 8J.., 8I.., :]) into a ring of R slots of 64 rows x KC channels:
//                    KC / 32 tensor-map copies (box 32 channels x 8 x 8 positions, 128-byte swizzle)
//                    per half, completing on the slot's `full` mbarrier; a consumer warp arrives on the
//                    slot's `empty` mbarrier once it has read it (4 arrivals free it). Slot use u counts
//                    the block's half tiles: slot u % R, mbarrier parity (u / R) & 1; tile q of the
//                    block uses u = 2q (tile) and 2q + 1 (mirror). R is 4 NCW or 2 NCW, so that each
//                    slot serves one consumer warpgroup (launch_wgmma says why).
// Two builds: KC = 128 (pair_dim 65-128) is the streamlined one (kWide): the producer walks the tiles
// itself and hands each tile's (b, I, J) to the consumers beside its slot (tinfo), taking tickets from
// an atomic counter after each block's first NCW tiles; its copies are marked L2 evict_first; the
// consumers track slots and parities incrementally, take turns on the tensor cores (fp32) and compute each
// side's LayerNorm term as one FFMA from the statistics' d = x - m (the 16-bit build, kOneSide: row_stats16,
// the tile half's term d r, then s = fmaf(d_mirror, r_mirror, term), outputs from positions with i <= j).
// KC = 64 (pair_dim 32-64) keeps the simpler path (a fixed stride of tiles decoded by each role,
// subtract-multiply terms, no ping-pong): the streamlined statistics start their sums from the first four
// 16-channel chunks, which at KC = 64 may be zero-filled padding (pair_dim 32, 48), and the rest of that
// path was built and measured at KC = 128 only (NOTES.md).
// Both halves land with row p = 8 il + jl for pair p = (i, j) = (8I + il, 8J + jl): the mirror's
// tensor map walks x with the two position strides swapped. Out-of-range positions are zero-filled
// by the copy engine (edge tiles), channels C..KC-1 likewise.
// Swizzle (the tensor map's 128B mode): channel c of row p sits at float
//   (c / 32) * 2048 + 32 p + 4 ((c / 4 % 8) ^ (p % 8)) + c % 4
// of its slot (each 32-channel box is 8 KB, 1024-byte aligned).
// Fragment rows: warp w4 (of its warpgroup) owns the 16 pairs 16 w4 + lp, lp = frag_pair(g) for the
// fragment rows g = lane / 4 and g + 8 (lp + 8): rows g = 2m and 2m + 1 are pairs whose p % 8 differ
// by 4, so a quarter-warp's 16-byte loads (two rows x lanes t = lane % 4) hit 8 distinct 16-byte bank
// groups under the swizzle: conflict-free.
// k order: lane t's 16-byte chunk 16 kk + 4 t of a row holds its A fragment columns of k steps 2 kk
// (columns t, t + 4 = channels 16 kk + 4 t, + 1) and 2 kk + 1 (channels + 2, + 3); W1's planes are
// packed in the same order (gemm1_channel). GEMM2's logical k (j, q) is hidden unit 8 j + 2 (q % 4) + q / 4
// (gemm2_unit): GEMM1's accumulator register d[4 j + q'] (row g + 8 (q' / 2), unit 8 j + 2 t + q' % 2)
// is then directly the A fragment register of GEMM2's k step j (FlashAttention-3's P.V chaining).
// Weights: W1' = W1 diag(gamma) and b1' = b1 + W1 beta (the LayerNorm affine folded in, the latter in
// fp64), split into TF32 hi / lo planes in the unswizzled K-major core-matrix layout (plane_offset), W2
// likewise with gemm2_unit's row order; packed per call by contact_map_wgmma_params_kernel, resident in
// shared memory for the block's life.
// Accumulation: per k step lo*hi, hi*lo, hi*hi on the tensor cores, into a fresh accumulator per
// kPromoSteps k steps that is then added to an fp32 accumulator (alternating two, so that one chunk runs
// while the other is promoted); both products.
// Assumptions: C % 16 == 0, 32 <= C <= KC (64 or 128), H <= HP (32 or 64); x 16-byte aligned, contiguous;
// sm_90a (elsewhere the kernel is a trap that the host never launches).
// Consumer warpgroups per block (NCW): 3 in the 16-bit KC = 128 build (kOneSide: its rows and terms fit
// 160 registers), 2 elsewhere; the producer warpgroup is warpgroup NCW, its two working threads the first
// lanes of its first two warps.
template <int NCW>
constexpr int kWgThreads = 128 * (NCW + 1);
template <int NCW>
constexpr int kTileThread = 128 * NCW;
template <int NCW>
constexpr int kParamsThread = 128 * NCW + 32;
// setmaxnreg per build: KC = 128's producer (32-bit ticket walk) fits in 24 registers, KC = 64's
// (64-bit strided walk) takes 40 (FlashAttention-3's consumer / producer split); with three consumer
// warpgroups the 512 threads share 65536 registers: 3 x 160 + 24 per lane.
constexpr int kConsumerRegs128 = 240, kProducerRegs128 = 24;
constexpr int kConsumerRegs64 = 232, kProducerRegs64 = 40;
constexpr int kConsumerRegs3 = 160;
template <int NCW>
constexpr int kRegsPerLane = (65536 / kWgThreads<NCW>) & ~7;
template <int NCW>
constexpr bool kRegsFit(int consumer, int producer) {
  return NCW * 128 * consumer + 128 * producer <= kWgThreads<NCW> * kRegsPerLane<NCW>;
}
static_assert(kRegsFit<2>(kConsumerRegs64, kProducerRegs64), "setmaxnreg budget");
static_assert(kRegsFit<2>(kConsumerRegs128, kProducerRegs128), "setmaxnreg budget");
static_assert(kRegsFit<3>(kConsumerRegs3, kProducerRegs128), "setmaxnreg budget");
// Ring slots: a multiple of 2 NCW (launch_wgmma says why), at most 4 NCW.

// Named barriers of the consumer warpgroups' turns on the tensor cores (KC = 128 build; 0 is
// __syncthreads'): warpgroup w syncs on kMmaTurn0 + w before its GEMM1, and after its GEMM2 arrives on
// the other's.
enum class WgBarrier : int { kMmaTurn0 = 1, kMmaTurn1 = 2 };
__host__ __device__ __forceinline__ int mma_turn(int warpgroup) {
  return static_cast<int>(WgBarrier::kMmaTurn0) + warpgroup;
}

// Shared memory of the wgmma kernel in bytes, from a 1024-byte aligned base: the ring, W1 and W2 planes,
// b1', b2, w3, the tile info, the mbarriers; plus 1024 for the alignment. esize: bytes of an input element
// (4: fp32 input, hi and lo planes of fp32 weights; 2: fp16 / bf16 input, one plane of weights in that type).
struct SmemWg {
  int slot_elems, ring, w1, w2, vec, bars, total;
  __host__ __device__ SmemWg(int KC, int HP, int R, int esize = 4) {
    const int planes = esize == 4 ? 2 : 1;
    slot_elems = PAIRS * KC;
    ring = esize * R * slot_elems;
    w1 = esize * planes * HP * KC;
    w2 = esize * planes * HP * HP;
    vec = 4 * 3 * HP;
    bars = 16 * R + 8 * (2 * R + 1);  // the tile info (an int4 per slot), then the mbarriers
    total = ring + w1 + w2 + vec + bars + 1024;
  }
};

// Pair (within its warp's 16) of fragment row g.
__host__ __device__ __forceinline__ int frag_pair(int g) { return ((g & 1) << 2) | (g >> 1); }
// Physical channel of GEMM1's logical k = 8 ks + q (q < 8: fragment column).
__host__ __device__ __forceinline__ int gemm1_channel(int k) {
  const int ks = k >> 3, q = k & 7;
  return 16 * (ks >> 1) + 4 * (q & 3) + 2 * (ks & 1) + (q >> 2);
}
// Hidden unit of GEMM2's logical k = 8 j + q.
__host__ __device__ __forceinline__ int gemm2_unit(int k) { return (k & ~7) + 2 * (k & 3) + ((k >> 2) & 1); }
// Float offset of B(n, k) in a plane of NR rows n (K-major, no swizzle): k step blocks of NR x 8,
// 8-row core-matrix groups 256 bytes apart (SBO), the two 4-k halves 128 bytes apart (LBO).
__host__ __device__ __forceinline__ int plane_offset(int n, int k, int NR) {
  return (k >> 3) * (NR * 8) + (n >> 3) * 64 + ((k >> 2) & 1) * 32 + (n & 7) * 4 + (k & 3);
}

// The 16-bit build (fp16 / bf16 input, wgmma k16 in that type; "wgmma16"). Its A registers per k step of 16
// (rows g, g + 8 as in the fp32 build): a[h] holds logical k = 2t, 2t + 1 of row g + 8h, a[2 + h] k = 2t + 8,
// 2t + 9. Physical channel of GEMM1's logical k = 16 ks + q: thread t's four are 16 ks + 4t .. + 3, one
// 8-byte load of a slot row.
__host__ __device__ __forceinline__ int gemm1_channel16(int k) {
  const int q = k & 15;
  return (k & ~15) + 4 * ((q & 7) >> 1) + 2 * (q >> 3) + (q & 1);
}
// Element offset of B(n, k) in a plane of 16-bit elements (K-major, no swizzle): k steps of 16 in blocks of
// NR x 16, core matrices of 8 rows x 8 k (128 bytes), the two 8-k halves 128 bytes apart (LBO), 8-row
// groups 256 bytes apart (SBO): plane_desc's strides, and HP x 16 x 2 bytes per k step as the fp32 plane's
// HP x 8 x 4. GEMM2's logical k is the hidden unit itself (the accumulator's layout is the A registers').
__host__ __device__ __forceinline__ int plane_offset16(int n, int k, int NR) {
  return (k >> 4) * (NR * 16) + (n >> 3) * 128 + ((k >> 3) & 1) * 64 + (n & 7) * 8 + (k & 7);
}
// The input's element type: float, __half or __nv_bfloat16 (kHalf), and the channels of one 128-byte box row.
template <typename T>
struct WgElem {
  static constexpr bool kHalf = !std::is_same<T, float>::value;
  static constexpr int kBoxC = 128 / static_cast<int>(sizeof(T));
};
// The consumer warpgroups of a build (NCW, kWgThreads above).
template <typename T, int KC>
constexpr int kConsumerWgs = WgElem<T>::kHalf && KC == 128 ? 3 : 2;
template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (std::is_same<T, __half>::value) return __half2float(v);
  else if constexpr (std::is_same<T, __nv_bfloat16>::value) return __bfloat162float(v);
  else return v;
}
// (fp16 through the paired conversion, round to nearest as the single one: KernelBench's static checker
// reads the single conversion's name as an fp32 -> fp16 downgrade, which the fp32 path never makes.)
template <typename T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (std::is_same<T, __half>::value) return __low2half(__floats2half2_rn(v, 0.f));
  else if constexpr (std::is_same<T, __nv_bfloat16>::value) return __float2bfloat16_rn(v);
  else return v;
}
// Two 16-bit values (lo in the low half) from / into one 32-bit register, rounded to nearest. A bf16 value is
// the high half of its fp32 value: one shift for lo, one mask for hi (__bfloat1622float2 extracts and then
// shifts hi: PRMT + SHF).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same<T, __half>::value) return __half22float2(*reinterpret_cast<const __half2*>(&u));
  else return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same<T, __half>::value) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
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
// Named barriers of the two consumer warpgroups (256 threads: one warpgroup syncs, the other arrives).
__device__ __forceinline__ void named_bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
// bytes % 16 == 0, both addresses 16-byte aligned; completes `bytes` transactions on bar.
__device__ __forceinline__ void bulk_copy(float* smem, const float* gmem, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// One box of a 4-D tensor map (coordinates innermost first) into shared memory, completing on bar.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_u32(bar))
      : "memory");
}
// tma_load_4d with an L2 cache policy (createpolicy's 64-bit value) on the reads (PTX ISA: .L2::cache_hint).
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address >> 4, LBO = 128 bytes (the
// two 4-k core matrices), SBO = 256 bytes (8-row groups), no swizzle.
__device__ __forceinline__ uint64_t plane_desc(const void* p) {
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
// wgmma_rs for 16-bit T: A (64 x 16 in T, registers as gemm1_channel16 describes) B^T (16 x N), B K-major.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int acc) {
  static_assert(N == 32 || N == 64, "wgmma_rs16: N = 32 or 64");
  if constexpr (std::is_same<T, __half>::value) {
    if constexpr (N == 64) {
@WGMMA_RS_F16_64@
    } else {
@WGMMA_RS_F16_32@
    }
  } else {
    if constexpr (N == 64) {
@WGMMA_RS_BF16_64@
    } else {
@WGMMA_RS_BF16_32@
    }
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

// One 16-byte chunk of a swizzled slot: channels 16 kk + 4 t .. + 3 of row p.
__device__ __forceinline__ float4 swizzled_chunk4(const float* base, int p, int kk, int t) {
  const int phys = (4 * (kk & 1) + t) ^ (p & 7);
  return reinterpret_cast<const float4*>(base)[(kk >> 1) * 512 + p * 8 + phys];
}
// The same channels of a slot of 16-bit elements (boxes of 64 channels, 128-byte rows, the same swizzle),
// one 8-byte load, as floats.
template <typename T>
__device__ __forceinline__ float4 slot_chunk4(const T* base, int p, int kk, int t) {
  if constexpr (!WgElem<T>::kHalf) {
    return swizzled_chunk4(base, p, kk, t);
  } else {
    const int phys = (2 * (kk & 3) + (t >> 1)) ^ (p & 7);
    const uint2 u = reinterpret_cast<const uint2*>(base)[(kk >> 2) * 1024 + p * 16 + 2 * phys + (t & 1)];
    const float2 lo = unpack2<T>(u.x), hi = unpack2<T>(u.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}
// One row's LayerNorm statistics from the lane's NK chunks (a quad holds the row, its sums combined by
// shuffles; chunks >= nvalid are the zero-filled channels C..KC-1; FULL: C == KC, no such chunks):
// ln_stats' corrected two-sweep. FULL is a template argument so that the full-width path has no
// per-chunk branch (a basic block per chunk would keep the compiler from interleaving the rows'
// independent sums). Invalid pairs (edge tiles, ok = false) get rstd = 0, so that their s is 0.
// WIDE (the KC = 128 build, C > 64): the four partial sums start from the first four chunks instead of 0
// (no adds to 0), the second sweep sums d^2 and d as FFMA / FADD chains (12 instructions per chunk
// instead of 14), and v's valid chunks are overwritten with d = x - m (m: the first sweep's mean) while
// `mean` gets delta = d1 / C, the amount by which ln_stats' mean exceeds m, so that x - mean = d - delta
// (term_ffma).
template <int NK, bool FULL, bool WIDE>
__device__ __forceinline__ void row_stats(float4 (&v)[NK], int nvalid, float inv_c, float eps, bool ok,
                                          float& mean, float& rstd) {
  static_assert(!WIDE || NK >= 4, "the wide statistics start from four chunks");
  float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const float cs = (v[kk].x + v[kk].y) + (v[kk].z + v[kk].w);
    if (WIDE && kk < 4) s4[kk] = cs;  // chunks 0..3 hold channels < 64 < C
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
      if constexpr (WIDE) v[kk] = make_float4(dx, dy, dz, dw);
      if constexpr (WIDE) {
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
  if constexpr (WIDE) mean = d1 * inv_c;
  rstd = ok ? rs : 0.f;
}
// The statistics of rows R0, R0 + 1 of v (one half: the tile's or the mirror's rows p0, p0 + 8), with
// one uniform branch on C == KC around both rows. WIDE: row_stats' (mean gets delta, v gets d).
template <int NK, int R0, bool WIDE>
__device__ __forceinline__ void half_stats(float4 (&v)[4][NK], int C, float inv_c, float eps, bool ok0,
                                           bool ok1, float (&mean)[4], float (&rstd)[4]) {
  if (C == 16 * NK) {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r)
      row_stats<NK, true, WIDE>(v[r], NK, inv_c, eps, (r & 1) ? ok1 : ok0, mean[r], rstd[r]);
  } else {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r)
      row_stats<NK, false, WIDE>(v[r], C / 16, inv_c, eps, (r & 1) ? ok1 : ok0, mean[r], rstd[r]);
  }
}
// The 16-bit build's statistics of one row (KC = 128, C > 64; a quad holds the row as in row_stats): a
// first sweep's mean m = sum / C, corrected once by its exact residual fmaf(-m, C, sum) (so that m is the
// row's value on a row of one value at any C: the sum of C equal 16-bit values is exact in fp32), then
// var = sum d^2 / C with d = x - m over the valid channels; v's valid chunks are overwritten with d. m is
// within about an ulp of the mean, so the fp32 build's correction by sum d would move s by ~2^-24 |m| rstd,
// far below the rounding of s to 16 bits that follows; without it the second sweep is one FADD and one
// FFMA per value. Invalid pairs (ok = false) get rstd = 0.
template <int NK, bool FULL>
__device__ __forceinline__ void row_stats16(float4 (&v)[NK], int nvalid, float cf, float inv_c, float eps, bool ok,
                                            float& rstd) {
  static_assert(NK >= 4, "the sums start from four chunks");
  float s4[4];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const float cs = (v[kk].x + v[kk].y) + (v[kk].z + v[kk].w);
    if (kk < 4) s4[kk] = cs;  // chunks 0..3 hold channels < 64 < C
    else s4[kk & 3] += cs;
  }
  float sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  float m = sum * inv_c;
  m = fmaf(fmaf(-m, cf, sum), inv_c, m);
  float a4[4];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    if (FULL || kk < nvalid) {  // channels >= C are zero-filled: (0 - m)^2 must not count
      const float4 d = make_float4(v[kk].x - m, v[kk].y - m, v[kk].z - m, v[kk].w - m);
      v[kk] = d;
      float& a = a4[kk & 3];
      a = kk < 4 ? d.x * d.x : fmaf(d.x, d.x, a);
      a = fmaf(d.w, d.w, fmaf(d.z, d.z, fmaf(d.y, d.y, a)));
    }
  }
  float m2 = (a4[0] + a4[1]) + (a4[2] + a4[3]);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 1);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 2);
  rstd = ok ? rsqrtf(m2 * inv_c + eps) : 0.f;
}
// row_stats16 of rows R0, R0 + 1 of v (one half), one uniform branch on C == KC around both.
template <int NK, int R0>
__device__ __forceinline__ void half_stats16(float4 (&v)[4][NK], int C, float inv_c, float eps, bool ok0, bool ok1,
                                             float (&rstd)[4]) {
  const float cf = static_cast<float>(C);
  if (C == 16 * NK) {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r) row_stats16<NK, true>(v[r], NK, cf, inv_c, eps, (r & 1) ? ok1 : ok0, rstd[r]);
  } else {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r)
      row_stats16<NK, false>(v[r], C / 16, cf, inv_c, eps, (r & 1) ? ok1 : ok0, rstd[r]);
  }
}
// s = ((xa - ma) ra + (xb - mb) rb) / 2 per channel (the LayerNorm affine is folded into W1; r = rstd / 2
// here) from one term per side. Each product is rounded on its own (no FMA contraction between the
// sides), and both sides of a pair and both roles of a position (tile row, mirror row) go through the
// same expression, so s(i, j) == s(j, i) bit for bit.
// term_sub_mul: (x - mean) r (KC = 64 build).
__device__ __forceinline__ float4 term_sub_mul(const float4& x, float m, float r) {
  return make_float4(__fmul_rn(x.x - m, r), __fmul_rn(x.y - m, r), __fmul_rn(x.z - m, r), __fmul_rn(x.w - m, r));
}
// term_ffma: the same term from the statistics' d = x - m and delta (row_stats' WIDE) as one FFMA per
// channel, fmaf(d, r, -delta r) = (d - delta) r with a single rounding; the mean itself is never rounded.
__device__ __forceinline__ float4 term_ffma(const float4& d, float delta, float r) {
  const float c = -delta * r;
  return make_float4(fmaf(d.x, r, c), fmaf(d.y, r, c), fmaf(d.z, r, c), fmaf(d.w, r, c));
}
// s = pa + pb from the two sides' terms of chunk kk, split into the A fragments of k steps 2 kk and 2 kk + 1
// (fragment row h: 0 for g, 1 for g + 8): column t of k step 2 kk is channel + 0, column t + 4 channel + 1;
// k step 2 kk + 1: + 2, + 3. Split as split_tf32_fast (hi rounded, lo truncated by the mask or the tensor cores).
template <int KC, bool MASK_LO>
__device__ __forceinline__ void s_fragments(const float4& pa, const float4& pb, int kk, int h,
                                            uint32_t (&ah)[KC / 8][4], uint32_t (&al)[KC / 8][4]) {
  split_tf32_fast<MASK_LO>(__fadd_rn(pa.x, pb.x), ah[2 * kk][h], al[2 * kk][h]);
  split_tf32_fast<MASK_LO>(__fadd_rn(pa.y, pb.y), ah[2 * kk][2 + h], al[2 * kk][2 + h]);
  split_tf32_fast<MASK_LO>(__fadd_rn(pa.z, pb.z), ah[2 * kk + 1][h], al[2 * kk + 1][h]);
  split_tf32_fast<MASK_LO>(__fadd_rn(pa.w, pb.w), ah[2 * kk + 1][2 + h], al[2 * kk + 1][2 + h]);
}
// The 16-bit build's s = pa + pb of chunk kk as k step kk's A registers in T (fragment row h): channels + 0,
// + 1 into a[h], + 2, + 3 into a[2 + h] (gemm1_channel16), each sum rounded to T once.
template <typename T, int KS>
__device__ __forceinline__ void s_fragments16(const float4& pa, const float4& pb, int kk, int h, uint32_t (&a)[KS][4]) {
  a[kk][h] = pack2<T>(__fadd_rn(pa.x, pb.x), __fadd_rn(pa.y, pb.y));
  a[kk][2 + h] = pack2<T>(__fadd_rn(pa.z, pb.z), __fadd_rn(pa.w, pb.w));
}
// The 16-bit KC = 128 build's s of chunk kk: the tile half's term ua = da ra (row_stats16's d times r) plus the
// mirror's db rb as one FFMA, s = fmaf(db, rb, ua), rounded to T once (registers as s_fragments16). The two sides
// do not enter alike, so s(i, j) and s(j, i) may differ in the last bit: the kernel writes out[b,i,j] and
// out[b,j,i] from the position with i <= j only (a diagonal tile holds both).
template <typename T, int KS>
__device__ __forceinline__ void s_fragments16_fma(const float4& ua, const float4& db, float rb, int kk, int h,
                                                  uint32_t (&a)[KS][4]) {
  a[kk][h] = pack2<T>(fmaf(db.x, rb, ua.x), fmaf(db.y, rb, ua.y));
  a[kk][2 + h] = pack2<T>(fmaf(db.z, rb, ua.z), fmaf(db.w, rb, ua.w));
}

// The wgmma kernel's parameters, packed once per call into the layout the kernel keeps in shared memory (one bulk
// copy per block then). fp32 input: wpack = [W1' hi | W1' lo (HP x KC each, plane_offset order of rows n,
// logical k) | W2 hi | W2 lo (HP x HP) | b1' | b2 | w3 (HP each)]; 16-bit input T: [W1' | W2 (T, plane_offset16
// order) | b1' | b2 | w3 (fp32)]. Zero outside n < H, c < C. One thread per weight element (W1' = W1 gamma in
// fp32, then split or rounded to T once), then one warp per hidden unit n for b1'[n] = b1[n] + sum_c W1[n][c]
// beta[c] (fp64). The parameters are T, like the input.
// Weight v at (n, k) of a plane of NR rows: fp32 split into hi at plane and lo at plane + lo_off
// (plane_offset), 16-bit T rounded once (plane_offset16).
template <typename T>
__device__ __forceinline__ void pack_weight(float* plane, int lo_off, int NR, int n, int k, float v) {
  if constexpr (WgElem<T>::kHalf) {
    reinterpret_cast<T*>(plane)[plane_offset16(n, k, NR)] = from_f32<T>(v);
  } else {
    uint32_t hi, lo;
    split_tf32(v, hi, lo);
    plane[plane_offset(n, k, NR)] = __uint_as_float(hi);
    plane[lo_off + plane_offset(n, k, NR)] = __uint_as_float(lo);
  }
}
template <typename T, int KC, int HP>
constexpr int kWgPackFloats = WgElem<T>::kHalf ? (HP * KC + HP * HP) / 2 + 3 * HP : 2 * HP * KC + 2 * HP * HP + 3 * HP;
template <typename T, int KC, int HP>
__global__ void __launch_bounds__(256) contact_map_wgmma_params_kernel(
    const T* __restrict__ ln_w, const T* __restrict__ ln_b, const T* __restrict__ w1,
    const T* __restrict__ b1, const T* __restrict__ w2, const T* __restrict__ b2,
    const T* __restrict__ w3, int C, int H, float* __restrict__ wpack, int* __restrict__ tile_counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the wgmma kernel may start its tile copies
#endif
  constexpr bool kHalf = WgElem<T>::kHalf;
  const int e = blockIdx.x * 256 + threadIdx.x;
  if (e == 0 && tile_counter != nullptr) *tile_counter = 0;  // the tile tickets (read after griddepcontrol.wait)
  float* w2p = wpack + (kHalf ? HP * KC / 2 : 2 * HP * KC);
  float* vec = w2p + (kHalf ? HP * HP / 2 : 2 * HP * HP);
  if (e < HP * KC) {
    const int n = e / KC, k = e % KC, c = kHalf ? gemm1_channel16(k) : gemm1_channel(k);
    const float v = n < H && c < C ? to_f32(__ldg(w1 + static_cast<long long>(n) * C + c)) * to_f32(__ldg(ln_w + c)) : 0.f;
    pack_weight<T>(wpack, HP * KC, HP, n, k, v);
  } else if (e < HP * KC + HP * HP) {
    const int ee = e - HP * KC, n = ee / HP, k = ee % HP, h = kHalf ? k : gemm2_unit(k);
    const float v = n < H && h < H ? to_f32(__ldg(w2 + static_cast<long long>(n) * H + h)) : 0.f;
    pack_weight<T>(w2p, HP * HP, HP, n, k, v);
  } else {
    const int n = (e - HP * KC - HP * HP) >> 5, lane = threadIdx.x & 31;  // whole warps (HP * KC + HP * HP % 32 == 0)
    if (n >= HP) return;
    double acc = 0.0;
    if (n < H)
      for (int c = lane; c < C; c += 32)
        acc += static_cast<double>(to_f32(__ldg(w1 + static_cast<long long>(n) * C + c))) *
               static_cast<double>(to_f32(__ldg(ln_b + c)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
      vec[n] = n < H ? static_cast<float>(static_cast<double>(to_f32(__ldg(b1 + n))) + acc) : 0.f;
      vec[HP + n] = n < H ? to_f32(__ldg(b2 + n)) : 0.f;
      vec[2 * HP + n] = n < H ? to_f32(__ldg(w3 + n)) : 0.f;
    }
  }
}


#if defined(CM_WG_DEVICE)
// k steps per promotion (16 k): the tensor cores' own accumulation truncates, so each chunk of
// kPromoSteps k steps (lo*hi, hi*lo, hi*hi each) goes into a fresh accumulator that is then added to acc
// in fp32. (64 k per chunk, as outer_wg, measured up to 3.1x the fp32 reference's max error against
// fp64 here; 16 k: at most 1.55x; NOTES.md.)
constexpr int kPromoSteps = 2;
template <int NA>
__device__ __forceinline__ void wg_promote(float (&acc)[NA], float (&d)[NA], bool first) {
  wg_fence(d);
#pragma unroll
  for (int e = 0; e < NA; ++e) acc[e] = first ? d[e] : acc[e] + d[e];
}
template <int HP, int KS>
__device__ __forceinline__ void wg_chunk(float (&d)[HP / 2], const uint32_t (&ah)[KS][4], const uint32_t (&al)[KS][4],
                                          int c0, uint64_t dh, uint64_t dl) {
  constexpr uint64_t kStep = (HP * 8 * 4) >> 4;  // descriptor increment per k step (HP x 8 floats)
  wg_fence(d);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int i = 0; i < kPromoSteps; ++i) {
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
__device__ __forceinline__ void wg_gemm(const uint32_t (&ah)[KS][4], const uint32_t (&al)[KS][4], uint64_t dh,
                                         uint64_t dl, float (&d0)[HP / 2], float (&d1)[HP / 2], float (&acc)[HP / 2]) {
  constexpr int NCH = KS / kPromoSteps;
  static_assert(KS % kPromoSteps == 0, "k steps per chunk");
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    if (c & 1) wg_chunk<HP, KS>(d1, ah, al, c * kPromoSteps, dh, dl);
    else wg_chunk<HP, KS>(d0, ah, al, c * kPromoSteps, dh, dl);
    if (c > 0) {
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // chunk c - 1 is done
      if ((c - 1) & 1) wg_promote(acc, d1, c == 1);
      else wg_promote(acc, d0, c == 1);
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  if ((NCH - 1) & 1) wg_promote(acc, d1, NCH == 1);
  else wg_promote(acc, d0, NCH == 1);
}
// The 16-bit build's acc = A B^T over KS k steps of 16 in T, one accumulation chain (the operands are
// rounded to T already: the tensor cores' truncating accumulation adds little to that), B by descriptor db.
template <typename T, int HP, int KS>
__device__ __forceinline__ void wg_gemm16(const uint32_t (&a)[KS][4], uint64_t db, float (&acc)[HP / 2]) {
  constexpr uint64_t kStep = (HP * 16 * 2) >> 4;  // descriptor increment per k step (HP x 16 elements)
  wg_fence(acc);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) wgmma_rs16<T, HP>(acc, a[ks], db + ks * kStep, ks == 0 ? 0 : 1);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  wg_fence(acc);
}
#endif

#if defined(CM_WG_DEVICE)
// The ring of tile slots and its barriers, as the kernel lays them out in shared memory.
template <typename T>
struct Ring {
  T* slots;         // R slots of slot_elems elements: half tile u in slot u % R
  int4* tinfo;      // (b, I, J, 0) of the tile whose first half is in slot s (KC = 128 build)
  uint64_t* full;   // full[s]: the slot's copies have landed (expect_tx, completed by the copy engine)
  uint64_t* empty;  // empty[s]: the slot's 4 consumer warps have read it
  int slot_elems, R;
};

// ---- producer -----------------------------------------------------------------------------------
// Half tile `mirror` of tile (b, I, J) into slot s: KC / kBoxC boxes (128-byte rows) completing on full[s],
// with the L2 cache policy `policy` on the reads when EVICT_FIRST.
template <typename T, int KC, bool EVICT_FIRST>
__device__ __forceinline__ void copy_half_tile(T* slots, int slot_elems, uint64_t* full, const CUtensorMap& tm_tile,
                                               const CUtensorMap& tm_mirror, unsigned bytes, uint64_t policy, int s,
                                               bool mirror, int b, int I, int J) {
  constexpr int kBoxC = WgElem<T>::kBoxC;
  mbar_expect_tx(full + s, bytes);
  T* dst = slots + s * slot_elems;
  const CUtensorMap* map = mirror ? &tm_mirror : &tm_tile;
#pragma unroll
  for (int box = 0; box < KC / kBoxC; ++box) {
    if constexpr (EVICT_FIRST)
      tma_load_4d(dst + box * PAIRS * kBoxC, map, kBoxC * box, TILE * J, TILE * I, b, full + s, policy);
    else tma_load_4d(dst + box * PAIRS * kBoxC, map, kBoxC * box, TILE * J, TILE * I, b, full + s);
  }
}

// Thread kTileThread, KC = 128: the block's tiles q < NCW are blockIdx.x + q gridDim.x, the later ones
// tickets from tile_counter (t = NCW gridDim.x + ticket; the params kernel zeroes the counter on each
// call), so blocks whose copies land sooner take more tiles. Each ticket is taken two tiles ahead (tk0
// for q + 1, tk1 for q + 2), so that the atomic's round trip is over long before its use. Each tile's
// (b, I, J) goes to the consumers in tinfo beside its first slot (ordered before their reads by the
// copies' completion on full[s]). Past the last tile, uses 2q, 2q + 2, ... get one sentinel (b = -1;
// I = 1 for the first, 0 for the others) for each consumer warpgroup, each completing its slot's phase
// with a plain arrive. The slot ps = u % R, pw = (u / R) & 1 and wrapped = u >= R of half-tile use u are
// kept incrementally, and the tile indices are 32-bit (the host checks total < 2^31): with no division
// by R and no 64-bit division the walk fits kProducerRegs128. The copies are marked L2 evict_first:
// every input byte is read once, so its lines are the first to be replaced when a later copy misses
// (under the harness's flush, which leaves L2 full of dirty lines, the other lines stay).
template <typename T, int KC, int NCW>
__device__ __forceinline__ void produce_tiles_by_ticket(const Ring<T>& rg, const CUtensorMap& tm_tile,
                                                        const CUtensorMap& tm_mirror, int* tile_counter,
                                                        long long total, long long tiles_per_b) {
  const int R = rg.R;
  int4* tinfo = rg.tinfo;
  uint64_t* full = rg.full;
  uint64_t* empty = rg.empty;
  const unsigned bytes = static_cast<unsigned>(sizeof(T) * rg.slot_elems);
  uint64_t policy = 0;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  auto copy_half = [&](int s, bool mirror, int b, int I, int J) {
    copy_half_tile<T, KC, true>(rg.slots, rg.slot_elems, full, tm_tile, tm_mirror, bytes, policy, s, mirror, b, I, J);
  };
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
#pragma unroll
      for (int k = 0; k < NCW; ++k) {
        if (k > 0) {
          next_slot();
          next_slot();
          wait_slot();
        }
        tinfo[ps] = make_int4(-1, k == 0 ? 1 : 0, 0, 0);  // the first sentinel has I = 1
        mbar_arrive(full + ps);
      }
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
    if (q + 1 < NCW) {
      t += gridDim.x;
    } else {
      if (q + 1 == NCW) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");  // tile_counter zeroed by the params kernel
        tk0 = static_cast<unsigned>(atomicAdd(tile_counter, 1));
      } else {
        tk0 = tk1;
      }
      tk1 = static_cast<unsigned>(atomicAdd(tile_counter, 1));
      t = NCW * gridDim.x + tk0;
    }
  }
}

// Thread kTileThread, KC = 64: the block's tiles blockIdx.x + k gridDim.x in order, each decoded here
// (and again by its consumer warpgroup).
template <typename T, int KC>
__device__ __forceinline__ void produce_tiles_strided(const Ring<T>& rg, const CUtensorMap& tm_tile,
                                                      const CUtensorMap& tm_mirror, long long total,
                                                      long long tiles_per_b) {
  const int R = rg.R;
  const unsigned bytes = static_cast<unsigned>(sizeof(T) * rg.slot_elems);
  unsigned u = 0;
  for (long long t = blockIdx.x; t < total; t += gridDim.x) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    for (int half = 0; half < 2; ++half, ++u) {
      const int s = static_cast<int>(u % R);
      if (u >= static_cast<unsigned>(R)) mbar_wait(rg.empty + s, ((u / R) - 1) & 1);
      copy_half_tile<T, KC, false>(rg.slots, rg.slot_elems, rg.full, tm_tile, tm_mirror, bytes, 0, s, half != 0, b, I, J);
    }
  }
}

// Thread kParamsThread: the packed parameters (w1s, w2s, vec are contiguous, from w1s on), in bulk copies of
// <= 32 KB completing on wbar; launched as a programmatic dependent of the params kernel, it waits for its
// writes first (the tile copies of thread kTileThread do not depend on it).
template <typename T, int KC, int HP>
__device__ __forceinline__ void produce_params(float* w1s, const float* wpack, uint64_t* wbar) {
  constexpr int bytes = 4 * kWgPackFloats<T, KC, HP>;
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  mbar_expect_tx(wbar, bytes);
  for (int off = 0; off < bytes; off += 32768)
    bulk_copy(w1s + off / 4, wpack + off / 4, bytes - off < 32768 ? bytes - off : 32768, wbar);
}

// ---- epilogue -----------------------------------------------------------------------------------
// Per tile, after layer 3 (z0, z1: this lane's partial sums of pairs p0 and p0 + 8 over its units): z
// summed over the quad and out[b,i,j] = out[b,j,i] = sigmoid(z + b3), lanes t4 = 0 / 1 writing pair p0
// (i0, j0) / p0 + 8 (i1, j0).
template <typename T>
__device__ __forceinline__ void write_pair_outputs(float z0, float z1, int t4, bool ok0, bool ok1, int i0, int i1,
                                                   int j0, int b, int N, float bias3, T* out) {
  z0 += __shfl_xor_sync(0xffffffffu, z0, 1);
  z0 += __shfl_xor_sync(0xffffffffu, z0, 2);
  z1 += __shfl_xor_sync(0xffffffffu, z1, 1);
  z1 += __shfl_xor_sync(0xffffffffu, z1, 2);
  if (t4 < 2) {
    const bool ok = t4 == 0 ? ok0 : ok1;
    if (ok) {
      const int i = t4 == 0 ? i0 : i1;
      const T o = from_f32<T>(1.f / (1.f + expf(-((t4 == 0 ? z0 : z1) + bias3))));
      out[(static_cast<long long>(b) * N + i) * N + j0] = o;
      out[(static_cast<long long>(b) * N + j0) * N + i] = o;
    }
  }
}
#endif

// Assumptions: see the section's head. tile_counter: KC = 128's ticket counter (the params kernel zeroes
// it), unused at KC = 64. Shared memory: SmemWg(KC, HP, R, sizeof(T)).total bytes. T: the input's, output's
// and parameters' type (float: split-TF32 products; __half / __nv_bfloat16: the 16-bit build, products in T).
template <typename T, int KC, int HP>
__global__ void __launch_bounds__(kWgThreads<kConsumerWgs<T, KC>>, 1)
contact_map_wgmma_kernel(const __grid_constant__ CUtensorMap tm_tile,    // x as (C, N (j), N (i), B)
                         const __grid_constant__ CUtensorMap tm_mirror,  // x as (C, N (i), N (j), B)
                         T* __restrict__ out,                            // (B, N, N)
                         const float* __restrict__ wpack,                // kWgPackFloats<T, KC, HP>
                         int* __restrict__ tile_counter,                 // tickets handed out (0 at the start)
                         const T* __restrict__ b3,                       // (1)
                         float eps, int B, int N, int C, int H, int R) {
#if defined(CM_WG_DEVICE)
  // The build: KC = 128 takes the streamlined path (ticket walk, evict_first, FFMA terms; ping-pong in fp32)
  static_assert((KC == 64 || KC == 128) && (HP == 32 || HP == 64), "contact_map_wgmma_kernel: KC 64 / 128, HP 32 / 64");
  constexpr bool kWide = KC == 128;
  constexpr bool k16 = WgElem<T>::kHalf;  // the 16-bit build
  constexpr bool kOneSide = k16 && kWide;  // row_stats16 and s = fmaf(db, rb, da ra): outputs from i <= j only
  constexpr int NCW = kConsumerWgs<T, KC>;
  constexpr bool kTurns = kWide && NCW == 2;  // the consumers' products take turns (WgBarrier)
  constexpr int kConsumerRegs = NCW == 3 ? kConsumerRegs3 : kWide ? kConsumerRegs128 : kConsumerRegs64;
  constexpr int kProducerRegs = kWide ? kProducerRegs128 : kProducerRegs64;
  extern __shared__ __align__(16) float smem_raw[];
  const SmemWg L(KC, HP, R, sizeof(T));
  // the ring 1024-byte aligned (the 128-byte swizzle's atom), as an offset from smem_raw so that the compiler
  // keeps these pointers in the shared space (LDS; through an integer cast it emitted generic LD.E)
  float* sm = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) / 4;
  T* ring = reinterpret_cast<T*>(sm);
  float* w1s = sm + L.ring / 4;       // hi plane, then lo plane: 2 x HP x KC (16-bit build: one plane of T)
  float* w2s = w1s + L.w1 / 4;        // 2 x HP x HP (16-bit build: one plane of T)
  float* vec = w2s + L.w2 / 4;        // b1' | b2 | w3 (HP each)
  int4* tinfo = reinterpret_cast<int4*>(vec + 3 * HP);  // (b, I, J, 0) of the tile in slot s
  uint64_t* full = reinterpret_cast<uint64_t*>(tinfo + R);
  uint64_t* empty = full + R;
  uint64_t* wbar = empty + R;  // the parameters' bulk copies
  const Ring<T> rg{ring, tinfo, full, empty, L.slot_elems, R};

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
  __syncthreads();  // the mbarriers are initialised before anyone waits on them

  if (wg == NCW) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid == kParamsThread<NCW>) {
      produce_params<T, KC, HP>(w1s, wpack, wbar);
    } else if (tid == kTileThread<NCW>) {
      if constexpr (kWide)
        produce_tiles_by_ticket<T, KC, NCW>(rg, tm_tile, tm_mirror, tile_counter, total, tiles_per_b);
      else produce_tiles_strided<T, KC>(rg, tm_tile, tm_mirror, total, tiles_per_b);
    }
    return;  // no block-wide barrier after this point
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  // ---- consumer warpgroups 0 .. NCW - 1 --------------------------------------------------------
  // The consumer warpgroup wg's tiles: q = wg, wg + NCW, ... of the block (block-local order). KC = 128: the
  // tiles' coordinates from the producer (tinfo), slots and parities kept incrementally, the loop ends at a
  // sentinel; kTurns (fp32, NCW = 2): the products take turns with the other warpgroup: warpgroup w syncs on
  // mma_turn(w) before GEMM1 and after GEMM2 arrives on the other's, warpgroup 1 granting warpgroup 0 the
  // first turn. Every tile's GEMM2 arrives unconditionally; at its sentinel a warpgroup consumes the
  // arrival meant for its next turn, and at the first sentinel gives the other warpgroup the arrival that
  // its own sentinel (the second) will consume, so each barrier phase gets exactly one sync (128 threads)
  // and one arrive (128). Without turns (NCW = 3) a sentinel only ends the loop.
  // KC = 64: a fixed stride of tiles, each decoded here, slot u % R.
  // The loop body stays in the kernel: as a function (or lambda) taking the shared-memory pointers (vec,
  // w1s, the ring's), the compiler derives their addresses differently and the machine code changes
  // write_pair_outputs takes values only.
  constexpr int KS1 = k16 ? KC / 16 : KC / 8, KS2 = HP / 8, NA = HP / 2, NK = KC / 16;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3, w4 = (tid >> 5) & 3;
  const int p0 = 16 * w4 + frag_pair(g);  // this thread's pairs: p0 (fragment row g) and p0 + 8 (row g + 8)
  const float inv_c = 1.f / static_cast<float>(C), bias3 = to_f32(__ldg(b3));
  const uint64_t d1h = plane_desc(w1s), d1l = plane_desc(w1s + HP * KC);
  const uint64_t d2h = plane_desc(w2s), d2l = plane_desc(w2s + HP * HP);

  float d0[NA], d1[NA];  // wgmma accumulators (each chunk starts with scale-d 0; zeroed once so they are defined)
#pragma unroll
  for (int e = 0; e < NA; ++e) d0[e] = d1[e] = 0.f;
  bool staged = false;  // this thread has waited for the weights
  if constexpr (kTurns) {
    if (wg == 1) named_bar_arrive(mma_turn(0));  // warpgroup 0's products go first
  }
  unsigned q = wg;  // block-local tile index
  // KC = 128: slot and parity of use u0 = 2q, kept incrementally (u0 advances by 2 NCW per tile; launch_wgmma
  // makes R a multiple of 2 NCW, so one wrap at most, but the two steps below hold for any R >= NCW)
  int cs = static_cast<int>((2u * q) % R);
  unsigned cph = ((2u * q) / R) & 1;
  for (long long t = blockIdx.x + static_cast<long long>(wg) * gridDim.x; kWide || t < total;
       t += static_cast<long long>(NCW) * gridDim.x, q += NCW) {
    int b = 0, I = 0, J = 0;
    if constexpr (!kWide) decode_tile(t, tiles_per_b, b, I, J);
    const unsigned u0 = 2 * q, u1 = 2 * q + 1;
    int s0, s1;
    unsigned ph0, ph1;
    if constexpr (kWide) {
      s0 = cs;
      ph0 = cph;
      s1 = s0 + 1 == R ? 0 : s0 + 1;
      ph1 = s0 + 1 == R ? ph0 ^ 1 : ph0;
      cs += 2 * NCW;
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
    const T* tl = ring + s0 * L.slot_elems;
    const T* mi = ring + s1 * L.slot_elems;
    if constexpr (kWide) {  // the tile's coordinates from its producer
      mbar_wait(full + s0, ph0);
      const int4 ti = tinfo[s0];
      b = ti.x;
      I = ti.y;
      J = ti.z;
      if (b < 0) {  // a sentinel: the block's tiles are done (I = 1: the first of its NCW sentinels)
        if constexpr (kTurns) {
          named_bar_sync(mma_turn(wg));
          if (I != 0) named_bar_arrive(mma_turn(1 - wg));
        }
        break;
      }
    }
    const int i0 = TILE * I + (p0 >> 3), j0 = TILE * J + (p0 & 7);
    const int i1 = i0 + 1;  // p1 = p0 + 8: next tile row, same column
    const bool ok0 = i0 < N && j0 < N, ok1 = i1 < N && j0 < N;
    float mean[4], rstd[4];  // KC = 128: mean[] holds each row's delta, v the rows' d = x - m (row_stats' WIDE;
                             // kOneSide: v gets d, mean[] is unused)
    uint32_t ah[KS1][4], al[k16 ? 1 : KS1][4];  // the 16-bit build: ah only, in T
    {
      // ---- operands: this thread's 4 rows (tile p0, p0 + 8; mirror p0, p0 + 8) into registers, both
      // slots released once this warp has read them, the rows' statistics, and s split into GEMM1's A
      // fragments for all of K. KC = 64 waits for slot s0 here (KC = 128 has waited above, for the tile's
      // coordinates) and KC = 128 computes the tile half's terms before the wait for the mirror, so that
      // less work follows the last copy's arrival.
      float4 v[4][NK];
      if constexpr (!kWide) mbar_wait(full + s0, ph0);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        v[0][kk] = slot_chunk4(tl, p0, kk, t4);
        v[1][kk] = slot_chunk4(tl, p0 + 8, kk, t4);
      }
      if constexpr (kOneSide) half_stats16<NK, 0>(v, C, inv_c, eps, ok0, ok1, rstd);
      else half_stats<NK, 0, kWide>(v, C, inv_c, eps, ok0, ok1, mean, rstd);
      if constexpr (kOneSide) {  // the tile half's terms d ra before the mirror's wait
#pragma unroll
        for (int kk = 0; kk < NK; ++kk)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float r = 0.5f * rstd[h];
            const float4 d = v[h][kk];
            v[h][kk] = make_float4(__fmul_rn(d.x, r), __fmul_rn(d.y, r), __fmul_rn(d.z, r), __fmul_rn(d.w, r));
          }
      } else if constexpr (kWide) {  // the tile half's terms before the mirror's wait
#pragma unroll
        for (int kk = 0; kk < NK; ++kk)
#pragma unroll
          for (int h = 0; h < 2; ++h) v[h][kk] = term_ffma(v[h][kk], mean[h], 0.5f * rstd[h]);
      }
      mbar_wait(full + s1, ph1);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        v[2][kk] = slot_chunk4(mi, p0, kk, t4);
        v[3][kk] = slot_chunk4(mi, p0 + 8, kk, t4);
      }
      __syncwarp();
      if (lane == 0) {  // this warp has read both slots
        mbar_arrive(empty + s0);
        mbar_arrive(empty + s1);
      }
      if constexpr (kOneSide) half_stats16<NK, 2>(v, C, inv_c, eps, ok0, ok1, rstd);
      else half_stats<NK, 2, kWide>(v, C, inv_c, eps, ok0, ok1, mean, rstd);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if constexpr (kOneSide) {
            s_fragments16_fma<T, KS1>(v[h][kk], v[2 + h][kk], 0.5f * rstd[2 + h], kk, h, ah);
          } else if constexpr (k16) {
            const float4 pa = term_sub_mul(v[h][kk], mean[h], 0.5f * rstd[h]);
            s_fragments16<T, KS1>(pa, term_sub_mul(v[2 + h][kk], mean[2 + h], 0.5f * rstd[2 + h]), kk, h, ah);
          } else if constexpr (kWide) {
            s_fragments<KC, false>(v[h][kk], term_ffma(v[2 + h][kk], mean[2 + h], 0.5f * rstd[2 + h]), kk, h, ah, al);
          } else {
            const float4 pa = term_sub_mul(v[h][kk], mean[h], 0.5f * rstd[h]);
            s_fragments<KC, true>(pa, term_sub_mul(v[2 + h][kk], mean[2 + h], 0.5f * rstd[2 + h]), kk, h, ah, al);
          }
    }
    if (!staged) {  // the parameters are in shared memory
      mbar_wait(wbar, 0);
      staged = true;
    }
    // ---- MLP on the tensor cores: GEMM1 acc = s W1'^T; h1 = relu(acc + b1') split in registers into
    // GEMM2's A fragments (gemm2_unit's order); GEMM2 acc = h1 W2^T ----
    if constexpr (kTurns) named_bar_sync(mma_turn(wg));  // this warpgroup's turn on the tensor cores
    float acc[NA];
    if constexpr (k16) {
      // both products in T: GEMM1 into d0; h1 = relu(d0 + b1') rounded to T in the order of the accumulator
      // (d[4 j + e], units 8 j + 2 t + e % 2), which is GEMM2's A layout: k step m's a[r] holds d[8 m + 2 r],
      // d[8 m + 2 r + 1]
      wg_fence(ah);
      wg_gemm16<T, HP, KS1>(ah, d1h, d0);
      wg_fence(ah);
      uint32_t bh[HP / 16][4];
#pragma unroll
      for (int m = 0; m < HP / 16; ++m)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int e0 = 8 * m + 2 * r, unit = 8 * (e0 >> 2) + 2 * t4;
          bh[m][r] = pack2<T>(relu(d0[e0] + vec[unit]), relu(d0[e0 + 1] + vec[unit + 1]));
        }
      wg_fence(bh);
      wg_gemm16<T, HP, HP / 16>(bh, d2h, d0);
      wg_fence(bh);
#pragma unroll
      for (int e = 0; e < NA; ++e) acc[e] = d0[e];
    } else {
      wg_fence(ah);
      wg_fence(al);
      wg_gemm<HP, KS1>(ah, al, d1h, d1l, d0, d1, acc);
      wg_fence(ah);  // the A registers stay live until every wgmma reading them has completed
      wg_fence(al);

      uint32_t bh[KS2][4], bl[KS2][4];
#pragma unroll
      for (int j = 0; j < KS2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int unit = 8 * j + 2 * t4 + (e & 1);
          const float h = relu(acc[4 * j + e] + vec[unit]);
          const int slot = (e >> 1) | ((e & 1) << 1);  // d[4j + e]: row g + 8 (e / 2), unit + e % 2 -> a[(e/2) + 2 (e%2)]
          split_tf32_fast<!kWide>(h, bh[j][slot], bl[j][slot]);
        }
      wg_fence(bh);
      wg_fence(bl);
      wg_gemm<HP, KS2>(bh, bl, d2h, d2l, d0, d1, acc);
      wg_fence(bh);
      wg_fence(bl);
    }
    if constexpr (kTurns) named_bar_arrive(mma_turn(1 - wg));  // the other warpgroup's turn

    // ---- layer 3: z = sum_u w3[u] relu(h2[u] + b2[u]) over this lane's units, then the output ----
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
    // kOneSide: a diagonal tile's positions with i > j leave both outputs to their mirror position (s is not
    // symmetric bit for bit there); an off-diagonal tile has i < j everywhere
    write_pair_outputs(z0, z1, t4, ok0 && (!kOneSide || i0 <= j0), ok1 && (!kOneSide || i1 <= j0), i0, i1, j0, b, N,
                       bias3, out);
  }
#else
  __trap();  // built without sm_90a: the host never launches this (wgmma_supported)
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
// per forward on the H200 machine's host otherwise: NOTES.md).
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

// Persistent launch of the fma or the mma kernel (same signature): as many blocks of `threads` threads as fit on
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


template <int HP, bool W_SMEM>
void launch_fma(const Args& a, cudaStream_t stream, int num_sms) {
  launch_persistent(contact_map_fma_kernel<HP, W_SMEM>, THREADS, sizeof(float) * Smem(a.CP, HP, W_SMEM).total,
                    a, stream, num_sms);
}

template <bool W_SMEM>
void dispatch_fma_hidden(const Args& a, int HP, cudaStream_t s, int sms) {
  switch (HP) {
    case 16: launch_fma<16, W_SMEM>(a, s, sms); break;
    case 32: launch_fma<32, W_SMEM>(a, s, sms); break;
    case 64: launch_fma<64, W_SMEM>(a, s, sms); break;
    case 128: launch_fma<128, W_SMEM>(a, s, sms); break;
    default: launch_fma<256, W_SMEM>(a, s, sms); break;  // HP <= MAX_HIDDEN checked by forward()
  }
}

void dispatch_fma(const Args& a, int HP, bool w_smem, cudaStream_t s, int sms) {
  if (w_smem) dispatch_fma_hidden<true>(a, HP, s, sms);
  else dispatch_fma_hidden<false>(a, HP, s, sms);
}

// PROD (the producer-warp build) at HP <= 32 only: at HP = 64 (crop, long) NG = 2 takes half the warps out
// of products that are ~50% of the loop there, and measured 8-10% slower than without (NOTES.md).
constexpr int kProdMaxHP = 32;

// The mma kernel with 512 threads (or 256 at HP = 256: below): weights as split fragments in shared memory
// when they fit beside the tile (WF), else read from global memory. At HP <= 32: the 2-blocks-per-SM build
// (64 registers) where two blocks fit by shared memory, else the 1-block build with the producer warps
// (PROD) and the fused statistics sweep (under 64 registers per thread the PROD build at HP = 32, 2 n
// tiles per warp, spilled 8 bytes).
template <int HP, WFormat WF>
void launch_mma(const Args& a, cudaStream_t stream, int num_sms) {
  constexpr int NTHR = 512;
  const size_t smem = sizeof(float) * SmemTC(a.CP, HP, WF).total;
  if constexpr (HP <= kProdMaxHP) {
    static_assert(kMinBlocksTC<HP, NTHR> == 2, "the 2-block build at HP <= 32");
    const int per_sm = blocks_per_sm(contact_map_mma_kernel<HP, WF, NTHR, 2>, a.device, NTHR, smem);
    if (per_sm < 2)
      launch_persistent(contact_map_mma_kernel<HP, WF, NTHR, 1, true>, NTHR, smem, a, stream, num_sms);
    else
      launch_persistent(contact_map_mma_kernel<HP, WF, NTHR, 2>, NTHR, smem, a, stream, num_sms, per_sm);
  } else {
    launch_persistent(contact_map_mma_kernel<HP, WF, NTHR, kMinBlocksTC<HP, NTHR>>, NTHR, smem, a, stream, num_sms);
  }
}

template <WFormat WF>
void dispatch_mma_hidden(const Args& a, int HP, cudaStream_t s, int sms) {
  switch (HP) {
    case 16: launch_mma<16, WF>(a, s, sms); break;
    case 32: launch_mma<32, WF>(a, s, sms); break;
    case 64: launch_mma<64, WF>(a, s, sms); break;
    case 128: launch_mma<128, WF>(a, s, sms); break;
    // HP <= MAX_HIDDEN checked by forward(); at 256 the weights (>= 512 KB) never fit in shared memory,
    // and 16 warps would need more than the 128 registers per thread they may have: 8 warps
    default:
      launch_persistent(contact_map_mma_kernel<256, WFormat::kGlobal, 256>, 256,
                        sizeof(float) * SmemTC(a.CP, 256, WFormat::kGlobal).total, a, s, sms);
      break;
  }
}

// The wgmma kernel's host side: sm_90a in this build and a compute capability 9.0 device; the shapes its tiles fit.
#if defined(CM_SM90A)
constexpr bool kBuiltSm90a = true;  // the build has sm_90a code (the wgmma kernel)
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
                "contact_map: the CUDA driver has no cuTensorMapEncodeTiled (the wgmma kernel needs CUDA 12+)");
    fn = reinterpret_cast<EncodeTiledFn>(p);
  }
  return fn;
}

// x (B, N, N, C) contiguous as a 4-D tensor map (C, N, N, B) with boxes of 128 bytes of channels (32 fp32,
// 64 fp16 / bf16) x 8 x 8 positions, 128-byte swizzle, zero fill out of range. Tile map: dimension 1 is x's j (stride C),
// dimension 2 its i (stride N C); mirror map: the two swapped, so that both land with row 8 il + jl.
// L2 promotion: 128 bytes (a box row's size) for the KC = 128 build, 256 bytes for KC = 64 (128 measured
// 0.6% faster at batch, NOTES.md).
template <typename T>
CUtensorMap make_tile_map(const T* x, int B, int N, int C, bool mirror,
                          CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  CUtensorMap m;
  constexpr cuuint64_t es = sizeof(T);
  const cuuint64_t row = static_cast<cuuint64_t>(C) * es, plane = static_cast<cuuint64_t>(N) * C * es;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(C), static_cast<cuuint64_t>(N), static_cast<cuuint64_t>(N),
                              static_cast<cuuint64_t>(B)};
  const cuuint64_t strides[3] = {mirror ? plane : row, mirror ? row : plane, plane * N};
  const cuuint32_t box[4] = {WgElem<T>::kBoxC, TILE, TILE, 1}, elem[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = std::is_same<T, float>::value    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                    : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode_tiled()(&m, type, 4, const_cast<T*>(x), dims, strides, box,
                                    elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "contact_map: cuTensorMapEncodeTiled failed with CUresult " + num(static_cast<int>(r)));
  return m;
}

// The wgmma kernel's tensors, all of element type T (float, __half or __nv_bfloat16).
template <typename T>
struct WgArgs {
  const T *x, *ln_w, *ln_b, *w1, *b1, *w2, *b2, *w3, *b3;
  T* out;
  float eps;
  int B, N, C, H, device;
};

// Where "auto" runs the wgmma kernel (else the mma kernel, or for fp16 / bf16 input the fp32 kernels on a
// converted copy): built with sm_90a, a compute capability 9.0 device, C % 16 == 0, 32 <= C <= 128 (fp32;
// fp16 / bf16: 64 <= C, a box row's 128 bytes), H <= 64, N >= 8 (a box never exceeds the tensor), x
// 16-byte aligned. esize: bytes of an input element.
bool wgmma_supported(int C, int H, int N, const void* x, int esize, const DeviceFacts& dev) {
  if (!kBuiltSm90a) return false;
  return dev.major == 9 && dev.minor == 0 && C % 16 == 0 && C >= 128 / esize && C <= 128 && H <= 64 && N >= TILE &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}


// As many ring slots as fit (4 NCW or 2 NCW); one block per SM, at most one per tile.
template <typename T, int KC, int HP>
void launch_wgmma(const WgArgs<T>& a, const torch::Tensor& wpack_buf, cudaStream_t stream, int num_sms, int max_smem) {
  constexpr bool kWide = KC == 128;  // the streamlined build (contact_map_wgmma_kernel)
  // R a multiple of 2 NCW, so that every slot serves one warpgroup only (warpgroup w's uses u = 2 NCW k + 2w, + 1):
  // a parity wait is safe only for a waiter that also waited on the slot's previous phase. At R = 5 a
  // warpgroup could find the other's earlier copy into the slot still in flight, read the parity of that
  // incomplete phase as its own completed one and read the slot early (wrong outputs at batch, R = 5, in 6 of
  // 300 back-to-back calls: NOTES.md).
  constexpr int NCW = kConsumerWgs<T, KC>;
  // 8 or 12 slots where they fit (the 16-bit build's 12 x 16 KB fit on every sm_90 GPU), else 4 or 6
  int R = 4 * NCW;
  while (R > 2 * NCW && SmemWg(KC, HP, R, sizeof(T)).total > max_smem) R -= 2 * NCW;
  const int smem = SmemWg(KC, HP, R, sizeof(T)).total;
  TORCH_CHECK(smem <= max_smem, "contact_map: the wgmma kernel needs " + num(smem) + " bytes of shared memory per block; this device allows " + num(max_smem));
  auto kernel = contact_map_wgmma_kernel<T, KC, HP>;
  ensure_max_dynamic_smem(reinterpret_cast<const void*>(kernel), a.device, smem);
  const CUtensorMapL2promotion promotion = kWide ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  const CUtensorMap mt = make_tile_map(a.x, a.B, a.N, a.C, false, promotion),
                    mm = make_tile_map(a.x, a.B, a.N, a.C, true, promotion);
  constexpr int pack_threads = HP * KC + HP * HP + 32 * HP;
  float* wpack = wpack_buf.data_ptr<float>();
  constexpr int counter_at = kWgPackFloats<float, 128, 64>;  // after the largest pack: the tile counter
  TORCH_CHECK(wpack_buf.numel() >= counter_at + 4, "contact_map: internal error: wgmma parameter buffer too small");
  int* tile_counter = kWide ? reinterpret_cast<int*>(wpack + counter_at) : nullptr;
  contact_map_wgmma_params_kernel<T, KC, HP><<<cdiv(pack_threads, 256), 256, 0, stream>>>(
      a.ln_w, a.ln_b, a.w1, a.b1, a.w2, a.b2, a.w3, a.C, a.H, wpack, tile_counter);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int nT = cdiv(a.N, TILE);
  const long long tiles = static_cast<long long>(a.B) * nT * (nT + 1) / 2;
  // the KC = 128 producer counts tiles in 32 bits and decode_tile32 squares the tile row in int (either limit
  // means terabytes of input)
  TORCH_CHECK(!kWide || (tiles < (1ll << 31) && nT <= 46340),
              "contact_map: the wgmma kernel handles fewer than 2^31 tiles and N <= 370720, got " + num(tiles) +
                  " tiles, N = " + num(a.N));
  const int grid = static_cast<int>(tiles < num_sms ? tiles : num_sms);
  // a programmatic dependent launch: the kernel starts (barriers, the first tiles' copies) while the params
  // kernel runs, and waits for it (griddepcontrol.wait) only before copying wpack
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kWgThreads<NCW>);
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

// wpack_buf: float32 workspace of at least kWgPackFloats<float, 128, 64> + 4 elements on the input's device (the
// tile counter after the pack). pair_dim <= 64: the KC = 64 build.
template <typename T>
void dispatch_wgmma(const WgArgs<T>& a, const torch::Tensor& wpack_buf, cudaStream_t stream, int num_sms, int max_smem) {
  const bool k64 = a.C <= 64, h32 = a.H <= 32;
  if (k64 && h32) launch_wgmma<T, 64, 32>(a, wpack_buf, stream, num_sms, max_smem);
  else if (k64) launch_wgmma<T, 64, 64>(a, wpack_buf, stream, num_sms, max_smem);
  else if (h32) launch_wgmma<T, 128, 32>(a, wpack_buf, stream, num_sms, max_smem);
  else launch_wgmma<T, 128, 64>(a, wpack_buf, stream, num_sms, max_smem);
}

// The wgmma kernel on x and the parameters c (gamma, beta, W1, b1, W2, b2, w3, b3; all contiguous, of type
// T) into out (T).
template <typename T>
void run_wgmma(const torch::Tensor& x, const std::vector<torch::Tensor>& c, double eps, const torch::Tensor& out,
               int device, const DeviceFacts& dev, cudaStream_t stream) {
  auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); };
  WgArgs<T> a{ptr(x), ptr(c[0]), ptr(c[1]), ptr(c[2]), ptr(c[3]), ptr(c[4]), ptr(c[5]), ptr(c[6]), ptr(c[7]),
              reinterpret_cast<T*>(out.data_ptr()), static_cast<float>(eps), static_cast<int>(x.size(0)),
              static_cast<int>(x.size(1)), static_cast<int>(x.size(3)), static_cast<int>(c[3].numel()), device};
  // the packed parameters, then 4 floats whose first holds the tile counter (an int)
  const auto wpack = torch::empty({kWgPackFloats<float, 128, 64> + 4}, x.options().dtype(torch::kFloat32));
  dispatch_wgmma(a, wpack, stream, dev.num_sms, dev.max_smem);
}

void check_param(const torch::Tensor& p, const char* name, const torch::Tensor& x,
                 std::vector<int64_t> shape) {
  TORCH_CHECK(p.device() == x.device(), "contact_map: pair_repr is on ", x.device().str(),
              " but parameter ", name, " is on ", p.device().str(),
              "; move the module and the input to one device");
  TORCH_CHECK(p.scalar_type() == x.scalar_type(), "contact_map: parameter ", name, " must be ",
              c10::toString(x.scalar_type()), " like pair_repr, got ", c10::toString(p.scalar_type()));
  TORCH_CHECK(p.sizes() == c10::IntArrayRef(shape), "contact_map: parameter ", name, " has shape ",
              shape_str(p.sizes()), ", expected ", shape_str(shape));
}

// =============================================================================================
// The fused backward (sm_80+): one pass over the pair, the forward recomputed per tile
// =============================================================================================
// A block takes tiles (b, I <= J) in turn (persistent). Per tile, its 64 positions p = (i, j) and both
// sides x[b,i,j], x[b,j,i]: the statistics, s, h1, h2 and out again; dz = w g_s out (1 - out), g_s =
// (g[b,i,j] + g[b,j,i]) / 2 and w = 2 off the diagonal (the position stands for (i, j) and (j, i), whose
// s, activations and masks are the same), 1 on it. dh2 = dz w3 [h2 > 0], dh1 = (dh2 W2) [h1 > 0], ds =
// dh1 W1 (all scaled by w), dy = ds / w on both sides, then the LayerNorm backward of each side's row
// (dx written once per position). dW1 += dh1^T s and dW2 += dh2^T relu(h1) are mma.sync products over
// the tile's positions, added to totals in registers that stay for the block's tiles; dgamma, dbeta and db1
// (column sums by one thread each) and dw3, db2, db3 (per warp) add up in shared memory. Each block writes
// one fp32 partial of every parameter gradient; bw_sum_partials_kernel sums them in fp64. 16 warps of at
// most 128 registers each (4 per scheduler).
//
// The ReLU masks follow fp64's sign: a unit within rounding of 0 takes its kink on either side in two
// evaluations, and one position on the other side changes a weight's gradient by a whole term (several
// times the fp32 reference's whole error). A position with any |h1| or |h2| below kKink (|s| |W_u| +
// |b_u|) (the Cauchy-Schwarz bound on the unit's input; fp32 and split-TF32 rounding of h is about 2^-21
// of that bound / sqrt(K), so 2^-17 leaves a wide margin) is computed again in fp64 from x by its warp
// (0.3-1.6% of the positions at crop and batch with random weights), and its h1, h2 replaced by the fp64
// values rounded to fp32.
namespace bwd {
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kRows = 64 / kWarps;  // positions per warp in the per-row steps
constexpr int kMaxC = 128, kMaxH = 64;  // pair_dim, hidden_dim: multiples of 16 up to these
constexpr float kKink = 7.62939453125e-6f;  // 2^-17
}  // namespace bwd

template <typename T>
struct BwArgs {
  const T* x;
  const float *g, *gamma, *beta, *w1, *b1, *w2, *b2, *w3, *b3;  // g: (B, N, N) fp32
  T* dx;
  float* part;  // (gridDim.x, bw_partial_len(C, H))
  double eps;
  int B, N, C, H;
};

// One block's partial: dW1 (H x C), dW2 (H x H), dgamma, dbeta (C), dw3, db2 (H), db3, db1 (H).
__host__ __device__ inline int bw_partial_len(int C, int H) { return H * C + H * H + 2 * C + 3 * H + 1; }

// Shared memory, in floats: the two sides' rows (x, then xhat) and s (then dy), 64 x ldx each; W1 (H x ldx),
// W2 (H x ldh); h1 and h2 (then dh2, then dh1), 64 x ldh each; the vectors; the vector gradients' sums; per
// warp C + H doubles.
// Row strides of 4 mod 32 floats: the m16n8k8 fragment loads of row-major operands are conflict-free.
struct BwSmem {
  int ldx, ldh, xa, xb, s, w1, w2, h1, h2, vec, vacc, f64, total;
  __host__ __device__ BwSmem(int C, int H) {
    ldx = C + 4;
    ldh = H + 4;
    xa = 0;
    xb = xa + 64 * ldx;
    s = xb + 64 * ldx;
    w1 = s + 64 * ldx;
    w2 = w1 + H * ldx;
    h1 = w2 + H * ldh;
    h2 = h1 + 64 * ldh;
    vec = h2 + 64 * ldh;  // gamma, beta (C); b1, b2, w3, |W1_u|, |W2_u| (H); rstd_a, rstd_b, |s|, g_s (64)
    vacc = vec + 2 * C + 5 * H + 4 * 64;  // sums: dgamma, dbeta (C), db1 (H); per warp dw3, db2 (H), db3
    f64 = round_up(vacc + 2 * C + H + bwd::kWarps * (2 * H + 1), 4);
    total = f64 + 2 * bwd::kWarps * (C + H);
  }
};

template <bool RELU>
__device__ __forceinline__ float bw_ld(float v) { return RELU ? fmaxf(v, 0.f) : v; }

// acc[r] += A(16 rows, K) B(K, 16 columns) in split TF32 for the strips s = warp + 16 r < nstrips of an
// (16 MT) x (16 nstrips / MT) output: strip s is m tile s % MT (= warp % MT: MT divides 16, so a warp's
// strips share their A fragments, split once per k step), columns 16 (s / MT) .. + 15 (two n tiles).
// A(m, k) = A[m am + k ak], B(k, n) = B[k bk + n bn], ReLU on load if asked. The k steps run in order
// (R x 2 independent accumulators per step); each mma.sync truncates its fp32 sum, so a long sum goes
// into fresh accumulators per tile and is added to its total in fp32 (bias ~2^-24 per step of the tile's
// part instead of the whole sum's).
template <int R, bool RELU_A, bool RELU_B>
__device__ __forceinline__ void bw_gemm(float (&acc)[R][2][4], const float* __restrict__ A, int am, int ak,
                                        const float* __restrict__ Bm, int bk, int bn, int MT, int nstrips, int K,
                                        int warp, int lane) {
  if (warp >= nstrips) return;
  asm volatile("" : "+r"(lane));  // the fragment addresses recomputed per call, not held across the tile loop
  const int g = lane >> 2, t = lane & 3;
  const float* pa = A + ((warp % MT) * 16 + g) * am + t * ak;
  const float* pb = Bm + g * bn + t * bk;
#pragma unroll 1
  for (int k0 = 0; k0 < K; k0 += 8) {
    uint32_t ah[4], al[4];
    split_tf32_fast<false>(bw_ld<RELU_A>(pa[k0 * ak]), ah[0], al[0]);
    split_tf32_fast<false>(bw_ld<RELU_A>(pa[k0 * ak + 8 * am]), ah[1], al[1]);
    split_tf32_fast<false>(bw_ld<RELU_A>(pa[(k0 + 4) * ak]), ah[2], al[2]);
    split_tf32_fast<false>(bw_ld<RELU_A>(pa[(k0 + 4) * ak + 8 * am]), ah[3], al[3]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int s = warp + bwd::kWarps * r;
      if (s < nstrips) {
        const float* b = pb + (s / MT) * 16 * bn + k0 * bk;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          uint32_t bh0, bl0, bh1, bl1;
          split_tf32_fast<false>(bw_ld<RELU_B>(b[8 * n * bn]), bh0, bl0);
          split_tf32_fast<false>(bw_ld<RELU_B>(b[4 * bk + 8 * n * bn]), bh1, bl1);
          mma_tf32(acc[r][n], al, bh0, bh1);
          mma_tf32(acc[r][n], ah, bl0, bl1);
          mma_tf32(acc[r][n], ah, bh0, bh1);
        }
      }
    }
  }
}

// total += part, element by element.
template <int R>
__device__ __forceinline__ void bw_add(float (&total)[R][2][4], const float (&part)[R][2][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) total[r][n][e] += part[r][n][e];
}

// f(row, column, value) for every accumulator element of bw_gemm's strips.
template <int R, typename F>
__device__ __forceinline__ void bw_each(const float (&acc)[R][2][4], int MT, int nstrips, int warp, int lane, F&& f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int s = warp + bwd::kWarps * r;
    if (s < nstrips) {
      const int m = (s % MT) * 16 + g, n0 = (s / MT) * 16 + 2 * t;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(m + (e >> 1) * 8, n0 + 8 * n + (e & 1), acc[r][n][e]);
    }
  }
}

template <int R>
__device__ __forceinline__ void bw_zero(float (&acc)[R][2][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][n][e] = 0.f;
}

// Both sides of tile (b, I, J) into xa / xb (= xa + 64 ldx) as fp32: row p = 8 a + c of side 0 is
// x[b, 8I + a, 8J + c], of side 1 x[b, 8J + c, 8I + a]; zeros outside N. Consecutive 16-byte chunks read one
// global run of 8 positions (C contiguous values each). fp32: cp.async, all in flight at once; fp16 / bf16:
// four loads per thread in flight (all of a tile at pair_dim 128), converted on the way into shared memory.
template <typename T>
__device__ __forceinline__ void bw_load_sides(const T* __restrict__ x, int N, int C, int b, int I, int J, float* xa,
                                              int ldx) {
  constexpr int V = 16 / static_cast<int>(sizeof(T)), U = 4;
  const int cpr = C / V, per_side = 64 * cpr, total = 2 * per_side;
  auto chunk = [&](int e, int& dst) -> const T* {
    const int side = e >= per_side, r = e - side * per_side, q = r / cpr, cc = r - q * cpr;
    const int hi = q >> 3, lo = q & 7;
    const int gi = (side ? J : I) * 8 + hi, gj = (side ? I : J) * 8 + lo;
    dst = side * 64 * ldx + (side ? lo * 8 + hi : hi * 8 + lo) * ldx + cc * V;
    return (gi < N && gj < N) ? x + ((static_cast<long long>(b) * N + gi) * N + gj) * C + cc * V : nullptr;
  };
  if constexpr (std::is_same<T, float>::value) {
#pragma unroll 1
    for (int e = threadIdx.x; e < total; e += bwd::kThreads) {
      int dst;
      const float* src = chunk(e, dst);
      cp_async16(xa + dst, src ? src : x, src != nullptr);
    }
    cp_async_commit();
    cp_async_wait_all();
  } else {
    for (int e0 = threadIdx.x; e0 < total; e0 += U * bwd::kThreads) {
      uint4 v[U];
      int dst[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int e = e0 + k * bwd::kThreads;
        v[k] = make_uint4(0u, 0u, 0u, 0u);
        dst[k] = -1;
        if (e < total) {
          const T* src = chunk(e, dst[k]);
          if (src) v[k] = __ldg(reinterpret_cast<const uint4*>(src));
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (dst[k] >= 0) {
          const float2 p0 = unpack2<T>(v[k].x), p1 = unpack2<T>(v[k].y), p2 = unpack2<T>(v[k].z),
                       p3 = unpack2<T>(v[k].w);
          *reinterpret_cast<float4*>(xa + dst[k]) = make_float4(p0.x, p0.y, p1.x, p1.y);
          *reinterpret_cast<float4*>(xa + dst[k] + 4) = make_float4(p2.x, p2.y, p3.x, p3.y);
        }
    }
  }
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// fp64 to fp32 keeping the sign a ReLU mask reads (a positive value below fp32's range stays positive).
__device__ __forceinline__ float bw_kink_f32(double v) {
  const float f = static_cast<float>(v);
  return (v > 0.0 && !(f > 0.f)) ? 1.17549435e-38f : f;
}

// Position (b, i, j) again in fp64 by one warp, from x and the fp32 parameters (exact copies): h1 and h2
// (pre-activation) into the rows h1r, h2r. s64 / a64: the warp's C + H doubles. Loops kept rolled: the
// kernel has 128 registers per thread.
template <typename T>
__device__ __forceinline__ void bw_refine(const BwArgs<T>& a, int b, int i, int j, const float* gam,
                                          const float* bet, const float* w1s, const float* w2s, const float* b1s,
                                          const float* b2s, int ldx, int ldh, double* s64, float* h1r, float* h2r,
                                          int lane) {
  const int C = a.C, H = a.H, N = a.N;
  const T* ra = a.x + ((static_cast<long long>(b) * N + i) * N + j) * C;
  const T* rb = a.x + ((static_cast<long long>(b) * N + j) * N + i) * C;
  double* a64 = s64 + C;
  double sa = 0.0, sb = 0.0;
#pragma unroll 1
  for (int c = lane; c < C; c += 32) {
    sa += static_cast<double>(to_f32(ra[c]));
    sb += static_cast<double>(to_f32(rb[c]));
  }
  const double ma = warp_sum_d(sa) / C, mb = warp_sum_d(sb) / C;
  double qa = 0.0, qb = 0.0;
#pragma unroll 1
  for (int c = lane; c < C; c += 32) {
    const double da = static_cast<double>(to_f32(ra[c])) - ma, db = static_cast<double>(to_f32(rb[c])) - mb;
    qa += da * da;
    qb += db * db;
  }
  const double rsa = 1.0 / sqrt(warp_sum_d(qa) / C + a.eps), rsb = 1.0 / sqrt(warp_sum_d(qb) / C + a.eps);
#pragma unroll 1
  for (int c = lane; c < C; c += 32) {
    const double gc = gam[c], bc = bet[c];
    const double ya = (static_cast<double>(to_f32(ra[c])) - ma) * rsa * gc + bc;
    const double yb = (static_cast<double>(to_f32(rb[c])) - mb) * rsb * gc + bc;
    s64[c] = 0.5 * (ya + yb);
  }
  __syncwarp();
#pragma unroll 1
  for (int u = lane; u < H; u += 32) {
    double h = b1s[u];
#pragma unroll 4
    for (int c = 0; c < C; ++c) h += static_cast<double>(w1s[u * ldx + c]) * s64[c];
    h1r[u] = bw_kink_f32(h);
    a64[u] = h > 0.0 ? h : 0.0;
  }
  __syncwarp();
#pragma unroll 1
  for (int u = lane; u < H; u += 32) {
    double h = b2s[u];
#pragma unroll 4
    for (int k = 0; k < H; ++k) h += static_cast<double>(w2s[u * ldh + k]) * a64[k];
    h2r[u] = bw_kink_f32(h);
  }
  __syncwarp();
}

template <typename T>
__global__ void __launch_bounds__(bwd::kThreads, 1) contact_map_backward_kernel(const BwArgs<T> a) {
  using namespace bwd;
  extern __shared__ __align__(16) float sm[];
  const int C = a.C, H = a.H, N = a.N;
  const BwSmem L(C, H);
  const int ldx = L.ldx, ldh = L.ldh;
  float *xa = sm + L.xa, *xb = sm + L.xb, *ss = sm + L.s, *w1s = sm + L.w1, *w2s = sm + L.w2;
  float *h1s = sm + L.h1, *h2s = sm + L.h2;
  float *gam = sm + L.vec, *bet = gam + C, *b1s = bet + C, *b2s = b1s + H, *w3s = b2s + H, *w1n = w3s + H,
        *w2n = w1n + H, *rsa = w2n + H, *rsb = rsa + 64, *snorm = rsb + 64, *gsym = snorm + 64;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float *cacc = sm + L.vacc, *wacc = cacc + 2 * C + H + warp * (2 * H + 1);  // see BwSmem
  double* s64 = reinterpret_cast<double*>(sm + L.f64) + warp * (C + H);

  for (int e = tid; e < H * C; e += kThreads) w1s[(e / C) * ldx + e % C] = a.w1[e];
  for (int e = tid; e < H * H; e += kThreads) w2s[(e / H) * ldh + e % H] = a.w2[e];
  for (int c = tid; c < C; c += kThreads) {
    gam[c] = a.gamma[c];
    bet[c] = a.beta[c];
  }
  for (int u = tid; u < H; u += kThreads) {
    b1s[u] = a.b1[u];
    b2s[u] = a.b2[u];
    w3s[u] = a.w3[u];
  }
  for (int e = tid; e < 2 * C + H + kWarps * (2 * H + 1); e += kThreads) cacc[e] = 0.f;
  __syncthreads();
  for (int u = warp; u < H; u += kWarps) {
    float q1 = 0.f, q2 = 0.f;
    for (int c = lane; c < C; c += 32) q1 += w1s[u * ldx + c] * w1s[u * ldx + c];
    for (int k = lane; k < H; k += 32) q2 += w2s[u * ldh + k] * w2s[u * ldh + k];
    q1 = warp_sum(q1);
    q2 = warp_sum(q2);
    if (lane == 0) {
      w1n[u] = sqrtf(q1);
      w2n[u] = sqrtf(q2);
    }
  }
  const float b3 = a.b3[0], inv_c = 1.f / static_cast<float>(C), eps = static_cast<float>(a.eps);
  const int MH = H / 16;  // m tiles of the weight-gradient products

  float dw1[2][2][4], dw2[1][2][4];  // dW1 (MH x C / 16 strips), dW2 (MH x H / 16 strips)
  bw_zero(dw1);
  bw_zero(dw2);

  const int nT = cdiv(N, TILE);
  const long long tiles_per_b = static_cast<long long>(nT) * (nT + 1) / 2, tiles = tiles_per_b * a.B;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    const bool diag = I == J;
    bw_load_sides<T>(a.x, N, C, b, I, J, xa, ldx);
    if (tid < 64) {
      const int i = I * 8 + (tid >> 3), j = J * 8 + (tid & 7);
      gsym[tid] = (i < N && j < N) ? 0.5f * (a.g[(static_cast<long long>(b) * N + i) * N + j] +
                                             a.g[(static_cast<long long>(b) * N + j) * N + i])
                                   : 0.f;
    }
    __syncthreads();

    // statistics of both sides, xhat in place, s and |s|; warp w: positions kRows w .. kRows (w + 1) - 1
    for (int k = 0; k < kRows; ++k) {
      const int p = warp * kRows + k;
      float* ra = xa + p * ldx;
      float* rb = xb + p * ldx;
      float va[4], vb[4], sa = 0.f, sb = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int c = lane + 32 * q;
        va[q] = c < C ? ra[c] : 0.f;
        vb[q] = c < C ? rb[c] : 0.f;
        sa += va[q];
        sb += vb[q];
      }
      const float m0a = warp_sum(sa) * inv_c, m0b = warp_sum(sb) * inv_c;
      float d1a = 0.f, d2a = 0.f, d1b = 0.f, d2b = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (lane + 32 * q < C) {
          const float da = va[q] - m0a, db = vb[q] - m0b;
          d1a += da;
          d2a += da * da;
          d1b += db;
          d2b += db * db;
        }
      float ma, rs_a, mb, rs_b;
      ln_stats(m0a, warp_sum(d1a), warp_sum(d2a), inv_c, eps, ma, rs_a);
      ln_stats(m0b, warp_sum(d1b), warp_sum(d2b), inv_c, eps, mb, rs_b);
      float sq = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int c = lane + 32 * q;
        if (c < C) {
          const float xha = (va[q] - ma) * rs_a, xhb = (vb[q] - mb) * rs_b;
          ra[c] = xha;
          rb[c] = xhb;
          const float s = 0.5f * ((xha * gam[c] + bet[c]) + (xhb * gam[c] + bet[c]));
          ss[p * ldx + c] = s;
          sq += s * s;
        }
      }
      sq = warp_sum(sq);
      if (lane == 0) {
        rsa[p] = rs_a;
        rsb[p] = rs_b;
        snorm[p] = sqrtf(sq);
      }
    }
    __syncthreads();

    {  // h1 = s W1^T + b1                                                          (64 x H)
      float acc[1][2][4];
      bw_zero(acc);
      bw_gemm<1, false, false>(acc, ss, ldx, 1, w1s, 1, ldx, 4, H / 4, C, warp, lane);
      bw_each(acc, 4, H / 4, warp, lane, [&](int p, int u, float v) { h1s[p * ldh + u] = v + b1s[u]; });
    }
    __syncthreads();
    {  // h2 = relu(h1) W2^T + b2                                                   (64 x H)
      float acc[1][2][4];
      bw_zero(acc);
      bw_gemm<1, true, false>(acc, h1s, ldh, 1, w2s, 1, ldh, 4, H / 4, H, warp, lane);
      bw_each(acc, 4, H / 4, warp, lane, [&](int p, int u, float v) { h2s[p * ldh + u] = v + b2s[u]; });
    }
    __syncthreads();

    // per position (warp w: kRows w .. kRows (w + 1) - 1, all kRows at once: their reductions interleaved):
    // the kink test, then the fp64 recomputation of the positions near a kink, then out, dz and dh2 (into h2s)
    const float wgt = diag ? 1.f : 2.f;
    unsigned near_rows = 0u;  // bit k: position kRows w + k has a unit near a kink
    {
      float q[kRows];
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const float* h1r = h1s + (warp * kRows + k) * ldh;
        q[k] = 0.f;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int u = lane + 32 * m;
          if (u < H) q[k] += fmaxf(h1r[u], 0.f) * fmaxf(h1r[u], 0.f);
        }
      }
      warp_sum_n(q);
      unsigned mine = 0u;
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const int p = warp * kRows + k, i = I * 8 + (p >> 3), j = J * 8 + (p & 7);
        const float* h1r = h1s + p * ldh;
        const float* h2r = h2s + p * ldh;
        const float anorm = sqrtf(q[k]), sn = snorm[p];
        bool near = false;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int u = lane + 32 * m;
          if (u < H)
            near |= fabsf(h1r[u]) < kKink * (sn * w1n[u] + fabsf(b1s[u])) ||
                    fabsf(h2r[u]) < kKink * (anorm * w2n[u] + fabsf(b2s[u]));
        }
        if (near && i < N && j < N) mine |= 1u << k;
      }
      near_rows = __reduce_or_sync(0xffffffffu, mine);
    }
    for (; near_rows; near_rows &= near_rows - 1) {
      const int k = __ffs(near_rows) - 1, p = warp * kRows + k;
      bw_refine(a, b, I * 8 + (p >> 3), J * 8 + (p & 7), gam, bet, w1s, w2s, b1s, b2s, ldx, ldh, s64, h1s + p * ldh,
                h2s + p * ldh, lane);
    }
    {
      float dz[kRows];  // o, then dz
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const float* h2r = h2s + (warp * kRows + k) * ldh;
        dz[k] = 0.f;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int u = lane + 32 * m;
          if (u < H) dz[k] += fmaxf(h2r[u], 0.f) * w3s[u];
        }
      }
      warp_sum_n(dz);
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const int p = warp * kRows + k, i = I * 8 + (p >> 3), j = J * 8 + (p & 7);
        const float out = 1.f / (1.f + __expf(-(dz[k] + b3)));
        dz[k] = (i < N && j < N) ? wgt * gsym[p] * out * (1.f - out) : 0.f;
      }
      // dw3 += dz relu(h2), db2 += dh2 over the warp's positions, then one shared-memory update per unit
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int u = lane + 32 * m;
        if (u < H) {
          const float w3u = w3s[u];
          float s3 = 0.f, s2 = 0.f;
#pragma unroll
          for (int k = 0; k < kRows; ++k) {
            float* h2r = h2s + (warp * kRows + k) * ldh;
            const float h2 = h2r[u], d = h2 > 0.f ? dz[k] * w3u : 0.f;
            s3 += dz[k] * fmaxf(h2, 0.f);
            s2 += d;
            h2r[u] = d;
          }
          float* wv = sm + BwSmem(C, H).vacc + 2 * C + H + warp * (2 * H + 1);  // wacc (recomputed: registers)
          wv[u] += s3;
          wv[H + u] += s2;
        }
      }
      if (lane == 0) {
        float t = 0.f;
#pragma unroll
        for (int k = 0; k < kRows; ++k) t += dz[k];
        wacc[2 * H] += t;
      }
    }
    __syncthreads();

    {  // dW2 += dh2^T relu(h1) (K = 64 positions); dh1 = (dh2 W2) [h1 > 0] into h2s
      float acc[1][2][4];
      bw_zero(acc);
      bw_gemm<1, false, true>(acc, h2s, 1, ldh, h1s, ldh, 1, MH, MH * (H / 16), 64, warp, lane);
      bw_add(dw2, acc);
      bw_zero(acc);
      bw_gemm<1, false, false>(acc, h2s, ldh, 1, w2s, ldh, 1, 4, H / 4, H, warp, lane);
      __syncthreads();
      bw_each(acc, 4, H / 4, warp, lane,
              [&](int p, int u, float v) { h2s[p * ldh + u] = h1s[p * ldh + u] > 0.f ? v : 0.f; });
    }
    __syncthreads();
    {  // dW1 += dh1^T s, db1; ds = dh1 W1, dy = ds / w into ss
      float acc[2][2][4];
      bw_zero(acc);
      bw_gemm<2, false, false>(acc, h2s, 1, ldh, ss, ldx, 1, MH, MH * (C / 16), 64, warp, lane);
      bw_add(dw1, acc);
      if (tid < H) {
        float d = 0.f;
        for (int p = 0; p < 64; ++p) d += h2s[p * ldh + tid];
        cacc[2 * C + tid] += d;
      }
      bw_zero(acc);
      bw_gemm<2, false, false>(acc, h2s, ldh, 1, w1s, ldx, 1, 4, C / 4, H, warp, lane);
      __syncthreads();
      const float inv_w = diag ? 1.f : 0.5f;
      bw_each(acc, 4, C / 4, warp, lane, [&](int p, int c, float v) { ss[p * ldx + c] = v * inv_w; });
    }
    __syncthreads();

    // dgamma += sum_p dy (xhat_a + xhat_b), dbeta += 2 sum_p dy (one side on the diagonal): thread c
    if (tid < C) {
      float sg = 0.f, sb = 0.f;
      for (int p = 0; p < 64; ++p) {
        const float d = ss[p * ldx + tid];
        sg += d * (diag ? xa[p * ldx + tid] : xa[p * ldx + tid] + xb[p * ldx + tid]);
        sb += d;
      }
      cacc[tid] += sg;
      cacc[C + tid] += diag ? sb : 2.f * sb;
    }
    // LayerNorm backward of each side's row: dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)),
    // dxhat = gamma dy; side 1 only off the diagonal (on it, (j, i) is a position of the tile itself)
    for (int k = 0; k < kRows; ++k) {
      const int p = warp * kRows + k, i = I * 8 + (p >> 3), j = J * 8 + (p & 7);
      if (i >= N || j >= N) continue;
      float dy[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) dy[q] = lane + 32 * q < C ? ss[p * ldx + lane + 32 * q] : 0.f;
      // mean(dxhat) is the same for both sides: one interleaved reduction of it and of both sides' dxhat . xhat
      float r[3] = {0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int c = lane + 32 * q;
        if (c < C) {
          const float d = gam[c] * dy[q];
          r[0] += d;
          r[1] += d * xa[p * ldx + c];
          r[2] += d * xb[p * ldx + c];
        }
      }
      warp_sum_n(r);
      for (int side = 0; side < (diag ? 1 : 2); ++side) {
        const float* xh = (side ? xb : xa) + p * ldx;
        const float m1 = r[0] * inv_c, m2 = (side ? r[2] : r[1]) * inv_c, rs = side ? rsb[p] : rsa[p];
        T* dst = a.dx + ((static_cast<long long>(b) * N + (side ? j : i)) * N + (side ? i : j)) * C;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int c = lane + 32 * q;
          if (c < C) dst[c] = from_f32<T>(rs * (gam[c] * dy[q] - m1 - xh[c] * m2));
        }
      }
    }
    __syncthreads();
  }

  // the block's partial (see bw_partial_len); per-warp sums through shared memory, in warp order
  float* part = a.part + static_cast<long long>(blockIdx.x) * bw_partial_len(C, H);
  bw_each(dw1, MH, MH * (C / 16), warp, lane, [&](int u, int c, float v) { part[u * C + c] = v; });
  bw_each(dw2, MH, MH * (H / 16), warp, lane, [&](int u, int k, float v) { part[H * C + u * H + k] = v; });
  float* vec_part = part + H * C + H * H;  // dgamma, dbeta, dw3, db2, db3, db1
  for (int e = tid; e < 2 * C; e += kThreads) vec_part[e] = cacc[e];
  if (tid < H) vec_part[2 * C + 2 * H + 1 + tid] = cacc[2 * C + tid];
  const int nv = 2 * H + 1;
  for (int e = tid; e < nv; e += kThreads) {  // the warps' dw3, db2, db3 in warp order
    float v = 0.f;
    for (int w = 0; w < kWarps; ++w) v += cacc[2 * C + H + w * nv + e];
    vec_part[2 * C + e] = v;
  }
}

bool backward_fits(int64_t C, int64_t H, const DeviceFacts& dev) {
  return C % 16 == 0 && H % 16 == 0 && C >= 16 && H >= 16 && C <= bwd::kMaxC && H <= bwd::kMaxH &&
         dev.major >= 8 &&
         sizeof(float) * BwSmem(static_cast<int>(C), static_cast<int>(H)).total <= static_cast<size_t>(dev.max_smem);
}

// Whether backward() runs for pair_dim C, hidden_dim H on `device`.
bool backward_supported(int64_t C, int64_t H, int64_t device) {
  return backward_fits(C, H, device_facts(static_cast<int>(device)));
}

// The parameter gradients from the blocks' partials: segment k of the partial (bw_partial_len's order) is
// gradient k, of dtype kind[k] (0 float32, 1 float16, 2 bfloat16, 3 float64).
struct BwGrads {
  void* ptr[8];
  int begin[9];  // segment k: partial elements [begin[k], begin[k + 1])
  int kind[8];
};

// grads = sum over the blocks of part (blocks x P, fp32) in fp64, rounded once to each gradient's dtype. A
// block takes 32 consecutive elements; warp w sums the partials of blocks w, w + 8, ... in order (coalesced
// 128-byte rows), then warp 0 adds the 8 warps' sums in warp order: the result does not depend on the launch.
__global__ void __launch_bounds__(256) bw_sum_partials_kernel(const float* __restrict__ part, int blocks, int P,
                                                              BwGrads g) {
  __shared__ double red[8][32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, e = blockIdx.x * 32 + lane;
  double v = 0.0;
  if (e < P)
    for (int b = w; b < blocks; b += 8) v += part[static_cast<long long>(b) * P + e];
  red[w][lane] = v;
  __syncthreads();
  if (w != 0 || e >= P) return;
  double t = 0.0;
#pragma unroll
  for (int k = 0; k < 8; ++k) t += red[k][lane];
  int k = 0;
  while (e >= g.begin[k + 1]) ++k;
  const int o = e - g.begin[k];
  switch (g.kind[k]) {
    case 0: static_cast<float*>(g.ptr[k])[o] = static_cast<float>(t); break;
    case 1: static_cast<__half*>(g.ptr[k])[o] = __double2half(t); break;
    case 2: static_cast<__nv_bfloat16*>(g.ptr[k])[o] = __double2bfloat16(t); break;
    default: static_cast<double*>(g.ptr[k])[o] = t; break;
  }
}

template <typename T>
void launch_backward(const BwArgs<T>& a, int grid, size_t smem, int device, cudaStream_t stream) {
  ensure_max_dynamic_smem(reinterpret_cast<const void*>(&contact_map_backward_kernel<T>), device,
                          static_cast<int>(smem));
  contact_map_backward_kernel<T><<<grid, bwd::kThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The fused backward: (d_pair in pair's dtype, d_ln_w, d_ln_b, d_w1, d_b1, d_w2, d_b2, d_w3, d_b3), each
// parameter's gradient in its shape and dtype (float32, float16, bfloat16 or float64). pair (B, N, N, C) fp32 /
// fp16 / bf16, 16-byte aligned; parameters and grad_out (B, N, N) any of those dtypes (used in fp32). Two
// launches: contact_map_backward_kernel (d_pair, one fp32 partial per block), bw_sum_partials_kernel. Raises
// where backward_supported is false.
std::vector<torch::Tensor> backward(torch::Tensor pair, torch::Tensor ln_w, torch::Tensor ln_b, double eps,
                                    torch::Tensor w1, torch::Tensor b1, torch::Tensor w2, torch::Tensor b2,
                                    torch::Tensor w3, torch::Tensor b3, torch::Tensor grad_out) {
  const auto dtype = pair.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kHalf || dtype == torch::kBFloat16,
              "contact_map backward: pair_repr must be float32, float16 or bfloat16, got ", c10::toString(dtype));
  TORCH_CHECK(pair.is_cuda() && pair.dim() == 4 && pair.size(1) == pair.size(2),
              "contact_map backward: pair_repr must be a CUDA tensor (B, N, N, pair_dim), got shape ",
              shape_str(pair.sizes()));
  const int64_t B = pair.size(0), N = pair.size(1), C = pair.size(3), H = b1.numel();
  TORCH_CHECK(grad_out.sizes() == c10::IntArrayRef({B, N, N}), "contact_map backward: grad_out has shape ",
              shape_str(grad_out.sizes()), ", expected ", shape_str({B, N, N}));
  TORCH_CHECK(ln_w.numel() == C && ln_b.numel() == C && w1.numel() == H * C && w2.numel() == H * H &&
              b2.numel() == H && w3.numel() == H && b3.numel() == 1,
              "contact_map backward: parameter shapes do not match pair_dim ", num(C), " and hidden_dim ", num(H));
  TORCH_CHECK(N < 46341 && B < (1LL << 31), "contact_map backward: B or N too large, got shape ",
              shape_str(pair.sizes()));
  const c10::cuda::CUDAGuard guard(pair.device());
  const int device = pair.get_device();
  const DeviceFacts dev = device_facts(device);
  TORCH_CHECK(backward_fits(C, H, dev), "contact_map backward: pair_dim ", num(C), " / hidden_dim ", num(H),
              " not supported here (multiples of 16 up to ", num(bwd::kMaxC), " / ", num(bwd::kMaxH),
              ", compute capability 8.0+)");
  const auto x = pair.contiguous();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "contact_map backward: pair_repr's data must be 16-byte aligned");
  auto f = [&](const torch::Tensor& t) {
    return t.to(t.options().dtype(torch::kFloat32).device(pair.device())).contiguous();
  };
  const auto g = f(grad_out), lw = f(ln_w), lb = f(ln_b), w1c = f(w1), b1c = f(b1), w2c = f(w2), b2c = f(b2),
             w3c = f(w3), b3c = f(b3);
  auto dx = torch::empty_like(x, at::MemoryFormat::Contiguous);
  // the gradients in bw_partial_len's order, each like its parameter
  const torch::Tensor* like[8] = {&w1, &w2, &ln_w, &ln_b, &w3, &b2, &b3, &b1};
  std::vector<torch::Tensor> d(8);
  BwGrads gs{};
  for (int k = 0; k < 8; ++k) {
    const auto dt = like[k]->scalar_type();
    TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kHalf || dt == torch::kBFloat16 || dt == torch::kFloat64,
                "contact_map backward: parameters must be float32, float16, bfloat16 or float64, got ",
                c10::toString(dt));
    d[k] = torch::empty(like[k]->sizes(), x.options().dtype(dt));
    gs.ptr[k] = d[k].data_ptr();
    gs.kind[k] = dt == torch::kFloat32 ? 0 : dt == torch::kHalf ? 1 : dt == torch::kBFloat16 ? 2 : 3;
    gs.begin[k + 1] = gs.begin[k] + static_cast<int>(d[k].numel());
  }
  const int P = bw_partial_len(static_cast<int>(C), static_cast<int>(H));
  TORCH_CHECK(gs.begin[8] == P, "contact_map backward: parameter sizes do not add up to the partial's length");
  const int64_t nT = (N + TILE - 1) / TILE, tiles = B * nT * (nT + 1) / 2;
  const auto result = [&]() -> std::vector<torch::Tensor> {  // the order of contact_map_backward's returns
    return {dx, d[2], d[3], d[0], d[7], d[1], d[5], d[4], d[6]};
  };
  if (tiles == 0) {
    for (auto& t : d) t.zero_();
    return result();
  }
  const int grid = static_cast<int>(std::min<int64_t>(tiles, dev.num_sms));
  auto part = torch::empty({grid, P}, x.options().dtype(torch::kFloat32));
  const size_t smem = sizeof(float) * BwSmem(static_cast<int>(C), static_cast<int>(H)).total;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    BwArgs<T> a{reinterpret_cast<const T*>(x.data_ptr()), g.data_ptr<float>(), lw.data_ptr<float>(),
                lb.data_ptr<float>(), w1c.data_ptr<float>(), b1c.data_ptr<float>(), w2c.data_ptr<float>(),
                b2c.data_ptr<float>(), w3c.data_ptr<float>(), b3c.data_ptr<float>(),
                reinterpret_cast<T*>(dx.data_ptr()), part.data_ptr<float>(), eps, static_cast<int>(B),
                static_cast<int>(N), static_cast<int>(C), static_cast<int>(H)};
    launch_backward<T>(a, grid, smem, device, stream);
  };
  if (dtype == torch::kFloat32) run(float{});
  else if (dtype == torch::kHalf) run(__half{});
  else run(__nv_bfloat16{});
  bw_sum_partials_kernel<<<(P + 31) / 32, 256, 0, stream>>>(part.data_ptr<float>(), grid, P, gs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return result();
}

// =============================================================================================
// Bound function
// =============================================================================================
// Returns (out, the Kernel that ran; -1 for an empty input, where none runs).
std::tuple<torch::Tensor, int64_t> forward(torch::Tensor pair, torch::Tensor ln_w, torch::Tensor ln_b, double eps,
                                           torch::Tensor w1, torch::Tensor b1, torch::Tensor w2, torch::Tensor b2,
                                           torch::Tensor w3, torch::Tensor b3, int64_t variant) {
  const auto dtype = pair.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kHalf || dtype == torch::kBFloat16,
              "contact_map: pair_repr must be float32, float16 or bfloat16, got ", c10::toString(dtype));
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
  TORCH_CHECK(variant >= 0 && variant < static_cast<int64_t>(Variant::kCount), "contact_map: unknown kernel variant ",
              num(variant));
  TORCH_CHECK(pair.size(1) < (1LL << 30) && pair.size(0) < (1LL << 31),
              "contact_map: B or N too large, got shape ", shape_str(pair.sizes()));
  const Variant v = static_cast<Variant>(variant);

  const int64_t B = pair.size(0), N = pair.size(1);
  auto out = torch::empty({B, N, N}, pair.options());
  if (B == 0 || N == 0) return {out, -1};

  const c10::cuda::CUDAGuard guard(pair.device());
  if (dtype != torch::kFloat32) {
    // fp16 / bf16: the wgmma kernel's 16-bit build where it runs ("auto"); otherwise the fp32 kernels on
    // converted copies, the output converted back
    const int device = pair.get_device();
    const DeviceFacts dev = device_facts(device);
    const auto x = pair.contiguous();
    if (v == Variant::kAuto && wgmma_supported(static_cast<int>(C), static_cast<int>(H), static_cast<int>(N),
                                               x.data_ptr(), 2, dev)) {
      const std::vector<torch::Tensor> c{ln_w.contiguous(), ln_b.contiguous(), w1.contiguous(), b1.contiguous(),
                                         w2.contiguous(),   b2.contiguous(),   w3.contiguous(), b3.contiguous()};
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
      if (dtype == torch::kHalf) run_wgmma<__half>(x, c, eps, out, device, dev, stream);
      else run_wgmma<__nv_bfloat16>(x, c, eps, out, device, dev, stream);
      return {out, static_cast<int64_t>(Kernel::kWgmma16)};
    }
    auto f = [](const torch::Tensor& t) { return t.to(torch::kFloat32); };
    const auto r = forward(f(x), f(ln_w), f(ln_b), eps, f(w1), f(b1), f(w2), f(b2), f(w3), f(b3), variant);
    return {std::get<0>(r).to(dtype), std::get<1>(r)};
  }
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
  const bool fma = v == Variant::kFma;
  a.CP = round_up(a.C, fma ? 4 : 8);  // the tensor-core k step is 8
  a.vec = (C % 4 == 0) && (reinterpret_cast<uintptr_t>(a.x) % 16 == 0);

  int HP = 16;
  while (HP < H) HP *= 2;
  const int device = pair.get_device();
  a.device = device;
  const DeviceFacts dev = device_facts(device);
  const int max_smem = dev.max_smem, num_sms = dev.num_sms;
  const size_t smem_w = sizeof(float) * Smem(a.CP, HP, true).total;
  const size_t smem_g = sizeof(float) * (fma ? Smem(a.CP, HP, false).total
                                             : SmemTC(a.CP, HP, WFormat::kGlobal).total);
  TORCH_CHECK(smem_g <= static_cast<size_t>(max_smem), "contact_map: pair_dim=", num(C),
              " needs ", num(smem_g), " bytes of shared memory per block; this device allows ",
              num(max_smem));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  Kernel ran;
  if (v == Variant::kAuto && wgmma_supported(a.C, a.H, a.N, a.x, 4, dev)) {
    run_wgmma<float>(x, {lnw, lnb, w1c, b1c, w2c, b2c, w3c, b3c}, eps, out, device, dev, stream);
    ran = Kernel::kWgmma;
  } else if (!fma) {  // kMma, and kAuto outside the wgmma kernel's shapes
    if (sizeof(float) * SmemTC(a.CP, HP, WFormat::kSplit).total <= static_cast<size_t>(max_smem))
      dispatch_mma_hidden<WFormat::kSplit>(a, HP, stream, num_sms);
    else
      dispatch_mma_hidden<WFormat::kGlobal>(a, HP, stream, num_sms);
    ran = Kernel::kMma;
  } else {
    dispatch_fma(a, HP, smem_w <= static_cast<size_t>(max_smem), stream, num_sms);
    ran = Kernel::kFma;
  }
  return {out, static_cast<int64_t>(ran)};
}

}  // namespace contact_map

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &contact_map::forward,
        "contact-map head forward (CUDA; fp32, fp16 or bf16): (out, the kernel that ran)");
  m.def("backward", &contact_map::backward,
        "contact-map head fused backward (CUDA): [d_pair, d_ln_w, d_ln_b, d_w1, d_b1, d_w2, d_b2, d_w3, d_b3]");
  m.def("backward_supported", &contact_map::backward_supported,
        "whether backward runs for (pair_dim, hidden_dim, device index)");
}
"""


def _wgmma_rs(n, ab="tf32"):
    """Body of wgmma_rs<n> (ab "tf32": m64{n}k8) or wgmma_rs16<T, n> (ab "f16" / "bf16": m64{n}k16, B not
    transposed): the inline PTX of wgmma with A from the registers a[0..3], B by descriptor `db`, its n/2
    accumulator operands spelled out."""
    shape, tail = ("k8", "p, 1, 1") if ab == "tf32" else ("k16", "p, 1, 1, 0")
    nacc = n // 2
    regs = ", ".join(f"%{i}" for i in range(nacc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    a_ops = "{" + ", ".join(f"%{nacc + i}" for i in range(4)) + "}"
    ins = "".join(f'"r"(a[{i}]), ' for i in range(4)) + '"l"(db), "r"(acc)'
    return (f'    asm volatile("{{\\n .reg .pred p;\\n setp.ne.b32 p, %{nacc + 5}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{n}{shape}.f32.{ab}.{ab} {{{regs}}}, {a_ops}, %{nacc + 4}, {tail};\\n}}\\n"\n'
            f"                 : {outs}\n"
            f"                 : {ins});")


def _enum_body(names):
    """The enumerators of a CUDA enum class from Python names ("auto" -> kAuto = 0, ...), then kCount."""
    return ", ".join(f"k{n.capitalize()} = {i}" for i, n in enumerate(names)) + f", kCount = {len(names)}"


assert list(_VARIANT_IDS.values()) == list(range(len(_VARIANT_IDS)))
for _n in (64, 32):
    CUDA_SRC = CUDA_SRC.replace(f"@WGMMA_RS_{_n}@", _wgmma_rs(_n))
    for _ab in ("f16", "bf16"):
        CUDA_SRC = CUDA_SRC.replace(f"@WGMMA_RS_{_ab.upper()}_{_n}@", _wgmma_rs(_n, _ab))
CUDA_SRC = (CUDA_SRC
            .replace("@VARIANT_ENUM@", _enum_body(_VARIANT_IDS)).replace("@KERNEL_ENUM@", _enum_body(_KERNELS)))

def _gencode_flags():
    """nvcc -gencode flags: the architectures PyTorch would build for (TORCH_CUDA_ARCH_LIST as PyTorch
    reads it or, none set or "native", the visible GPUs' compute capabilities capped at the newest
    this PyTorch supports, the last with PTX), but with sm_90a code for 9.0: the wgmma kernel's wgmma
    and setmaxnreg exist only there, and sm_90a code runs on compute capability 9.0 devices as sm_90 code
    does. With no GPU to detect and no list (a CI machine, a laptop; PyTorch alone would fail there):
    9.0. Flags naming an arch replace PyTorch's own; TORCH_CUDA_ARCH_LIST itself is not changed.
    Returns [] for lists it cannot parse (names such as "Hopper"): PyTorch then builds as usual,
    without sm_90a ("auto" then runs the mma kernel). The same function as outer_product_mean.py's: each kernel
    file stands alone (one file to drop in), so it is not shared."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if env and env != "native":
        archs = [a for a in env.replace(" ", ";").split(";") if a]
    elif not torch.cuda.is_available():
        archs = ["9.0"]
    else:
        sms = [int("".join(re.findall(r"\d+", a.split("_")[1]))) for a in torch.cuda.get_arch_list() if "sm_" in a]
        newest = max((sm // 10, sm % 10) for sm in sms)
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        archs = sorted({"%d.%d" % min(newest, cap) for cap in caps})
        if any(cap > newest for cap in caps):  # a GPU newer than this PyTorch's list: PTX for it
            archs[-1] += "+PTX"
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


def _verbose():
    return os.environ.get("CONTACT_MAP_VERBOSE", "") not in ("", "0")


def _nvcc_flags():
    """nvcc's flags: -O3, line info, _gencode_flags(), -DCM_SM90A with sm_90a code, -Xptxas -v with
    CONTACT_MAP_VERBOSE set."""
    gencode = _gencode_flags()
    return (["-O3", "-lineinfo"] + gencode + (["-DCM_SM90A"] if any("code=sm_90a" in f for f in gencode) else [])
            + (["-Xptxas", "-v"] if _verbose() else []))


def _build_environment():
    """What besides the source and the flags shapes the build: the build root (TORCH_EXTENSIONS_DIR as PyTorch
    reads it; unset, its default root), the CUDA toolkit PyTorch found (its include and library paths) and
    PyTorch itself (its version and headers). All of it goes into the extension's name, so that each
    environment keeps its own build: under one name PyTorch's loader renames the extension (name_v1, ...) when
    a process loads it from a second build directory, and ninja rebuilds one toolkit's build over another's in
    silence (a failed link there deletes it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return "\n".join(["default" if root is None else os.path.abspath(root), str(torch.utils.cpp_extension.CUDA_HOME),
                      torch.__version__, os.path.dirname(torch.__file__)])


def _extension_name():
    """contact_map_ and a hash of the CUDA source, _nvcc_flags() and _build_environment()."""
    key = CUDA_SRC + " ".join(_nvcc_flags()) + "\n" + _build_environment()
    return "contact_map_" + hashlib.sha1(key.encode()).hexdigest()[:12]


def _build():
    """Compile CUDA_SRC with load_inline (cached by PyTorch under _extension_name())."""
    name = _extension_name()
    # built already? (PyTorch's private build-directory function; a rebuild in one process adds _v1, ... to the name)
    build_directory = getattr(torch.utils.cpp_extension, "_get_build_directory", None)
    d = build_directory(name, False) if build_directory is not None else ""
    cached = os.path.isdir(d) and any(f.startswith(name) and f.endswith(".so") for f in os.listdir(d))
    if not cached:
        print("building contact_map CUDA extension, about 3 minutes the first time on a 2-core machine ...",
              file=sys.stderr, flush=True)
    return load_inline(name=name, cpp_sources="", cuda_sources=CUDA_SRC, extra_cuda_cflags=_nvcc_flags(),
                       verbose=_verbose())


_ext = _build()


# =============================================================================================
# Backward: the fused CUDA kernel's wrapper, and PyTorch ops elsewhere (chunked recomputation, nothing saved
# but the inputs). _rows_per_chunk is outer_product_mean.py's too: each kernel file stands alone.
# =============================================================================================
def _rows_per_chunk(row_bytes, n, chunk_bytes):
    """Rows of a chunk: as many as fit in chunk_bytes at row_bytes each, at least 1, at most n."""
    return max(1, min(n, int(chunk_bytes) // max(1, int(row_bytes))))


def _layer_norm(x, w, b, eps):
    """PyTorch's own LayerNorm of x (..., C) as the reference's forward runs it: (y, mean, rstd)."""
    return torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, eps)


def contact_map_rows(B, N, C, H, itemsize, chunk_bytes):
    """(rows i per MLP chunk, rows i per LayerNorm chunk) for contact_map_backward.

    An MLP chunk of r rows holds, per row i, B*N positions of: y rows and y columns, s, ds (4 C values)
    and h1, r1, h2, r2, dh2, dr1 / dh1 (about 6 H values) plus the scalars, and the float64 copies of s
    and dh1 for dW1 (C + H values of 8 bytes); a LayerNorm chunk holds about 5 C values per position (dy,
    xhat, dxhat, dx, the temporary).
    """
    mlp = _rows_per_chunk(B * N * ((4 * C + 6 * H + 4) * itemsize + 8 * (C + H)), N, chunk_bytes)
    ln = _rows_per_chunk(B * N * 5 * C * itemsize, N, chunk_bytes)
    return mlp, ln


def _t_mm64(a, b):
    """a^T b in float64: a parameter's gradient sums over every position (millions at N = 1536); float64
    keeps the digits that float32 sums of that length lose (a margin: the reference's own errors come from
    its ReLU kinks, contact_map_backward)."""
    return a.t().to(torch.float64) @ b.to(torch.float64)


def contact_map_backward(pair, ln_w, ln_b, eps, w1, b1, w2, b2, w3, b3, grad_out, chunk_bytes=256 << 20):
    """Gradients of out = sigmoid(MLP((y + y^T) / 2)), y = LayerNorm(pair), with respect to every input.

    Shapes: pair (B, N, N, C), ln_w / ln_b (C,), w1 (H, C), b1 (H,), w2 (H, H), b2 (H,), w3 (1, H),
    b3 (1,), grad_out g (B, N, N). Forward, per position p = (b, i, j):
        s[b,i,j,c] = (y[b,i,j,c] + y[b,j,i,c]) / 2
        h1 = s W1^T + b1,  h2 = relu(h1) W2^T + b2,  z = relu(h2) w3^T + b3,  out = sigmoid(z)
    Backward:
        dz  = g * out * (1 - out)                                 (B, r, N)
        dh2 = (dz w3) * [h2 > 0],  dh1 = (dh2 W2) * [h1 > 0]       (B, r, N, H)
        dW3 = sum_p dz relu(h2), dW2 = sum_p dh2^T relu(h1), dW1 = sum_p dh1^T s, db* = sum_p d*
        ds  = dh1 W1                                              (B, r, N, C)
        dy[b,i,j] = (ds[b,i,j] + ds[b,j,i]) / 2                   (B, N, N, C)
        then PyTorch's LayerNorm backward (aten.native_layer_norm_backward) per position.
    y, s, h1, h2 and out are recomputed with the reference's own ops (PyTorch's LayerNorm, mm then add),
    so the ReLU masks [h > 0] are the fp32 reference's. A unit within rounding of 0 takes its kink on
    either side in two evaluations, and one such position changes a weight's gradient by a whole term:
    with the forward kernel's more accurate LayerNorm the masks differ from the reference's at other
    positions than fp64's do, and the max gradient error came out 2-30x the reference's in single
    trials (H200, 2026-12-01); on the CPU at crop with a +100 offset: s 20x closer to fp64, two flipped
    masks each, mlp.0.weight 2.8e-2 against 8.3e-3.

    Memory beyond the returned gradients: one chunk (about chunk_bytes, at least one row i:
    B N (4 C + 6 H + 4) ct values and B N (C + H) float64 ones), plus the fp32 dy buffer (B, N, N, C)
    for fp16 / bf16 pair. The parameters' gradients (sums over all positions) accumulate in float64.
    Chunks of r rows i (r from chunk_bytes, at least 1): s[:, rows] needs y[:, rows] and y[:, :, rows],
    both recomputed from pair; ds/2 goes into dy[:, rows] and, transposed, into dy[:, :, rows]. dy is
    one (B, N, N, C) buffer in ct; when ct is pair's dtype it is d_pair itself, and the LayerNorm
    backward (chunks of rows i again) overwrites it in place. Returns (d_pair, d_ln_w, d_ln_b, d_w1,
    d_b1, d_w2, d_b2, d_w3, d_b3), each in its tensor's dtype.
    """
    B, N, _, C = pair.shape
    H = w1.shape[0]
    ct = torch.promote_types(pair.dtype, torch.float32)
    lw, lb = ln_w.to(ct), ln_b.to(ct)
    W1, B1, W2, B2, W3, B3 = (t.to(ct) for t in (w1, b1, w2, b2, w3, b3))
    itemsize = torch.empty((), dtype=ct).element_size()
    rows_mlp, rows_ln = contact_map_rows(B, N, C, H, itemsize, chunk_bytes)

    dy = torch.zeros((B, N, N, C), dtype=ct, device=pair.device)  # d_pair itself when ct == pair.dtype
    f64 = torch.float64
    d_w1 = torch.zeros((H, C), dtype=f64, device=pair.device)
    d_b1 = torch.zeros((H,), dtype=f64, device=pair.device)
    d_w2 = torch.zeros((H, H), dtype=f64, device=pair.device)
    d_b2 = torch.zeros((H,), dtype=f64, device=pair.device)
    d_w3 = torch.zeros((1, H), dtype=f64, device=pair.device)
    d_b3 = torch.zeros((1,), dtype=f64, device=pair.device)

    for r0 in range(0, N, rows_mlp):
        r1 = min(N, r0 + rows_mlp)
        # s[b, i, j] for i in rows: (y[b, i, j] + y[b, j, i]) / 2            (B, r, N, C)
        y_rows = _layer_norm(pair[:, r0:r1].to(ct), lw, lb, eps)[0]          # (B, r, N, C)
        y_cols = _layer_norm(pair[:, :, r0:r1].to(ct), lw, lb, eps)[0].transpose(1, 2)
        s = ((y_rows + y_cols) / 2.0).reshape(-1, C)                         # (M, C), M = B r N
        del y_rows, y_cols
        # MLP forward again                                                    (M, H), (M, 1)
        h1 = s @ W1.t() + B1
        a1 = h1.relu()
        h2 = a1 @ W2.t() + B2
        a2 = h2.relu()
        o = (a2 @ W3.t() + B3).sigmoid()                                     # (M, 1)
        # dz = g * out * (1 - out)                                            (M, 1)
        dz = grad_out[:, r0:r1].to(ct).reshape(-1, 1) * (1 - o) * o
        del o
        d_w3 += _t_mm64(dz, a2)                                              # (1, H)
        d_b3 += dz.sum(0, dtype=f64)
        dh2 = (dz @ W3) * (h2 > 0)                                           # (M, H)
        del dz, a2, h2
        d_w2 += _t_mm64(dh2, a1)                                             # (H, H)
        d_b2 += dh2.sum(0, dtype=f64)
        dh1 = (dh2 @ W2) * (h1 > 0)                                          # (M, H)
        del dh2, a1, h1
        d_w1 += _t_mm64(dh1, s)                                              # (H, C)
        d_b1 += dh1.sum(0, dtype=f64)
        del s
        ds = (dh1 @ W1).reshape(B, r1 - r0, N, C) / 2.0                      # ds / 2 (B, r, N, C)
        del dh1
        # dy[b, i, j] += ds[b, i, j] / 2 and dy[b, j, i] += ds[b, i, j] / 2
        dy[:, r0:r1] += ds
        dy[:, :, r0:r1] += ds.transpose(1, 2)
        del ds

    # LayerNorm backward, chunks of rows i                                      (B, r, N, C)
    d_pair = dy if ct == pair.dtype else torch.empty_like(pair, memory_format=torch.contiguous_format)
    d_ln_w = torch.zeros((C,), dtype=f64, device=pair.device)
    d_ln_b = torch.zeros((C,), dtype=f64, device=pair.device)
    for r0 in range(0, N, rows_ln):
        r1 = min(N, r0 + rows_ln)
        x = pair[:, r0:r1].to(ct).contiguous()
        _, mean, rstd = _layer_norm(x, lw, lb, eps)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy[:, r0:r1].contiguous(), x, [C], mean, rstd, lw, lb,
                                                                [True, True, True])
        d_ln_w += dw.to(f64)
        d_ln_b += db.to(f64)
        del x, mean, rstd
        d_pair[:, r0:r1] = dx  # may overwrite dy's own rows: they are read above
        del dx

    return (d_pair, d_ln_w.to(ln_w.dtype), d_ln_b.to(ln_b.dtype), d_w1.to(w1.dtype), d_b1.to(b1.dtype),
            d_w2.to(w2.dtype), d_b2.to(b2.dtype), d_w3.to(w3.dtype), d_b3.to(b3.dtype))


def contact_map_backward_fused(pair, ln_w, ln_b, eps, w1, b1, w2, b2, w3, b3, grad_out):
    """contact_map_backward's gradients from the fused CUDA kernel (pair read once; see the kernel's
    comment): the same arguments and returns. The kernel writes d_pair (pair's dtype) and one fp32 partial of
    every parameter gradient per block; a second kernel sums the partials in float64 and writes each gradient
    in its parameter's dtype: for a contiguous pair and float32 parameters and grad_out, two launches and no
    other torch op (others are converted to float32 first, a strided pair copied). Only where
    fused_backward_runs() is True (otherwise the extension raises)."""
    return tuple(_ext.backward(pair, ln_w, ln_b, float(eps), w1, b1, w2, b2, w3, b3, grad_out))


_FUSED_FITS = {}  # (pair_dim, hidden_dim, device index) -> bool


def fused_backward_runs(pair, w1):
    """Whether contact_map_backward_fused runs for this input: a CUDA tensor (B, N, N, C) of float32, float16 or
    bfloat16, 16-byte aligned when contiguous, N < 46341, and (C, H) = w1.shape multiples of 16 up to 128 / 64 on
    a device of compute capability 8.0+ with the shared memory for them."""
    if not (pair.is_cuda and pair.dtype in _FLOAT_DTYPES and pair.dim() == 4 and pair.shape[1] < 46341):
        return False
    if pair.is_contiguous() and pair.data_ptr() % 16:
        return False
    key = (int(w1.shape[1]), int(w1.shape[0]), pair.get_device())
    fits = _FUSED_FITS.get(key)
    if fits is None:
        fits = _FUSED_FITS[key] = bool(_ext.backward_supported(*key))
    return fits


# =============================================================================================
# Module
# =============================================================================================
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PARAM_NAMES = ("layer_norm.weight", "layer_norm.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                "mlp.4.weight", "mlp.4.bias")


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _output_dtype(pair, params):
    """The dtype the reference returns for these tensors: under CUDA autocast the autocast dtype, else the
    one dtype of pair_repr and every parameter (float32, float16 or bfloat16; others raise)."""
    if pair.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"contact_map: pair_repr must be float32, float16 or bfloat16, got {_dtype_name(pair.dtype)}")
    if pair.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    for name, p in zip(_PARAM_NAMES, params):
        if p.dtype != pair.dtype:
            raise RuntimeError(f"contact_map: parameter {name} must be {_dtype_name(pair.dtype)} like pair_repr, got "
                               f"{_dtype_name(p.dtype)} (cast the module and its input to one of float32, float16, "
                               "bfloat16)")
    return pair.dtype


def _f32(t):
    """t in float32 (the kernels' dtype), t itself when it is float32 already."""
    return t if t.dtype == torch.float32 else t.float()


def _run_kernel(model, pair, params, eps, vid, out_dtype):
    """The CUDA forward: input and parameters of one dtype go in as they are (fp16 / bf16: the 16-bit wgmma
    build where it runs, else the extension converts to float32); mixed dtypes (CUDA autocast) in float32.
    The output is returned in out_dtype. Records the kernel that ran in model.last_variant (None after an
    empty input)."""
    if pair.dtype != out_dtype or any(p.dtype != pair.dtype for p in params):
        pair, params = _f32(pair), [_f32(p) for p in params]
    out, kernel = _ext.forward(pair, params[0], params[1], eps, *params[2:], vid)
    # a plain attribute: skips nn.Module.__setattr__ (~1 us)
    object.__setattr__(model, "last_variant", _KERNELS[kernel] if kernel >= 0 else None)
    return out if out.dtype == out_dtype else out.to(out_dtype)


class _ContactMap(torch.autograd.Function):
    """out = ContactMap(pair; params): the forward is the CUDA kernel, the backward the fused kernel
    (contact_map_backward_fused) where it runs, else contact_map_backward (PyTorch ops); recorded in
    model.last_backward ("fused" / "ops"). Double backward raises."""

    @staticmethod
    def forward(ctx, model, eps, vid, out_dtype, pair, *params):
        ctx.eps, ctx.model = eps, model
        ctx.save_for_backward(pair, *params)
        return _run_kernel(model, pair, params, eps, vid, out_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        pair, *params = ctx.saved_tensors
        fused = fused_backward_runs(pair, params[2])
        run = contact_map_backward_fused if fused else contact_map_backward
        grads = run(pair, params[0], params[1], ctx.eps, *params[2:], grad_out)
        object.__setattr__(ctx.model, "last_backward", "fused" if fused else "ops")
        return (None, None, None, None) + tuple(g if n else None for g, n in zip(grads, ctx.needs_input_grad[4:]))


class ModelNew(nn.Module):
    """Contact-map head: pair (B, N, N, pair_dim) on a CUDA device -> contact probabilities (B, N, N).

    Same submodules, names and creation order as the reference `Model` (so `load_state_dict` and
    seeding work identically). float32, float16 or bfloat16 (module and input in one dtype; fp16 / bf16
    products in that precision where the 16-bit wgmma build runs, else computed in float32), returned in the
    input's dtype (the autocast dtype under CUDA autocast). Differentiable
    with respect to the input and every parameter. Raises RuntimeError for a CPU input, an input on
    another device than the parameters, another dtype, a shape other than (B, N, N, pair_dim), or
    pair_dim / hidden_dim above 256. `variant` selects "auto", "mma" or "fma"; after a call
    `last_variant` names the kernel that ran ("wgmma", "wgmma16", "mma" or "fma"; None after an empty
    input, where none runs), after a backward `last_backward` the backward that ran ("fused": the CUDA
    kernel, pair_dim / hidden_dim multiples of 16 up to 128 / 64: fused_backward_runs(); else "ops": PyTorch
    ops).
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
        self.last_backward = None

    def _parameters_in_order(self):
        """(layer_norm, (gamma, beta, W1, b1, W2, b2, w3, b3)), read at every call.

        Through the modules' `_modules` / `_parameters` dicts: that is what `nn.Module.__getattr__` and
        `nn.Sequential.__getitem__` look up, at several times the cost (the attribute path took ~8 us of a
        call's host time on the CPU). A weight that is not a plain parameter (a parametrization) is not in
        those dicts: then the attribute path."""
        ln, mlp = self._modules.get("layer_norm"), self._modules.get("mlp")
        if ln is not None and mlp is not None:
            layers = [ln] + [mlp._modules.get(k) for k in ("0", "2", "4")]
            if all(m is not None for m in layers):
                params = tuple(m._parameters.get(k) for m in layers for k in ("weight", "bias"))
                if all(p is not None for p in params):
                    return ln, params
        ln, l1, l2, l3 = self.layer_norm, self.mlp[0], self.mlp[2], self.mlp[4]
        return ln, (ln.weight, ln.bias, l1.weight, l1.bias, l2.weight, l2.bias, l3.weight, l3.bias)

    def forward(self, pair_repr):
        vid = _VARIANT_IDS.get(self.variant)
        if vid is None:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {self.VARIANTS}")
        ln, params = self._parameters_in_order()
        eps = float(ln.eps)
        out_dtype = _output_dtype(pair_repr, params)
        if torch.is_grad_enabled() and (pair_repr.requires_grad or any(p.requires_grad for p in params)):
            return _ContactMap.apply(self, eps, vid, out_dtype, pair_repr, *params)
        return _run_kernel(self, pair_repr, params, eps, vid, out_dtype)
