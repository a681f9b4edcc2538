"""Fused outer product mean (AlphaFold-style MSA -> pair update), CUDA kernels, KernelBench format.

The op (b batch, s MSA sequence, i/j residue, m msa channel, h/k hidden channel, z pair channel):

    x[b,s,n,:]   = LayerNorm(msa[b,s,n,:])                                  (gamma, beta, eps of the module)
    a[b,s,n,h]   = (sum_m Wa[h,m] x[b,s,n,m] + ba[h]) * mask[b,s,n]
    b[b,s,n,k]   = (sum_m Wb[k,m] x[b,s,n,m] + bb[k]) * mask[b,s,n]
    denom[b,i]   = max(sum_s mask[b,s,i], 1)
    out[b,i,j,z] = bo[z] + (1 / denom[b,i]) * sum_{h,k} Wo[z, h*c+k] * sum_s a[b,s,i,h] b[b,s,j,k]

Tensors: msa_repr (B, S, N, c_m), c_m = msa_dim, float32, float16 or bfloat16, the parameters in the
same dtype; msa_mask (B, S, N), float32 / float16 / bfloat16 (any values), bool, uint8, int8, int16,
int32 or int64; gamma, beta (c_m); Wa, Wb (c, c_m), ba, bb (c), c = hidden_dim; Wo (c_z, c*c), bo
(c_z), c_z = pair_dim; out (B, N, N, c_z). The (B, N, N, c, c) outer product is never stored in
global memory; c is zero-padded to CP = 16, 32, 64 or 128.

Two contraction orders (FLOPs after the 4 B S N c_m c of LayerNorm + projections):
  outer_first  O[(i,h),(j,k)] = sum_s a[s,i,h] b[s,j,k] per tile on chip, then out = Wo . O:
               2 B N^2 c^2 (S + c_z)
  w_first      P[s,j,h,z] = sum_k Wo[z,h*c+k] b[s,j,k] (stage 1, in j-chunks), then
               out[i,j,z] = sum_{s,h} a[s,i,h] P[s,j,h,z] (stage 2): 2 B S N c^2 c_z + 2 B N^2 S c c_z

Default, variant "auto": opm_forward estimates each candidate's time (FLOPs as executed over a
per-kernel rate measured on the H200, kEff* in the CUDA source, plus 2 us per launch) and runs the
cheapest. Candidates: outer_first; w_first where one j column of P fits 32 MB, its stage 2 being
w_first_small when a 128 x 128 tile grid is under one wave, else w_first_tc2 on sm_80+ (w_first_tc
where its 136 KB of shared memory per block do not fit), else the FMA w_first; on an H100 / H200
with the sm_90a build also w_first_wg2 and outer_wg (hidden_dim <= 32, B * S * N / 16 < 2^31 and
B * N^2 / 64 < 2^31 per 128 of pair_dim).
There outer_wg wins at most shapes (in float16 / bfloat16 at few sequences too), w_first_wg2 at few
sequences, w_first_small at tiny ones.
`model.last_variant` names the variant that ran. The paths:
  outer_wg     opm_ow_params_kernel (LayerNorm affine folded into the projection weights, split-TF32
               weight planes; row-scaled float16 planes for a 16-bit msa), opm_prep_ow_kernel (LayerNorm
               + projections + mask on mma.sync, written as a / b's split-TF32 planes in wgmma tile
               order, fp16 / bf16 planes for a 16-bit msa; inv_denom; a 16-bit msa with msa_dim % 16
               == 0 up to 256 takes opm_prep16_kernel, the same work in warp tiles, bit-equal),
               opm_outer_wg_kernel<T>
               (persistent, warp-specialised: per 16 i x 4 j x 128 z tile, phase A O = a b^T and phase B
               out += O Wo on wgmma, fed by one producer warpgroup's bulk copies).
  w_first_wg2  opm_prep_kernel (FMA LayerNorm + projections: aT (B, S, CP, ceil4(N)), bq (B, S, N,
               CP), inv_denom (B, N), packed Wo), opm_pack_a_kernel, per j-chunk (<= 512 MB of P's
               planes) opm_wfirst_proj_wg_kernel and the persistent wgmma GEMM opm_wfirst_wg_kernel.
  others       opm_prep_kernel, then opm_outer_kernel<CP> (outer_first: 128 x 128 tiles, on-chip Wo
               epilogue) or opm_wfirst_proj_kernel<CP> + a stage-2 GEMM per j-chunk (<= 32 MB of P).
Forced variants (set `model.variant`; ModelNew.VARIANTS: those that run on this GPU, ALL_VARIANTS:
every name; forcing one that cannot run raises with the reason):
  outer_first    FMA, any CUDA GPU: the plain check of the fast paths; "auto" at crop / long off Hopper.
  w_first        FMA stage 2 (opm_wfirst_gemm_kernel), any GPU: "auto" below sm_80.
  w_first_small  FMA stage 2 on 32 x 64 tiles, K split over warps (opm_wfirst_small_kernel): small N.
  w_first_tc     split-TF32 mma.sync stage 2 (opm_wfirst_tc_kernel<1>), sm_80+: 100 KB-smem parts.
  w_first_tc2    the same with 64-row K stages (opm_wfirst_tc_kernel<2>, 136 KB), sm_80+.
  w_first_wg2    wgmma stage 2, compute capability 9.0 with the sm_90a build: few sequences (S ~ 32).
  outer_wg       outer_first on wgmma, 9.0 with the sm_90a build, hidden_dim <= 32: most shapes there.

Precision (fp32 input): the FMA paths accumulate in fp32; the tensor-core paths use split TF32 (x =
hi + lo, a b ~ hi hi + hi lo + lo hi, the dropped lo lo ~2^-21 |a b|), wgmma accumulators promoted
into fp32 by ordinary adds every 64 k. Max error against fp64 over all the harness's trials over the
fp32 reference's: outer_wg 0.58-1.09x, w_first_wg2 0.75-1.0x, w_first_tc / _tc2 up to 1.8x at deep
(S = 2048; 2.2-2.5x in single trials), outer_first 0.5x there, the FMA w_first 5.3x (7.9x in one
trial; not "auto"'s choice there). inv_denom sums float masks in fp64 and integer masks in int64.

Supported: any B, S, N >= 0 (S = 0 gives the bias everywhere; B = 0 or N = 0 an empty result, no
launch), 1 <= msa_dim <= 768, 1 <= hidden_dim <= 128 (32 is the tuned case), any pair_dim >= 1,
outputs over 2^31 elements, non-contiguous inputs (copied first). One CUDA device; parameters on
the device of the inputs.
Half precision and training: with float16 / bfloat16 inputs and parameters outer_wg reads msa_repr,
the mask and the parameters and writes its output in that dtype (no PyTorch casts): LayerNorm and
the projections on mma.sync in float16 with fp32 accumulation (normalised rows and row-scaled weights
each split into two float16 terms for float16, one term for bfloat16), a and b rounded to
the input's dtype as the reference's are, O = a b^T on the 16-bit tensor cores with fp32
accumulation, O / denom rounded to float16 (each pair's row scaled by a power of two: no overflow;
2^-11, under bfloat16's 2^-8) and multiplied by Wo in float16 on the tensor cores (bfloat16 weights
above 65504 would overflow there; below 2^-14 they lose bits, an absolute error under 2^-25). The
other variants run the float32 kernels on converted copies. The output comes back in the input's
dtype; under CUDA autocast in the autocast dtype, as the reference's, with the kernels chosen by the
module's and the input's dtypes as above (a float32 module: the float32 kernels).
The backward (outer_product_mean_backward) saves the inputs, and a, b and 1 / denom where outer_wg
ran with hidden_dim 32 (else recomputes them: outer_wg's prep on Hopper, ATen elsewhere); on Hopper
with hidden_dim 32 and pair_dim <= 128, wgmma kernels compute out_proj's weight gradient (O per tile
on chip) and, for pair_dim % 4 == 0, da and db (G = (g / denom) Wo per tile on chip), in split TF32
for a float32 msa and on the float16 / bfloat16 tensor cores for a 16-bit one with pair_dim % 8 == 0,
and for msa_dim 128 / 256 one kernel the LayerNorm part; elsewhere PyTorch ops build O and G for a
chunk of rows i at a time (about 256 MB), never the whole (B, N, N, c*c); `model.last_backward` names the parts that ran in kernels. Gradients for
msa_repr and every parameter, none for the mask (one that requires grad raises); double backward
raises.
Limits: float32 inside but in outer_wg and the backward kernels (float16 / bfloat16 cost one conversion
each way elsewhere); msa_dim <= 768 (64 rows of msa in shared memory); hidden_dim <= 128 (64 and 128
run with smaller residue tiles, slower per FLOP); outer_wg needs hidden_dim <= 32, B * S * N / 16 < 2^31 (S
rounded up to 16, or to 32 in float16 / bfloat16, N to 16) and B * N^2 / 64 < 2^31 per 128 of pair_dim.

Run:   python harness.py outer_product_mean
Build: about 110 s cold on a 2-core machine (nvcc ~105 s of CPU; cached, rebuilt when this changes).
       OPM_VERBOSE=1 shows the compiler commands and `-Xptxas -v` (registers, spills) per kernel.
       Architectures: TORCH_CUDA_ARCH_LIST if set, else the visible GPUs' (PyTorch's default), else
       (no GPU) 9.0; 9.0 is built as sm_90a (wgmma exists only there; sm_90a code runs on 9.0
       devices), "9.0+PTX" as sm_90a plus portable compute_90 PTX, passed as nvcc -gencode flags
       (`_gencode_flags`; TORCH_CUDA_ARCH_LIST itself is left as it is). Lists with names such as
       "Hopper" go to PyTorch unchanged, which leaves w_first_wg2 and outer_wg out.
"""
import hashlib
import os
import re
import sys

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.utils.cpp_extension import load_inline

# The variant table, the one place that names the variants: a variant's id is its index here. The
# CUDA source receives it as `enum Variant` (kAuto = 0, kOuterFirst = 1, ...: "k" + the name in
# CamelCase) and kNumVariants, which its range check and dispatch read; ModelNew passes the id and
# maps the id that ran back to the name.
_ALL_VARIANTS = ("auto", "outer_first", "w_first", "w_first_small", "w_first_tc", "w_first_tc2", "w_first_wg2",
                 "outer_wg")


def _variant_enum(names):
    """The C++ enum of the variant ids: k + the CamelCase name = its index, then kNumVariants."""
    ids = ", ".join(f"k{''.join(w.capitalize() for w in n.split('_'))} = {i}" for i, n in enumerate(names))
    return f"enum Variant : int64_t {{ {ids}, kNumVariants = {len(names)} }};"

# =============================================================================================
# CUDA source
# =============================================================================================
_CUDA_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>
#include <tuple>
#include <sstream>
#include <algorithm>
#include <cmath>

namespace opm {

// ---------------------------------------------------------------------------------------------
// Constants and shared device functions
// ---------------------------------------------------------------------------------------------
constexpr int kThreads = 256;      // every kernel: 256 threads (8 warps)
constexpr int kTile = 128;         // GEMM block tile: 128 x 128 outputs, 8 x 8 per thread
constexpr int kKC = 16;            // GEMM K chunk per cp.async stage (two stages)
constexpr int kRows1 = 64;         // prep kernel: msa rows per block
constexpr int kKC1 = 32;           // prep kernel: K (c_m) chunk of the projection weights
static_assert(256 % kKC1 == 0, "prep: fixed weight column per thread");
constexpr int kZC = 64;            // outer epilogue: pair channels per pass
constexpr int kR2 = 32;            // outer epilogue: rows of packed Wo per cp.async stage
constexpr int kMaxHidden = 128;
constexpr int kMaxMsaDim = 768;
@VARIANT_ENUM@
constexpr int64_t kPChunkBytes = 32ll << 20;   // w_first: cap of one P chunk
constexpr int64_t kPChunkBytesWg = 512ll << 20; // w_first_wg2: cap of one chunk of P's hi + lo planes
// "auto" time model (seconds = FLOPs / efficiency + launches * kLaunchS), rates of fp32 work on the
// H200. kEffOuter: crop, 86 GFLOP in 2.70 ms. w_first: stage 1 (K = CP only) 20 TFLOP/s, stage 2
// 128-tile GEMM 38 TFLOP/s (the outer kernel's main loop without its epilogue), small kernel 25
// TFLOP/s; these model shallow at 2.06 ms against 1.97 ms measured.
// kEffWTc, kEffWTc1: the split-TF32 stage 2, w_first_tc2 ("auto"'s choice) and w_first_tc (where
// w_first_tc2's 136 KB do not fit), at shallow (w_first_tc 1.842 ms against
// w_first's 1.974 ms with the same stage 1: ~42 TFLOP/s of fp32 work; w_first_tc2 1.803 ms: ~43).
// kEffWg, kEffProjWg (w_first_wg2, Hopper): its stage 2 and its stage 1 (opm_wfirst_proj_wg_kernel,
// which writes the split planes, twice w_first's bytes) at shallow
// (profile with 128 MB chunks: stage 2 68.7 GFLOP in 0.634 ms = 108 TFLOP/s of fp32 work, stage 1
// 4.3 GFLOP in 0.199 ms = 21.6 TFLOP/s).
// kEffOwA, kEffOwB (outer_wg, Hopper): its phase A and phase B, fitted to the fused kernel's time
// at crop (profile: 0.721 ms) and shallow (~0.96 ms of a 0.99 ms forward)
// with the wave model of "auto" (whole waves of tiles; phase B, N = 64 per wgmma with A from
// registers, runs at about 60% of phase A's rate).
// kEffOwA16, kEffOwB16: both phases on the 16-bit tensor cores (fp16 / bf16 inputs), fitted with the
// wave model to the fused kernel's time in bf16 at crop, shallow and long (profile: 252 / 413 / 2047 us
// with the row max by shuffles, modelled 247 / 408 / 2049; by REDUX, as built, 247 / - / 1977).
// The kernel with wgmmas in flight (221 / 346 / 1727 us) fits 513 / 233: kept at the older fit, the
// model overestimates it by ~11%, so "auto" leans away from outer_wg at small shapes.
// kEffPrep: opm_prep_kernel (FMA LayerNorm + projections), 4.3 GFLOP in ~255 us at crop (profile).
// kEffPrepOw, kBwPrepOw: outer_wg's tensor-core prep (opm_prep_ow_kernel): its tensor
// FLOPs (x3 for the split) ran at ~90 TFLOP/s at crop (12.9 GFLOP in 146-151 us) and deep (51.5 in
// 506-561 us), under the bytes at 3 TB/s.
constexpr double kEffOuter = 32e12, kEffProj = 20e12, kEffW = 38e12, kEffSmall = 25e12, kEffWTc = 43e12,
                 kEffWTc1 = 42e12, kEffWg = 108e12, kEffProjWg = 21e12, kEffOwA = 138e12, kEffOwB = 85e12,
                 kEffOwA16 = 458e12, kEffOwB16 = 192e12, kEffPrep = 17e12, kEffPrepOw = 90e12, kBwPrepOw = 3e12, kLaunchS = 2e-6;

__host__ __device__ __forceinline__ int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ __forceinline__ int64_t round_up(int64_t a, int64_t b) { return cdiv(a, b) * b; }
__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Asynchronous global -> shared copy of BYTES (4, 8 or 16); bytes past src_bytes are zero-filled,
// so partial tiles and out-of-range rows cost no branches in the inner loops.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(BYTES),
                 "r"(src_bytes));
  }
#else
  float* d = reinterpret_cast<float*>(smem);
  const float* g = reinterpret_cast<const float*>(gmem);
  for (int e = 0; e < BYTES / 4; ++e) d[e] = (4 * e < src_bytes) ? g[e] : 0.f;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Mask element -> the float the reference multiplies by (bool 0/1, integers by value).
enum MaskKind { kF32 = 0, kBool = 1, kU8 = 2, kI8 = 3, kI16 = 4, kI32 = 5, kI64 = 6, kF16 = 7, kBF16 = 8 };
__host__ __device__ __forceinline__ bool mask_is_float(int kind) { return kind == kF32 || kind == kF16 || kind == kBF16; }

__device__ __forceinline__ float mask_value(const void* m, int64_t idx, int kind) {
  switch (kind) {
    case kF32: return static_cast<const float*>(m)[idx];
    case kF16: return __half2float(static_cast<const __half*>(m)[idx]);
    case kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(m)[idx]);
    case kBool: return static_cast<const uint8_t*>(m)[idx] ? 1.f : 0.f;
    case kU8: return static_cast<float>(static_cast<const uint8_t*>(m)[idx]);
    case kI8: return static_cast<float>(static_cast<const int8_t*>(m)[idx]);
    case kI16: return static_cast<float>(static_cast<const int16_t*>(m)[idx]);
    case kI32: return static_cast<float>(static_cast<const int32_t*>(m)[idx]);
    default: return static_cast<float>(static_cast<const long long*>(m)[idx]);
  }
}
// Integer view of a mask element (for the exact int64 sum the reference does on bool/int masks).
__device__ __forceinline__ long long mask_int(const void* m, int64_t idx, int kind) {
  switch (kind) {
    case kBool: return static_cast<const uint8_t*>(m)[idx] ? 1 : 0;
    case kU8: return static_cast<const uint8_t*>(m)[idx];
    case kI8: return static_cast<const int8_t*>(m)[idx];
    case kI16: return static_cast<const int16_t*>(m)[idx];
    case kI32: return static_cast<const int32_t*>(m)[idx];
    default: return static_cast<const long long*>(m)[idx];
  }
}

// inv_denom[b, i] = 1 / max(sum_s mask[b, s, i], 1) for the 32-column blocks cb = first, first + step,
// ... of every b, by one block of blockDim.x threads: thread (sl, il) sums s = sl, sl + SL, ... of
// column 32 cb + il (SL = blockDim.x / 32: coalesced over i), and the SL partial sums are added in a
// fixed order. Float masks summed in fp64 (closest to the exact sum the fp64 oracle sees), bool / int
// masks in int64 as the reference does.
// red_f, red_i: shared arrays of blockDim.x elements. Every thread of the block calls this.
__device__ __forceinline__ void inv_denom_cols(const void* mask, int mask_kind, int64_t B, int64_t S, int64_t N,
                                               float* inv_denom, int64_t first, int64_t step, double* red_f,
                                               long long* red_i) {
  const int SL = blockDim.x / 32, sl = threadIdx.x / 32, il = threadIdx.x % 32;
  const int64_t ncb = cdiv(N, 32);
  for (int64_t b = 0; b < B; ++b)  // (nested, not one flat index: no 64-bit division)
    for (int64_t cb = first; cb < ncb; cb += step) {
      const int64_t i = cb * 32 + il;
      double af = 0.0;
      long long ai = 0;
      if (i < N) {
        if (mask_kind == kF32) {
          for (int64_t s = sl; s < S; s += SL) af += static_cast<const float*>(mask)[(b * S + s) * N + i];
        } else if (mask_is_float(mask_kind)) {
          for (int64_t s = sl; s < S; s += SL) af += mask_value(mask, (b * S + s) * N + i, mask_kind);
        } else {
          for (int64_t s = sl; s < S; s += SL) ai += mask_int(mask, (b * S + s) * N + i, mask_kind);
        }
      }
      red_f[threadIdx.x] = af;
      red_i[threadIdx.x] = ai;
      __syncthreads();  // the SL partial sums of every column in shared memory
      if (sl == 0 && i < N) {
        float dn;
        if (mask_is_float(mask_kind)) {  // fp64 sum, then clamp(min = 1); NaN stays NaN
          double sum = 0.0;
          for (int q = 0; q < SL; ++q) sum += red_f[q * 32 + il];
          dn = static_cast<float>(sum);
          dn = (dn < 1.f) ? 1.f : dn;
        } else {
          long long sum = 0;
          for (int q = 0; q < SL; ++q) sum += red_i[q * 32 + il];
          dn = static_cast<float>(sum < 1 ? 1 : sum);
        }
        inv_denom[b * N + i] = 1.f / dn;
      }
      __syncthreads();  // red_* read before the next column block overwrites them
    }
}

// The sum of v over the lane's quad (lanes 4 g .. 4 g + 3: an mma fragment's row), in every lane of it.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---------------------------------------------------------------------------------------------
// GEMM main loop shared by opm_outer_kernel and opm_wfirst_gemm_kernel.
//   acc[r][q] += sum_k A[k][m(r)] * Bm[k][n(q)],  A/B stages in shared memory [2][kKC][128],
//   m(r) = r<4 ? ty*4+r : 64+ty*4+r-4,  n(q) likewise with tx;  tx = tid%16, ty = tid/16.
//   load_stage(buf, chunk) issues the cp.async copies of K chunk `chunk` into stage `buf`.
// Assumptions: 256 threads; load_stage issues only cp.async (no shared stores of its own).
// ---------------------------------------------------------------------------------------------
template <class LoadStage>
__device__ __forceinline__ void gemm_mainloop(float (&acc)[8][8], const float* As, const float* Bs,
                                              int64_t nchunks, LoadStage&& load_stage, int tx, int ty) {
  if (nchunks > 0) {
    load_stage(0, 0);
    cp_async_commit();
  }
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int buf = static_cast<int>(ch & 1);
    if (ch + 1 < nchunks) {
      load_stage(buf ^ 1, ch + 1);   // prefetch the next chunk while this one is multiplied
      cp_async_commit();
      cp_async_wait<1>();            // this thread's copies of chunk ch have landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies of chunk ch are visible to all threads
    const float* a = As + buf * kKC * kTile;
    const float* b = Bs + buf * kKC * kTile;
#pragma unroll
    for (int k = 0; k < kKC; ++k) {
      const float4 a0 = *reinterpret_cast<const float4*>(a + k * kTile + ty * 4);
      const float4 a1 = *reinterpret_cast<const float4*>(a + k * kTile + 64 + ty * 4);
      const float4 b0 = *reinterpret_cast<const float4*>(b + k * kTile + tx * 4);
      const float4 b1 = *reinterpret_cast<const float4*>(b + k * kTile + 64 + tx * 4);
      const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int r = 0; r < 8; ++r)
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[r][q] = fmaf(av[r], bv[q], acc[r][q]);
    }
    __syncthreads();  // stage buf fully read before iteration ch+1 prefetches chunk ch+2 into it
  }
}

// ---------------------------------------------------------------------------------------------
// Split TF32 on the tensor cores (variants w_first_tc, w_first_tc2, w_first_wg2, outer_wg).
// x = hi + lo: hi = x rounded to TF32 (add half a TF32 ulp to the magnitude, clear the low 13 bits),
// lo = x - hi (exact in fp32) truncated to TF32; a*b ~ hi_a hi_b + hi_a lo_b + lo_a hi_b, the dropped
// lo_a lo_b ~2^-21 |a b|. The scheme and the accumulation are contact_map.py's (max error there
// 0.75-1.03x the fp32 reference's at seed, crop, batch, long).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}


// ---------------------------------------------------------------------------------------------
// w_first_wg2 (Hopper, sm_90a): w_first's stage 2 on wgmma.
// Operands in *tile order*, pre-split: each 64-row (A = a, rows i) or 128-row (B = P, rows n) by
// kWgBK-deep block of an operand is one contiguous run: the hi plane, then the lo plane, each in the
// unswizzled K-major core-matrix layout wgmma reads (8 rows x 16 bytes per core matrix; element
// (r, k) at float wg_tile_off(r, k); leading-dimension byte offset 128 between the core matrices
// along k, stride byte offset 1024 between 8-row groups). One 1-D bulk copy (TMA engine) moves a
// block into shared memory: no per-thread copy instructions and no splits in the main loop.
//   At[((b*MB64 + mb)*KB + kb)*2*kWgAPlane + plane*kWgAPlane + wg_tile_off(i % 64, k % 32)],  i = 64 mb + r
//   Pt[((b*NB + nb)*KB + kb)*2*kWgBPlane + plane*kWgBPlane + wg_tile_off(n % 128, k % 32)], n = 128 nb + r
// (k = s*CP + h, n = jl*CZP4 + z as in w_first; zeros past N, K = S*CP and the chunk's columns).
// ---------------------------------------------------------------------------------------------
constexpr int kWgBK = 32;                        // k per pipeline stage (4 wgmma k steps of 8)
constexpr int kWgARows = 64, kWgBRows = 128;     // rows of an A block (one warpgroup's), of a B block
constexpr int kWgAPlane = kWgARows * kWgBK;      // floats of one plane of an A block (8 KB)
constexpr int kWgBPlane = kWgBRows * kWgBK;      // floats of one plane of a B block (16 KB)
constexpr int kWgStages = 3;
constexpr int kWgStage = 2 * 2 * kWgAPlane + 2 * kWgBPlane;  // floats per stage: 2 A blocks + 1 B block (64 KB)
constexpr int kWgThreads = 288;                  // 2 consumer warpgroups + 1 producer warp
constexpr int kWgPromo = 8;                      // k steps (of 8) per promotion into fp32 (64 k)
constexpr size_t kWgSmemBytes = 4ull * kWgStages * kWgStage + 16 * kWgStages;  // + full/empty mbarriers
__host__ __device__ __forceinline__ int wg_tile_off(int r, int k) {
  return (r >> 3) * 256 + (k >> 2) * 32 + (r & 7) * 4 + (k & 3);
}
// fp16 / bf16 <-> fp32 by the intrinsics (PyTorch builds without the types' conversion operators).
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
template <typename P>  // element idx of a read-only parameter as fp32
__device__ __forceinline__ float ldg_f(const P* p, int64_t idx) { return to_float(__ldg(p + idx)); }
template <typename T>  // (fp16 by the paired conversion: the same F2FP instruction as the single one)
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return __low2half(__floats2half2_rn(v, 0.f));
}
// Two T packed in one register, element 0 in the low half. bfloat16: a shift and a mask, one instruction
// each (the intrinsic took two for the low element).
template <typename T>
__device__ __forceinline__ float2 to_float2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  else return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
template <typename T>  // two fp32 rounded to T (to nearest), element 0 in the low half
__device__ __forceinline__ uint32_t pack2_16(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}
template <typename T>
__device__ __forceinline__ uint2 pack4_16(float v0, float v1, float v2, float v3) {
  return make_uint2(pack2_16<T>(v0, v1), pack2_16<T>(v2, v3));
}

// Four consecutive k of one row, split: 16 bytes into each plane (k % 4 == 0 at dst).
__device__ __forceinline__ void store_split4(float* hi_dst, float* lo_dst, float v0, float v1, float v2, float v3) {
  uint32_t h[4], l[4];
  split_tf32(v0, h[0], l[0]);
  split_tf32(v1, h[1], l[1]);
  split_tf32(v2, h[2], l[2]);
  split_tf32(v3, h[3], l[3]);
  *reinterpret_cast<uint4*>(hi_dst) = make_uint4(h[0], h[1], h[2], h[3]);
  *reinterpret_cast<uint4*>(lo_dst) = make_uint4(l[0], l[1], l[2], l[3]);
}

// sm_90a-only instructions (wgmma, bulk copies, mbarriers), compiled where nvcc targets sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL); elsewhere the kernel using them is a trap, never launched (the host
// runs w_first_wg2 and outer_wg only when the extension was built with sm_90a, OPM_SM90A, on a 9.0 device).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OPM_WG_DEVICE 1
__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride byte
// offsets, each >> 4 in 14 bits; swizzle mode 0 (none) in bits 62-63.
// sbo: bytes between 8-row groups (1024 for 32-k blocks, 512 for outer_wg's 16-k blocks).
__device__ __forceinline__ uint64_t wg_desc(const float* p, unsigned sbo = 1024) {
  return static_cast<uint64_t>((smem_u32(p) & 0x3ffff) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}
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
// The full / empty mbarriers of a ring of `stages` slots (thread 0; the caller then syncs the block):
// full: one producer arrival (plus the copies' bytes), empty: one arrival per consumer warp (8).
__device__ __forceinline__ void mbar_ring_init(uint64_t* full, uint64_t* empty, int stages) {
  for (int st = 0; st < stages; ++st) {
    mbar_init(full + st, 1);
    mbar_init(empty + st, 8);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// bytes % 16 == 0, both addresses 16-byte aligned; completes `bytes` transactions on bar.
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// One box of a 4-D tensor map (coordinates innermost first) into shared memory (128-byte aligned),
// completing the box's bytes (zeros out of range included) on bar.
__device__ __forceinline__ void tma_load_4d(float* smem, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(smem_u32(smem)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_u32(bar))
      : "memory");
}
// d (64 x 128, fp32, this warpgroup's accumulator fragment) = A (64 x 8) B^T (8 x 128) + (acc ? d : 0),
// TF32 operands K-major in shared memory. d[4 j + q]: row 16 (warp % 4) + lane / 4 + 8 (q / 2),
// column 8 j + 2 (lane % 4) + q % 2.
__device__ __forceinline__ void wgmma_tf32_m64n128k8(float (&d)[64], uint64_t da, uint64_t db, int acc) {
@WGMMA_M64N128K8@}
// The same for one k step of 16 with T (__nv_bfloat16 or __half) operands K-major in shared memory
// (core matrices of 8 rows x 16 bytes); d's layout as m64n128k8's.
template <typename T>
__device__ __forceinline__ void wgmma16_m64n128k16(float (&d)[64], uint64_t da, uint64_t db, int acc) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
@WGMMA_BF16_M64N128K16@  } else {
@WGMMA_F16_M64N128K16@  }
}
// Compiler fence on the accumulator registers (CUTLASS's warpgroup_fence_operand): the asynchronous
// wgmma reads and writes them behind the compiler's back, so no access may move across the
// wgmma.fence / wait_group points this is placed at.
template <int NACC>
__device__ __forceinline__ void wg_fence_acc(float (&d)[NACC]) {
#pragma unroll
  for (int q = 0; q < NACC; ++q) asm volatile("" : "+f"(d[q])::"memory");
}
// d (64 x 64, fp32) = A (64 x 8, TF32 in registers) B^T (8 x 64) + (acc ? d : 0); B K-major in shared
// memory. A fragment (CUTLASS's ALayout_64x8): a[0] row 16 (warp % 4) + lane / 4, column lane % 4;
// a[1] row + 8; a[2] column + 4; a[3] both. d[4 j + q]: row 16 (warp % 4) + lane / 4 + 8 (q / 2),
// column 8 j + 2 (lane % 4) + q % 2 (as m64n128k8's).
__device__ __forceinline__ void wgmma_tf32_m64n64k8_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int acc) {
@WGMMA_M64N64K8_RS@}
// The same for one k step of 16 in fp16: A's fragment as fp16 pairs (mma m16n8k16's A layout per
// warp: a[0] row g, k 2 t4 + {0, 1}; a[1] row g + 8; a[2] k + 8; a[3] both), B K-major.
__device__ __forceinline__ void wgmma_f16_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int acc) {
@WGMMA_F16_M64N64K16_RS@}
// The same in T (__half or __nv_bfloat16).
template <typename T>
__device__ __forceinline__ void wgmma16_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int acc) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
@WGMMA_BF16_M64N64K16_RS@  } else {
    wgmma_f16_m64n64k16_rs(d, a, db, acc);
  }
}
// d += A B^T for one k step of 8 in split TF32 (B's hi and lo planes K-major at b_hi, b_lo; sbo bytes
// between 8-row groups): lo_a hi_b, hi_a lo_b, then hi_a hi_b (the small terms first); d is
// overwritten rather than added to where fresh.
__device__ __forceinline__ void wgmma_split_m64n64k8_rs(float (&d)[32], const uint32_t (&ahi)[4],
                                                        const uint32_t (&alo)[4], const float* b_hi,
                                                        const float* b_lo, unsigned sbo, bool fresh) {
  wgmma_tf32_m64n64k8_rs(d, alo, wg_desc(b_hi, sbo), fresh ? 0 : 1);
  wgmma_tf32_m64n64k8_rs(d, ahi, wg_desc(b_lo, sbo), 1);
  wgmma_tf32_m64n64k8_rs(d, ahi, wg_desc(b_hi, sbo), 1);
}
// KS split-TF32 k steps in one wgmma batch with A in registers (k step q's B planes at b + 64 q, hi, and
// b + lo_off + 64 q, lo): into the fresh accumulator d, waited for, then added into sum in fp32.
template <int KS>
__device__ __forceinline__ void wgmma_split_batch_rs(float (&d)[32], float (&sum)[32], uint32_t (&ahi)[KS][4],
                                                     uint32_t (&alo)[KS][4], const float* b, int lo_off, unsigned sbo) {
  wg_fence_acc(d);
#pragma unroll
  for (int q = 0; q < KS; ++q)  // the A fragments are wgmma inputs too: written before the fence
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(ahi[q][e]), "+r"(alo[q][e])::"memory");
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int q = 0; q < KS; ++q)
    wgmma_split_m64n64k8_rs(d, ahi[q], alo[q], b + 64 * q, b + lo_off + 64 * q, sbo, q == 0);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  wg_fence_acc(d);
#pragma unroll
  for (int e = 0; e < 32; ++e) sum[e] += d[e];
}
// The same for KS k steps of 16 in T (k step q's B at b + 64 q floats, K-major core matrices of 8 rows x
// 16 bytes, sbo bytes between 8-row groups).
template <int KS, typename T>
__device__ __forceinline__ void wgmma16_batch_rs(float (&d)[32], float (&sum)[32], uint32_t (&a)[KS][4], const float* b,
                                                 unsigned sbo) {
  wg_fence_acc(d);
#pragma unroll
  for (int q = 0; q < KS; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[q][e])::"memory");
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int q = 0; q < KS; ++q)
    wgmma16_m64n64k16_rs<T>(d, a[q], wg_desc(b + 64 * q, sbo), q > 0);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  wg_fence_acc(d);
#pragma unroll
  for (int e = 0; e < 32; ++e) sum[e] += d[e];
}
// One ring stage of a 64 x 128 product in split TF32 (operands K-major in shared memory, sbo bytes
// between 8-row groups): KSTEPS k steps of 8, each lo_a hi_b, hi_a lo_b, then hi_a hi_b (the small terms
// first) into d and its own commit group; d restarts (scale-d 0) at k steps k0 + ks that are multiples
// of PROMO (w_first_wg2's stage 2 and dWo's phase A; outer_wg's phase A writes the same loop out).
template <int KSTEPS, int PROMO>
__device__ __forceinline__ void wgmma_split_stage_m64n128(float (&d)[64], const float* a_hi, const float* a_lo,
                                                          const float* b_hi, const float* b_lo, unsigned sbo,
                                                          int k0) {
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const int off = ks * 64;  // two core matrices along k (8 k): 256 bytes
    const int fresh = (k0 + ks) % PROMO == 0;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    wgmma_tf32_m64n128k8(d, wg_desc(a_lo + off, sbo), wg_desc(b_hi + off, sbo), fresh ? 0 : 1);
    wgmma_tf32_m64n128k8(d, wg_desc(a_hi + off, sbo), wg_desc(b_lo + off, sbo), 1);
    wgmma_tf32_m64n128k8(d, wg_desc(a_hi + off, sbo), wg_desc(b_hi + off, sbo), 1);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  }
}
#endif

// =============================================================================================
// Kernels
// =============================================================================================

// ---------------------------------------------------------------------------------------------
// opm_prep_kernel<CP>: LayerNorm + both projections + mask (role 1), inv_denom (role 2), packed Wo
// (role 3), in one launch.  Blocks [0, n_den) role 2, [n_den, n_den+n_pack) role 3, the rest role 1.
//   x      (R, c_m) rows r = (b*S + s)*N + n, contiguous          mask (B, S, N) contiguous
//   aT     (B, S, CP, Npad):  aT[(b*S+s)*CP + h][n] = a[b,s,n,h]  (h >= c written as 0)
//   bq     (B, S, N, CP):     bq[r][k] = b[b,s,n,k]               (k >= c written as 0)
//   inv_denom (B, N) = 1 / max(sum_s mask[b,s,i], 1)
//   wpack: mode 0 (outer_first): wpack[(h*CP + k)*zp + z] = Wo[z, h*c+k];
//          mode 1 (w_first):     wpack[(k*CP + h)*zp + z] = Wo[z, h*c+k]; 0 where h,k >= c or z >= c_z.
// Role 1 shared memory: xs [64][LDX] (reused as ys [CP][65] for the transposed a store),
//   ws [kKC1][2CP+4] (projection weights, transposed, one K chunk).
// Thread (tr = tid/16, to = tid%16) owns rows tr + 16*u (u < 4) and outputs o = to*RO + v (v < RO),
// RO = 2CP/16; o < CP are a-channels, o >= CP b-channels (RO divides CP, so never both).
// LayerNorm is two-pass over the row held in shared memory: mean, then sum (x-mean)^2: stable for
// large offsets (no E[x^2] - E[x]^2 cancellation).
// Assumptions: 256 threads; c_m <= kMaxMsaDim; dynamic smem as computed by prep_smem_bytes.
// ---------------------------------------------------------------------------------------------
template <int CP>
__global__ void __launch_bounds__(kThreads) opm_prep_kernel(
    const float* __restrict__ x, const void* __restrict__ mask, int mask_kind,
    const float* __restrict__ ln_w, const float* __restrict__ ln_b,
    const float* __restrict__ wa, const float* __restrict__ ba,
    const float* __restrict__ wb, const float* __restrict__ bb,
    const float* __restrict__ wo,
    float* __restrict__ aT, float* __restrict__ bq, float* __restrict__ inv_denom, float* __restrict__ wpack,
    int64_t B, int64_t S, int64_t N, int64_t Npad, int cm, int c, int cz, float eps,
    int64_t n_row_blocks, int n_den, int n_pack, int pack_mode, int pack_zp) {
  constexpr int RO = 2 * CP / 16;
  constexpr int LDW = 2 * CP + 4;
  const int tid = threadIdx.x;
  const int64_t blk = blockIdx.x;

  extern __shared__ float4 smem_f4[];
  // ---- role 2: inv_denom[b,i] = 1 / max(sum_s mask[b,s,i], 1), 32 columns per block iteration; its
  //      partial sums in the dynamic shared memory (>= 4160 bytes: xs alone holds CP * 65 >= 1040 floats) ----
  if (blk < n_den) {
    double* red_f = reinterpret_cast<double*>(smem_f4);
    inv_denom_cols(mask, mask_kind, B, S, N, inv_denom, blk, n_den, red_f,
                   reinterpret_cast<long long*>(red_f + kThreads));
    return;
  }
  // ---- role 3: pack Wo ----
  if (blk < n_den + n_pack) {
    const int64_t total = static_cast<int64_t>(CP) * CP * pack_zp;
    for (int64_t e = (blk - n_den) * kThreads + tid; e < total; e += static_cast<int64_t>(n_pack) * kThreads) {
      const int64_t z = e % pack_zp, xy = e / pack_zp;
      const int xx = static_cast<int>(xy / CP), yy = static_cast<int>(xy % CP);
      const int h = pack_mode == 0 ? xx : yy, k = pack_mode == 0 ? yy : xx;
      wpack[e] = (h < c && k < c && z < cz) ? wo[z * c * c + h * c + k] : 0.f;
    }
    return;
  }

  // ---- role 1: LayerNorm + projections + mask for 64 rows per block iteration ----
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int LDX = static_cast<int>(round_up(cm, 4));
  const int xs_floats = static_cast<int>(round_up(max(kRows1 * LDX, CP * 65), 4));
  float* xs = smem;              // [64][LDX]
  float* ys = smem;              // [CP][65], aliases xs after the GEMM
  float* ws = smem + xs_floats;  // [kKC1][LDW]
  __shared__ float s_mask[kRows1];

  const int64_t R = B * S * N;
  const int tr = tid / 16, to = tid % 16;
  const int warp = tid / 32, lane = tid % 32;
  const int64_t first_row_block = blk - n_den - n_pack;
  const int64_t row_block_stride = gridDim.x - n_den - n_pack;

  for (int64_t rb = first_row_block; rb < n_row_blocks; rb += row_block_stride) {
    const int64_t r0 = rb * kRows1;
    const int nrows = static_cast<int>(min64(kRows1, R - r0));
    const float* src = x + r0 * cm;  // the block's rows are contiguous: nrows * c_m floats
    // x -> xs (rows >= nrows zero); 16-byte loads when c_m % 4 == 0 (row starts stay 16-byte aligned)
    if ((cm & 3) == 0) {
      const int q4 = cm / 4;
      for (int q = tid; q < kRows1 * q4; q += kThreads) {
        const int r = q / q4, col = (q - r * q4) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nrows) v = __ldg(reinterpret_cast<const float4*>(src + static_cast<int64_t>(r) * cm + col));
        *reinterpret_cast<float4*>(xs + r * LDX + col) = v;
      }
    } else {
      for (int q = tid; q < kRows1 * cm; q += kThreads) {
        const int r = q / cm, col = q - r * cm;
        xs[r * LDX + col] = (r < nrows) ? __ldg(src + static_cast<int64_t>(r) * cm + col) : 0.f;
      }
    }
    if (tid < kRows1) s_mask[tid] = (tid < nrows) ? mask_value(mask, r0 + tid, mask_kind) : 0.f;
    __syncthreads();  // xs and s_mask complete before the per-row statistics read them

    // LayerNorm, one warp per row: mean, then centred variance (two passes over shared memory)
    for (int r = warp; r < kRows1; r += kThreads / 32) {
      float* row = xs + r * LDX;
      float s1 = 0.f;
      for (int k = lane; k < cm; k += 32) s1 += row[k];
      const float mean = warp_sum(s1) / cm;
      float s2 = 0.f;
      for (int k = lane; k < cm; k += 32) {
        const float d = row[k] - mean;
        s2 = fmaf(d, d, s2);
      }
      const float rstd = 1.f / sqrtf(warp_sum(s2) / cm + eps);
      for (int k = lane; k < cm; k += 32) row[k] = (row[k] - mean) * rstd * __ldg(ln_w + k) + __ldg(ln_b + k);
    }

    // y[r][o] = sum_m xs[r][m] * Wcat[o][m],  Wcat = [Wa (padded to CP rows); Wb (padded)]
    float acc[4][RO];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int v = 0; v < RO; ++v) acc[u][v] = 0.f;
    for (int k0 = 0; k0 < cm; k0 += kKC1) {
      __syncthreads();  // normalised rows visible (first chunk) / previous ws chunk fully read
      // fixed column kk per thread (256 % kKC1 == 0), rows o = o0 + 8u; unrolled by 4 so four
      // independent loads are in flight together (with unroll 1 they were 8 serial L2 round trips
      // per chunk at CP = 32: ~2.5 us per chunk at the seed shape)
      {
        const int kk = tid % kKC1, k = k0 + kk;
#pragma unroll 4
        for (int o = tid / kKC1; o < 2 * CP; o += kThreads / kKC1) {  // lanes along k: coalesced reads
          const int h = o < CP ? o : o - CP;
          const float* W = o < CP ? wa : wb;
          ws[kk * LDW + o] = (h < c && k < cm) ? __ldg(W + static_cast<int64_t>(h) * cm + k) : 0.f;
        }
      }
      __syncthreads();  // ws chunk complete
      const int kmax = min(kKC1, cm - k0);
      for (int kk = 0; kk < kmax; ++kk) {
        float xv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) xv[u] = xs[(tr + 16 * u) * LDX + k0 + kk];
        float wv[RO];
        if constexpr (RO % 4 == 0) {
#pragma unroll
          for (int v = 0; v < RO; v += 4) {
            const float4 w4 = *reinterpret_cast<const float4*>(ws + kk * LDW + to * RO + v);
            wv[v] = w4.x; wv[v + 1] = w4.y; wv[v + 2] = w4.z; wv[v + 3] = w4.w;
          }
        } else {
#pragma unroll
          for (int v = 0; v < RO; v += 2) {
            const float2 w2 = *reinterpret_cast<const float2*>(ws + kk * LDW + to * RO + v);
            wv[v] = w2.x; wv[v + 1] = w2.y;
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int v = 0; v < RO; ++v) acc[u][v] = fmaf(xv[u], wv[v], acc[u][v]);
      }
    }

    // epilogue: (y + bias) * mask; b-channels straight to bq, a-channels via ys to aT (transposed)
    __syncthreads();  // every thread finished reading xs before it is overwritten as ys
    const int o0 = to * RO;
    const bool is_a = o0 < CP;
    const int h0 = is_a ? o0 : o0 - CP;
    float bias[RO];
#pragma unroll
    for (int v = 0; v < RO; ++v) {
      const int h = h0 + v;
      bias[v] = h < c ? __ldg((is_a ? ba : bb) + h) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int r = tr + 16 * u;
      const float m = s_mask[r];
      float y[RO];
#pragma unroll
      for (int v = 0; v < RO; ++v) y[v] = (acc[u][v] + bias[v]) * m;
      if (is_a) {
#pragma unroll
        for (int v = 0; v < RO; ++v) ys[(h0 + v) * 65 + r] = y[v];
      } else if (r < nrows) {
        float* dst = bq + (r0 + r) * CP + h0;
        if constexpr (RO % 4 == 0) {
#pragma unroll
          for (int v = 0; v < RO; v += 4)
            *reinterpret_cast<float4*>(dst + v) = make_float4(y[v], y[v + 1], y[v + 2], y[v + 3]);
        } else {
#pragma unroll
          for (int v = 0; v < RO; v += 2) *reinterpret_cast<float2*>(dst + v) = make_float2(y[v], y[v + 1]);
        }
      }
    }
    __syncthreads();  // ys complete before the transposed store reads it
    for (int q = tid; q < CP * kRows1; q += kThreads) {
      const int h = q / kRows1, r = q % kRows1;  // lanes along rows: consecutive n, coalesced
      if (r < nrows) {
        const int64_t rg = r0 + r, bs = rg / N, n = rg - bs * N;
        aT[(bs * CP + h) * Npad + n] = ys[h * 65 + r];
      }
    }
    __syncthreads();  // ys read completely before the next row block overwrites xs
  }
}

// ---------------------------------------------------------------------------------------------
// opm_outer_kernel<CP>: outer_first.  One block per tile (b, i0 = TI*ti, j0 = TJ*tj), TI = TJ = 128/CP.
//   GEMM 1 (main loop, K = S):  O[m][n] = sum_s A[s][m] Bm[s][n],
//     m = h*TI + il:  A[s][m]  = aT[b,s,h,i0+il]   (TI consecutive i per h: one cp.async of 4*min(TI,4) B)
//     n = jl*CP + k:  Bm[s][n] = bq[b,s,j0+jl,k]   (128 contiguous floats per s)
//   O -> Os[kk][p] in shared memory, kk = h*CP + k, p = jl*TI + il (pairs), row stride LDO.
//   GEMM 2 (epilogue, K = CP*CP): out[b,i0+il,j0+jl,z] = bo[z] + inv_denom[b,i] * sum_kk Os[kk][p] Wt[kk][z]
//     per z chunk of 64; thread (zg = tid%16, pg, sl) owns PT pairs x 4 z over the K slice sl
//     (KSPLIT slices of L = KK/KSPLIT); slices summed through shared memory (red).
//   Wt = wpack mode 0: (CP*CP, CZP), CZP = ceil64(c_z), zero padded.
// Shared memory: main loop As, Bs [2][16][128] each (32 KB), aliased in the epilogue by
//   Os [KK][LDO] and Ws [2][kR2][64] (red [KSPLIT][NP][64] aliases Ws).
// Assumptions: 256 threads; CP in {16,32,64,128}; N, S >= 1 handled with any remainder (zero-filled
//   copies); wpack covers CZP columns.
// ---------------------------------------------------------------------------------------------
template <int CP>
struct OuterCfg {
  static constexpr int TI = kTile / CP;                // residues i (and j) per tile
  static constexpr int NP = TI * TI;                   // pairs (i, j) per tile
  static constexpr int KK = CP * CP;                   // K of GEMM 2
  static constexpr int LDO = NP >= 16 ? NP + 4 : NP;   // Os row stride: +4 spreads the transposed stores
  static constexpr int PT = NP >= 4 ? 4 : 1;           // pairs per thread in GEMM 2
  static constexpr int PG = NP / PT;                   // pair groups
  static constexpr int KSPLIT = kThreads / (16 * PG);  // K slices of GEMM 2
  static constexpr int L = KK / KSPLIT;                // K per slice
  static constexpr int KCS = kR2 / KSPLIT;             // K per slice per Ws stage
  static constexpr int NST = KK / kR2;                 // Ws stages per z chunk
  static constexpr int VA = TI >= 4 ? 4 : TI;          // floats per A copy
  static constexpr size_t smem_floats_main = 2 * 2 * kKC * kTile;
  static constexpr size_t smem_floats_epi = static_cast<size_t>(KK) * LDO + 2 * kR2 * kZC;
  static constexpr size_t smem_bytes =
      4 * (smem_floats_main > smem_floats_epi ? smem_floats_main : smem_floats_epi);
  static_assert(KSPLIT >= 1 && kR2 % KSPLIT == 0 && L % KCS == 0, "GEMM 2 split");
  static_assert(KSPLIT * NP * kZC <= 2 * kR2 * kZC, "red fits in Ws");
};

template <int CP>
__global__ void __launch_bounds__(kThreads, 2) opm_outer_kernel(
    const float* __restrict__ aT, const float* __restrict__ bq, const float* __restrict__ inv_denom,
    const float* __restrict__ wt, const float* __restrict__ bo, float* __restrict__ out,
    int64_t B, int64_t S, int64_t N, int64_t Npad, int cz, int CZP) {
  using C = OuterCfg<CP>;
  constexpr int TI = C::TI, NP = C::NP, KK = C::KK, LDO = C::LDO, PT = C::PT, PG = C::PG;
  constexpr int KSPLIT = C::KSPLIT, L = C::L, KCS = C::KCS, NST = C::NST, VA = C::VA;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  float* As = smem;                                  // [2][kKC][128]
  float* Bs = smem + 2 * kKC * kTile;                // [2][kKC][128]
  float* Os = smem;                                  // [KK][LDO]      (epilogue)
  float* Ws = smem + static_cast<size_t>(KK) * LDO;  // [2][kR2][64]   (epilogue)
  float* red = Ws;                                   // [KSPLIT][NP][64]
  __shared__ float s_inv[TI];

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t ntile = cdiv(N, TI);
  const int64_t total = B * ntile * ntile;
  const int64_t nchunks = cdiv(S, kKC);
  const int nzc = static_cast<int>(cdiv(cz, kZC));
  const int zg = tid % 16, pg = (tid / 16) % PG, sl = tid / (16 * PG);

  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t tj = t % ntile, ti = (t / ntile) % ntile, b = t / (ntile * ntile);
    const int64_t i0 = ti * TI, j0 = tj * TI;

    // Per-thread copy assignment, fixed for the tile (256 is a multiple of the copies per row, so
    // every copy u of a thread has the same column and rows kl0 + u * KLU):
    //   A: column m = h*TI + il, rows s = ch*16 + kla + u*KLA;  B: column n = jl*CP + k, rows klb + u*8.
    constexpr int CPR_A = kTile / VA, KLA = kThreads / CPR_A;
    static_assert(kKC % KLA == 0 && kKC % 8 == 0, "copies per thread");
    const int ma = (tid % CPR_A) * VA, kla = tid / CPR_A;
    const int ha = ma / TI, ila = ma % TI;
    const int nva = static_cast<int>(max64(0, min64(VA, N - (i0 + ila))));  // valid floats of the A copy
    const float* a_src = aT + ((b * S + kla) * CP + ha) * Npad + i0 + ila;   // row s = kla
    const int64_t a_row = static_cast<int64_t>(CP) * Npad;                  // one s step
    const int nb = (tid % 32) * 4, klb = tid / 32;
    const int jlb = nb / CP, kb = nb % CP;
    const bool okj = j0 + jlb < N;
    const float* b_src = bq + ((b * S + klb) * N + j0 + jlb) * CP + kb;     // row s = klb
    const int64_t b_row = N * CP;

    auto load_stage = [&](int buf, int64_t ch) {
      float* as = As + buf * kKC * kTile;
      float* bs = Bs + buf * kKC * kTile;
      const int64_t s0 = ch * kKC;
#pragma unroll
      for (int u = 0; u < kKC / KLA; ++u) {
        const int64_t ds = s0 + u * KLA;  // s - kla
        const bool ok = kla + ds < S && nva > 0;
        cp_async<VA * 4>(as + (kla + u * KLA) * kTile + ma, ok ? a_src + ds * a_row : aT, ok ? nva * 4 : 0);
      }
#pragma unroll
      for (int u = 0; u < kKC / 8; ++u) {
        const int64_t ds = s0 + u * 8;
        const bool ok = klb + ds < S && okj;
        cp_async<16>(bs + (klb + u * 8) * kTile + nb, ok ? b_src + ds * b_row : bq, ok ? 16 : 0);
      }
    };

    float acc[8][8];
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[r][q] = 0.f;
    gemm_mainloop(acc, As, Bs, nchunks, load_stage, tx, ty);
    // (the main loop ends with a barrier, or issued nothing: Os may overwrite As/Bs now; the
    //  previous tile ended with a barrier after its last read of Os/red)

    // O -> Os[(h*CP + k)][jl*TI + il]
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const int m0 = g * 64 + ty * 4;
#pragma unroll
      for (int hb = 0; hb < 2; ++hb)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int n = hb * 64 + tx * 4 + q, jl = n / CP, k = n % CP;
          if constexpr (TI >= 4) {  // the 4 rows m0..m0+3 share h and are 4 consecutive il
            const int h = m0 / TI, il = m0 % TI;
            *reinterpret_cast<float4*>(Os + (h * CP + k) * LDO + jl * TI + il) =
                make_float4(acc[g * 4][hb * 4 + q], acc[g * 4 + 1][hb * 4 + q], acc[g * 4 + 2][hb * 4 + q],
                            acc[g * 4 + 3][hb * 4 + q]);
          } else {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int m = m0 + r, h = m / TI, il = m % TI;
              Os[(h * CP + k) * LDO + jl * TI + il] = acc[g * 4 + r][hb * 4 + q];
            }
          }
        }
    }
    if (tid < TI) s_inv[tid] = (i0 + tid < N) ? inv_denom[b * N + i0 + tid] : 0.f;
    __syncthreads();  // Os and s_inv complete before GEMM 2 reads them

    auto load_w = [&](int buf, int zc, int st) {
#pragma unroll
      for (int u = 0; u < kR2 * kZC / 4 / kThreads; ++u) {
        const int q = tid + u * kThreads;
        const int r = q / (kZC / 4), c4 = (q % (kZC / 4)) * 4;
        const int kk = (r / KCS) * L + st * KCS + (r % KCS);  // row r of the stage serves slice r/KCS
        cp_async<16>(Ws + (buf * kR2 + r) * kZC + c4, wt + static_cast<int64_t>(kk) * CZP + zc * kZC + c4, 16);
      }
    };
    for (int zc = 0; zc < nzc; ++zc) {
      float acc2[PT][4];
#pragma unroll
      for (int p = 0; p < PT; ++p)
#pragma unroll
        for (int z = 0; z < 4; ++z) acc2[p][z] = 0.f;
      load_w(0, zc, 0);
      cp_async_commit();
      for (int st = 0; st < NST; ++st) {
        const int buf = st & 1;
        if (st + 1 < NST) {
          load_w(buf ^ 1, zc, st + 1);
          cp_async_commit();
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies of Ws stage st are visible
        const float* w = Ws + buf * kR2 * kZC;
#pragma unroll 8
        for (int kl = 0; kl < KCS; ++kl) {
          const int kk = sl * L + st * KCS + kl;
          float o[PT];
          if constexpr (PT == 4) {
            const float4 o4 = *reinterpret_cast<const float4*>(Os + kk * LDO + pg * 4);
            o[0] = o4.x; o[1] = o4.y; o[2] = o4.z; o[3] = o4.w;
          } else {
            o[0] = Os[kk * LDO + pg];
          }
          const float4 w4 = *reinterpret_cast<const float4*>(w + (sl * KCS + kl) * kZC + zg * 4);
#pragma unroll
          for (int p = 0; p < PT; ++p) {
            acc2[p][0] = fmaf(o[p], w4.x, acc2[p][0]);
            acc2[p][1] = fmaf(o[p], w4.y, acc2[p][1]);
            acc2[p][2] = fmaf(o[p], w4.z, acc2[p][2]);
            acc2[p][3] = fmaf(o[p], w4.w, acc2[p][3]);
          }
        }
        __syncthreads();  // Ws stage buf read by all before it is refilled (st+2) or reused as red
      }
      // slice partials -> red[sl][p][z]
#pragma unroll
      for (int p = 0; p < PT; ++p)
        *reinterpret_cast<float4*>(red + ((sl * NP) + pg * PT + p) * kZC + zg * 4) =
            make_float4(acc2[p][0], acc2[p][1], acc2[p][2], acc2[p][3]);
      __syncthreads();  // all partials written before the slice sum reads them
#pragma unroll 1
      for (int oi = tid; oi < NP * kZC; oi += kThreads) {
        const int p = oi / kZC, z = oi % kZC;  // lanes along z: coalesced stores
        float sum = 0.f;
#pragma unroll
        for (int q = 0; q < KSPLIT; ++q) sum += red[(q * NP + p) * kZC + z];
        const int jl = p / TI, il = p % TI;
        const int64_t i = i0 + il, j = j0 + jl;
        const int zz = zc * kZC + z;
        if (i < N && j < N && zz < cz) out[((b * N + i) * N + j) * cz + zz] = __ldg(bo + zz) + s_inv[il] * sum;
      }
      __syncthreads();  // red (= Ws) and s_inv read by all before the next z chunk / next tile reuse them
    }
  }
}

// ---------------------------------------------------------------------------------------------
// opm_wfirst_proj_kernel<CP>: w_first stage 1 for the j-chunk [j0, j0 + JCv), as a GEMM
//   P[b,s,h,jl,z] = sum_k bq[b,s,j0+jl,k] * Wk[k][n],   n = h*CZP4 + z  (NCOL = CP*CZP4 columns)
//   Wk = wpack mode 1: wpack[k*NCOL + n] (row k contiguous over n), zero where h, k >= c or z >= c_z.
//   P layout ((b*S + s)*CP + h, jl, z) with row stride ldp = JC*CZP4.
// One block per (b*S + s, 64-row j tile, 128-column n tile); K = CP in chunks of KC1 = min(CP, 32):
//   Bt[k][jl] (b tile transposed, stride 68) and Wsm[k][128] in shared memory; thread (tj = tid/16,
//   tz = tid%16) owns 4 j x 8 n (n = tz*4 + {0..3} and 64 + tz*4 + {0..3}): 32 FMA per 3 LDS.128.
//   Since CZP4 % 4 == 0, the 4 columns of one float4 share h: one 16-byte store each.
// Assumptions: 256 threads; CZP4 % 4 == 0; ldp % 4 == 0.
// ---------------------------------------------------------------------------------------------
template <int CP>
__global__ void __launch_bounds__(kThreads) opm_wfirst_proj_kernel(
    const float* __restrict__ bq, const float* __restrict__ wk, float* __restrict__ P,
    int64_t B, int64_t S, int64_t N, int64_t j0, int64_t JCv, int64_t ldp, int CZP4) {
  constexpr int KC1 = CP < 32 ? CP : 32;
  constexpr int LDB = 64 + 4;
  constexpr int TN = 128;
  __shared__ __align__(16) float Bt[KC1 * LDB];
  __shared__ __align__(16) float Wsm[KC1 * TN];
  const int tid = threadIdx.x, tj = tid / 16, tz = tid % 16;
  const int64_t NCOL = static_cast<int64_t>(CP) * CZP4;
  const int64_t njt = cdiv(JCv, 64), nct = cdiv(NCOL, TN);
  const int64_t total = B * S * njt * nct;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t ct = t % nct, jt = (t / nct) % njt, bs = t / (nct * njt);  // bs = b*S + s
    const int64_t n0 = ct * TN;
    float acc[4][8];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
    for (int k0 = 0; k0 < CP; k0 += KC1) {
      // Bt[kk][jl] = bq[b,s,j0 + jt*64 + jl, k0 + kk]  (zero past the chunk)
      for (int q = tid; q < 64 * KC1 / 4; q += kThreads) {
        const int jl = q / (KC1 / 4), k4 = (q % (KC1 / 4)) * 4;
        const int64_t jc = jt * 64 + jl;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (jc < JCv) v = __ldg(reinterpret_cast<const float4*>(bq + (bs * N + j0 + jc) * CP + k0 + k4));
        Bt[(k4 + 0) * LDB + jl] = v.x;
        Bt[(k4 + 1) * LDB + jl] = v.y;
        Bt[(k4 + 2) * LDB + jl] = v.z;
        Bt[(k4 + 3) * LDB + jl] = v.w;
      }
      // Wsm[kk][nl] = Wk[k0 + kk][n0 + nl]  (zero past NCOL; NCOL % 4 == 0)
      for (int q = tid; q < KC1 * TN / 4; q += kThreads) {
        const int kk = q / (TN / 4), c4 = (q % (TN / 4)) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (n0 + c4 < NCOL) v = __ldg(reinterpret_cast<const float4*>(wk + (k0 + kk) * NCOL + n0 + c4));
        *reinterpret_cast<float4*>(Wsm + kk * TN + c4) = v;
      }
      __syncthreads();  // Bt and Wsm complete before the products read them
#pragma unroll 8
      for (int kk = 0; kk < KC1; ++kk) {
        const float4 bv = *reinterpret_cast<const float4*>(Bt + kk * LDB + tj * 4);
        const float4 w0 = *reinterpret_cast<const float4*>(Wsm + kk * TN + tz * 4);
        const float4 w1 = *reinterpret_cast<const float4*>(Wsm + kk * TN + 64 + tz * 4);
        const float b4[4] = {bv.x, bv.y, bv.z, bv.w};
        const float w8[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(b4[r], w8[e], acc[r][e]);
      }
      __syncthreads();  // Bt and Wsm read by all before the next chunk / tile overwrites them
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t jc = jt * 64 + tj * 4 + r;
      if (jc >= JCv) continue;
#pragma unroll
      for (int hb = 0; hb < 2; ++hb) {
        const int64_t n = n0 + hb * 64 + tz * 4;
        if (n >= NCOL) continue;
        const int64_t h = n / CZP4, z = n - h * CZP4;
        *reinterpret_cast<float4*>(P + (bs * CP + h) * ldp + jc * CZP4 + z) =
            make_float4(acc[r][hb * 4], acc[r][hb * 4 + 1], acc[r][hb * 4 + 2], acc[r][hb * 4 + 3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// WfirstTiles: the 128 x 128 output tiles (rows i, columns n = jl*CZP4 + z < ncols) of w_first stage
// 2 for one j-chunk, K = S*CP; tile t -> (b, i0, n0), columns fastest.
struct WfirstTiles {
  int64_t K, ncols, tm, tn, total;
  __device__ __forceinline__ WfirstTiles(int64_t B, int64_t S, int64_t N, int CP, int64_t JCv, int CZP4)
      : K(S * CP), ncols(JCv * CZP4), tm(cdiv(N, kTile)), tn(cdiv(ncols, kTile)), total(B * tm * tn) {}
  __device__ __forceinline__ void tile(int64_t t, int64_t& b, int64_t& i0, int64_t& n0) const {
    const int64_t tcol = t % tn, trow = (t / tn) % tm;
    b = t / (tn * tm);
    i0 = trow * kTile;
    n0 = tcol * kTile;
  }
};

// WfirstCopy: the copy side of the w-first GEMM main loops (opm_wfirst_gemm_kernel, opm_wfirst_tc_kernel).
//   Thread tid copies columns c4 = 4 (tid % 32) .. c4 + 3 of the tile's 128 columns of aT (i, from i0)
//   and P (n, from n0), rows k = ch KCH + tid / 32 + RSTEP u (u < KCH / RSTEP, RSTEP = threads / 32)
//   of K chunk ch, into stage rows LD floats apart, by 16-byte cp.async; rows past K, aT columns past
//   N (nva < 4 valid floats) and P columns past ncols are zero-filled.
// Assumptions: Npad % 4 == 0; ldp % 4 == 0; ncols % 4 == 0 (whole 16-byte pieces of P).
// ---------------------------------------------------------------------------------------------
struct WfirstCopy {
  const float *aT, *P, *a_src, *p_src;
  int64_t K, Npad, ldp;
  int c4, kl0, nva;
  bool okn;
  __device__ __forceinline__ WfirstCopy(const float* aT_, const float* P_, int tid, int64_t b, int64_t i0,
                                        int64_t n0, int64_t N, int64_t K_, int64_t Npad_, int64_t ldp_,
                                        int64_t ncols)
      : aT(aT_), P(P_), K(K_), Npad(Npad_), ldp(ldp_), c4((tid % 32) * 4), kl0(tid / 32) {
    nva = static_cast<int>(max64(0, min64(4, N - (i0 + c4))));
    okn = n0 + c4 < ncols;
    a_src = aT + (b * K + kl0) * Npad + i0 + c4;
    p_src = P + (b * K + kl0) * ldp + n0 + c4;
  }
  template <int KCH, int RSTEP, int LD>
  __device__ __forceinline__ void stage(float* as, float* bs, int64_t ch) const {
#pragma unroll
    for (int u = 0; u < KCH / RSTEP; ++u) {
      const int64_t dk = ch * KCH + u * RSTEP;  // k - kl0
      const bool in_k = kl0 + dk < K;
      const bool oka = in_k && nva > 0, okb = in_k && okn;
      cp_async<16>(as + (kl0 + u * RSTEP) * LD + c4, oka ? a_src + dk * Npad : aT, oka ? nva * 4 : 0);
      cp_async<16>(bs + (kl0 + u * RSTEP) * LD + c4, okb ? p_src + dk * ldp : P, okb ? 16 : 0);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// opm_wfirst_gemm_kernel: w_first stage 2 for the j-chunk [j0, j0 + JCv):
//   out[b,i,j0+jl,z] = bo[z] + inv_denom[b,i] * sum_{k=(s,h)} aT[b][k][i] * P[b][k][jl*CZP4 + z]
//   GEMM with M = N (i), columns n = jl*CZP4 + z (< JCv*CZP4), K = S*CP; both operands k-major, so
//   each stage row is 128 contiguous floats: 16-byte cp.async copies, zero-filled past the edges.
// Assumptions: 256 threads; Npad % 4 == 0; ldp % 4 == 0; CZP4 = ceil4(c_z).
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads, 2) opm_wfirst_gemm_kernel(
    const float* __restrict__ aT, const float* __restrict__ P, const float* __restrict__ inv_denom,
    const float* __restrict__ bo, float* __restrict__ out,
    int64_t B, int64_t S, int64_t N, int64_t Npad, int CP, int64_t j0, int64_t JCv, int64_t ldp, int cz, int CZP4) {
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  float* As = smem;
  float* Bs = smem + 2 * kKC * kTile;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const WfirstTiles tiles(B, S, N, CP, JCv, CZP4);
  const int64_t ncols = tiles.ncols;
  const int64_t nchunks = cdiv(tiles.K, kKC);
  for (int64_t t = blockIdx.x; t < tiles.total; t += gridDim.x) {
    int64_t b, i0, n0;
    tiles.tile(t, b, i0, n0);
    const WfirstCopy copy(aT, P, tid, b, i0, n0, N, tiles.K, Npad, ldp, ncols);
    auto load_stage = [&](int buf, int64_t ch) {
      copy.stage<kKC, kThreads / 32, kTile>(As + buf * kKC * kTile, Bs + buf * kKC * kTile, ch);
    };
    float acc[8][8];
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[r][q] = 0.f;
    gemm_mainloop(acc, As, Bs, nchunks, load_stage, tx, ty);
    // (the main loop ends with a barrier, so the next tile's prefetch cannot race this one's reads)

    const bool vec = (cz & 3) == 0;  // then CZP4 == c_z: 4 consecutive columns are 4 consecutive z of one j
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int64_t i = i0 + (r < 4 ? ty * 4 + r : 64 + ty * 4 + r - 4);
      if (i >= N) continue;
      const float inv = inv_denom[b * N + i];
#pragma unroll
      for (int hb = 0; hb < 2; ++hb) {
        const int64_t nb = n0 + hb * 64 + tx * 4;
        if (vec) {
          if (nb < ncols) {
            const int64_t jl = nb / CZP4;
            const int z = static_cast<int>(nb - jl * CZP4);
            const float4 bz = __ldg(reinterpret_cast<const float4*>(bo + z));
            *reinterpret_cast<float4*>(out + ((b * N + i) * N + j0 + jl) * cz + z) =
                make_float4(bz.x + inv * acc[r][hb * 4], bz.y + inv * acc[r][hb * 4 + 1],
                            bz.z + inv * acc[r][hb * 4 + 2], bz.w + inv * acc[r][hb * 4 + 3]);
          }
        } else {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int64_t n = nb + q;
            if (n >= ncols) continue;
            const int64_t jl = n / CZP4;
            const int z = static_cast<int>(n - jl * CZP4);
            if (z < cz) out[((b * N + i) * N + j0 + jl) * cz + z] = __ldg(bo + z) + inv * acc[r][hb * 4 + q];
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// mma.sync split-TF32 pieces (w_first_tc, w_first_tc2; split_tf32 itself is with the wgmma pieces above).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float lds_volatile(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return v;
}
// d += A(16 x 8, row-major) * B(8 x 8, column-major), TF32 inputs, fp32 accumulate (sm_80+).
// Fragments (g = lane / 4, t = lane % 4): a = {A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]},
// b = {B[t][g], B[t+4][g]}, d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // TF32 mma needs sm_80+: never return a silently wrong product
#endif
}
// d += a b for one m16n8k16 step in float16 (fp32 accumulation): a[0] row g, k 2 t + {0, 1}; a[1] row
// g + 8; a[2] k + 8; a[3] both; b0 k 2 t + {0, 1}, b1 k + 8, column g; d as mma_tf32's.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // f16 mma needs sm_80+
#endif
}

// ---------------------------------------------------------------------------------------------
// opm_wfirst_tc_kernel: opm_wfirst_gemm_kernel's product (w_first stage 2 for the j-chunk
//   [j0, j0 + JCv): out[b,i,j0+jl,z] = bo[z] + inv_denom[b,i] * sum_{k=(s,h)} aT[b][k][i] P[b][k][n],
//   n = jl*CZP4 + z) on the tensor cores in split TF32.
// Block tile 128 (i) x 128 (n), 16 warps of 32 x 32 (2 m16 blocks x 4 n8 tiles each; with 8 warps of
//   64 x 32 the accumulators alone took 128 registers and ptxas spilled), K in stages
//   of kTcKC rows, double-buffered cp.async; the stage rows are kTcLd = 136 floats apart, so the
//   scalar fragment loads (lanes g = 0..7 along i or n, t = 0..3 along k) hit 32 distinct banks.
// Accumulation: each k step's hi*hi into a zeroed set, promoted into acc by an fp32 add (the tensor
//   cores' own accumulation truncates); lo*hi + hi*lo accumulated on the tensor cores over all of K
//   (sm), added at the end.
// VER 2 (variant w_first_tc2): VER 1 is latency-bound (ncu at shallow: tensor pipe 41% busy, issue
//   slots 49%, 1.2 of 4 warps eligible): each k step is one dependent chain from the fragment loads
//   to the promoting adds. VER 2 (a) folds lo*hi and hi*lo into the k step's fresh
//   accumulator before hi*hi (d = lo_a hi_b + hi_a lo_b, then d += hi_a hi_b, then acc += d: the
//   tensor cores' truncation is relative to |d| once per k step, as in VER 1, the small terms first),
//   which frees the 32 registers of sm; (b) loads the next k step's fragments into registers
//   before the current one's splits (ptxas moves them after the products, though); (c) takes K
//   stages of 64 rows (half the barriers): 2% faster than VER 1 at shallow.
// Assumptions: kTcThreads = 512 threads; Npad % 4 == 0; ldp % 4 == 0; JCv*CZP4 % 4 == 0.
// Shared memory (dynamic): As [2][KC][kTcLd], Bs [2][KC][kTcLd] (68 KB at KC = 32, 136 KB at 64).
// ---------------------------------------------------------------------------------------------
constexpr int kTcThreads = 512, kTcLd = kTile + 8;
template <int VER>
constexpr int kTcKC = VER == 1 ? 32 : 64;
template <int VER>
constexpr size_t kTcSmemBytes = 4 * 2 * 2 * kTcKC<VER> * kTcLd;

template <int VER>
__global__ void __launch_bounds__(kTcThreads, 1) opm_wfirst_tc_kernel(
    const float* __restrict__ aT, const float* __restrict__ P, const float* __restrict__ inv_denom,
    const float* __restrict__ bo, float* __restrict__ out,
    int64_t B, int64_t S, int64_t N, int64_t Npad, int CP, int64_t j0, int64_t JCv, int64_t ldp, int cz, int CZP4) {
  constexpr int KC = kTcKC<VER>;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  float* As = smem;                          // [2][KC][kTcLd]: As[k][i]
  float* Bs = smem + 2 * KC * kTcLd;         // [2][KC][kTcLd]: Bs[k][n]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t4 = lane % 4;
  const int wm = warp / 4, wn = warp % 4;    // warp tile: rows 32 wm.., columns 32 wn..
  const WfirstTiles tiles(B, S, N, CP, JCv, CZP4);
  const int64_t ncols = tiles.ncols;
  const int64_t nchunks = cdiv(tiles.K, KC);
  for (int64_t tt = blockIdx.x; tt < tiles.total; tt += gridDim.x) {
    int64_t b, i0, n0;
    tiles.tile(tt, b, i0, n0);
    const WfirstCopy copy(aT, P, tid, b, i0, n0, N, tiles.K, Npad, ldp, ncols);
    auto load_stage = [&](int buf, int64_t ch) {
      copy.stage<KC, kTcThreads / 32, kTcLd>(As + buf * KC * kTcLd, Bs + buf * KC * kTcLd, ch);
    };
    float acc[2][4][4], sm[2][4][4];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mb][nt][q] = sm[mb][nt][q] = 0.f;

    if (nchunks > 0) {
      load_stage(0, 0);
      cp_async_commit();
    }
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int buf = static_cast<int>(ch & 1);
      if (ch + 1 < nchunks) {
        load_stage(buf ^ 1, ch + 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // every thread's copies of chunk ch are visible to all threads
      const float* a = As + buf * KC * kTcLd + wm * 32 + g;
      const float* bm = Bs + buf * KC * kTcLd + wn * 32 + g;
      if constexpr (VER == 2) {
        // fragments of k step ks (raw fp32): fa[mb] = A rows g, g+8 at k = t, t+4; fb[nt] = B at k = t, t+4.
        // Volatile loads, meant to keep the next step's loads ahead of this step's products; in the
        // SASS ptxas still issues them after the HMMAs, among the promoting adds (so the loads
        // overlap the adds, not the products).
        auto load_frag = [&](int ks, float (&fa)[2][4], float (&fb)[4][2]) {
          const int r0 = (ks * 8 + t4) * kTcLd, r1 = r0 + 4 * kTcLd;
#pragma unroll
          for (int mb = 0; mb < 2; ++mb) {
            fa[mb][0] = lds_volatile(a + r0 + mb * 16);
            fa[mb][1] = lds_volatile(a + r0 + mb * 16 + 8);
            fa[mb][2] = lds_volatile(a + r1 + mb * 16);
            fa[mb][3] = lds_volatile(a + r1 + mb * 16 + 8);
          }
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            fb[nt][0] = lds_volatile(bm + r0 + nt * 8);
            fb[nt][1] = lds_volatile(bm + r1 + nt * 8);
          }
        };
        float fa[2][4], fb[4][2];
        load_frag(0, fa, fb);
#pragma unroll 1
        for (int ks = 0; ks < KC / 8; ++ks) {
          float na[2][4], nb[4][2];
          load_frag(ks + 1 < KC / 8 ? ks + 1 : ks, na, nb);  // the next step's (last step: reloaded)
          uint32_t ah[2][4], al[2][4], bh[4][2], bl[4][2];
#pragma unroll
          for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int q = 0; q < 4; ++q) split_tf32(fa[mb][q], ah[mb][q], al[mb][q]);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            split_tf32(fb[nt][0], bh[nt][0], bl[nt][0]);
            split_tf32(fb[nt][1], bh[nt][1], bl[nt][1]);
          }
#pragma unroll
          for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              float d[4] = {0.f, 0.f, 0.f, 0.f};
              mma_tf32(d, al[mb], bh[nt][0], bh[nt][1]);  // the small terms first
              mma_tf32(d, ah[mb], bl[nt][0], bl[nt][1]);
              mma_tf32(d, ah[mb], bh[nt][0], bh[nt][1]);
#pragma unroll
              for (int q = 0; q < 4; ++q) acc[mb][nt][q] += d[q];
            }
#pragma unroll
          for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int q = 0; q < 4; ++q) fa[mb][q] = na[mb][q];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            fb[nt][0] = nb[nt][0];
            fb[nt][1] = nb[nt][1];
          }
        }
      } else {
#pragma unroll 1  // one k step's fragments live at a time (register budget: 128 at 512 threads)
        for (int ks = 0; ks < KC / 8; ++ks) {
          const int r0 = (ks * 8 + t4) * kTcLd, r1 = r0 + 4 * kTcLd;  // k = 8 ks + t, 8 ks + t + 4
          uint32_t ah[2][4], al[2][4], bh[4][2], bl[4][2];
#pragma unroll
          for (int mb = 0; mb < 2; ++mb) {
            split_tf32(a[r0 + mb * 16], ah[mb][0], al[mb][0]);
            split_tf32(a[r0 + mb * 16 + 8], ah[mb][1], al[mb][1]);
            split_tf32(a[r1 + mb * 16], ah[mb][2], al[mb][2]);
            split_tf32(a[r1 + mb * 16 + 8], ah[mb][3], al[mb][3]);
          }
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            split_tf32(bm[r0 + nt * 8], bh[nt][0], bl[nt][0]);
            split_tf32(bm[r1 + nt * 8], bh[nt][1], bl[nt][1]);
          }
#pragma unroll
          for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              float d[4] = {0.f, 0.f, 0.f, 0.f};
              mma_tf32(d, ah[mb], bh[nt][0], bh[nt][1]);
              mma_tf32(sm[mb][nt], al[mb], bh[nt][0], bh[nt][1]);
              mma_tf32(sm[mb][nt], ah[mb], bl[nt][0], bl[nt][1]);
#pragma unroll
              for (int q = 0; q < 4; ++q) acc[mb][nt][q] += d[q];
            }
        }
      }  // VER 1
      __syncthreads();  // stage buf fully read before iteration ch+1 prefetches chunk ch+2 into it
    }

    // Epilogue: d[q] of (mb, nt) is row i0 + 32 wm + 16 mb + g + 8 (q / 2), column
    // n0 + 32 wn + 8 nt + 2 t + (q % 2).
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int64_t i = i0 + wm * 32 + mb * 16 + g + 8 * hr;
        if (i >= N) continue;
        const float inv = inv_denom[b * N + i];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int hc = 0; hc < 2; ++hc) {
            const int64_t n = n0 + wn * 32 + nt * 8 + 2 * t4 + hc;
            if (n >= ncols) continue;
            const int64_t jl = n / CZP4;
            const int z = static_cast<int>(n - jl * CZP4);
            if (z >= cz) continue;
            const int q = 2 * hr + hc;
            out[((b * N + i) * N + j0 + jl) * cz + z] = __ldg(bo + z) + inv * (acc[mb][nt][q] + sm[mb][nt][q]);
          }
      }
    // (the K loop ends with a barrier, so the next tile's first copies cannot race this one's reads)
  }
}

// ---------------------------------------------------------------------------------------------
// opm_wfirst_small_kernel: w_first stage 2 for small problems (variant w_first_small), same math as
//   opm_wfirst_gemm_kernel: out[b,i,j0+jl,z] = bo[z] + inv_denom[b,i] * sum_k aT[b][k][i] P[b][k][n],
//   n = jl*CZP4 + z, k = (s, h) < K = S*CP.
// Why: at the seed shape (N = 32, 2048 columns, K = 256) the 128 x 128 kernel has 32 blocks, each
//   with 3/4 of its rows past N and a 16-step serial K loop (~20 us); here a block owns a 32 x 64
//   tile and its 8 warps split K (warp w takes rows w*8..w*8+7 of every 64-row K stage), each lane an
//   8 x 8 micro-tile (rows lr*4+{0..3}, 16+lr*4+{0..3}; columns lc*4+{0..3}, 32+lc*4+{0..3};
//   lr = lane/8, lc = lane%8); the 8 warp partials are summed through shared memory (deterministic).
// Shared memory (dynamic): stages As [2][64][32], Bs [2][64][64] (48 KB), aliased after the main loop
//   by red [8][32][64] (64 KB).
// Assumptions: 256 threads; Npad % 4 == 0; ldp % 4 == 0; JCv*CZP4 % 4 == 0.
// ---------------------------------------------------------------------------------------------
constexpr int kSmM = 32, kSmN = 64, kSmK = 64;
constexpr size_t kSmallSmemFloats = 8 * kSmM * kSmN;  // red; >= 2 * kSmK * (kSmM + kSmN)
static_assert(kSmallSmemFloats >= 2 * kSmK * (kSmM + kSmN), "red aliases the stages");

__global__ void __launch_bounds__(kThreads) opm_wfirst_small_kernel(
    const float* __restrict__ aT, const float* __restrict__ P, const float* __restrict__ inv_denom,
    const float* __restrict__ bo, float* __restrict__ out,
    int64_t B, int64_t S, int64_t N, int64_t Npad, int CP, int64_t j0, int64_t JCv, int64_t ldp, int cz, int CZP4) {
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  float* As = smem;                      // [2][kSmK][kSmM]
  float* Bs = smem + 2 * kSmK * kSmM;    // [2][kSmK][kSmN]
  float* red = smem;                     // [8][kSmM][kSmN]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, lr = lane / 8, lc = lane % 8;
  const int64_t K = S * CP;
  const int64_t ncols = JCv * CZP4;
  const int64_t tm = cdiv(N, kSmM), tn = cdiv(ncols, kSmN);
  const int64_t total = B * tm * tn;
  const int64_t nchunks = cdiv(K, kSmK);
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t tcol = t % tn, trow = (t / tn) % tm, b = t / (tn * tm);
    const int64_t i0 = trow * kSmM, n0 = tcol * kSmN;
    // copies: A 64 rows x 8 float4 (2 per thread), B 64 rows x 16 float4 (4 per thread)
    const int ca = (tid % 8) * 4, ka = tid / 8;    // A: column ca, rows ka, ka + 32
    const int cb = (tid % 16) * 4, kb = tid / 16;  // B: column cb, rows kb + 16u
    const int nva = static_cast<int>(max64(0, min64(4, N - (i0 + ca))));
    const bool okn = n0 + cb < ncols;
    const float* a_src = aT + (b * K + ka) * Npad + i0 + ca;
    const float* p_src = P + (b * K + kb) * ldp + n0 + cb;
    auto load_stage = [&](int buf, int64_t ch) {
      float* as = As + buf * kSmK * kSmM;
      float* bs = Bs + buf * kSmK * kSmN;
      const int64_t k0 = ch * kSmK;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int64_t dk = k0 + u * 32;
        const bool ok = ka + dk < K && nva > 0;
        cp_async<16>(as + (ka + u * 32) * kSmM + ca, ok ? a_src + dk * Npad : aT, ok ? nva * 4 : 0);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t dk = k0 + u * 16;
        const bool ok = kb + dk < K && okn;
        cp_async<16>(bs + (kb + u * 16) * kSmN + cb, ok ? p_src + dk * ldp : P, ok ? 16 : 0);
      }
    };
    float acc[8][8];
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[r][q] = 0.f;
    if (nchunks > 0) {
      load_stage(0, 0);
      cp_async_commit();
    }
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int buf = static_cast<int>(ch & 1);
      if (ch + 1 < nchunks) {
        load_stage(buf ^ 1, ch + 1);  // prefetch the next stage while this one is multiplied
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // every thread's copies of stage ch are visible to all threads
      const float* a = As + buf * kSmK * kSmM;
      const float* bm = Bs + buf * kSmK * kSmN;
#pragma unroll
      for (int kl = 0; kl < 8; ++kl) {
        const int k = warp * 8 + kl;
        const float4 a0 = *reinterpret_cast<const float4*>(a + k * kSmM + lr * 4);
        const float4 a1 = *reinterpret_cast<const float4*>(a + k * kSmM + 16 + lr * 4);
        const float4 b0 = *reinterpret_cast<const float4*>(bm + k * kSmN + lc * 4);
        const float4 b1 = *reinterpret_cast<const float4*>(bm + k * kSmN + 32 + lc * 4);
        const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int r = 0; r < 8; ++r)
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[r][q] = fmaf(av[r], bv[q], acc[r][q]);
      }
      __syncthreads();  // stage buf fully read before it is refilled (ch+2) or reused as red
    }
    // warp partials -> red[warp][row][col]
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int row = (r < 4 ? 0 : 16) + lr * 4 + (r & 3);
#pragma unroll
      for (int hb = 0; hb < 2; ++hb)
        *reinterpret_cast<float4*>(red + (warp * kSmM + row) * kSmN + hb * 32 + lc * 4) =
            make_float4(acc[r][hb * 4], acc[r][hb * 4 + 1], acc[r][hb * 4 + 2], acc[r][hb * 4 + 3]);
    }
    __syncthreads();  // all partials written before the sum reads them
#pragma unroll 1
    for (int oi = tid; oi < kSmM * kSmN; oi += kThreads) {
      const int row = oi / kSmN, col = oi % kSmN;  // lanes along columns: consecutive z, coalesced
      const int64_t i = i0 + row, n = n0 + col;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) sum += red[(w * kSmM + row) * kSmN + col];
      if (i < N && n < ncols) {
        const int64_t jl = n / CZP4;
        const int z = static_cast<int>(n - jl * CZP4);
        if (z < cz) out[((b * N + i) * N + j0 + jl) * cz + z] = __ldg(bo + z) + inv_denom[b * N + i] * sum;
      }
    }
    __syncthreads();  // red read by all before the next tile's prefetch overwrites the stages
  }
}

// ---------------------------------------------------------------------------------------------
// opm_wfirst_proj_wg_kernel<CP>: w_first_wg2 stage 1 for the j-chunk [j0, j0 + JCv): the products of
//   opm_wfirst_proj_kernel (P[s,j,h,z] = sum_k bq[b,s,j,k] Wk[k][h*CZP4 + z]) written as P's
//   tile-order hi / lo planes (Pt, see "w_first_wg2" above), padding included: s runs to
//   Sx = KB*kWgBK/CP, jl to JCx = ceil(NB*128 / CZP4), with zero rows of bq past S and JCv.
// Block: (b, group of kProjWgSG s, 64-row jl tile, column tile of 4 h x 32 z). The block's W tile
//   (all CP k of its 128 columns, Wsm[k][zz*4 + hh]) is loaded once; then per s the b tile (64 jl x
//   CP, rows LDR = CP + 4 floats apart) by 16-byte cp.async into one of two buffers, the next s's
//   copies in flight during this s's products. Thread (tj = tid/16, tz = tid%16) owns 4 jl x (4 h at
//   z = z0 + tz, 4 h at z0 + tz + 16): one float4 per (jl, z) holds 4 consecutive k = s*CP + h0 .. +3,
//   i.e. one 16-byte row of a core matrix in each plane (store_split4).
// Shared memory (dynamic): Wsm [CP][128], Bt [2][64][CP + 4] floats.
// Assumptions: 256 threads; CP % 16 == 0; CZP4 % 4 == 0; bq 16-byte aligned.
// ---------------------------------------------------------------------------------------------
constexpr int kProjWgSG = 8;  // s per block
template <int CP>
constexpr size_t kProjWgSmemBytes = 4ull * (CP * 128 + 2 * 64 * (CP + 4));
template <int CP>
__global__ void __launch_bounds__(kThreads, 2) opm_wfirst_proj_wg_kernel(
    const float* __restrict__ bq, const float* __restrict__ wk, float* __restrict__ Pt, int64_t B, int64_t S,
    int64_t N, int64_t j0, int64_t JCv, int CZP4, int64_t NB, int64_t KB) {
  constexpr int LDR = CP + 4, TN = 128;
  constexpr int NV = 64 * (CP / 4) / kThreads;  // 16-byte copies of one b tile per thread
  static_assert(NV >= 1 && NV * kThreads == 64 * (CP / 4), "b tile: whole 16-byte copies per thread");
  extern __shared__ float4 smem_f4[];
  float* Wsm = reinterpret_cast<float*>(smem_f4);  // [CP][TN]
  float* Bt = Wsm + CP * TN;                       // [2][64][LDR]
  const int tid = threadIdx.x, tj = tid / 16, tz = tid % 16;
  const int64_t NCOL = static_cast<int64_t>(CP) * CZP4;
  const int64_t Sx = KB * kWgBK / CP, JCx = cdiv(NB * kWgBRows, CZP4), nzg = cdiv(CZP4, 32);
  const int64_t njt = cdiv(JCx, 64), nct = (CP / 4) * nzg, nsg = cdiv(Sx, kProjWgSG);
  const int64_t total = B * nsg * njt * nct;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t ct = t % nct, jt = (t / nct) % njt, sg = (t / (nct * njt)) % nsg, b = t / (nct * njt * nsg);
    const int64_t h0 = 4 * (ct / nzg), z0 = 32 * (ct % nzg);
    const int64_t s_begin = sg * kProjWgSG, s_end = min64(Sx, s_begin + kProjWgSG);
    auto load_b = [&](int buf, int64_t s) {  // b tile of s (zero past S and JCv) into Bt[buf]
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int q = tid + v * kThreads, jl = q / (CP / 4), k4 = (q % (CP / 4)) * 4;
        const int64_t jc = jt * 64 + jl;
        const bool ok = jc < JCv && s < S;
        cp_async<16>(Bt + (buf * 64 + jl) * LDR + k4, ok ? bq + ((b * S + s) * N + j0 + jc) * CP + k4 : bq, ok ? 16 : 0);
      }
      cp_async_commit();
    };
    // this thread's 8 output rows n = jc*CZP4 + z of P: offset of row n's k block 0 (-1: not stored)
    int64_t row_off[4][2];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int hb = 0; hb < 2; ++hb) {
        const int64_t z = z0 + tz + 16 * hb, n = (jt * 64 + tj * 4 + r) * CZP4 + z;
        row_off[r][hb] = z < CZP4 && n < NB * kWgBRows
                             ? (b * NB + n / kWgBRows) * KB * (2 * kWgBPlane) + wg_tile_off(static_cast<int>(n % kWgBRows), 0)
                             : -1;
      }
    __syncthreads();  // the previous tile's readers of Wsm and Bt are done
    load_b(0, s_begin);
    for (int q = tid; q < CP * TN; q += kThreads) {
      const int kk = q / TN, hh = (q / 32) % 4, zz = q % 32;
      Wsm[kk * TN + zz * 4 + hh] = z0 + zz < CZP4 ? __ldg(wk + kk * NCOL + (h0 + hh) * CZP4 + z0 + zz) : 0.f;
    }
    for (int64_t s = s_begin; s < s_end; ++s) {
      const int buf = static_cast<int>((s - s_begin) & 1);
      cp_async_wait<0>();
      __syncthreads();  // Bt[buf] (and Wsm) complete for all; Bt[buf ^ 1]'s readers (s - 1) are done
      if (s + 1 < s_end) load_b(buf ^ 1, s + 1);
      const float* bt = Bt + (buf * 64 + tj * 4) * LDR;
      float acc[4][8];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < CP; ++kk) {
        const float b4[4] = {bt[kk], bt[LDR + kk], bt[2 * LDR + kk], bt[3 * LDR + kk]};
        const float4 w0 = *reinterpret_cast<const float4*>(Wsm + kk * TN + tz * 4);
        const float4 w1 = *reinterpret_cast<const float4*>(Wsm + kk * TN + 64 + tz * 4);
        const float w8[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(b4[r], w8[e], acc[r][e]);
      }
      // k = s*CP + h0 .. + 3 lies in k block kb at k % kWgBK = kq (a multiple of 4)
      const int64_t k = s * CP + h0;
      float* pk = Pt + (k / kWgBK) * (2 * kWgBPlane) + wg_tile_off(0, static_cast<int>(k % kWgBK));
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int hb = 0; hb < 2; ++hb)
          if (row_off[r][hb] >= 0) {
            float* dst = pk + row_off[r][hb];
            store_split4(dst, dst + kWgBPlane, acc[r][hb * 4], acc[r][hb * 4 + 1], acc[r][hb * 4 + 2], acc[r][hb * 4 + 3]);
          }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// opm_pack_a_kernel: aT (B, S, CP, Npad) = [b][k][i] -> At, the tile-order hi / lo planes of the A
//   operand of w_first_wg2 (rows i < MB64*64, k < KB*kWgBK; zeros past N and K = S*CP). One thread per
//   4 consecutive k of one row (i fastest: coalesced reads of aT, 16-byte writes).
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) opm_pack_a_kernel(const float* __restrict__ aT, float* __restrict__ At,
                                                              int64_t B, int64_t N, int64_t Npad, int64_t K,
                                                              int64_t MB64, int64_t KB) {
  const int64_t rows = MB64 * kWgARows, quads = KB * (kWgBK / 4), total = B * quads * rows;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % rows, q = (e / rows) % quads, b = e / (rows * quads);
    float v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t k = 4 * q + u;
      v[u] = (i < N && k < K) ? __ldg(aT + (b * K + k) * Npad + i) : 0.f;
    }
    float* dst = At + ((b * MB64 + i / kWgARows) * KB + q / (kWgBK / 4)) * (2 * kWgAPlane) +
                 wg_tile_off(static_cast<int>(i % kWgARows), static_cast<int>(4 * (q % (kWgBK / 4))));
    store_split4(dst, dst + kWgAPlane, v[0], v[1], v[2], v[3]);
  }
}

// ---------------------------------------------------------------------------------------------
// opm_wfirst_wg_kernel: w_first stage 2 for the j-chunk [j0, j0 + ncols / CZP4) on Hopper wgmma
//   (variant w_first_wg2): out[b,i,j0+jl,z] = bo[z] + inv_denom[b,i] * sum_k At[i][k] Pt[n][k],
//   n = jl*CZP4 + z, in split TF32: per k step of 8, d = lo_a hi_b + hi_a lo_b + hi_a hi_b on the
//   tensor cores (the small terms first, as w_first_tc2), d promoted into the fp32 acc by ordinary
//   adds every kWgPromo k steps (the tensor cores' accumulation truncates: without promotion the
//   error at K = 2048 is 41x the fp32 reference's).
// Tiles of 128 (i) x 128 (n), t -> (row tile t % MB128, column tile, b): the row tiles that read
//   one P block are neighbours and share it in L2. Block b takes tiles b, b + grid, ...; the
//   grid is one block per SM (persistent: the producer fetches the next tile's first stages during
//   this tile's epilogue).
// Warp-specialised: warps 0-7 are two consumer warpgroups (rows 64 wg .. 64 wg + 63, one m64n128k8
//   wgmma per product per k step); warp 8's lane 0 is the producer: per stage of kWgBK k, three bulk
//   copies (the two 16 KB A blocks, the 32 KB P block) completing on the stage's `full` mbarrier;
//   consumers release a stage on its `empty` mbarrier (one arrival per consumer warp) once their
//   wgmmas on it have completed (wait_group 0). Stage use u = running count over the block's tiles:
//   buffer u % kWgStages, mbarrier phase parity (u / kWgStages) & 1.
// Shared memory (dynamic, kWgSmemBytes = 192 KB + 48 B): kWgStages stages of [A0 hi, A0 lo, A1 hi,
//   A1 lo, P hi, P lo], then full[kWgStages], empty[kWgStages].
// Assumptions: kWgThreads threads; ncols <= NB * 128 < 2^31; At, Pt as opm_pack_a_kernel and the
//   stage-1 kernel opm_wfirst_proj_wg_kernel write them; 16-byte aligned.
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kWgThreads, 1) opm_wfirst_wg_kernel(
    const float* __restrict__ At, const float* __restrict__ Pt, const float* __restrict__ inv_denom,
    const float* __restrict__ bo, float* __restrict__ out, int64_t B, int64_t N, int64_t MB128, int64_t NB,
    int64_t KB, int64_t j0, int64_t ncols, int cz, int CZP4) {
#if defined(OPM_WG_DEVICE)
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + kWgStages * kWgStage);
  uint64_t* empty = full + kWgStages;
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t total = B * MB128 * NB;
  const int kbs = static_cast<int>(KB);
  if (tid == 0) mbar_ring_init(full, empty, kWgStages);
  __syncthreads();
  if (wg == 2) {  // producer warp
    if (tid == 256) {
      const int64_t MB64 = 2 * MB128;
      uint32_t u = 0;  // stage uses so far (32 bits: a 64-bit u % kWgStages is ~40 dependent instructions)
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const int64_t mblk = t % MB128, nb = (t / MB128) % NB, b = t / (MB128 * NB);
        const float* a0 = At + (b * MB64 + 2 * mblk) * KB * (2 * kWgAPlane);
        const float* a1 = a0 + KB * (2 * kWgAPlane);
        const float* p = Pt + (b * NB + nb) * KB * (2 * kWgBPlane);
        for (int kb = 0; kb < kbs; ++kb, ++u) {
          const int st = static_cast<int>(u % kWgStages);
          if (u >= kWgStages) mbar_wait(empty + st, (u / kWgStages - 1) & 1);
          mbar_expect_tx(full + st, 4 * kWgStage);
          float* dst = sm + st * kWgStage;
          bulk_copy(dst, a0 + kb * (2 * kWgAPlane), 4 * 2 * kWgAPlane, full + st);
          bulk_copy(dst + 2 * kWgAPlane, a1 + kb * (2 * kWgAPlane), 4 * 2 * kWgAPlane, full + st);
          bulk_copy(dst + 4 * kWgAPlane, p + kb * (2 * kWgBPlane), 4 * 2 * kWgBPlane, full + st);
        }
      }
    }
    return;  // (no block-wide barrier after this point)
  }
  const int lane = tid % 32, g = lane / 4, t4 = lane % 4, w4 = (tid / 32) % 4;
  const bool pair = (cz & 1) == 0;  // then CZP4 is even, z even, and z + 1 < c_z whenever z < c_z
  uint32_t u = 0;
  float acc[64], d[64];
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t mblk = t % MB128, nb = (t / MB128) % NB, b = t / (MB128 * NB);
#pragma unroll
    for (int q = 0; q < 64; ++q) acc[q] = d[q] = 0.f;
    for (int kb = 0; kb < kbs; ++kb, ++u) {
      const int st = static_cast<int>(u % kWgStages);
      mbar_wait(full + st, (u / kWgStages) & 1);
      const float* a_hi = sm + st * kWgStage + wg * 2 * kWgAPlane;
      const float* a_lo = a_hi + kWgAPlane;
      const float* b_hi = sm + st * kWgStage + 4 * kWgAPlane;
      const float* b_lo = b_hi + kWgBPlane;
      wg_fence_acc(d);
      wgmma_split_stage_m64n128<kWgBK / 8, kWgPromo>(d, a_hi, a_lo, b_hi, b_lo, 1024, kb * (kWgBK / 8));
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      wg_fence_acc(d);
      if (lane == 0) mbar_arrive(empty + st);  // this warp is done with the stage
      if (((kb + 1) * (kWgBK / 8)) % kWgPromo == 0) {
#pragma unroll
        for (int q = 0; q < 64; ++q) acc[q] += d[q];
      }
    }
    if ((kbs * (kWgBK / 8)) % kWgPromo != 0) {  // the last, partial promotion period
#pragma unroll
      for (int q = 0; q < 64; ++q) acc[q] += d[q];
    }
    // Epilogue: acc[4 j + q] is row 128 mblk + 64 wg + 16 w4 + g + 8 (q / 2), column
    // 128 nb + 8 j + 2 t4 + q % 2; (jl, z) of the column stepped by 8 per j (no divisions in the
    // loop); pairs of columns as one 8-byte store where c_z is even.
    const int n0 = static_cast<int>(nb * kWgBRows) + 2 * t4, nc = static_cast<int>(ncols);
    int jl0 = n0 / CZP4, z00 = n0 - jl0 * CZP4;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t i = mblk * 128 + 64 * wg + 16 * w4 + g + 8 * hr;
      if (i >= N) continue;
      const float inv = inv_denom[b * N + i];
      float* orow = out + ((b * N + i) * N + j0) * cz;
      int jl = jl0, z = z00;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int n = n0 + 8 * j;
        const float v0 = acc[4 * j + 2 * hr], v1 = acc[4 * j + 2 * hr + 1];
        if (n < nc) {
          if (pair) {
            if (z < cz)
              *reinterpret_cast<float2*>(orow + static_cast<int64_t>(jl) * cz + z) =
                  make_float2(__ldg(bo + z) + inv * v0, __ldg(bo + z + 1) + inv * v1);
          } else {
            if (z < cz) orow[static_cast<int64_t>(jl) * cz + z] = __ldg(bo + z) + inv * v0;
            const int z1 = z + 1 < CZP4 ? z + 1 : 0, jl1 = z + 1 < CZP4 ? jl : jl + 1;  // column n + 1
            if (n + 1 < nc && z1 < cz) orow[static_cast<int64_t>(jl1) * cz + z1] = __ldg(bo + z1) + inv * v1;
          }
        }
        z += 8;
        while (z >= CZP4) {
          z -= CZP4;
          ++jl;
        }
      }
    }
  }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::wg_ok)
#endif
}

// ---------------------------------------------------------------------------------------------
// outer_wg (Hopper, sm_90a): outer_first on wgmma in split TF32, for CP = 32 (hidden_dim <= 32,
// zero-padded to 32). A block owns a pair tile of kOwTI = 16 residues i x kOwTJ = 4 residues j
// (64 pairs) and 128 pair channels z (zc = z chunk), and walks the hidden channels h in kOwNQ = 4
// chunks q of kOwHC = 8:
//   phase A (per q, K = S):  O_q[(il, hl), (jl, k)] = sum_s a[s, i, 8q + hl] b[s, j, k]
//     M = 128 rows (il, hl) (warpgroup w: il in [8w, 8w + 8)), N = 128 columns (jl, k), one
//     m64n128k8 wgmma per product per 8 s, operands from shared memory; promoted into fp32 every
//     64 s as in w_first_wg2.
//   O_q -> Os[p][kk] in shared memory (fp32), p = il*4 + jl, kk = hl*32 + ((k + 8 hl) & 31) (the
//     rotation by 8 hl makes the staging stores conflict-free; Wo's packed columns follow it).
//   phase B (per q, K = 256):  acc_out[p, z] += sum_kk Os[p][kk] WoP_q[z][kk]
//     M = 64 pairs, N = 64 z per warpgroup (w: z in [64w, 64w + 64)), A = Os from registers (each
//     warpgroup loads and splits the fragments itself), B = Wo's packed planes from shared memory,
//     m64n64k8; promoted every 64 kk.
//   out[b, i, j, z] = bo[z] + inv_denom[b, i] * acc_out: the (i, j, c, c) block never leaves the SM.
// FLOPs as executed (tensor cores, each x3 for the split): per tile and q, 2 * 128 * 128 * S16
//   (phase A) + 2 * 64 * 128 * 256 (phase B): outer_first's 2 N^2 c^2 (S + c_z) with S, c, c_z
//   padded to 16, 32, 128. Over w_first's stage 2 (2 N^2 S c c_z) that is c / c_z + c / S: fewer
//   FLOPs where S > 43 at c = 32, c_z = 128 (crop, long, deep), more at shallow (S = 32).
// Operands in tile order (written by opm_prep_ow_kernel and opm_ow_params_kernel), hi plane then lo
// plane per block:
//   Aow[b][q][kb][mb] blocks of 64 rows x 16 s: row r = (i % 8) * 8 + hl of residues i in
//     [8 mb, 8 mb + 8), element (r, s % 16) at wg_tile_off16(r, s % 16); the two blocks of one
//     tile (mb = 2 it, 2 it + 1) are adjacent: one 16 KB bulk copy.
//   Bow[b][nb][kb] blocks of 128 rows x 16 s: row r = (j % 4) * 32 + k, j in [4 nb, 4 nb + 4).
//   WoP[zc][q][hl] blocks of 128 z x 32 kl (wg_tile_off): Wo[zc*128 + z, (8q + hl) c + ((kl - 8 hl) & 31)].
//   Zeros past N, S, c, c_z.
// Pipeline: one ring of kOwStages 32 KB stages fed by one producer lane (bulk copies on full
//   mbarriers, empty mbarriers released by each consumer warp, as in w_first_wg2); per tile and q
//   the ring carries S16/16 phase-A stages (A blocks 16 KB + B block 16 KB) then 8 phase-B stages
//   (one Wo block, 32 KB each, one per hl), in the same order for producer and consumers.
// ---------------------------------------------------------------------------------------------
constexpr int kOwTI = 16, kOwTJ = 4;     // residues i, j per tile
constexpr int kOwHC = 8, kOwNQ = 4;      // h per chunk, chunks (CP = 32)
constexpr int kOwSK = 16;                // s per phase-A stage (two wgmma k steps)
constexpr int kOwZ = 128;                // pair channels per tile (two warpgroups of 64)
constexpr int kOwAPlane = 64 * kOwSK;    // floats of one plane of an A block (4 KB)
constexpr int kOwBPlane = 128 * kOwSK;   // floats of one plane of a B block (8 KB)
constexpr int kOwWPlane = kOwZ * 32;     // floats of one plane of a Wo block (16 KB)
constexpr int kOwStage = 2 * 2 * kOwAPlane + 2 * kOwBPlane;  // 32 KB: 2 A blocks + 1 B block
static_assert(kOwStage == 2 * kOwWPlane, "a phase-B stage (one Wo block) fills a ring slot");
constexpr int kOwStages = 5;
constexpr int kOwLDO = kOwHC * 32 + 4;   // Os row stride: 4 mod 32 words, conflict-free fragment loads
constexpr int kOwThreads = 384;          // 2 consumer warpgroups + 1 producer warpgroup (setmaxnreg)
constexpr int kOwConsumerRegs = 232, kOwProducerRegs = 40;
// setmaxnreg moves registers within the block's allocation (384 threads x 168, the launch bound's
// cap): more would leave setmaxnreg.inc waiting for registers that never come
static_assert(2 * 128 * kOwConsumerRegs + 128 * kOwProducerRegs <= kOwThreads * ((65536 / kOwThreads) & ~7),
              "outer_wg: register budget of the warpgroups");
constexpr size_t kOwSmemBytes = 4ull * (kOwStages * kOwStage + 64 * kOwLDO) + 16 * kOwStages;
// 16-k block (outer_wg's A and B blocks): 8-row groups 512 bytes apart
__host__ __device__ __forceinline__ int wg_tile_off16(int r, int k) {
  return (r >> 3) * 128 + (k >> 2) * 32 + (r & 7) * 4 + (k & 3);
}
// fp16 / bf16 input: A and B blocks of kOwS16 = 32 s in T, element (r, k) at ow_off16h(r, k): 8-row groups
// 512 bytes apart, each 4 core matrices (8 rows x 8 k, 128 bytes) along k; one ring slot of kOwSlot16
// floats (16 KB) holds a phase-A stage (2 A blocks + 1 B block, 4 + 4 + 8 KB) or a phase-B one (two Wo
// blocks in fp16, WoP16, 8 KB each, the same layout).
constexpr int kOwS16 = 32;
constexpr int kOwABlk16 = 64 * kOwS16, kOwBBlk16 = 128 * kOwS16;  // T elements of an A / B block
constexpr int kOwSlot16 = kOwStage / 2, kOwStages16 = 12;
constexpr int kOwWBlk16 = kOwZ * 32;  // T elements of one Wo block (128 z x 32 kk): two per phase-B slot
static_assert(2 * (2 * kOwABlk16 + kOwBBlk16) == 4 * kOwSlot16 && 2 * 2 * kOwWBlk16 == 4 * kOwSlot16, "outer_wg: 16-bit slots");
// Os16 (16-bit phase B's A operand, O / denom in fp16, rows scaled): rows of kOwLDO16 words (8 mod 32:
// conflict-free 8-byte fragment loads), each 8 hl blocks of 16 words (fp16 pairs), then the rows' 1 / scale
// (Osc, 64 floats). Word ow_os16_word(hl, m) of a row holds hidden
// k = 2m, 2m + 1 (m < 16): rotated by 4 (hl / 2) words so that the staging stores are conflict-free.
// Phase B's k16 step ks of block hl reads words 8 ks + 2 t4 and 8 ks + 2 t4 + 1 of a row as the A
// fragment's k = 2 t4, 2 t4 + 1 and 2 t4 + 8, 2 t4 + 9 (mma's m16n8k16 A layout).
constexpr int kOwLDO16 = 136;
__host__ __device__ __forceinline__ int ow_os16_word(int hl, int m) { return (m + 4 * (hl >> 1)) & 15; }
// The hidden k (of block hl) at phase-B position kap (0..31: k16 step kap / 16, fragment k kap % 16).
__host__ __device__ __forceinline__ int ow_wo16_k(int hl, int kap) {
  const int ks = kap >> 4, kk = kap & 15;
  const int w = 8 * ks + 2 * ((kk & 7) >> 1) + (kk >> 3);  // the Os16 word holding it
  return 2 * ((w - 4 * (hl >> 1)) & 15) + (kk & 1);
}
__host__ __device__ __forceinline__ int ow_off16h(int r, int k) { return (r >> 3) * 256 + (k >> 3) * 64 + (r & 7) * 8 + (k & 7); }
template <typename T>  // s per A / B block: 16 (fp32 split planes) or 32 (T planes)
__host__ __device__ constexpr int ow_block_s() { return std::is_same_v<T, float> ? kOwSK : kOwS16; }
template <typename T>  // outer_wg's dynamic shared memory: the ring, Os, the mbarriers
__host__ __device__ constexpr size_t ow_smem_bytes() {
  return std::is_same_v<T, float> ? kOwSmemBytes : 4ull * (kOwStages16 * kOwSlot16 + 64 * kOwLDO16 + 64) + 16 * kOwStages16;
}
constexpr size_t kOwSmemMax = ow_smem_bytes<__half>() > kOwSmemBytes ? ow_smem_bytes<__half>() : kOwSmemBytes;

// WoP's element group e3 in [0, nzc * kOwNQ * kOwHC * kOwZ * 8): 4 consecutive kl of one z row of
// one Wo block, split into both planes (WoP: see "outer_wg" above).
template <typename P>
__device__ __forceinline__ void pack_wop4(int64_t e3, const P* __restrict__ wo, float* __restrict__ WoP, int c,
                                          int cz) {
  const int m = static_cast<int>(e3 % 8), z = static_cast<int>((e3 / 8) % kOwZ);
  const int hl = static_cast<int>((e3 / (8 * kOwZ)) % kOwHC), q = static_cast<int>((e3 / (8 * kOwZ * kOwHC)) % kOwNQ);
  const int64_t zc = e3 / (8 * kOwZ * kOwHC * kOwNQ), zz = zc * kOwZ + z;
  const int h = q * kOwHC + hl, k0 = (4 * m - 8 * hl) & 31;  // kl = 4m .. 4m+3 -> k = k0 .. k0+3
  float v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) v[u] = (zz < cz && h < c && k0 + u < c) ? ldg_f(wo, zz * c * c + h * c + k0 + u) : 0.f;
  float* dst = WoP + ((zc * kOwNQ + q) * kOwHC + hl) * (2 * kOwWPlane) + wg_tile_off(z, 4 * m);
  store_split4(dst, dst + kOwWPlane, v[0], v[1], v[2], v[3]);
}

// WoP16's element group e3 in [0, nzc * kOwNQ * kOwHC * kOwZ * 8) (fp16 / bf16 input): 4 consecutive
// phase-B positions kap of one z row of one Wo block, in T = __half (exact for float16 weights; for
// bfloat16 ones too, but below 2^-14 (subnormal: absolute error under 2^-25) and above 65504), at
// ow_off16h(z, kap) of block (zc, q, hl) (kOwWBlk16 elements each; two blocks per phase-B slot).
template <typename T, typename P>
__device__ __forceinline__ void pack_wop16(int64_t e3, const P* __restrict__ wo, T* __restrict__ WoP16, int c,
                                           int cz) {
  const int m = static_cast<int>(e3 % 8), z = static_cast<int>((e3 / 8) % kOwZ);
  const int hl = static_cast<int>((e3 / (8 * kOwZ)) % kOwHC), q = static_cast<int>((e3 / (8 * kOwZ * kOwHC)) % kOwNQ);
  const int64_t zc = e3 / (8 * kOwZ * kOwHC * kOwNQ), zz = zc * kOwZ + z;
  const int h = q * kOwHC + hl;
  float v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int k = ow_wo16_k(hl, 4 * m + u);
    v[u] = (zz < cz && h < c && k < c) ? ldg_f(wo, zz * c * c + h * c + k) : 0.f;
  }
  T* dst = WoP16 + ((zc * kOwNQ + q) * kOwHC + hl) * kOwWBlk16 + ow_off16h(z, 4 * m);
  *reinterpret_cast<uint2*>(dst) = pack4_16<T>(v[0], v[1], v[2], v[3]);
}

// ---------------------------------------------------------------------------------------------
// outer_wg's LayerNorm + projections on the tensor cores (mma.sync split TF32), writing Aow and Bow
// directly: no aT / bq in global memory and no pack of them (opm_ow_params_kernel, opm_prep_ow_kernel).
// The LayerNorm affine is folded into the weights:
//   y[r, o] = rstd_r * sum_k (x[r, k] - mean_r) Wg[o, k] + bias'[o],    a / b = y * mask[r]
//   Wg[o, k] = gamma[k] W[o, k],  bias'[o] = bias[o] + sum_k beta[k] W[o, k]   (fp64 sum)
// with o < 32 the a channels (Wa row o) and o >= 32 the b channels (Wb row o - 32), zero where
// o % 32 >= c: the reference's (x_hat gamma + beta) . W + bias, summed in another order.
// Wf: Wg split into TF32 hi / lo planes in mma.sync B-fragment order, zero for k >= c_m:
//   Wf[((u * 8 + nt) * 2 + plane) * 128 + lane * 4 + e] = plane of Wg[8 nt + lane / 4, 16 u + 4 (lane % 4) + e]
// (the k order of opm_prep_ow_kernel: in each 16-k group u, lane t's k = 16u + 4t + {0, 1} make
// mma step 0's columns t and t + 4, and 16u + 4t + {2, 3} step 1's).
// For float16 / bfloat16 msa (w16) the products run on mma.sync m16n8k16 in float16 instead:
//   y[r, o] = isc[o] sum_k xn[r, k] (sc[o] Wg[o, k]) + bias'[o],   xn = (x - mean_r) rstd_r
// with sc[o] = 2^e the power of two that puts max_k |Wg[o, k]| sc[o] in [2^14, 2^15) (no float16
// overflow; the row's large values far above float16's subnormals) and isc[o] = 1 / sc[o]; |xn| <=
// sqrt(c_m), so xn needs no scale. Each operand is rounded to float16 (hi), and for float16 msa also
// split: lo = float16(v - hi), products lo hi + hi lo + hi hi (about 2^-21 relative, as split TF32);
// bfloat16 msa takes hi hi alone (2^-11 per operand, as one TF32 pass, under bfloat16's 2^-8).
// Wf (as float16, U * 8 * 2 * 128 halves, the first half of the float32 layout's space):
//   Wf16[(((u * 8 + nt) * 2 + plane) * 32 + lane) * 4 + e] = plane of sc Wg[8 nt + lane / 4, 16 u + 4 (lane % 4) + e]
// (lane t's k = 16u + 4t + {0, 1} are m16n8k16's k 2t, 2t + 1 (b0), 16u + 4t + {2, 3} its k 2t + 8,
// 2t + 9 (b1), as the x chunk that lane reads: a0 / a2).
// ---------------------------------------------------------------------------------------------
constexpr int kPoLDY = 64 * 4 + 4; // staging row (one n): 64 channels x 4 s, +4: conflict-free stores
constexpr int kPoBiasBlocks = 64;  // opm_ow_params_kernel: one block per channel o

// opm_ow_params_kernel: outer_wg's weight operands in one launch. Blocks [0, kPoBiasBlocks): bias'[o],
//   one block per o (threads over k, fp64), and with w16 also sc[o] and row o of Wf16 (above); the rest,
//   one grid-stride index over Wf's 4-element groups (U * 8 * 32, U = ceil(c_m / 16); none with w16)
//   then WoP's (pack_wop4; with wo16, pack_wop16: float16 blocks), then, where bof is not null, bo as
//   fp32 into bof (c_z). P: the parameters' type (float, __half or __nv_bfloat16), read as fp32.
//   Wf: (U * 8 * 2 * 128) floats (or Wf16) then bias' (64), then isc (64; 1 without w16), as above.
template <typename P>
__global__ void __launch_bounds__(kThreads) opm_ow_params_kernel(
    const P* __restrict__ ln_w, const P* __restrict__ ln_b, const P* __restrict__ wa, const P* __restrict__ ba,
    const P* __restrict__ wb, const P* __restrict__ bb, const P* __restrict__ wo, const P* __restrict__ bo,
    float* __restrict__ Wf, float* __restrict__ biasf, float* __restrict__ bof, void* __restrict__ WoP, int wo16, int w16,
    int cm, int c, int cz, int nzc) {
  const int tid = threadIdx.x;
  const int64_t blk = blockIdx.x;
  const int U = static_cast<int>(cdiv(cm, 16));
  if (blk < kPoBiasBlocks) {
    const int o = static_cast<int>(blk), h = o % 32, lane = tid % 32, warp = tid / 32;
    const P* W = o < 32 ? wa : wb;
    // thread's k = tid + kThreads i: all loads in flight at once, Wg kept for Wf16; the fp64 sums per
    // thread, then per warp by shuffles, then over the warps in order (zeros past c_m add nothing)
    constexpr int KI = kMaxMsaDim / kThreads;
    static_assert(KI * kThreads == kMaxMsaDim, "opm_ow_params_kernel: k chunks cover c_m");
    double acc = 0.0;
    float wg[KI], mx = 0.f;  // Wg[o, k]; max_k |Wg[o, k]|
#pragma unroll
    for (int i = 0; i < KI; ++i) {
      const int k = tid + kThreads * i;
      const bool in = h < c && k < cm;
      const float w = in ? ldg_f(W, static_cast<int64_t>(h) * cm + k) : 0.f;
      acc += static_cast<double>(in ? ldg_f(ln_b, k) : 0.f) * w;
      wg[i] = (in ? ldg_f(ln_w, k) : 0.f) * w;
      mx = fmaxf(mx, fabsf(wg[i]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      acc += __shfl_xor_sync(0xffffffffu, acc, off);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    __shared__ double red_d[kThreads / 32];
    __shared__ float red_m[kThreads / 32];
    if (lane == 0) {
      red_d[warp] = acc;
      red_m[warp] = mx;
    }
    __syncthreads();
    acc = 0.0;
    mx = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      acc += red_d[w];
      mx = fmaxf(mx, red_m[w]);
    }
    // sc = 2^e with mx sc in [2^14, 2^15) (mx = m 2^ex, m in [0.5, 1)); 1 for a zero or non-finite row
    int ex = 0;
    frexpf(mx, &ex);
    const int e = w16 && mx > 0.f && isfinite(mx) ? min(max(15 - ex, -126), 126) : 0;
    if (tid == 0) {
      biasf[o] = h < c ? static_cast<float>(static_cast<double>(ldg_f(o < 32 ? ba : bb, h)) + acc) : 0.f;
      biasf[64 + o] = ldexpf(1.f, -e);
    }
    if (w16) {  // row o of Wf16: k over 16 U (<= kMaxMsaDim), zeros past c_m
      const float sc = ldexpf(1.f, e);
      __half* W16 = reinterpret_cast<__half*>(Wf);
      const int nt = o / 8, g = o % 8;
#pragma unroll
      for (int i = 0; i < KI; ++i) {
        const int k = tid + kThreads * i;
        if (k < 16 * U) {
          const float v = wg[i] * sc;
          const __half hi = from_float<__half>(v), lo = from_float<__half>(v - __half2float(hi));
          const int u = k / 16, t = (k % 16) / 4;
          __half* dst = W16 + ((static_cast<int64_t>(u * 8 + nt) * 2) * 32 + 4 * g + t) * 4 + k % 4;
          dst[0] = hi;
          dst[32 * 4] = lo;
        }
      }
    }
    return;
  }
  const int64_t nF = w16 ? 0 : static_cast<int64_t>(U) * 8 * 32;
  const int64_t nW = static_cast<int64_t>(nzc) * kOwNQ * kOwHC * kOwZ * 8;
  const int64_t nB = bof != nullptr ? cz : 0;  // bo as fp32 (16-bit parameters)
  const int64_t stride = (gridDim.x - kPoBiasBlocks) * static_cast<int64_t>(kThreads);
  for (int64_t e = (blk - kPoBiasBlocks) * kThreads + tid; e < nF + nW + nB; e += stride) {
    if (e >= nF + nW) {
      bof[e - nF - nW] = ldg_f(bo, e - nF - nW);
      continue;
    }
    if (e >= nF) {
      if (wo16) pack_wop16(e - nF, wo, static_cast<__half*>(WoP), c, cz);
      else pack_wop4(e - nF, wo, static_cast<float*>(WoP), c, cz);
      continue;
    }
    const int ln = static_cast<int>(e % 32), nt = static_cast<int>((e / 32) % 8);
    const int64_t u = e / 256;
    const int o = 8 * nt + ln / 4, h = o % 32, k0 = static_cast<int>(16 * u) + 4 * (ln % 4);
    const P* W = o < 32 ? wa : wb;
    float v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      v[q] = (h < c && k0 + q < cm) ? ldg_f(ln_w, k0 + q) * ldg_f(W, static_cast<int64_t>(h) * cm + k0 + q) : 0.f;
    float* dst = Wf + (u * 8 + nt) * 256 + ln * 4;
    store_split4(dst, dst + 128, v[0], v[1], v[2], v[3]);
  }
}

// opm_prep_ow_kernel<MT>'s x tile: 16 MT rows of LDX floats (po_ldx: c_m rounded up to 4, then to
// 16 mod 32 words), or the staging (4 MT rows of kPoLDY) that reuses it.
__host__ __device__ __forceinline__ int po_ldx(int cm) {
  const int l = (cm + 3) & ~3;
  return l + ((16 - l % 32) + 32) % 32;
}
__host__ __device__ __forceinline__ int po_tile_floats(int cm, int MT) {
  const int x = 16 * MT * po_ldx(cm), y = 4 * MT * kPoLDY;
  return x > y ? x : y;
}

#if defined(OPM_WG_DEVICE)
// Tile wt of opm_prep_ow_kernel (4 s x NW n) -> (b, n0, s0) and its valid s / n counts (rows past S or
// N are zeros). 32-bit decode: the host keeps the tile count under 2^31 (64-bit division is a call).
struct PoTile {
  int64_t b, n0, s0;
  int ns, nn;
};
__device__ __forceinline__ PoTile po_tile(int64_t wt, int64_t NNT, int64_t NSQ, int64_t S, int64_t N, int NW) {
  const uint32_t w = static_cast<uint32_t>(wt), nnt = static_cast<uint32_t>(NNT), nsq = static_cast<uint32_t>(NSQ);
  const uint32_t wq = w / nnt;
  PoTile p;
  p.b = wq / nsq;
  p.n0 = static_cast<int64_t>(NW) * (w - wq * nnt);
  p.s0 = 4 * static_cast<int64_t>(wq - static_cast<uint32_t>(p.b) * nsq);
  p.ns = static_cast<int>(min64(4, max64(0, S - p.s0)));
  p.nn = static_cast<int>(min64(NW, max64(0, N - p.n0)));
  return p;
}
__device__ __forceinline__ bool po_row_ok(const PoTile& p, int rho) { return rho % 4 < p.ns && rho / 4 < p.nn; }
__device__ __forceinline__ int64_t po_row(const PoTile& p, int64_t S, int64_t N, int rho) {  // msa row of rho
  return (p.b * S + p.s0 + rho % 4) * N + p.n0 + rho / 4;
}
// 16-bit x of tile p into the x tile as fp32: warp w's rows rho = w + 4 r (r < RPW), the lane's 8
// values at k = 256 c + 8 lane (c < CPL, k < c_m; c_m % 8 == 0), valid rows only (the rest is zeroed
// apart). Every load of the warp is issued before the first conversion (RPW CPL 16-byte loads in
// flight per lane; a loop over the rows kept one).
template <int RPW, int CPL, typename T>
__device__ __forceinline__ void po_load16(float* xs, int LDX, const T* __restrict__ x, const PoTile& p, int64_t S,
                                          int64_t N, int cm, int warp, int lane) {
  uint4 v[RPW][CPL];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int rho = warp + 4 * r;
    const bool ok = po_row_ok(p, rho);
    const T* src = x + (ok ? po_row(p, S, N, rho) * cm : 0);
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int k = 256 * c + 8 * lane;
      v[r][c] = ok && k < cm ? __ldg(reinterpret_cast<const uint4*>(src + k)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int rho = warp + 4 * r;
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int k = 256 * c + 8 * lane;
      if (po_row_ok(p, rho) && k < cm) {
        const float2 f0 = to_float2<T>(v[r][c].x), f1 = to_float2<T>(v[r][c].y);
        const float2 f2 = to_float2<T>(v[r][c].z), f3 = to_float2<T>(v[r][c].w);
        float* dst = xs + rho * LDX + k;
        *reinterpret_cast<float4*>(dst) = make_float4(f0.x, f0.y, f1.x, f1.y);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(f2.x, f2.y, f3.x, f3.y);
      }
    }
  }
}
// The 16-bit preps' A fragment (opm_prep_ow_kernel, opm_prep16_kernel): the lane's 4 values v (k 16 u + 4 t
// .. + 3) of row half hf (rows g, g + 8) as xn = (v - m) rs rounded to float16 into ah[hf] (k + {0, 1}) and
// ah[hf + 2] (k + {2, 3}); kSplit: also lo = float16(xn - hi) into al.
template <bool kSplit>
__device__ __forceinline__ void po_frag16(float4 v, float m, float rs, int hf, uint32_t (&ah)[4], uint32_t (&al)[4]) {
  const float x0 = (v.x - m) * rs, x1 = (v.y - m) * rs, x2 = (v.z - m) * rs, x3 = (v.w - m) * rs;
  ah[hf] = pack2_16<__half>(x0, x1);
  ah[hf + 2] = pack2_16<__half>(x2, x3);
  if constexpr (kSplit) {
    const float2 h01 = to_float2<__half>(ah[hf]), h23 = to_float2<__half>(ah[hf + 2]);
    al[hf] = pack2_16<__half>(x0 - h01.x, x1 - h01.y);
    al[hf + 2] = pack2_16<__half>(x2 - h23.x, x3 - h23.y);
  }
}
// acc += a b for one m16n8k16 step in float16: kSplit lo hi + hi lo + hi hi into a fresh accumulator, then
// added (B fragment hi bh0 / bh1, lo bl0 / bl1); else hi hi straight into acc.
template <bool kSplit>
__device__ __forceinline__ void po_mma16(float (&acc)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                         uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  if constexpr (kSplit) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma_f16(d, al, bh0, bh1);  // the small terms first
    mma_f16(d, ah, bl0, bl1);
    mma_f16(d, ah, bh0, bh1);
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] += d[q];
  } else {
    mma_f16(acc, ah, bh0, bh1);
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// opm_prep_ow_kernel<MT, T>: LayerNorm + both projections + mask for outer_wg, on mma.sync m16n8k8 in split
//   TF32 for float32 x; for float16 / bfloat16 x on m16n8k16 in float16 (Wf16 above: split for float16, one
//   pass for bfloat16, whose a and b are rounded to 2^-8 after it). A block (4 warps) takes tiles of 4 s x
//   NW = 4 MT n (16 MT msa rows) of one b: s in [s0, s0 + 4) (s0 = 4 sq: a quarter of a 16-s block of the
//   fp32 planes, an eighth of a 32-s block of the T planes), n in [n0, n0 + NW); tiles cover s < kSS KBS
//   (kSS = ow_block_s<T>) and n < 16 NIT; rows past S or N are zeros and give zeros (mask 0, rstd 0).
//   Warp w computes channels o in [16 w, 16 w + 16) (two n8 tiles) for all the tile's rows, so each
//   weight fragment feeds MT m16 tiles. Per tile:
//   (1) x rows -> shared memory, row rho = 4 n_l + s_l at rho * LDX (LDX = 16 mod 32 words: the
//       fragment loads below are conflict-free): zeros for rows past S / N and columns [c_m, 16 U),
//       then one bulk copy per row (thread rho) on one mbarrier when c_m % 4 == 0, else plain loads;
//       float16 / bfloat16 x (T): 16-byte loads of 8 values per lane when c_m % 8 == 0, all of a
//       warp's rows in flight at once (po_load16), else one value per load; converted to fp32 into
//       the same tile.
//   (2) statistics, warp w < 2 MT for rows [8 w, 8 w + 8) (at MT 1 warps 2, 3 wait): lane (g, t) sums
//       the 16-byte chunks 4u + t of row 8 w + g; two passes (mean, then the centred sum of squares:
//       no cancellation at large offsets), 2 shuffles each; mean, rstd and the mask to st_s.
//   (3) y = (x - mean) . Wg over K = 16 U: per 16-k group u the lane's x chunk holds its two
//       A-fragment columns of two mma k steps (Wf's k order); B fragments from Wf (L1 / L2) in a
//       register ring of kWR groups (below), its first groups loaded during (2); per k step
//       the small terms, then hi*hi, into a fresh accumulator, promoted into fp32 by ordinary adds
//       (promoting once per group instead measured no faster: 151 vs 146 us at crop); one pass:
//       hi*hi into the running accumulator. 16-bit x: y = xn . (sc Wg), each 16-k group one
//       m16n8k16 k step (the lane's chunk is its a0 / a1 and a2 / a3 pairs), the split's three
//       products per group into a fresh accumulator, promoted as above.
//   (4) y * rstd + bias' (16-bit x: y * isc + bias'), times the mask, staged as ys[n_l][o][s_l] (row
//       kPoLDY) over the x tile, then read as 4 s of one (n, o) (16 bytes), split, and written to both
//       planes of Aow (o < 32) or Bow (o >= 32; j < 4 NBB): 8 lanes write 128 contiguous bytes per plane;
//       for T, rounded to T and written as 8 bytes at ow_off16h of the block (8 lanes: 8 rows of one core
//       matrix).
//       With a_rows (not null; hidden_dim 32), also a and b as rows: a_rows, b_rows (B, S, N, 32) fp32,
//       row po_row, channel o % 32, valid rows only (32 lanes write one row's 128 bytes per s): the a,
//       b that the backward takes. kPlanes false: the rows only (Aow, Bow not written).
// Blocks [0, n_den) compute inv_denom instead (inv_denom_cols), concurrently with the tiles.
// Shared memory (dynamic): po_tile_floats(c_m, MT) floats; static: the mbarrier, st_s.
// Assumptions: 128 threads (kPoThreads); Wf, biasf as opm_ow_params_kernel writes them; c_m <= kMaxMsaDim.
// ---------------------------------------------------------------------------------------------
constexpr int kPoThreads = 128;
// Blocks per SM that ptxas is held to: 5 for 16-bit x (96 registers; 37 KB of shared memory per block
// at c_m 256 allow 5 per SM, 4 above c_m 656; left free, ptxas takes up to 168 registers: 3 blocks; at 4 blocks, bfloat16 at crop
// 93 against 87 us, float16 134 against 126, H200, 2026-12-02); none for float32 (0 emits no
// .minnctapersm).
template <typename T>
constexpr int po_min_blocks() { return std::is_same_v<T, float> ? 0 : 5; }
template <int MT, typename T, bool kPlanes>
__global__ void __launch_bounds__(kPoThreads, po_min_blocks<T>()) opm_prep_ow_kernel(
    const T* __restrict__ x, const void* __restrict__ mask, int mask_kind, const float* __restrict__ Wf,
    const float* __restrict__ biasf, void* __restrict__ Aow_v, void* __restrict__ Bow_v, int64_t B, int64_t S,
    int64_t N, int cm, float eps, int64_t KBS, int64_t NIT, int64_t NBB, float* __restrict__ inv_denom, int n_den,
    float* __restrict__ a_rows, float* __restrict__ b_rows) {
#if defined(OPM_WG_DEVICE)
  constexpr int RT = 16 * MT, NW = 4 * MT;  // rows, residues n per tile
  constexpr bool k16 = !std::is_same_v<T, float>;        // 16-bit input: T planes (ow_off16h)
  constexpr int kSS = ow_block_s<T>();                      // s per plane block
  constexpr bool kSplitProj = !std::is_same_v<T, __nv_bfloat16>;  // bfloat16: one pass (hi hi, below)
  using PT = std::conditional_t<k16, T, float>;
  PT* Aow = static_cast<PT*>(Aow_v);
  PT* Bow = static_cast<PT*>(Bow_v);
  if (blockIdx.x < n_den) {  // blocks [0, n_den): inv_denom, beside the tiles (the fused kernel needs it)
    __shared__ double red_f[kPoThreads];
    __shared__ long long red_i[kPoThreads];
    inv_denom_cols(mask, mask_kind, B, S, N, inv_denom, blockIdx.x, n_den, red_f, red_i);
    return;
  }
  extern __shared__ float4 smem_f4[];
  float* xs = reinterpret_cast<float*>(smem_f4);
  __shared__ uint64_t bar;
  __shared__ float st_s[3][RT];  // per row rho: mean, rstd, mask
  const int LDX = po_ldx(cm), U = static_cast<int>(cdiv(cm, 16)), K16 = 16 * U;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  if (tid == 0) {
    mbar_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const bool bulk = (cm & 3) == 0;  // rows are 16-byte multiples at 16-byte aligned addresses
  const int64_t NNT = 16 * NIT / NW, NSQ = (kSS / 4) * KBS, ntiles = B * NSQ * NNT, MBA = 2 * NIT;
  unsigned phase = 0;
  // Wf's B fragments for (3): a ring of kWR 16-k groups in registers, group u in slot u % kWR,
  // refilled with group u + kWR once read, filled after each tile's x loads (its latency under the
  // statistics); (3) runs kWR groups per loop step so that no slot is copied (a one-group ring moved its
  // registers at every step and so waited there for the load just issued). float32: one group (its
  // prep, 146 us at crop, as before; a deeper ring there is not measured). bfloat16 reads no lo plane:
  // those loads are dead and the compiler drops them. Per lane and group one float4 per n8 tile and
  // plane (two TF32 k steps), or one uint2 (Wf16: one float16 k step of 16).
  constexpr int kWR = std::is_same_v<T, float> ? 1 : kSplitProj ? 2 : 4;
  using WV = std::conditional_t<k16, uint2, float4>;
  const WV* wf = reinterpret_cast<const WV*>(Wf) + (2 * warp) * 64 + lane;  // this warp's n8 tiles 2 warp, 2 warp + 1
  WV wh[kWR][2], wl[kWR][2];
  // 16-bit x with c_m % 8 == 0 (16-byte rows): po_load16 with RPW rows x CPL chunks per lane (MT 2
  // takes c_m <= 256, MT 1 c_m <= 768)
  constexpr int RPW = RT / 4, CPL = MT == 2 ? 1 : 3;
  static_assert(MT != 1 || 256 * CPL >= kMaxMsaDim, "opm_prep_ow_kernel: MT 1's chunks cover c_m");
  const bool ld16 = (cm & 7) == 0 && cm <= 256 * CPL;
  for (int64_t wt = blockIdx.x - n_den; wt < ntiles; wt += gridDim.x - n_den) {
    const PoTile p = po_tile(wt, NNT, NSQ, S, N, NW);
    // ---- (1) x -> xs ----
    for (int rho = warp; rho < RT; rho += kPoThreads / 32) {  // zeros: rows past S / N, columns [c_m, 16 U)
      const int c0 = po_row_ok(p, rho) ? cm : 0;
      for (int k = c0 + lane; k < K16; k += 32) xs[rho * LDX + k] = 0.f;
    }
    if constexpr (k16) {
      if (ld16) {
        po_load16<RPW, CPL, T>(xs, LDX, x, p, S, N, cm, warp, lane);
      } else {
        for (int rho = warp; rho < RT; rho += kPoThreads / 32)
          if (po_row_ok(p, rho)) {
            const T* src = x + po_row(p, S, N, rho) * cm;
            for (int k = lane; k < cm; k += 32) xs[rho * LDX + k] = to_float(src[k]);
          }
      }
    } else if (bulk) {
      if (p.ns * p.nn > 0) {
        if (tid == 0) mbar_expect_tx(&bar, static_cast<unsigned>(p.ns * p.nn * cm * 4));
        __syncthreads();  // the expected bytes are set before any copy can complete
        if (tid < RT && po_row_ok(p, tid))
          bulk_copy(xs + tid * LDX, x + po_row(p, S, N, tid) * cm, static_cast<unsigned>(cm * 4), &bar);
        mbar_wait(&bar, phase);
        phase ^= 1;
      }
    } else {
      for (int rho = warp; rho < RT; rho += kPoThreads / 32)
        if (po_row_ok(p, rho)) {
          const float* src = x + po_row(p, S, N, rho) * cm;
          for (int k = lane; k < cm; k += 32) xs[rho * LDX + k] = __ldg(src + k);
        }
    }
    // the ring's first groups, loading during the barrier and (2)
#pragma unroll
    for (int r = 0; r < kWR; ++r)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int ur = r < U ? r : U - 1;
        wh[r][j] = __ldg(wf + ur * 512 + j * 64);
        wl[r][j] = __ldg(wf + ur * 512 + j * 64 + 32);
      }
    __syncthreads();  // the tile (zeros and plain loads included) visible to every warp
    // ---- (2) statistics of rows 8 warp + g (warps < RT / 8) ----
    if (warp < RT / 8) {
      const int rho = 8 * warp + g;
      const float4* row = reinterpret_cast<const float4*>(xs + rho * LDX) + t;
      float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int u = 0; u < U; ++u) {  // columns >= c_m are zero
        const float4 v = row[4 * u];
        s4.x += v.x; s4.y += v.y; s4.z += v.z; s4.w += v.w;
      }
      const float mu = quad_sum((s4.x + s4.y) + (s4.z + s4.w)) / cm;
      float4 q4 = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int u = 0; u < U; ++u) {
        const float4 v = row[4 * u];
        const int k = 16 * u + 4 * t;
        const float d0 = k < cm ? v.x - mu : 0.f, d1 = k + 1 < cm ? v.y - mu : 0.f;
        const float d2 = k + 2 < cm ? v.z - mu : 0.f, d3 = k + 3 < cm ? v.w - mu : 0.f;
        q4.x = fmaf(d0, d0, q4.x); q4.y = fmaf(d1, d1, q4.y); q4.z = fmaf(d2, d2, q4.z); q4.w = fmaf(d3, d3, q4.w);
      }
      const float s2 = quad_sum((q4.x + q4.y) + (q4.z + q4.w));
      if (t == 0) {
        st_s[0][rho] = mu;
        // rows past S / N: rstd 0, so their y is 0 * 0 + bias' times mask 0 (1 / sqrt(eps) is inf at eps = 0)
        st_s[1][rho] = po_row_ok(p, rho) ? 1.f / sqrtf(s2 / cm + eps) : 0.f;
        st_s[2][rho] = po_row_ok(p, rho) ? mask_value(mask, po_row(p, S, N, rho), mask_kind) : 0.f;
      }
    }
    __syncthreads();  // st_s complete
    // ---- (3) acc[mt][j][2 hf + e] = sum_k (x - mean)[row 16 mt + 8 hf + g][k] Wg[16 warp + 8 j + 2 t + e][k] ----
    // (16-bit x: sum_k xn[row][k] sc Wg[o][k], xn = (x - mean) rstd, on m16n8k16 in float16)
    float mean[MT][2], rstd[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        mean[mt][hf] = st_s[0][16 * mt + 8 * hf + g];
        if constexpr (k16) rstd[mt][hf] = st_s[1][16 * mt + 8 * hf + g];
      }
    float acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mt][j][q] = 0.f;
#pragma unroll 1
    for (int u0 = 0; u0 < U; u0 += kWR) {
#pragma unroll
      for (int r = 0; r < kWR; ++r) {
        const int u = u0 + r;
        if (u >= U) break;
        if constexpr (k16) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t ah[4], al[4];  // m16n8k16 A fragment: the lane's chunk of rows g (hf 0) and g + 8 (hf 1)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              // columns >= c_m hold zeros, so -mean rstd there; Wf16 is zero there (finite values give 0)
              const float4 v = reinterpret_cast<const float4*>(xs + (16 * mt + 8 * hf + g) * LDX)[4 * u + t];
              po_frag16<kSplitProj>(v, mean[mt][hf], rstd[mt][hf], hf, ah, al);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j)
              po_mma16<kSplitProj>(acc[mt][j], ah, al, wh[r][j].x, wh[r][j].y, wl[r][j].x, wl[r][j].y);
          }
        } else {
          const uint32_t bh[2][2][2] = {  // [j][k step][b register]
              {{__float_as_uint(wh[r][0].x), __float_as_uint(wh[r][0].y)}, {__float_as_uint(wh[r][0].z), __float_as_uint(wh[r][0].w)}},
              {{__float_as_uint(wh[r][1].x), __float_as_uint(wh[r][1].y)}, {__float_as_uint(wh[r][1].z), __float_as_uint(wh[r][1].w)}}};
          const uint32_t bl[2][2][2] = {
              {{__float_as_uint(wl[r][0].x), __float_as_uint(wl[r][0].y)}, {__float_as_uint(wl[r][0].z), __float_as_uint(wl[r][0].w)}},
              {{__float_as_uint(wl[r][1].x), __float_as_uint(wl[r][1].y)}, {__float_as_uint(wl[r][1].z), __float_as_uint(wl[r][1].w)}}};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t ah[2][4], al[2][4];  // [k step][fragment register]
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              // columns >= c_m hold zeros, so -mean there; Wg is zero there (finite means give 0)
              const float4 v = reinterpret_cast<const float4*>(xs + (16 * mt + 8 * hf + g) * LDX)[4 * u + t];
              split_tf32(v.x - mean[mt][hf], ah[0][hf], al[0][hf]);
              split_tf32(v.y - mean[mt][hf], ah[0][hf + 2], al[0][hf + 2]);
              split_tf32(v.z - mean[mt][hf], ah[1][hf], al[1][hf]);
              split_tf32(v.w - mean[mt][hf], ah[1][hf + 2], al[1][hf + 2]);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
              for (int st = 0; st < 2; ++st) {
                if constexpr (kSplitProj) {
                  float d[4] = {0.f, 0.f, 0.f, 0.f};
                  mma_tf32(d, al[st], bh[j][st][0], bh[j][st][1]);  // the small terms first
                  mma_tf32(d, ah[st], bl[j][st][0], bl[j][st][1]);
                  mma_tf32(d, ah[st], bh[j][st][0], bh[j][st][1]);
#pragma unroll
                  for (int q = 0; q < 4; ++q) acc[mt][j][q] += d[q];
                } else {
                  mma_tf32(acc[mt][j], ah[st], bh[j][st][0], bh[j][st][1]);
                }
              }
          }
        }
        if (u + kWR < U) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            wh[r][j] = __ldg(wf + (u + kWR) * 512 + j * 64);
            wl[r][j] = __ldg(wf + (u + kWR) * 512 + j * 64 + 32);
          }
        }
      }
    }
    // ---- (4) staging: ys[n_l * kPoLDY + 4 o + s_l], row rho = 16 mt + 8 hf + g -> n_l = rho / 4, s_l = g % 4 ----
    __syncthreads();  // every warp's reads of xs are done: ys overwrites it
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int rho = 16 * mt + 8 * hf + g;
        const float rs = st_s[1][rho], mr = st_s[2][rho];
        float* yrow = xs + (rho / 4) * kPoLDY + rho % 4;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int o = 16 * warp + 8 * j + 2 * t + e;
            // (16-bit x: rstd is in xn, and isc[o], after bias', undoes Wf16's row scale exactly)
            const float f = k16 ? __ldg(biasf + 64 + o) : rs;
            yrow[4 * o] = (acc[mt][j][2 * hf + e] * f + __ldg(biasf + o)) * mr;
          }
      }
    __syncthreads();  // ys complete
    const int64_t kb = p.s0 / kSS, quad = (p.s0 % kOwSK) / 4;  // (quad: the fp32 planes' 16-s blocks)
#pragma unroll
    for (int iu = 0; iu < NW * 64 / kPoThreads; ++iu) {  // unit e = (n_l, o): o = e % 64 (lanes along o)
      const int e = tid + kPoThreads * iu, n_l = e / 64, o = e % 64;
      const float4 v = *reinterpret_cast<const float4*>(xs + n_l * kPoLDY + 4 * o);
      const int64_t n = p.n0 + n_l;
      if (a_rows != nullptr && n_l < p.nn) {  // rows (b, s0 + s_l, n): po_row of rho = 4 n_l + s_l
        float* dst = (o < 32 ? a_rows : b_rows) + ((p.b * S + p.s0) * N + n) * 32 + o % 32;
        const int64_t step = N * 32;
        if (p.ns > 0) dst[0] = v.x;
        if (p.ns > 1) dst[step] = v.y;
        if (p.ns > 2) dst[2 * step] = v.z;
        if (p.ns > 3) dst[3 * step] = v.w;
      }
      if (!kPlanes) continue;
      if constexpr (k16) {  // 4 s of one row: 8 bytes at ow_off16h (see "outer_wg": 32-s blocks of T)
        const int ks = static_cast<int>(p.s0 % kSS);
        if (o < 32) {
          const int q = o / 8, hl = o % 8;
          PT* dst = Aow + (((p.b * kOwNQ + q) * KBS + kb) * MBA + n / 8) * kOwABlk16 + ow_off16h(static_cast<int>(n % 8) * 8 + hl, ks);
          *reinterpret_cast<uint2*>(dst) = pack4_16<T>(v.x, v.y, v.z, v.w);
        } else if (n < 4 * NBB) {
          const int k = o - 32;
          PT* dst = Bow + ((p.b * NBB + n / 4) * KBS + kb) * kOwBBlk16 + ow_off16h(static_cast<int>(n % 4) * 32 + k, ks);
          *reinterpret_cast<uint2*>(dst) = pack4_16<T>(v.x, v.y, v.z, v.w);
        }
      } else if (o < 32) {
        const int q = o / 8, hl = o % 8;
        float* dst = Aow + (((p.b * kOwNQ + q) * KBS + kb) * MBA + n / 8) * (2 * kOwAPlane) + (n % 8) * 128 + quad * 32 + hl * 4;
        store_split4(dst, dst + kOwAPlane, v.x, v.y, v.z, v.w);
      } else if (n < 4 * NBB) {
        const int k = o - 32;
        float* dst = Bow + ((p.b * NBB + n / 4) * KBS + kb) * (2 * kOwBPlane) + ((n % 4) * 4 + k / 8) * 128 + quad * 32 + (k % 8) * 4;
        store_split4(dst, dst + kOwBPlane, v.x, v.y, v.z, v.w);
      }
    }
    // every thread's generic accesses of xs ordered before the next tile's bulk copies
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
  }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// ---------------------------------------------------------------------------------------------
// opm_prep16_kernel<T, kPlanes, kU>: opm_prep_ow_kernel's work for a 16-bit msa (T float16 / bfloat16) with
//   c_m % 16 == 0 and c_m <= 256, every warp on its own tiles: no block barrier after the block's weights
//   are staged. A warp tile is 8 s x 2 n (16 msa rows) of one b: s in [s0, s0 + 8) (s0 = 8 sq), n in
//   [n0, n0 + 2); tiles cover s < kOwS16 KBS and n < 16 NIT, rows past S or N give zeros (mask 0, rstd 0).
//   Lane (g, t) owns rows (s0 + g, n0 + hf) (hf = 0, 1: m16n8k16's rows g and g + 8) and in each 16-k
//   group u the 4 values k = 16 u + 4 t .. + 3 of both, which are its A fragment in Wf16's k order
//   (fragment registers 0 / 1, rows g / g + 8, hold k 16 u + 4 t + {0, 1}; registers 2 / 3 hold + {2, 3}).
//   Per tile:
//   (1) every 8-byte load of the lane's 2 x c_m / 4 values issued at once (c_m / 2 16-bit values in c_m / 4
//       registers; 64 where U is a run-time value), the rows' mask values;
//   (2) statistics as opm_prep_ow_kernel's: the lane sums its chunk of each row over u (4 partial sums),
//       then the quad by 2 shuffles; two passes (mean, then the centred sum of squares);
//   (3) y = xn . (sc Wg) on m16n8k16 in float16, xn = (x - mean) rstd rounded to float16 (float16 msa:
//       split, lo hi + hi lo + hi hi per group into a fresh accumulator, then added), all 8 n8 tiles of
//       o (a and b channels) per warp, B fragments from the block's copy of Wf16 in shared memory (one
//       16-byte load per lane for two n8 tiles' hi, or one tile's hi and lo);
//   (4) (y isc + bias') mask: where a_rows is not null, written as fp32 rows (as opm_prep_ow_kernel's);
//       where kPlanes, rounded to T and staged as ys[hf][o][s_l] in the warp's shared memory, then each
//       (n, o) written as 16 bytes (8 s: one row of a core matrix) at ow_off16h of the Aow / Bow block.
//   Every operation and its order per a / b value is opm_prep_ow_kernel's, so a and b are bit-equal
//   (the planes hold the same values rounded to T by the same rounding). inv_denom: inv_denom_cols adds
//   blockDim.x / 32 partial sums per column, 8 here against 4 there, so a float mask's fp64 sum can
//   differ in its last bit where it is not exact (integer and bool masks sum exactly in int64).
// Blocks [0, n_den) compute inv_denom instead (inv_denom_cols); the host launches at most 2 blocks per
//   SM in all, so that every block is resident from the start (the tiles are split statically).
// kU: c_m / 16 at compile time (16: c_m 256, no guards per group), or 0 (c_m / 16 at run time).
// Shared memory (dynamic, p16_smem_bytes): Wf16's B fragments of the planes read (hi; float16 msa hi and
//   lo), U * 4 * NP x 32 uint4, bias' and isc (128 floats), then per warp ys [2][64][8] T.
// Assumptions: kP16Threads threads; x 8-byte aligned; Wf, biasf as opm_ow_params_kernel writes them with
//   w16; 16 <= c_m <= 256, c_m % 16 == 0; the tile count under 2^31.
// ---------------------------------------------------------------------------------------------
constexpr int kP16Warps = 8, kP16Threads = 32 * kP16Warps, kP16MaxU = 16;  // kP16MaxU: 16-k groups (c_m <= 256)
template <typename T>
__host__ __device__ constexpr int p16_planes() { return std::is_same_v<T, __half> ? 2 : 1; }
template <typename T>
__host__ __device__ constexpr size_t p16_smem_bytes(int cm) {
  return 8ull * (cm / 16) * 8 * p16_planes<T>() * 32 + 4ull * 128 + 2ull * kP16Warps * 2 * 64 * 8;
}
template <typename T, bool kPlanes, int kU>
__global__ void __launch_bounds__(kP16Threads, 2) opm_prep16_kernel(
    const T* __restrict__ x, const void* __restrict__ mask, int mask_kind, const float* __restrict__ Wf,
    const float* __restrict__ biasf, T* __restrict__ Aow, T* __restrict__ Bow, int64_t B, int64_t S, int64_t N,
    int cm, float eps, int64_t KBS, int64_t NIT, int64_t NBB, float* __restrict__ inv_denom, int n_den,
    float* __restrict__ a_rows, float* __restrict__ b_rows) {
#if defined(OPM_WG_DEVICE)
  constexpr bool kSplit = std::is_same_v<T, __half>;  // float16 msa: split products
  constexpr int NP = p16_planes<T>();
  if (blockIdx.x < n_den) {  // blocks [0, n_den): inv_denom, beside the tiles
    __shared__ double red_f[kP16Threads];
    __shared__ long long red_i[kP16Threads];
    inv_denom_cols(mask, mask_kind, B, S, N, inv_denom, blockIdx.x, n_den, red_f, red_i);
    return;
  }
  extern __shared__ uint4 p16_smem[];
  const int U = kU > 0 ? kU : cm / 16;
  const uint4* ws = p16_smem;                                      // B fragments, 16 bytes per lane
  float* bs = reinterpret_cast<float*>(p16_smem + U * 4 * NP * 32);  // bias'[64], isc[64]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  T* ys = reinterpret_cast<T*>(bs + 128) + warp * (2 * 64 * 8);  // [hf][o][s_l]
  {
    // Wf16: [(u * 8 + nt) * 2 + plane][lane] uint2 -> ws: float16 msa [(u * 8 + nt)][lane] (hi, lo),
    // bfloat16 [(u * 4 + nt / 2)][lane] (hi of nt, hi of nt + 1)
    const uint2* src = reinterpret_cast<const uint2*>(Wf);
    for (int i = tid; i < U * 4 * NP * 32; i += kP16Threads) {
      const int f = i / 32, ln = i % 32;
      const uint2 v0 = __ldg(src + (NP == 2 ? 2 * f : 4 * f) * 32 + ln);
      const uint2 v1 = __ldg(src + (NP == 2 ? 2 * f + 1 : 4 * f + 2) * 32 + ln);
      p16_smem[i] = make_uint4(v0.x, v0.y, v1.x, v1.y);
    }
    if (tid < 128) bs[tid] = __ldg(biasf + tid);
  }
  __syncthreads();  // the block's weights staged; from here on every warp runs alone
  const uint32_t NN2 = static_cast<uint32_t>(8 * NIT), NS8 = static_cast<uint32_t>(4 * KBS);
  const uint32_t ntiles = static_cast<uint32_t>(B) * NS8 * NN2, MBA = static_cast<uint32_t>(2 * NIT);
  const uint32_t stride = static_cast<uint32_t>(gridDim.x - n_den) * kP16Warps;
  for (uint32_t wt = static_cast<uint32_t>(blockIdx.x - n_den) * kP16Warps + warp; wt < ntiles; wt += stride) {
    const uint32_t np = wt % NN2, rest = wt / NN2, sq = rest % NS8;
    const int64_t b = rest / NS8, s = 8 * static_cast<int64_t>(sq) + g, n0 = 2 * static_cast<int64_t>(np);
    const int64_t row0 = (b * S + s) * N + n0;  // msa row of hf 0; hf 1 is row0 + 1
    const bool ok[2] = {s < S && n0 < N, s < S && n0 + 1 < N};
    // ---- (1) the lane's values of both rows, all loads in flight; the rows' mask values ----
    uint2 xr[kP16MaxU][2];
#pragma unroll
    for (int u = 0; u < kP16MaxU; ++u)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        xr[u][hf] = ok[hf] && u < U ? __ldg(reinterpret_cast<const uint2*>(x + (row0 + hf) * cm + 16 * u + 4 * t))
                                    : make_uint2(0u, 0u);
    float mk[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) mk[hf] = ok[hf] ? mask_value(mask, row0 + hf, mask_kind) : 0.f;
    // ---- (2) statistics: mean, rstd of rows hf ----
    float mean[2], rstd[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < kP16MaxU; ++u)
        if (u < U) {
          const float2 v01 = to_float2<T>(xr[u][hf].x), v23 = to_float2<T>(xr[u][hf].y);
          s4.x += v01.x; s4.y += v01.y; s4.z += v23.x; s4.w += v23.y;
        }
      const float mu = quad_sum((s4.x + s4.y) + (s4.z + s4.w)) / cm;
      float4 q4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < kP16MaxU; ++u)
        if (u < U) {
          const float2 v01 = to_float2<T>(xr[u][hf].x), v23 = to_float2<T>(xr[u][hf].y);
          const float d0 = v01.x - mu, d1 = v01.y - mu, d2 = v23.x - mu, d3 = v23.y - mu;
          q4.x = fmaf(d0, d0, q4.x); q4.y = fmaf(d1, d1, q4.y); q4.z = fmaf(d2, d2, q4.z); q4.w = fmaf(d3, d3, q4.w);
        }
      const float s2 = quad_sum((q4.x + q4.y) + (q4.z + q4.w));
      mean[hf] = mu;
      rstd[hf] = ok[hf] ? 1.f / sqrtf(s2 / cm + eps) : 0.f;  // rows past S / N: y = bias' times mask 0
    }
    // ---- (3) acc[nt][2 hf + e] = sum_k xn[row hf][k] sc Wg[8 nt + 2 t + e][k] ----
    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
#pragma unroll
    for (int u = 0; u < kP16MaxU; ++u) {
      if (u >= U) break;
      uint32_t ah[4], al[4];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float2 v01 = to_float2<T>(xr[u][hf].x), v23 = to_float2<T>(xr[u][hf].y);
        po_frag16<kSplit>(make_float4(v01.x, v01.y, v23.x, v23.y), mean[hf], rstd[hf], hf, ah, al);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if constexpr (kSplit) {
          const uint4 w = ws[(u * 8 + nt) * 32 + lane];  // hi, lo
          po_mma16<true>(acc[nt], ah, al, w.x, w.y, w.z, w.w);
        } else if (nt % 2 == 0) {
          const uint4 w = ws[(u * 4 + nt / 2) * 32 + lane];  // hi of nt, of nt + 1
          mma_f16(acc[nt], ah, w.x, w.y);
          mma_f16(acc[nt + 1], ah, w.z, w.w);
        }
      }
    }
    // ---- (4) y = (acc isc + bias') mask: fp32 rows and / or the T planes ----
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int o = 8 * nt + 2 * t;
        const float y0 = (acc[nt][2 * hf] * bs[64 + o] + bs[o]) * mk[hf];
        const float y1 = (acc[nt][2 * hf + 1] * bs[64 + o + 1] + bs[o + 1]) * mk[hf];
        if (a_rows != nullptr && ok[hf])  // (B, S, N, 32) fp32: a for o < 32, b above
          *reinterpret_cast<float2*>((nt < 4 ? a_rows : b_rows) + (row0 + hf) * 32 + o % 32) = make_float2(y0, y1);
        if constexpr (kPlanes) {
          ys[(hf * 64 + o) * 8 + g] = from_float<T>(y0);
          ys[(hf * 64 + o + 1) * 8 + g] = from_float<T>(y1);
        }
      }
    if constexpr (kPlanes) {
      __syncwarp();  // ys complete
      const int64_t kb = sq / 4;
      const int ks = 8 * static_cast<int>(sq % 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // unit e = (hf, o): lanes along o
        const int e = lane + 32 * i, hf = e / 64, o = e % 64;
        const uint4 v = *reinterpret_cast<const uint4*>(ys + e * 8);
        const int64_t n = n0 + hf;
        if (o < 32) {
          const int q = o / 8, hl = o % 8;
          T* dst = Aow + (((b * kOwNQ + q) * KBS + kb) * MBA + n / 8) * kOwABlk16 +
                   ow_off16h(static_cast<int>(n % 8) * 8 + hl, ks);
          *reinterpret_cast<uint4*>(dst) = v;
        } else if (n < 4 * NBB) {
          T* dst = Bow + ((b * NBB + n / 4) * KBS + kb) * kOwBBlk16 +
                   ow_off16h(static_cast<int>(n % 4) * 32 + o - 32, ks);
          *reinterpret_cast<uint4*>(dst) = v;
        }
      }
    }
    __syncwarp();  // ys read before the next tile's stores
  }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// ---------------------------------------------------------------------------------------------
// opm_outer_wg_kernel: outer_wg's fused kernel (see "outer_wg" above). Persistent: block b takes
//   tiles b, b + grid, ...; tile t -> (it = t % NIT, jt, zc, b): neighbouring blocks share the B
//   blocks of one jt in L2.
// Warps 0-7: two consumer warpgroups (setmaxnreg to kOwConsumerRegs: the 64 + 64 + 32 accumulators
//   do not fit the 168 registers a 384-thread block starts with); warps 8-11: the producer
//   warpgroup (down to kOwProducerRegs), of which thread 256 issues the copies. Stage use u counts ring slots
//   over the block's whole walk: slot u % kStages, parity (u / kStages) & 1 (the producer's u is 32-bit;
//   the consumers keep the slot and parity incrementally).
// Per thread: phase A acc[64] (running) + d[64] (fresh; 16-bit: acc alone, all of S); phase B o[32]
//   (running, over all q; 16-bit: from the bias) + d2[32] (fresh); o lives across the whole tile.
// Shared memory (dynamic, ow_smem_bytes<T>): the ring [kStages][kSlot], then float: Os [64][kOwLDO]
//   (5 x 32 KB + 65 KB + the barriers: 230480 bytes); fp16 / bf16: Os16 [64][kOwLDO16 words] and Osc [64]
//   (12 x 16 KB + 34 KB: 231872 bytes); then full[kStages], empty[kStages].
// Named barrier 1 (256 consumer threads) guards Os (Os16, Osc): before the staging (the previous q's
//   phase-B loads are done) and after it.
// Split TF32: every stage's wgmmas are waited for (wait_group 0) before the next stage's are issued;
//   the two warpgroups fill each other's waits (keeping one stage in flight, wait_group 1 with a full
//   wait only at each promotion, is no faster). 16-bit: one phase-A stage's (one phase-B slot's)
//   wgmmas stay in flight while the next one's are issued, each slot released once its wgmmas are done.
// T float: split TF32 throughout (fp32 planes, hi and lo). T __nv_bfloat16 / __half (16-bit input and
//   output): phase A on the 16-bit tensor cores (wgmma m64n128k16, fp32 accumulation) from the T planes
//   of 32-s blocks (a and b rounded to T, as the reference in that dtype rounds its projections), two
//   k steps per stage; phase B on wgmma m64n64k16 in fp16 for both types: O / denom rounded to fp16
//   (2^-11, under bfloat16's 2^-8 and equal to float16's, where the reference rounds O and O / denom
//   to T), each pair's row scaled by a power of two first (no overflow), Wo in fp16 blocks (WoP16);
//   the output written in T (one rounding).
// Assumptions: kOwThreads threads; Aow, Bow, WoP as opm_prep_ow_kernel<., T> / opm_ow_params_kernel write
//   them; 16-byte aligned.
// ---------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kOwThreads, 1) opm_outer_wg_kernel(
    const void* __restrict__ Aow_v, const void* __restrict__ Bow_v, const void* __restrict__ WoP_v,
    const float* __restrict__ inv_denom, const float* __restrict__ bo, T* __restrict__ out, int64_t B, int64_t N,
    int64_t KBS, int64_t NIT, int64_t NBB, int nzc, int cz) {
#if defined(OPM_WG_DEVICE)
  constexpr bool kSplit = std::is_same_v<T, float>;
  constexpr int kSlot = kSplit ? kOwStage : kOwSlot16, kStages = kSplit ? kOwStages : kOwStages16;
  constexpr int kKSteps = kSplit ? kOwSK / 8 : kOwS16 / 16;  // wgmma k steps per phase-A stage
  constexpr int kPromo = kWgPromo;  // split TF32: k steps per promotion (64 s)
  using PT = std::conditional_t<kSplit, float, T>;
  const PT* Aow = static_cast<const PT*>(Aow_v);
  const PT* Bow = static_cast<const PT*>(Bow_v);
  [[maybe_unused]] const float* WoP = static_cast<const float*>(WoP_v);  // (fp32 planes: kSplit only)
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  float* Os = sm + kStages * kSlot;  // (16-bit: Os16, rows of kOwLDO16 words)
  uint64_t* full = reinterpret_cast<uint64_t*>(Os + (kSplit ? 64 * kOwLDO : 64 * kOwLDO16 + 64));  // (16-bit: Osc)
  uint64_t* empty = full + kStages;
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t MBA = 2 * NIT;
  // tile and slot counters in 32 bits (the host's ow_tiles_ok keeps the tiles under 2^31; a block's walk uses
  // fewer ring slots than that): 64-bit divisions by kStages and NIT cost ~40 dependent instructions each
  const uint32_t total = static_cast<uint32_t>(B * nzc * NBB * NIT), nit = static_cast<uint32_t>(NIT),
                 nbb = static_cast<uint32_t>(NBB), nz = static_cast<uint32_t>(nzc);
  const int kbs = static_cast<int>(KBS);
  if (tid == 0) mbar_ring_init(full, empty, kStages);
  __syncthreads();
  if (wg == 2) {  // producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kOwProducerRegs));
    if (tid == 256) {
      uint32_t u = 0;  // ring slots used so far
      auto slot = [&](unsigned bytes) -> float* {  // the next slot, once free; its full barrier expects `bytes`
        const int st = static_cast<int>(u % kStages);
        if (u >= kStages) mbar_wait(empty + st, (u / kStages - 1) & 1);
        mbar_expect_tx(full + st, bytes);
        ++u;
        return sm + st * kSlot;
      };
      for (uint32_t t = blockIdx.x; t < total; t += gridDim.x) {
        const int64_t it = t % nit, jt = t / nit % nbb, zc = t / nit / nbb % nz, b = t / nit / nbb / nz;
        for (int q = 0; q < kOwNQ; ++q) {
          if constexpr (kSplit) {
            const float* a = Aow + ((b * kOwNQ + q) * KBS * MBA + 2 * it) * (2 * kOwAPlane);
            const float* bb = Bow + (b * NBB + jt) * KBS * (2 * kOwBPlane);
            for (int kb = 0; kb < kbs; ++kb) {
              const int st = static_cast<int>(u % kStages);
              float* dst = slot(4 * kOwStage);
              bulk_copy(dst, a + kb * MBA * (2 * kOwAPlane), 4 * 4 * kOwAPlane, full + st);
              bulk_copy(dst + 4 * kOwAPlane, bb + kb * (2 * kOwBPlane), 4 * 2 * kOwBPlane, full + st);
            }
          } else {  // the two A blocks of this i tile (adjacent), then the B block
            const PT* a = Aow + ((b * kOwNQ + q) * KBS * MBA + 2 * it) * kOwABlk16;
            const PT* bb = Bow + (b * NBB + jt) * KBS * kOwBBlk16;
            for (int kb = 0; kb < kbs; ++kb) {
              const int st = static_cast<int>(u % kStages);
              float* dst = slot(4 * kOwSlot16);
              bulk_copy(dst, a + kb * MBA * kOwABlk16, 2 * 2 * kOwABlk16, full + st);
              bulk_copy(dst + kOwABlk16, bb + kb * kOwBBlk16, 2 * kOwBBlk16, full + st);
            }
          }
          if constexpr (kSplit) {
            const float* w = WoP + (zc * kOwNQ + q) * kOwHC * (2 * kOwWPlane);
            for (int hl = 0; hl < kOwHC; ++hl) {
              const int st = static_cast<int>(u % kStages);
              float* dst = slot(4 * 2 * kOwWPlane);
              bulk_copy(dst, w + hl * (2 * kOwWPlane), 4 * 2 * kOwWPlane, full + st);
            }
          } else {  // two Wo blocks (hl, hl + 1) per slot
            const T* w = static_cast<const T*>(WoP_v) + (zc * kOwNQ + q) * kOwHC * kOwWBlk16;
            for (int hl = 0; hl < kOwHC; hl += 2) {
              const int st = static_cast<int>(u % kStages);
              float* dst = slot(4 * kOwSlot16);
              bulk_copy(dst, w + hl * kOwWBlk16, 4 * kOwSlot16, full + st);
            }
          }
        }
      }
    }
    return;  // (no block-wide barrier after this point: the consumers use named barrier 1)
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kOwConsumerRegs));
  const int lane = tid % 32, g = lane / 4, t4 = lane % 4, w4 = (tid / 32) % 4;
  const bool pair = (cz & 1) == 0;  // then z even and z + 1 < c_z whenever z < c_z
  // the next slot use's slot cs and parity cph, kept incrementally (no division on the path between wgmmas)
  int cs = 0;
  uint32_t cph = 0;
  auto wait_full = [&]() -> const float* {  // the next slot use, once its copies have landed; cs advances
    mbar_wait(full + cs, cph);
    const float* p = sm + cs * kSlot;
    if (++cs == kStages) {
      cs = 0;
      cph ^= 1;
    }
    return p;
  };
  auto back = [&](int k) {  // the slot of the k-th latest use (k = 1: the one wait_full returned last)
    const int st = cs - k;
    return st < 0 ? st + kStages : st;
  };
  auto release = [&](int st) {  // this warp is done with slot st (its wgmmas have completed)
    if (lane == 0) mbar_arrive(empty + st);
  };
  // 16-bit phase A: the wgmma descriptors of slot 0's blocks (this warpgroup's A block, the B block); another slot
  // or k step adds its byte offset / 16 to the start-address field, which holds any shared address of this
  // block (under 2^18 bytes) without a carry
  [[maybe_unused]] const uint64_t dA0 = wg_desc(sm + wg * kOwABlk16 / 2, 512), dB0 = wg_desc(sm + kOwABlk16, 512);
  float acc[64], d[64], o[32], d2[32];
  for (uint32_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t it = t % nit, jt = t / nit % nbb, zc = t / nit / nbb % nz, b = t / nit / nbb / nz;
    if constexpr (kSplit) {
#pragma unroll
      for (int e = 0; e < 32; ++e) o[e] = 0.f;
    } else {  // 16-bit: o starts from the bias (its loads overlap phase A; the epilogue had waited on them)
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int z = static_cast<int>(zc * kOwZ) + 64 * wg + 8 * jj + 2 * t4 + e;
          o[4 * jj + e] = o[4 * jj + 2 + e] = z < cz ? __ldg(bo + z) : 0.f;
        }
    }
    for (int q = 0; q < kOwNQ; ++q) {
      // ---- phase A: O_q (this warpgroup's 64 rows (il, hl) x 128 columns (jl, k)), K = S ----
#pragma unroll
      for (int e = 0; e < 64; ++e) acc[e] = d[e] = 0.f;
      for (int kb = 0; kb < kbs; ++kb) {
        [[maybe_unused]] const int st = cs;  // this stage's slot
        const float* stg = wait_full();
        // split: hi / lo planes of this warpgroup's A block and of the B block (16-bit: dA0, dB0)
        [[maybe_unused]] const float* a_hi = stg + wg * 2 * kOwAPlane;
        [[maybe_unused]] const float* a_lo = a_hi + kOwAPlane;
        [[maybe_unused]] const float* b_hi = stg + 4 * kOwAPlane;
        [[maybe_unused]] const float* b_lo = b_hi + kOwBPlane;
        if constexpr (kSplit) {
          wg_fence_acc(d);
          // (wgmma_split_stage_m64n128's body, written out: through the function ptxas orders this
          // kernel's descriptor arithmetic differently, with the same instruction count)
#pragma unroll
          for (int ks = 0; ks < kKSteps; ++ks) {
            const int off = ks * 64;  // two core matrices along k (8 k): 256 bytes
            const int fresh = (kb * kKSteps + ks) % kPromo == 0;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
            wgmma_tf32_m64n128k8(d, wg_desc(a_lo + off, 512), wg_desc(b_hi + off, 512), fresh ? 0 : 1);
            wgmma_tf32_m64n128k8(d, wg_desc(a_hi + off, 512), wg_desc(b_lo + off, 512), 1);
            wgmma_tf32_m64n128k8(d, wg_desc(a_hi + off, 512), wg_desc(b_hi + off, 512), 1);
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          }
          asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
          wg_fence_acc(d);
          release(back(1));
          if (((kb + 1) * kKSteps) % kPromo == 0) {  // a promotion period ends here
#pragma unroll
            for (int e = 0; e < 64; ++e) acc[e] += d[e];
          }
        } else {  // 16-bit: all of S into acc, one stage's wgmmas left in flight while the next is issued
          wg_fence_acc(acc);
          asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
          for (int ks = 0; ks < kKSteps; ++ks) {  // two core matrices along k (16 k in T): 256 bytes
            const uint64_t off = static_cast<uint64_t>(st * (kSlot / 4) + ks * 16);
            wgmma16_m64n128k16<T>(acc, dA0 + off, dB0 + off, kb + ks > 0);
          }
          asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          if (kb > 0) {
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            release(back(2));  // the previous stage's wgmmas have completed
          }
        }
      }
      if constexpr (kSplit) {
        if ((kbs * kKSteps) % kPromo != 0) {  // the last, partial promotion period
#pragma unroll
          for (int e = 0; e < 64; ++e) acc[e] += d[e];
        }
      } else {
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_fence_acc(acc);
        release(back(1));
      }
      if constexpr (kSplit) {
        // ---- O_q -> Os: acc[4 jj + 2 hr + e] is row 16 w4 + g + 8 hr = (il8 = 2 w4 + hr, hl = g),
        //      column 8 jj + 2 t4 + e = (jl = jj / 4, k = 8 (jj % 4) + 2 t4 + e) ----
        asm volatile("bar.sync 1, 256;\n" ::: "memory");  // every consumer's phase-B loads of Os are done
#pragma unroll
        for (int jj = 0; jj < 16; ++jj)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int p = (8 * wg + 2 * w4 + hr) * kOwTJ + jj / 4, k = 8 * (jj % 4) + 2 * t4;
            *reinterpret_cast<float2*>(Os + p * kOwLDO + g * 32 + ((k + 8 * g) & 31)) =
                make_float2(acc[4 * jj + 2 * hr], acc[4 * jj + 2 * hr + 1]);
          }
        asm volatile("bar.sync 1, 256;\n" ::: "memory");  // Os complete
        // ---- phase B: o[p, z] += sum_kk Os[p][kk] WoP_q[z][kk], one Wo block (32 kk) per hl ----
#pragma unroll
        for (int e = 0; e < 32; ++e) d2[e] = 0.f;  // (overwritten: scale-d 0 first; zeroed here so that d2 is not live in phase A)
        for (int hl = 0; hl < kOwHC; ++hl) {
          uint32_t ahi[4][4], alo[4][4];  // this hl's A fragments (Os is complete: loaded before the wait)
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            const float* r0 = Os + (16 * w4 + g) * kOwLDO + hl * 32 + ks * 8 + t4;
            split_tf32(r0[0], ahi[ks][0], alo[ks][0]);
            split_tf32(r0[8 * kOwLDO], ahi[ks][1], alo[ks][1]);
            split_tf32(r0[4], ahi[ks][2], alo[ks][2]);
            split_tf32(r0[8 * kOwLDO + 4], ahi[ks][3], alo[ks][3]);
          }
          const float* stg = wait_full();
          const float* w_hi = stg + wg * (64 / 8) * 256;  // this warpgroup's 64 z of the 128-row block
          const float* w_lo = w_hi + kOwWPlane;
          wg_fence_acc(d2);
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)  // the A fragments are wgmma inputs too: written before the fence
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(ahi[ks][e]), "+r"(alo[ks][e])::"memory");
          asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            const int off = ks * 64;
            const int fresh = (hl % 2 == 0) && ks == 0;  // promotion every 64 kk
            wgmma_split_m64n64k8_rs(d2, ahi[ks], alo[ks], w_hi + off, w_lo + off, 1024, fresh);
          }
          asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
          wg_fence_acc(d2);
          release(back(1));
          if (hl % 2 == 1) {
#pragma unroll
            for (int e = 0; e < 32; ++e) o[e] += d2[e];
          }
        }
      } else {
        // ---- O_q / denom -> Os16 in fp16, each pair's row scaled by a power of two (its largest value in
        //      [2^14, 2^15): no overflow, 2^-11 rounding): acc[4 jj + 2 hr + e] is row p = (il8 = 2 w4 + hr,
        //      jl = jj / 4), hidden h = 8 q + g, k = 8 (jj % 4) + 2 t4 + e; a row's 256 values lie in the 32
        //      lanes of one warp. Osc[p] = 1 / (the row's scale) ----
        uint32_t* Os16 = reinterpret_cast<uint32_t*>(Os);
        float* Osc = Os + 64 * kOwLDO16;
        float rowf[2][kOwTJ];  // inv_denom times the row's scale
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int64_t i = it * kOwTI + 8 * wg + 2 * w4 + hr;
          const float inv = i < N ? inv_denom[b * N + i] : 0.f;
#pragma unroll
          for (int jl = 0; jl < kOwTJ; ++jl) {
            float mx = 0.f;
#pragma unroll
            for (int jq = 0; jq < 4; ++jq)
              mx = fmaxf(mx, fmaxf(fabsf(acc[4 * (4 * jl + jq) + 2 * hr]), fabsf(acc[4 * (4 * jl + jq) + 2 * hr + 1])));
            // the warp's max: as unsigned integers, non-negative floats order as their values (NaN above inf)
            mx = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(mx)));
            // scale 2^(14 - exponent of mx * inv): its exponent field 268 - E, kept in [1, 253] (0 and
            // subnormal rows: 2^126; inf / NaN stay so)
            const int E = static_cast<int>((__float_as_uint(mx * inv) >> 23) & 0xff), fs = min(253, max(1, 268 - E));
            rowf[hr][jl] = inv * __uint_as_float(static_cast<uint32_t>(fs) << 23);
            if (lane == 0) Osc[(8 * wg + 2 * w4 + hr) * kOwTJ + jl] = __uint_as_float(static_cast<uint32_t>(254 - fs) << 23);
          }
        }
        asm volatile("bar.sync 1, 256;\n" ::: "memory");  // every consumer's phase-B loads of Os16, Osc are done
#pragma unroll
        for (int jj = 0; jj < 16; ++jj)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int p = (8 * wg + 2 * w4 + hr) * kOwTJ + jj / 4, m = 4 * (jj % 4) + t4;
            Os16[p * kOwLDO16 + g * 16 + ow_os16_word(g, m)] =
                pack2_16<__half>(acc[4 * jj + 2 * hr] * rowf[hr][jj / 4], acc[4 * jj + 2 * hr + 1] * rowf[hr][jj / 4]);
          }
        asm volatile("bar.sync 1, 256;\n" ::: "memory");  // Os16, Osc complete
        const float rs[2] = {Osc[16 * w4 + g], Osc[16 * w4 + g + 8]};  // this thread's phase-B rows' 1 / scale
        // ---- phase B: o[p, z] += Osc[p] sum_kap Os16[p][kap] WoP16_q[z][kap] on wgmma m64n64k16 (fp16), two
        //      Wo blocks (hl, hl + 1) per slot, one accumulator over the q's four slots; a slot's wgmmas
        //      stay in flight while the next slot's are issued, so its A fragments (af[sl % 2]) and the
        //      slot are released one slot later ----
#pragma unroll
        for (int e = 0; e < 32; ++e) d2[e] = 0.f;  // (overwritten: scale-d 0 first)
        uint32_t af[2][4][4];  // [sl % 2][2 (hl - hl0) + ks][fragment register]
#pragma unroll
        for (int sl = 0; sl < kOwHC / 2; ++sl) {
          uint32_t (&a)[4][4] = af[sl % 2];
#pragma unroll
          for (int f = 0; f < 4; ++f) {
            const uint32_t* r0 = Os16 + (16 * w4 + g) * kOwLDO16 + (2 * sl + f / 2) * 16 + (f % 2) * 8 + 2 * t4;
            const uint2 lo = *reinterpret_cast<const uint2*>(r0), hi = *reinterpret_cast<const uint2*>(r0 + 8 * kOwLDO16);
            a[f][0] = lo.x; a[f][1] = hi.x; a[f][2] = lo.y; a[f][3] = hi.y;
          }
          const __half* wst = reinterpret_cast<const __half*>(wait_full()) + wg * 8 * 256;  // this warpgroup's 64 z
          wg_fence_acc(d2);
#pragma unroll
          for (int f = 0; f < 4; ++f)  // the A fragments are wgmma inputs: written before the fence
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[f][e])::"memory");
          asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
          for (int f = 0; f < 4; ++f)
            wgmma_f16_m64n64k16_rs(d2, a[f], wg_desc(reinterpret_cast<const float*>(wst + (f / 2) * kOwWBlk16 + (f % 2) * 128), 512),
                                   sl + f > 0);
          asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          if (sl > 0) {
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#pragma unroll
            for (int f = 0; f < 4; ++f)  // the previous slot's fragments were read until here
#pragma unroll
              for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(af[(sl + 1) % 2][f][e])::"memory");
            release(back(2));
          }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_fence_acc(d2);
#pragma unroll
        for (int f = 0; f < 4; ++f)
#pragma unroll
          for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(af[1][f][e])::"memory");
        release(back(1));
#pragma unroll
        for (int e = 0; e < 32; ++e) o[e] = fmaf(d2[e], rs[(e / 2) % 2], o[e]);  // d2[4 jj + 2 hr + .]: row hr
      }
    }
    // ---- epilogue: o[4 jj + 2 hr + e] is pair p = 16 w4 + g + 8 hr (il = p / 4, jl = p % 4),
    //      z = zc*128 + 64 wg + 8 jj + 2 t4 + e ----
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int p = 16 * w4 + g + 8 * hr;
      const int64_t i = it * kOwTI + p / kOwTJ, j = jt * kOwTJ + p % kOwTJ;
      if (i >= N || j >= N) continue;
      const float inv = inv_denom[b * N + i];  // (16-bit: in Os16 already)
      T* orow = out + ((b * N + i) * N + j) * cz;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int z = static_cast<int>(zc * kOwZ) + 64 * wg + 8 * jj + 2 * t4;
        const float v0 = o[4 * jj + 2 * hr], v1 = o[4 * jj + 2 * hr + 1];
        if constexpr (kSplit) {
          if (pair) {
            if (z < cz) *reinterpret_cast<float2*>(orow + z) = make_float2(__ldg(bo + z) + inv * v0, __ldg(bo + z + 1) + inv * v1);
          } else {
            if (z < cz) orow[z] = __ldg(bo + z) + inv * v0;
            if (z + 1 < cz) orow[z + 1] = __ldg(bo + z + 1) + inv * v1;
          }
        } else {  // T: one rounding of the fp32 value (bias included), as the reference's Linear output has
          if (pair) {
            if (z < cz) *reinterpret_cast<uint32_t*>(orow + z) = pack2_16<T>(v0, v1);
          } else {
            if (z < cz) orow[z] = from_float<T>(v0);
            if (z + 1 < cz) orow[z + 1] = from_float<T>(v1);
          }
        }
      }
    }
  }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::wg_ok)
#endif
}

// ---------------------------------------------------------------------------------------------
// The backward's out_proj weight gradient on wgmma, without the (N, N, c*c) outer product in memory:
//   dWo[z, hk] = sum_{b,i,j} gd[b,i,j,z] O[b,i,j,hk],  gd = g inv_denom[b,i],  O[b,i,j,(h,k)] = sum_s a b
// for c = 32 (hk = 1024), c_z <= 128, a, b (B, S, N, 32) fp32 (masked); T float: split TF32 throughout, T
// __half / __nv_bfloat16: the products' operands rounded to T (16-bit wgmma, fp32 accumulation).
// opm_bw_wo_prep_kernel<float> writes three sets of split planes in 16-k core-matrix blocks (element (r, k)
// of a block plane at wo_off16(r, k): 8-row groups 512 bytes apart, k core matrices 128 bytes apart):
//   Abw[(((b*kBwNSL + sl)*KB16 + kb)*MB + mb)*2*kOwAPlane + plane*kOwAPlane + wo_off16(r, s % 16)]
//       = a[b, s, 32 mb + r % 32, 2 sl + r / 32]  (r < 64: rows (hh = r / 32, il = r % 32); MB = 2 NIT)
//   Bbw[((b*NBB + jb)*KB16 + kb)*2*kOwBPlane + plane*kOwBPlane + wo_off16(n, s % 16)]
//       = b[b, s, 4 jb + n / 32, n % 32]  (outer_wg's Bow layout)
//   Gbw[(((b*NITc + it - it0)*NBB + jt)*8 + c)*kOwStage + w*4096 + plane*2048 + wo_off16(z, p % 16)]
//       = gd[b, 64 it + 32 w + p / 4, 4 jt + p % 4, z],  p = 16 c + p % 16  (warpgroup w's pair p)
// (s = 16 kb + s % 16; zeros past S, N and c_z); Abw and Bbw only if ab, Gbw for the i tiles it0 ..
// it0 + NITc - 1 (a chunk). Work items of 4 consecutive k, one store_split4 each.
// 16-bit T: one T plane per set, blocks of 32 s (KB16 then counts them) at ow_off16h (outer_wg's 16-bit
// blocks: 8-row groups 512 bytes apart), 8 consecutive k per item:
//   Abw[(((b*kBwNSL + sl)*KB16 + kb)*MB + mb)*kOwABlk16 + ow_off16h(r, s % 32)]  (s = 32 kb + s % 32)
//   Bbw[((b*NBB + jb)*KB16 + kb)*kOwBBlk16 + ow_off16h(n, s % 32)]
//   Gbw[(((b*NITc + it - it0)*NBB + jt)*4 + c)*8192 + w*4096 + ow_off16h(z, P)] = gd of warpgroup w's
//       pair p = 32 c + wo_pair16(P): 32 pairs per slot, in the order of phase W's A fragments; its items
//       take 4 z (an 8-byte load of g per pair: c_z % 8 == 0 for 16-bit T) and 8 positions.
// (16-bit indices in T elements.)
// ---------------------------------------------------------------------------------------------
constexpr int kBwNSL = 16;        // hk slices of 64 (2 h each)
constexpr int kBwLDO = 64 + 8;    // Os row stride (pairs x hk): 8 mod 32 words, conflict-free A fragments
constexpr int kBwoStages = 4;
constexpr size_t kBwoSmemBytes = 4ull * (kBwoStages * kOwStage + 2 * 128 * kBwLDO) + 16 * kBwoStages;
__host__ __device__ __forceinline__ int wo_off16(int r, int k) { return (r >> 3) * 128 + (k >> 2) * 32 + (r & 7) * 4 + (k & 3); }
// The pair at position P (0..31) of a 16-bit G slot: the A fragment of k position kk = P % 16 of k step
// ks = P / 16 holds Os rows 16 ks + t4 + 4 e + 8 h for kk = 2 t4 + e + 8 h (8 t4 words apart: no bank
// conflicts).
__host__ __device__ __forceinline__ int wo_pair16(int P) {
  const int kk = P & 15;
  return (P & 16) + ((kk & 7) >> 1) + 4 * (kk & 1) + 8 * (kk >> 3);
}
// The A and B items of opm_bw_wo_prep_kernel: an A item e is (b, sl, kb, mb, grp, r) with r fastest, a B item
// f = e - nA is (b, jb, kb, grp, n) with n fastest. Each puts into v its P consecutive s = P (4 kb + grp) + q
// of a at (i = 32 mb + r % 32, h = 2 sl + r / 32) or of b at (j = 4 jb + n / 32, n % 32), zeros past S and N
// (v holds zeros on entry), and returns its block ((b*kBwNSL + sl)*KB + kb)*MB + mb or (b*NBB + jb)*KB + kb;
// row is r or n.
template <int P>
__device__ __forceinline__ int64_t wo_prep_a_item(int64_t e, const float* __restrict__ av, int64_t S, int64_t N,
                                                  int64_t KB, int64_t MB, float (&v)[P], int& row, int& grp) {
  row = static_cast<int>(e % 64);
  grp = static_cast<int>(e / 64 % 4);
  const int64_t blk = e / 256;
  const int64_t mb = blk % MB, kb = blk / MB % KB, sl = blk / MB / KB % kBwNSL, b = blk / MB / KB / kBwNSL;
  const int64_t i = 32 * mb + row % 32, h = 2 * sl + row / 32;
  for (int q = 0; q < P; ++q) {
    const int64_t s = 4 * P * kb + P * grp + q;
    if (s < S && i < N) v[q] = __ldg(av + ((b * S + s) * N + i) * 32 + h);
  }
  return blk;
}
template <int P>
__device__ __forceinline__ int64_t wo_prep_b_item(int64_t f, const float* __restrict__ bv, int64_t S, int64_t N,
                                                  int64_t KB, int64_t NBB, float (&v)[P], int& row, int& grp) {
  row = static_cast<int>(f % 128);
  grp = static_cast<int>(f / 128 % 4);
  const int64_t blk = f / 512;
  const int64_t kb = blk % KB, jb = blk / KB % NBB, b = blk / KB / NBB;
  const int64_t j = 4 * jb + row / 32;
  for (int q = 0; q < P; ++q) {
    const int64_t s = 4 * P * kb + P * grp + q;
    if (s < S && j < N) v[q] = __ldg(bv + ((b * S + s) * N + j) * 32 + row % 32);
  }
  return blk;
}
template <typename T>
__global__ void __launch_bounds__(kThreads) opm_bw_wo_prep_kernel(
    const float* __restrict__ av, const float* __restrict__ bv, const float* __restrict__ g,
    const float* __restrict__ inv_denom, float* __restrict__ Abw, float* __restrict__ Bbw, float* __restrict__ Gbw,
    int64_t B, int64_t S, int64_t N, int cz, int64_t KB16, int64_t NIT, int64_t NBB, bool ab, int64_t it0, int64_t NITc) {
  const int64_t MB = 2 * NIT;
  if constexpr (!std::is_same_v<T, float>) {  // T planes, blocks of 32 s (KB16 counts them), 8 consecutive k per item
    const T* g16 = reinterpret_cast<const T*>(g);  // (g in T)
    const int64_t KB = KB16;
    const int64_t nA = ab ? B * kBwNSL * KB * MB * 64 * 4 : 0, nB = ab ? B * NBB * KB * 128 * 4 : 0;
    const int64_t nG = B * NITc * NBB * 4 * 2 * 4 * 32;
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < nA + nB + nG;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if (e >= nA + nB) {  // (b, it, jt, c, w, oct, zq): zq fastest; z = 4 zq + e4, positions P = 8 oct + q of slot c
        const int64_t f = e - nA - nB;
        const int zq = static_cast<int>(f % 32), oct = static_cast<int>(f / 32 % 4), w = static_cast<int>(f / 128 % 2);
        const int64_t blk = f / 256;  // ((b*NITc + it - it0)*NBB + jt)*4 + c
        const int c = static_cast<int>(blk % 4);
        const int64_t jt = blk / 4 % NBB, it = it0 + blk / 4 / NBB % NITc, b = blk / 4 / NBB / NITc;
        const int z0 = 4 * zq;
        float v4[4][8] = {};
        if (z0 < cz) {
          for (int q = 0; q < 8; ++q) {
            const int p = 32 * c + wo_pair16(8 * oct + q);
            const int64_t i = 64 * it + 32 * w + p / 4, j = 4 * jt + p % 4;
            if (i < N && j < N) {
              const float inv = __ldg(inv_denom + b * N + i);
              // 4 T in one 8-byte load (c_z % 8 == 0)
              const uint2 h = __ldg(reinterpret_cast<const uint2*>(g16 + ((b * N + i) * N + j) * cz + z0));
              const float2 lo = to_float2<T>(h.x), hi = to_float2<T>(h.y);
              v4[0][q] = lo.x * inv;
              v4[1][q] = lo.y * inv;
              v4[2][q] = hi.x * inv;
              v4[3][q] = hi.y * inv;
            }
          }
        }
        T* d0 = reinterpret_cast<T*>(Gbw) + blk * 8192 + w * 4096 + ow_off16h(z0, 8 * oct);  // z0 % 8 + 3 < 8
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4)
          *reinterpret_cast<uint4*>(d0 + 8 * e4) =
              make_uint4(pack2_16<T>(v4[e4][0], v4[e4][1]), pack2_16<T>(v4[e4][2], v4[e4][3]),
                         pack2_16<T>(v4[e4][4], v4[e4][5]), pack2_16<T>(v4[e4][6], v4[e4][7]));
        continue;
      }
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      T* dst;
      int row, oct;
      if (e < nA) {
        const int64_t blk = wo_prep_a_item<8>(e, av, S, N, KB, MB, v, row, oct);
        dst = reinterpret_cast<T*>(Abw) + blk * kOwABlk16 + ow_off16h(row, 8 * oct);
      } else {
        const int64_t blk = wo_prep_b_item<8>(e - nA, bv, S, N, KB, NBB, v, row, oct);
        dst = reinterpret_cast<T*>(Bbw) + blk * kOwBBlk16 + ow_off16h(row, 8 * oct);
      }
      *reinterpret_cast<uint4*>(dst) =
          make_uint4(pack2_16<T>(v[0], v[1]), pack2_16<T>(v[2], v[3]), pack2_16<T>(v[4], v[5]), pack2_16<T>(v[6], v[7]));
    }
    return;
  }
  const int64_t nA = ab ? B * kBwNSL * KB16 * MB * 64 * 4 : 0, nB = ab ? B * NBB * KB16 * 128 * 4 : 0;
  const int64_t nG = B * NITc * NBB * 8 * 2 * 128 * 4;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < nA + nB + nG;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    float* dst;
    int plane;
    if (e < nA) {
      int row, quad;
      const int64_t blk = wo_prep_a_item<4>(e, av, S, N, KB16, MB, v, row, quad);
      dst = Abw + blk * (2 * kOwAPlane) + wo_off16(row, 4 * quad);
      plane = kOwAPlane;
    } else if (e < nA + nB) {
      int row, quad;
      const int64_t blk = wo_prep_b_item<4>(e - nA, bv, S, N, KB16, NBB, v, row, quad);
      dst = Bbw + blk * (2 * kOwBPlane) + wo_off16(row, 4 * quad);
      plane = kOwBPlane;
    } else {  // (b, it, jt, c, w, quad, z): z fastest
      const int64_t f = e - nA - nB;
      const int z = static_cast<int>(f % 128), quad = static_cast<int>(f / 128 % 4), w = static_cast<int>(f / 512 % 2);
      const int64_t blk = f / 1024;  // ((b*NITc + it - it0)*NBB + jt)*8 + c
      const int c = static_cast<int>(blk % 8);
      const int64_t jt = blk / 8 % NBB, it = it0 + blk / 8 / NBB % NITc, b = blk / 8 / NBB / NITc;
      const int il = (16 * c + 4 * quad) / 4;  // the 4 pairs 16 c + 4 quad + q: one i, j = 4 jt + q
      const int64_t i = 64 * it + 32 * w + il;
      if (i < N && z < cz) {
        const float inv = __ldg(inv_denom + b * N + i);
        for (int q = 0; q < 4; ++q) {
          const int64_t j = 4 * jt + q;
          if (j < N) v[q] = __ldg(g + ((b * N + i) * N + j) * cz + z) * inv;
        }
      }
      dst = Gbw + blk * kOwStage + w * 4096 + wo_off16(z, 4 * quad);
      plane = 2048;
    }
    store_split4(dst, dst + plane, v[0], v[1], v[2], v[3]);
  }
}

// ---------------------------------------------------------------------------------------------
// opm_bw_wo_kernel: dWo's partial sums. Block x = (slice sl = x % kBwNSL: hk 64 sl .. 64 sl + 63, group
// gr = x / kBwNSL of gridDim.x / kBwNSL); it takes tiles t = gr, gr + groups, ... of (b, 64 i, 4 j) of
// the chunk, t -> (it = it0 + t % NITc, jt, b). Warps 0-7: two consumer warpgroups (warpgroup w: residues i 64 it + 32 w
// + il); warps 8-11: the producer (thread 256 issues the bulk copies), as in opm_outer_wg_kernel. Per tile:
//   phase A: O (rows (hh, il), columns (jl, k)), K = S, wgmma m64n128k8 from the Abw / Bbw stages, split
//     TF32 promoted every kWgPromo k steps (outer_wg's phase A);
//   O to Os_w[p][hk] (p = 4 il + jl, hk = 32 hh + k: one fp32 plane per warpgroup, 128 x kBwLDO);
//   phase W: D[hk][z] += sum_p O[p][hk] gd[p][z] over the warpgroup's 128 pairs, 16 per slot of Gbw:
//     wgmma m64n64k8 with A = O^T fragments from Os_w (split on load) and B = the slot's planes, for z
//     0-63 and 64-127; a fresh accumulator per 64 pairs added into D in fp32.
// D stays in registers over the block's tiles: part[(x*2 + w)*8192 + 128 hk + z] at the end
// (opm_bw_wo_sum_kernel sums the groups and warpgroups in order).
// Registers per consumer thread: phase A acc 64 + d 64, D 64; phase W D 64 + fresh 64 + fragments.
// 16-bit T (float16 / bfloat16 inputs): phase A on wgmma m64n128k16 from 32-s stages of T planes, all of S
// accumulated in acc on the tensor cores, a stage's wgmmas waited for after the next stage's are issued
// (wait_group 1); phase W on m64n64k16 with 32 pairs per slot, O rounded to T as its A fragments are
// loaded (rows wo_pair16: conflict-free), a fresh accumulator per 64 pairs; each operand rounded to T,
// as the reference in that dtype rounds O and g / d.
// ---------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kOwThreads, 1) opm_bw_wo_kernel(
    const float* __restrict__ Abw, const float* __restrict__ Bbw, const float* __restrict__ Gbw,
    float* __restrict__ part, int64_t B, int64_t KB16, int64_t NIT, int64_t NBB, int64_t it0, int64_t NITc) {
#if defined(OPM_WG_DEVICE)
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  float* Os = sm + kBwoStages * kOwStage;
  uint64_t* full = reinterpret_cast<uint64_t*>(Os + 2 * 128 * kBwLDO);
  uint64_t* empty = full + kBwoStages;
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t sl = blockIdx.x % kBwNSL, gr = blockIdx.x / kBwNSL, groups = gridDim.x / kBwNSL;
  const int64_t MB = 2 * NIT, total = B * NITc * NBB;
  const int kbs = static_cast<int>(KB16);
  constexpr bool kHalf = !std::is_same_v<T, float>;
  constexpr int kABlk = kHalf ? kOwABlk16 / 2 : 2 * kOwAPlane, kBBlk = kHalf ? kOwBBlk16 / 2 : 2 * kOwBPlane;  // floats
  // G slots per tile and per 64 pairs, floats per slot: 16 pairs per slot split, 32 in T
  constexpr int kSlots = kHalf ? 4 : 8, kPer64 = kHalf ? 2 : 4, kGSlot = kHalf ? 4096 : kOwStage;
  if (tid == 0) mbar_ring_init(full, empty, kBwoStages);
  __syncthreads();
  if (wg == 2) {  // producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kOwProducerRegs));
    if (tid == 256) {
      uint32_t u = 0;  // (32 bits, as outer_wg's)
      auto slot = [&](unsigned bytes) -> float* {
        const int st = static_cast<int>(u % kBwoStages);
        if (u >= kBwoStages) mbar_wait(empty + st, (u / kBwoStages - 1) & 1);
        mbar_expect_tx(full + st, bytes);
        ++u;
        return sm + st * kOwStage;
      };
      for (int64_t t = gr; t < total; t += groups) {
        const int64_t itc = t % NITc, it = it0 + itc, jt = (t / NITc) % NBB, b = t / (NITc * NBB);
        const float* a = Abw + ((b * kBwNSL + sl) * KB16 * MB + 2 * it) * kABlk;
        const float* bb = Bbw + (b * NBB + jt) * KB16 * kBBlk;
        for (int kb = 0; kb < kbs; ++kb) {
          const int st = static_cast<int>(u % kBwoStages);
          const float* ak = a + kb * MB * kABlk;
          const float* bk = bb + kb * kBBlk;
          if constexpr (kHalf) {  // both 32-row blocks of a, then b (32 s each)
            float* dst = slot(4 * (2 * kABlk + kBBlk));
            bulk_copy(dst, ak, 4 * 2 * kABlk, full + st);
            bulk_copy(dst + 2 * kABlk, bk, 4 * kBBlk, full + st);
          } else {
            float* dst = slot(4 * kOwStage);
            bulk_copy(dst, ak, 4 * 4 * kOwAPlane, full + st);
            bulk_copy(dst + 4 * kOwAPlane, bk, 4 * 2 * kOwBPlane, full + st);
          }
        }
        const float* gt = Gbw + ((b * NITc + itc) * NBB + jt) * kSlots * kGSlot;
        for (int c = 0; c < kSlots; ++c) {
          const int st = static_cast<int>(u % kBwoStages);
          float* dst = slot(4 * kGSlot);
          bulk_copy(dst, gt + c * kGSlot, 4 * kGSlot, full + st);
        }
      }
    }
    return;  // (no block-wide barrier after this point: the consumers use named barrier 1)
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kOwConsumerRegs));
  const int lane = tid % 32, g = lane / 4, t4 = lane % 4, w4 = (tid / 32) % 4;
  float* Os_w = Os + wg * 128 * kBwLDO;
  uint32_t u = 0;
  auto wait_full = [&]() -> const float* {
    const int st = static_cast<int>(u % kBwoStages);
    mbar_wait(full + st, (u / kBwoStages) & 1);
    ++u;
    return sm + st * kOwStage;
  };
  auto release = [&](uint32_t us) {
    if (lane == 0) mbar_arrive(empty + static_cast<int>(us % kBwoStages));
  };
  float D[2][32], dz[2][32];
#pragma unroll
  for (int zh = 0; zh < 2; ++zh)
#pragma unroll
    for (int e = 0; e < 32; ++e) D[zh][e] = 0.f;
  for (int64_t t = gr; t < total; t += groups) {
    // ---- phase A: O (this warpgroup's 64 rows (hh, il) x 128 columns (jl, k)), K = S ----
    {
      float acc[64], d[64];
#pragma unroll
      for (int e = 0; e < 64; ++e) acc[e] = d[e] = 0.f;
      if constexpr (!kHalf) {
        for (int kb = 0; kb < kbs; ++kb) {
          const uint32_t us = u;
          const float* stg = wait_full();
          const float* a_hi = stg + wg * 2 * kOwAPlane;
          const float* a_lo = a_hi + kOwAPlane;
          const float* b_hi = stg + 4 * kOwAPlane;
          const float* b_lo = b_hi + kOwBPlane;
          wg_fence_acc(d);
          wgmma_split_stage_m64n128<kOwSK / 8, kWgPromo>(d, a_hi, a_lo, b_hi, b_lo, 512, kb * (kOwSK / 8));
          asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
          wg_fence_acc(d);
          release(us);
          if (((kb + 1) * (kOwSK / 8)) % kWgPromo == 0) {
#pragma unroll
            for (int e = 0; e < 64; ++e) acc[e] += d[e];
          }
        }
        if ((kbs * (kOwSK / 8)) % kWgPromo != 0) {
#pragma unroll
          for (int e = 0; e < 64; ++e) acc[e] += d[e];
        }
      } else {  // T: all of S into acc, one stage's wgmmas in flight while the next is issued
        uint32_t prev = 0;
        for (int kb = 0; kb < kbs; ++kb) {
          const uint32_t us = u;
          const float* stg = wait_full();
          const float* a16 = stg + wg * kABlk;
          const float* b16 = stg + 2 * kABlk;
          wg_fence_acc(acc);
          asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
          for (int ks = 0; ks < 2; ++ks)  // two core matrices along k (16 s in T): 256 bytes
            wgmma16_m64n128k16<T>(acc, wg_desc(a16 + ks * 64, 512), wg_desc(b16 + ks * 64, 512), kb + ks > 0);
          asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          if (kb > 0) {
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            release(prev);  // the previous stage's wgmmas have completed
          }
          prev = us;
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_fence_acc(acc);
        release(prev);
      }
      // ---- O -> Os_w: acc[4 jj + 2 hr + e] is row R = 16 w4 + g + 8 hr = (hh = R / 32, il = R % 32),
      //      column 8 jj + 2 t4 + e = (jl = jj / 4, k = 8 (jj % 4) + 2 t4 + e) ----
      asm volatile("bar.sync 1, 256;\n" ::: "memory");  // every consumer's phase-W loads of Os are done
#pragma unroll
      for (int jj = 0; jj < 16; ++jj)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int R = 16 * w4 + g + 8 * hr;
          const int p = (R & 31) * 4 + jj / 4, hk = (R >> 5) * 32 + 8 * (jj % 4) + 2 * t4;
          *reinterpret_cast<float2*>(Os_w + p * kBwLDO + hk) = make_float2(acc[4 * jj + 2 * hr], acc[4 * jj + 2 * hr + 1]);
        }
      asm volatile("bar.sync 1, 256;\n" ::: "memory");  // Os complete
    }
    // ---- phase W: D[hk][z] += sum_p Os_w[p][hk] gd[p][z], 16 pairs per slot (16-bit: 32) ----
#pragma unroll
    for (int zh = 0; zh < 2; ++zh)
#pragma unroll
      for (int e = 0; e < 32; ++e) dz[zh][e] = 0.f;  // (overwritten: scale-d 0 first; zeroed so that dz is not live in phase A)
    // split on load, or 16-bit T: two k steps of 16 per slot (pairs wo_pair16), O rounded to T on load
    for (int c = 0; c < kSlots; ++c) {
      // A[hk][p] = Os_w[p][hk], rows 16 w4 + g (+ 8): split, columns t4 (+ 4) of k step ks; 16-bit T, k
      // 2 t4 + e + 8 h of k step ks: Os_w row 32 c + 16 ks + t4 + 4 e + 8 h (ahi holds the T pairs)
      uint32_t ahi[2][4];
      [[maybe_unused]] uint32_t alo[2][4];
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        if constexpr (kHalf) {
          const float* r0 = Os_w + (32 * c + 16 * ks + t4) * kBwLDO + 16 * w4 + g;
          ahi[ks][0] = pack2_16<T>(r0[0], r0[4 * kBwLDO]);
          ahi[ks][1] = pack2_16<T>(r0[8], r0[4 * kBwLDO + 8]);
          ahi[ks][2] = pack2_16<T>(r0[8 * kBwLDO], r0[12 * kBwLDO]);
          ahi[ks][3] = pack2_16<T>(r0[8 * kBwLDO + 8], r0[12 * kBwLDO + 8]);
        } else {
          const float* r0 = Os_w + (16 * c + 8 * ks + t4) * kBwLDO + 16 * w4 + g;
          split_tf32(r0[0], ahi[ks][0], alo[ks][0]);
          split_tf32(r0[8], ahi[ks][1], alo[ks][1]);
          split_tf32(r0[4 * kBwLDO], ahi[ks][2], alo[ks][2]);
          split_tf32(r0[4 * kBwLDO + 8], ahi[ks][3], alo[ks][3]);
        }
      }
      const uint32_t us = u;
      const float* stg = wait_full();
      const float* g_hi = stg + wg * (kHalf ? 2048 : 4096);  // this warpgroup's 128 z x 16 pairs (T: 32)
      [[maybe_unused]] const float* g_lo = g_hi + 2048;
      wg_fence_acc(dz[0]);
      wg_fence_acc(dz[1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if constexpr (kHalf) asm volatile("" : "+r"(ahi[ks][e])::"memory");
          else asm volatile("" : "+r"(ahi[ks][e]), "+r"(alo[ks][e])::"memory");
        }
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int fresh = (c % kPer64 == 0) && ks == 0;  // a fresh accumulator per 64 pairs
#pragma unroll
        for (int zh = 0; zh < 2; ++zh) {
          // z rows 64 zh .. (8 row groups of 128 floats, T: 256 T), pairs 8 ks .. (T: 16 ks ..)
          const int off = zh * 1024 + ks * 64;
          if constexpr (kHalf) wgmma16_m64n64k16_rs<T>(dz[zh], ahi[ks], wg_desc(g_hi + off, 512), fresh ? 0 : 1);
          else wgmma_split_m64n64k8_rs(dz[zh], ahi[ks], alo[ks], g_hi + off, g_lo + off, 512, fresh);
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      wg_fence_acc(dz[0]);
      wg_fence_acc(dz[1]);
      release(us);
      if (c % kPer64 == kPer64 - 1) {
#pragma unroll
        for (int zh = 0; zh < 2; ++zh)
#pragma unroll
          for (int e = 0; e < 32; ++e) D[zh][e] += dz[zh][e];
      }
    }
  }
  // ---- part: D[zh][4 jj + 2 hr + e] is hk = 16 w4 + g + 8 hr, z = 64 zh + 8 jj + 2 t4 + e ----
  float* pw = part + (static_cast<int64_t>(blockIdx.x) * 2 + wg) * 8192;
#pragma unroll
  for (int zh = 0; zh < 2; ++zh)
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int hk = 16 * w4 + g + 8 * hr, z = 64 * zh + 8 * jj + 2 * t4;
        *reinterpret_cast<float2*>(pw + hk * 128 + z) = make_float2(D[zh][4 * jj + 2 * hr], D[zh][4 * jj + 2 * hr + 1]);
      }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// dwo[z][64 sl + hk] += sum over the groups gr and warpgroups w (in that order, in fp64) of
// part[((sl + kBwNSL gr)*2 + w)*8192 + 128 hk + z], for z < c_z; one thread per (sl, hk, z), z fastest.
__global__ void __launch_bounds__(kThreads) opm_bw_wo_sum_kernel(const float* __restrict__ part, float* __restrict__ dwo,
                                                                 int groups, int cz) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= kBwNSL * 64 * 128) return;
  const int z = e % 128, hk = e / 128 % 64, sl = e / 8192;
  if (z >= cz) return;
  double s = 0.0;
  for (int gr = 0; gr < groups; ++gr)
    for (int w = 0; w < 2; ++w) s += part[((sl + kBwNSL * gr) * 2 + w) * 8192 + hk * 128 + z];
  dwo[static_cast<int64_t>(z) * 1024 + 64 * sl + hk] += static_cast<float>(s);
}

// ---------------------------------------------------------------------------------------------
// The backward's da and db on wgmma, G recomputed per tile on chip (never in memory):
//   G[b,i,j,h,k] = inv_denom[b,i] sum_z g[b,i,j,z] Wo[z, 32 h + k]
//   da[b,s,i,h] = sum_{j,k} b[b,s,j,k] G[b,i,j,h,k],   db[b,s,j,k] = sum_{i,h} a[b,s,i,h] G[b,i,j,h,k]
// One kernel does both in two forms: the "own" residue o (i for da, j for db) and channel c1 (h, k)
// name the output, the "loop" residue l (j, i) and channel c2 (k, h) are summed, v = b (da) or a (db):
//   out[b,s,o,c1] = sum_{l,c2} v[b,s,l,c2] G_f[o,l,c1,c2],  G_f[o,l,c1,c2] = sum_z gf[o,l,z] Wf[z,c1,c2]
// with gf[o,l,z] = g[i,j,z] / d_i and Wf[z,c1,c2] = Wo[z, 32 h + k] in either form's naming.
// opm_bw_ab_prep_kernel writes, per form f:
//   Vt[f][((b*NJT + J)*SB + sb)*8192 + ((ks*4 + w4)*32 + lane)*4 + q] = v[b, s, 4 J + kk / 32, kk % 32],
//     s = 64 sb + 16 w4 + lane / 4 + 8 (q & 1), kk = 8 ks + lane % 4 + 4 (q >> 1) (zero past S, N): a
//     64 x 128 block in wgmma's A-fragment order (one float4 per thread and k step);
//   Wt[f][(sl*2 + plane)*8192 + ab_off(n, kap)] = Wf[z(kap), 2 sl + n / 32, n % 32] split (zero past c_z),
//     n = (c1 - 2 sl, c2) of the slice sl's 64 columns, kap the k index of the G product, z(kap) =
//     16 (ks / 2) + 4 (cc % 4) + 2 (ks % 2) + cc / 4 for kap = 8 ks + cc: the order in which a thread's
//     float4 of g (4 consecutive z) holds the A fragments of k steps 2p and 2p + 1.
// ab_off(n, kap): K-major core matrices of a 64 x 128 operand, 8-row groups 4096 bytes apart.
// opm_bw_ab_prep_kernel<T> for 16-bit T: the same blocks in T, 8 per item (16 bytes), k steps of 16:
//   Vt[f][((b*NJT + J)*SB + sb)*8192 + ((ks*4 + w4)*32 + lane)*8 + q] (T elements), s as above with
//     (q / 2) & 1 for q & 1, kk = 16 ks + 2 (lane % 4) + q % 2 + 8 (q / 4): m64n64k16's A fragment;
//   Wt[f][sl*8192 + ab_off16(n, kap)] = Wf[ab_zperm16(kap), ...], one T plane.
// ---------------------------------------------------------------------------------------------
constexpr int kAbStages = 3;
constexpr int kAbOperand = 2 * 8192;  // floats of a split 64 x 128 operand (hi plane, lo plane)
constexpr size_t kAbSmemBytes = 4ull * (2 * kAbOperand + kAbStages * 8192) + 8 * (2 * kAbStages + 2);
__host__ __device__ __forceinline__ int ab_off(int n, int kap) {
  return (n >> 3) * 1024 + (kap >> 2) * 32 + (n & 7) * 4 + (kap & 3);
}
__host__ __device__ __forceinline__ int ab_zperm(int kap) {
  const int ks = kap >> 3, cc = kap & 7;
  return 16 * (ks >> 1) + 4 * (cc & 3) + 2 * (ks & 1) + (cc >> 2);
}
// The T layouts (16-bit products): ab_off16 in T elements (core matrices of 8 rows x 8 T, 8-row groups
// 2048 bytes apart); ab_zperm16: a thread's 4 values of g (z = 16 p + 4 t4 + e) are its A fragment of k
// step p (k 2 t4 + e for e < 2, 8 + 2 t4 + e - 2 for e >= 2); in T, those 4 z are one 8-byte load.
__host__ __device__ __forceinline__ int ab_off16(int n, int kap) {
  return (n >> 3) * 1024 + (kap >> 3) * 64 + (n & 7) * 8 + (kap & 7);
}
__host__ __device__ __forceinline__ int ab_zperm16(int kap) {
  return 16 * (kap >> 4) + 4 * ((kap & 7) >> 1) + 2 * ((kap >> 3) & 1) + (kap & 1);
}
template <typename T>
__global__ void __launch_bounds__(kThreads) opm_bw_ab_prep_kernel(
    const float* __restrict__ av, const float* __restrict__ bv, const float* __restrict__ wo, float* __restrict__ Vt,
    float* __restrict__ Wt, int64_t B, int64_t S, int64_t N, int cz, int64_t NJT, int64_t SB) {
  if constexpr (!std::is_same_v<T, float>) {  // T operands: 8 per item (16 bytes)
    const int64_t nV = B * NJT * SB * 1024, nW = 16 * 64 * 16;
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < 2 * (nV + nW);
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int f = static_cast<int>(e / (nV + nW));
      const int64_t x = e % (nV + nW);
      float r[8];
      uint4* dst;
      if (x < nV) {  // x = ((b*NJT + J)*SB + sb)*1024 + (ks*4 + w4)*32 + lane; item q: register q / 2, half q % 2
        const int lane = static_cast<int>(x % 32), w4 = static_cast<int>(x / 32 % 4), ks = static_cast<int>(x / 128 % 8);
        const int64_t sb = x / 1024 % SB, J = x / 1024 / SB % NJT, b = x / 1024 / SB / NJT;
        const float* v = f == 0 ? bv : av;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const int reg = q / 2;
          const int64_t s = 64 * sb + 16 * w4 + lane / 4 + 8 * (reg & 1);
          const int kk = 16 * ks + 2 * (lane % 4) + q % 2 + 8 * (reg >> 1);
          const int64_t l = 4 * J + kk / 32;
          r[q] = (s < S && l < N) ? __ldg(v + ((b * S + s) * N + l) * 32 + kk % 32) : 0.f;
        }
        dst = reinterpret_cast<uint4*>(reinterpret_cast<T*>(Vt) + (f * nV + x) * 8);
      } else {  // x - nV = (sl*64 + n)*16 + kap / 8
        const int y = static_cast<int>(x - nV), kq = y % 16, n = y / 16 % 64, sl = y / 1024;
        const int c1 = 2 * sl + n / 32, c2 = n % 32;
        const int hk = f == 0 ? 32 * c1 + c2 : 32 * c2 + c1;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const int z = ab_zperm16(8 * kq + q);
          r[q] = z < cz ? __ldg(wo + static_cast<int64_t>(z) * 1024 + hk) : 0.f;
        }
        dst = reinterpret_cast<uint4*>(reinterpret_cast<T*>(Wt) + (f * 16 + sl) * 8192 + ab_off16(n, 8 * kq));
      }
      *dst = make_uint4(pack2_16<T>(r[0], r[1]), pack2_16<T>(r[2], r[3]), pack2_16<T>(r[4], r[5]), pack2_16<T>(r[6], r[7]));
    }
    return;
  }
  const int64_t nV = B * NJT * SB * 2048, nW = 16 * 64 * 32;  // float4 items per form
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < 2 * (nV + nW);
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int f = static_cast<int>(e / (nV + nW));
    const int64_t x = e % (nV + nW);
    if (x < nV) {  // x = ((b*NJT + J)*SB + sb)*2048 + (ks*4 + w4)*32 + lane
      const int lane = static_cast<int>(x % 32), w4 = static_cast<int>(x / 32 % 4), ks = static_cast<int>(x / 128 % 16);
      const int64_t sb = x / 2048 % SB, J = x / 2048 / SB % NJT, b = x / 2048 / SB / NJT;
      const float* v = f == 0 ? bv : av;
      float r[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t s = 64 * sb + 16 * w4 + lane / 4 + 8 * (q & 1);
        const int kk = 8 * ks + lane % 4 + 4 * (q >> 1);
        const int64_t l = 4 * J + kk / 32;
        r[q] = (s < S && l < N) ? __ldg(v + ((b * S + s) * N + l) * 32 + kk % 32) : 0.f;
      }
      *reinterpret_cast<float4*>(Vt + static_cast<int64_t>(f) * nV * 4 + x * 4) = make_float4(r[0], r[1], r[2], r[3]);
    } else {  // x - nV = (sl*64 + n)*32 + kap / 4
      const int y = static_cast<int>(x - nV), kq = y % 32, n = y / 32 % 64, sl = y / 2048;
      const int c1 = 2 * sl + n / 32, c2 = n % 32;
      const int hk = f == 0 ? 32 * c1 + c2 : 32 * c2 + c1;  // da: (h, k) = (c1, c2); db: (c2, c1)
      float r[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int z = ab_zperm(4 * kq + q);
        r[q] = z < cz ? __ldg(wo + static_cast<int64_t>(z) * 1024 + hk) : 0.f;
      }
      float* dst = Wt + (static_cast<int64_t>(f) * 16 + sl) * kAbOperand + ab_off(n, 4 * kq);
      store_split4(dst, dst + 8192, r[0], r[1], r[2], r[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// opm_bw_ab_kernel<form>: out (da or db, before the mask) for one block = (b, own tile ot of 32 residues,
// slice sl of 2 channels c1, s chunk sc of up to 512 rows): x = ((b*NOT + ot)*16 + sl)*NSC + sc.
// Warps 0-7: two consumer warpgroups; warp 8's thread 256 issues the copies (g by tensor-map boxes, Wt
// and Vt by bulk copies; opm_outer_wg_kernel's structure). Shared memory: the slice's Wt planes (64 KB,
// once), the G^T operand Gt (64 KB), a ring of kAbStages 32 KB slots. Per loop tile J of 4 residues
// (l = 4 J + 2 w + ll for warpgroup w):
//   G step: warpgroup w's 64 rows r = 32 ll + ol (pairs), 64 columns n = (c1 - 2 sl, c2), K = c_z
//     rounded to 16: wgmma m64n64k8 with A = its g slot (float4 per row and 16 z, split on load) and B =
//     Wt, then the rows scaled by 1 / d_i (0 for pairs past N);
//   Gt[(2 ol + c1 - 2 sl)][32 (2 w + ll) + c2] = that, split (a consumer barrier before and after);
//   da step: for each 64-row block mb of the chunk's s rows (warpgroup mb % 2): v block . Gt^T on
//     wgmma m64n64k8, A = the Vt slot (float4 per k step, split on load), into the block's running
//     total (4 x 32 registers).
// The G step starts a fresh accumulator every two k steps (6 wgmma), the da step every four (12), each
// added into fp32 sums: longer chains on the tensor cores' accumulator biased proj_a / proj_b's weight
// gradients (sums over every msa row of da, db) to ~5x the reference's error at crop with one
// accumulator per J (48 wgmma). 16-bit T (float16 / bfloat16 inputs): both steps on m64n64k16 with the
// operands in T (g as given, its tensor map's boxes of T; Wt and Vt rounded by the prep, G as Gt is
// written, at ab_off16), 4 and 8 k steps of 16 per fresh accumulator; g, Wt, Gt and the Vt slots take
// half the bytes of the split build's g and Vt and a quarter of its Wt and Gt (one plane), and Gt has two
// buffers (by J's parity: no barrier before its stores).
// The slots go in one order (per J: g of warpgroup 0, g of warpgroup 1, the Vt blocks); a warpgroup
// waits for every slot and arrives on its empty barrier, reading only its own (so neither runs ahead).
// g slots: one box of the tensor map tm_g (g as (c_z, N j, N i, B)), da: (c_z, 2 j, 32 i) at (0, l0, o0,
// b), rows (ol, ll) at elements 2 c_z ol + c_z ll; db: (c_z, 32 j, 2 i) at (0, o0, l0, b), 32 c_z ll +
// c_z ol. Rows past N are zeros (the map's fill; their scale is 0 too), and the G step's last
// float4s past c_z read the next row (or the slot's stale tail: the ring starts zeroed, so it holds
// earlier data, finite for finite inputs), against zero rows of Wt; the 16-bit G step loads zeros there.
// ---------------------------------------------------------------------------------------------
template <int kForm, typename T>
__global__ void __launch_bounds__(kOwThreads, 1) opm_bw_ab_kernel(
    const float* __restrict__ Vt, const float* __restrict__ Wt, const __grid_constant__ CUtensorMap tm_g,
    const float* __restrict__ inv_denom, float* __restrict__ out, int64_t B, int64_t S, int64_t N, int cz,
    int64_t NJT, int64_t SB, int64_t NOT, int64_t NSC) {
#if defined(OPM_WG_DEVICE)
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  float* Ws = sm;                     // Wt slice: hi, lo
  float* Gt = sm + kAbOperand;        // G^T: hi, lo
  float* ring = sm + 2 * kAbOperand;  // kAbStages x 8192
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kAbStages * 8192);
  uint64_t* empty = full + kAbStages;
  uint64_t* wbar = empty + kAbStages;
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t x = blockIdx.x, sc = x % NSC, sl = x / NSC % 16, ot = x / NSC / 16 % NOT, b = x / NSC / 16 / NOT;
  const int mbc = static_cast<int>(min64(8, SB - 8 * sc));  // 64-row s blocks of this chunk
  const int kp = (cz + 15) / 16;                             // pairs of k steps in the G step (16-bit: k steps)
  constexpr bool kHalf = !std::is_same_v<T, float>;
  constexpr unsigned kVtBytes = kHalf ? 2 * 8192 : 4 * 8192;  // one 64 x 128 Vt block
  for (int e = tid; e < kAbStages * 2048; e += kOwThreads) reinterpret_cast<float4*>(ring)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the zeros before any copy
  if (tid == 0) {
    mbar_ring_init(full, empty, kAbStages);
    mbar_init(wbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == 2) {  // producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kOwProducerRegs));
    if (tid == 256) {
      constexpr unsigned kWtBytes = kHalf ? 2 * 8192 : 4 * kAbOperand;
      mbar_expect_tx(wbar, kWtBytes);
      bulk_copy(Ws, Wt + sl * (kWtBytes / 4), kWtBytes, wbar);
      uint32_t u = 0;  // (32 bits, as outer_wg's)
      auto slot = [&](unsigned bytes) -> float* {
        const int st = static_cast<int>(u % kAbStages);
        if (u >= kAbStages) mbar_wait(empty + st, (u / kAbStages - 1) & 1);
        mbar_expect_tx(full + st, bytes);
        ++u;
        return ring + st * 8192;
      };
      const int o0 = static_cast<int>(32 * ot), bi = static_cast<int>(b);
      for (int64_t J = 0; J < NJT; ++J) {
        for (int w = 0; w < 2; ++w) {  // one box of g: (c_z, 2 j, 32 i) for da, (c_z, 32 j, 2 i) for db
          const int l0 = static_cast<int>(4 * J + 2 * w);
          uint64_t* bar = full + static_cast<int>(u % kAbStages);
          float* dst = slot(static_cast<unsigned>(sizeof(T) * 64 * cz));  // (g in T for 16-bit T)
          if (kForm == 0) tma_load_4d(dst, &tm_g, 0, l0, o0, bi, bar);
          else tma_load_4d(dst, &tm_g, 0, o0, l0, bi, bar);
        }
        for (int mb = 0; mb < mbc; ++mb) {
          uint64_t* bar = full + static_cast<int>(u % kAbStages);
          float* dst = slot(kVtBytes);
          bulk_copy(dst, Vt + ((b * NJT + J) * SB + 8 * sc + mb) * (kVtBytes / 4), kVtBytes, bar);
        }
      }
    }
    return;  // (no block-wide barrier after this point: the consumers use named barrier 1)
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kOwConsumerRegs));
  const int lane = tid % 32, gq = lane / 4, t4 = lane % 4, w4 = (tid / 32) % 4;
  uint32_t u = 0;
  auto wait_full = [&]() -> const float* {
    const int st = static_cast<int>(u % kAbStages);
    mbar_wait(full + st, (u / kAbStages) & 1);
    ++u;
    return ring + st * 8192;
  };
  auto release = [&](uint32_t us) {
    if (lane == 0) mbar_arrive(empty + static_cast<int>(us % kAbStages));
  };
  const int ll = w4 / 2;                // this thread's G rows: r = 16 w4 + gq + 8 hr = 32 ll + ol
  const int rs1 = kForm == 0 ? 2 * cz : cz, rs2 = kForm == 0 ? cz : 32 * cz;
  float total[4][32];
#pragma unroll
  for (int mp = 0; mp < 4; ++mp)
#pragma unroll
    for (int e = 0; e < 32; ++e) total[mp][e] = 0.f;
  mbar_wait(wbar, 0);
  for (int64_t J = 0; J < NJT; ++J) {
    // ---- G step ----
    float gacc[32], gsum[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) gacc[e] = gsum[e] = 0.f;
    for (int f = 0; f < 2; ++f) {
      const uint32_t us = u;
      const float* stg = wait_full();
      if (f == wg) {
        if constexpr (kHalf) {  // k steps of 16, 4 per batch: the 4 T at z = 16 p + 4 t4 are k step p's fragment
          // (steps past c_z: zero fragments, not the slot's other data, against Wt's zero rows)
          const T* r16 = reinterpret_cast<const T*>(stg) + (16 * (w4 % 2) + gq) * rs1 + ll * rs2 + 4 * t4;  // row r
          for (int p0 = 0; p0 < kp; p0 += 4) {
            uint32_t a16[4][4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              uint2 x0 = make_uint2(0u, 0u), x1 = x0;
              if (16 * (p0 + q) + 4 * t4 < cz) {
                x0 = *reinterpret_cast<const uint2*>(r16 + 16 * (p0 + q));
                x1 = *reinterpret_cast<const uint2*>(r16 + 8 * rs1 + 16 * (p0 + q));
              }
              a16[q][0] = x0.x;
              a16[q][1] = x1.x;
              a16[q][2] = x0.y;
              a16[q][3] = x1.y;
            }
            wgmma16_batch_rs<4, T>(gacc, gsum, a16, Ws + p0 * 64, 2048);
          }
        } else {  // 2 k steps (6 wgmma) per batch: k steps 2 p, 2 p + 1 (z = 16 p + 4 t4 + e)
          const float* row0 = stg + (16 * (w4 % 2) + gq) * rs1 + ll * rs2 + 4 * t4;  // row r (hr 0)
          const float* row1 = row0 + 8 * rs1;                                       // row r + 8 (hr 1)
          for (int p = 0; p < kp; ++p) {
            const float4 x0 = *reinterpret_cast<const float4*>(row0 + 16 * p);
            const float4 x1 = *reinterpret_cast<const float4*>(row1 + 16 * p);
            uint32_t ahi[2][4], alo[2][4];
            split_tf32(x0.x, ahi[0][0], alo[0][0]);
            split_tf32(x1.x, ahi[0][1], alo[0][1]);
            split_tf32(x0.y, ahi[0][2], alo[0][2]);
            split_tf32(x1.y, ahi[0][3], alo[0][3]);
            split_tf32(x0.z, ahi[1][0], alo[1][0]);
            split_tf32(x1.z, ahi[1][1], alo[1][1]);
            split_tf32(x0.w, ahi[1][2], alo[1][2]);
            split_tf32(x1.w, ahi[1][3], alo[1][3]);
            wgmma_split_batch_rs<2>(gacc, gsum, ahi, alo, Ws + 2 * p * 64, 8192, 4096);
          }
        }
      }
      release(us);
    }
    // gsum[4 jj + q]: row r = 16 w4 + gq + 8 (q >> 1) (pair (ol, ll)), column n = 8 jj + 2 t4 + (q & 1)
    float sc2[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t o = 32 * ot + 16 * (w4 % 2) + gq + 8 * hr, l = 4 * J + 2 * wg + ll;
      const int64_t i = kForm == 0 ? o : l;
      sc2[hr] = (o < N && l < N) ? __ldg(inv_denom + b * N + i) : 0.f;
    }
    // 16-bit T: G^T in two 16 KB buffers by J's parity; a warpgroup passed the barrier before J - 1's da
    // step only after its da step of J - 2 (the last reader of this buffer) had completed, so no barrier here
    [[maybe_unused]] float* GtJ = Gt + (J & 1) * 4096;
    if constexpr (!kHalf) asm volatile("bar.sync 1, 256;\n" ::: "memory");  // every consumer's da-step wgmma on Gt is done
    // (n, kap) = (2 ol + jj / 4, 32 (2 wg + ll) + 8 (jj % 4) + 2 t4), ol = 16 (w4 % 2) + gq + 8 hr: ab_off is
    // gt0's plus 2048 hr + 64 (jj % 4) + 4 (jj / 4) ((2 gq) % 8 + 1 < 8: no carry; kap steps by 8): one
    // address per thread and J (16 from ab_off each are hoisted out of the J loop by ptxas, and spill)
    if constexpr (kHalf) {  // the same in T and ab_off16: 2048 hr + 64 (jj % 4) + 8 (jj / 4) T from gt0
      T* gt0 = reinterpret_cast<T*>(GtJ) + ab_off16(2 * (16 * (w4 % 2) + gq), 32 * (2 * wg + ll) + 2 * t4);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          *reinterpret_cast<uint32_t*>(gt0 + 2048 * hr + 64 * (jj % 4) + 8 * (jj / 4)) =
              pack2_16<T>(gsum[4 * jj + 2 * hr] * sc2[hr], gsum[4 * jj + 2 * hr + 1] * sc2[hr]);
    } else {
      float* gt0 = Gt + ab_off(2 * (16 * (w4 % 2) + gq), 32 * (2 * wg + ll) + 2 * t4);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          uint32_t h0, l0, h1, l1;
          split_tf32(gsum[4 * jj + 2 * hr] * sc2[hr], h0, l0);
          split_tf32(gsum[4 * jj + 2 * hr + 1] * sc2[hr], h1, l1);
          float* dst = gt0 + 2048 * hr + 64 * (jj % 4) + 4 * (jj / 4);
          *reinterpret_cast<uint2*>(dst) = make_uint2(h0, h1);
          *reinterpret_cast<uint2*>(dst + 8192) = make_uint2(l0, l1);
        }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the stores before wgmma reads Gt
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    // ---- da step ----
#pragma unroll
    for (int mp = 0; mp < 4; ++mp)
#pragma unroll
      for (int par = 0; par < 2; ++par) {
        if (2 * mp + par >= mbc) continue;
        const uint32_t us = u;
        const float* stg = wait_full();
        if (par == wg) {
          float acc[32];
#pragma unroll
          for (int e = 0; e < 32; ++e) acc[e] = 0.f;
          if constexpr (kHalf) {  // the block's 8 k steps of 16 in one batch, a uint4 of A per k step
            const uint4* frag = reinterpret_cast<const uint4*>(stg) + w4 * 32 + lane;
            uint32_t a16[8][4];
#pragma unroll
            for (int ks = 0; ks < 8; ++ks) {
              const uint4 v = frag[ks * 128];
              a16[ks][0] = v.x;
              a16[ks][1] = v.y;
              a16[ks][2] = v.z;
              a16[ks][3] = v.w;
            }
            wgmma16_batch_rs<8, T>(acc, total[mp], a16, GtJ, 2048);
          } else {
            const float* frag = stg + (w4 * 32 + lane) * 4;
#pragma unroll 1
            for (int k2 = 0; k2 < 4; ++k2) {  // four k steps per batch
              uint32_t ahi[4][4], alo[4][4];
#pragma unroll
              for (int h2 = 0; h2 < 4; ++h2) {
                const float4 v = *reinterpret_cast<const float4*>(frag + (4 * k2 + h2) * 512);
                split_tf32(v.x, ahi[h2][0], alo[h2][0]);
                split_tf32(v.y, ahi[h2][1], alo[h2][1]);
                split_tf32(v.z, ahi[h2][2], alo[h2][2]);
                split_tf32(v.w, ahi[h2][3], alo[h2][3]);
              }
              wgmma_split_batch_rs<4>(acc, total[mp], ahi, alo, Gt + 4 * k2 * 64, 8192, 4096);
            }
          }
        }
        release(us);
      }
  }
  // ---- out: total[mp][4 jj + q] is s = 64 (8 sc + 2 mp + wg) + 16 w4 + gq + 8 (q >> 1), n = 8 jj + 2 t4 +
  //      (q & 1) = (2 ol + c1 - 2 sl): residue o = 32 ot + 4 jj + t4, channels 2 sl, 2 sl + 1 ----
#pragma unroll
  for (int mp = 0; mp < 4; ++mp) {
    if (2 * mp + wg >= mbc) continue;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t s = 64 * (8 * sc + 2 * mp + wg) + 16 * w4 + gq + 8 * hr;
      if (s >= S) continue;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int64_t o = 32 * ot + 4 * jj + t4;
        if (o < N)
          *reinterpret_cast<float2*>(out + ((b * S + s) * N + o) * 32 + 2 * sl) =
              make_float2(total[mp][4 * jj + 2 * hr], total[mp][4 * jj + 2 * hr + 1]);
      }
    }
  }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// ---------------------------------------------------------------------------------------------
// The backward's LayerNorm part, each msa row read once (x_in and d_x_in of type T: float32, float16 or
// bfloat16; the mask of its own kind; everything else fp32; hidden_dim 32, msa_dim CM):
//   xhat = (x_in - mean) rstd,  x = xhat ln_w + ln_b            (recomputed; statistics in two passes
//                                                                over the row in registers)
//   dpa = da * mask, dpb = db * mask                             (per row)
//   dy[r, m]  = sum_c dpa[r, c] Wa[c, m] + dpb[r, c] Wb[c, m]
//   d_x_in    = rstd (g - mean_m g - xhat mean_m(g xhat)),  g = dy ln_w
//   dWa[c, m] = sum_r dpa[r, c] x[r, m] (dWb likewise),  d_ln_w = sum_r dy xhat,  d_ln_b = sum_r dy,
//   d_ba = sum_r dpa, d_bb = sum_r dpb
// Persistent blocks of 256 threads (one per SM) take tiles of 32 rows t = blockIdx.x, + gridDim.x, ...;
// double-buffered: while a tile is computed, the block's next tile (x_in by one bulk copy per row into
// rows of LDX = CM + 8 floats, a 16-bit row in the first CM / 2 of them, da and db by one each, all on
// the other buffer's mbarrier; lane 0 of each warp issues 4 rows, warps 0 and 1 also da, db) is in flight;
// a partial last tile (R % 32) is loaded by plain loads with zeros past R; the mask of the block's next tile
// is loaded a tile ahead (threads 0-31, in registers). Wa | Wb (ws, rows of CM + 8) sit in shared memory
// once per block. Per tile:
//   build: dp = (da | db) rows times the mask, split into TF32 hi / lo planes as dp[r][k] (rows of 68)
//     and dp^T[k][r] (rows of 36; 16-bit x: the hi planes alone); thread tid adds channel tid % 64 of
//     rows tid / 64 + 4 i (bias sums);
//     statistics, warp w for rows 4 w .. 4 w + 3 (2 or 4 at once) from registers (one 16- or 8-byte load
//     per 128 columns per lane, two passes), xhat written in place as fp32;
//   dy = dp . W (32 x CM, K = 64) and dW += dp^T . x (64 x CM, K = 32), both on mma.sync m16n8k8 in
//     split TF32 (the small terms, then hi x hi, into a fresh accumulator per k step, added in fp32;
//     16-bit x: single TF32, hi x hi alone);
//     warp w owns columns [w CM / 8, (w + 1) CM / 8) of both (NT = CM / 64 n8 tiles); W and x (= xhat
//     ln_w + ln_b) are split as their B fragments are loaded;
//   per row, the sums of g and g xhat over the warp's columns (quad shuffles), the 8 warps' added in
//     order through shared memory; d_x_in (rounded once to T) staged in the warp's columns of xs, then
//     written by 16-byte stores; d_ln_w, d_ln_b accumulated.
// Each block writes its partials (part[blk][64][CM]: dWa | dWb; part_ln[blk][2 CM + 64]: d_ln_w, d_ln_b
// over the block's rows (lanes added by shuffles), d_ba, d_bb); opm_block_sum_kernel adds them in block
// order in fp64.
// Conflict-free shared loads: the padded rows (LDX = CM + 8 for xs and ws, 68, 36 floats) put the 32
// lanes of every fragment load in distinct banks.
// Assumptions: 256 threads; x_in, da, db 16-byte aligned (the bulk copies); sm_90a (bulk copies, mbarriers).
// ---------------------------------------------------------------------------------------------
constexpr int kLnRows = 32;
template <int CM>
struct LnSmem {  // offsets in floats
  static constexpr int LDX = CM + 8, LDP = 68, LDT = 36;
  static constexpr int xs = 0;                            // [2][32][LDX]: x_in, then xhat
  static constexpr int raw = xs + 2 * kLnRows * LDX;      // [2][2][32][32]: da rows, db rows as copied
  static constexpr int ph = raw + 2 * kLnRows * 64;       // dp hi [32][LDP]
  static constexpr int pl = ph + kLnRows * LDP;           // dp lo
  static constexpr int th = pl + kLnRows * LDP;           // dp^T hi [64][LDT]
  static constexpr int tl = th + 64 * LDT;                // dp^T lo
  static constexpr int ws = tl + 64 * LDT;                // [64][LDX]: Wa | Wb
  static constexpr int lws = ws + 64 * LDX;               // [CM] ln_w, [CM] ln_b
  static constexpr int stat = lws + 2 * CM;               // [32] rstd
  static constexpr int red = stat + kLnRows;              // [2][32][8]: per row and warp, sum g, sum g xhat
  static constexpr int msk = red + 2 * kLnRows * 8;       // [32]
  static constexpr int bsum = msk + kLnRows;              // [256]
  static constexpr int floats = bsum + 256;
};
template <int CM>
constexpr size_t ln_smem_bytes() { return 4ull * LnSmem<CM>::floats; }
template <int CM, typename T>
__global__ void __launch_bounds__(256, 1) opm_bw_ln_kernel(
    const T* __restrict__ xin, const float* __restrict__ da, const float* __restrict__ db,
    const void* __restrict__ mask, int mask_kind, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
    const float* __restrict__ wa, const float* __restrict__ wb, T* __restrict__ dx, float* __restrict__ part,
    float* __restrict__ part_ln, int64_t R, float eps) {
#if defined(OPM_WG_DEVICE)
  using L = LnSmem<CM>;
  constexpr int NT = CM / 64, LDX = L::LDX, LDP = L::LDP, LDT = L::LDT;
  constexpr bool kSplit = std::is_same_v<T, float>;  // 16-bit x: single TF32 products (the lo planes unused)
  static_assert(CM == 128 || CM == 256, "CM: 128 or 256");
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  float* ws = sm + L::ws;
  float* lws = sm + L::lws;
  float* stat = sm + L::stat;
  float* red = sm + L::red;
  float* msk = sm + L::msk;
  uint32_t* ph = reinterpret_cast<uint32_t*>(sm + L::ph);
  uint32_t* pl = reinterpret_cast<uint32_t*>(sm + L::pl);
  uint32_t* th = reinterpret_cast<uint32_t*>(sm + L::th);
  uint32_t* tl = reinterpret_cast<uint32_t*>(sm + L::tl);
  __shared__ uint64_t bar[2];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int col0 = warp * (CM / 8);  // this warp's columns of dy and dW
  const int64_t tiles = (R + kLnRows - 1) / kLnRows;
  auto full = [&](int64_t tt) { return (tt + 1) * kLnRows <= R; };
  const unsigned tile_bytes = kLnRows * (unsigned(sizeof(T)) * CM + 4u * 64);
  // lane 0 of warp w: rows 4 w .. 4 w + 3 of tile tt's x_in, and its da (w = 0) or db (w = 1), into buffer
  // buf (thread 0 set the buffer's byte count before a block barrier). Spread over the warps: one thread
  // issuing all 34 held every warp at the next barrier.
  auto issue = [&](int64_t tt, int buf) {
    float* xs = sm + L::xs + buf * kLnRows * LDX;
    float* raw = sm + L::raw + buf * kLnRows * 64;
#pragma unroll
    for (int r = 4 * warp; r < 4 * warp + 4; ++r)
      bulk_copy(xs + r * LDX, xin + (tt * kLnRows + r) * CM, unsigned(sizeof(T)) * CM, &bar[buf]);
    if (warp < 2)
      bulk_copy(raw + warp * kLnRows * 32, (warp == 0 ? da : db) + tt * kLnRows * 32, 4u * kLnRows * 32, &bar[buf]);
  };
  if (tid == 0) {
    mbar_init(&bar[0], 1);
    mbar_init(&bar[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the barriers initialised before any copy or wait
  if (tid == 0 && blockIdx.x < tiles && full(blockIdx.x)) mbar_expect_tx(&bar[0], tile_bytes);
  for (int e = tid; e < 64 * (CM / 4); e += 256) {
    const int k = e / (CM / 4), q = e % (CM / 4);
    reinterpret_cast<float4*>(ws + k * LDX)[q] =
        __ldg(reinterpret_cast<const float4*>(k < 32 ? wa + k * CM : wb + (k - 32) * CM) + q);
  }
  for (int e = tid; e < 2 * CM; e += 256) lws[e] = __ldg(e < CM ? ln_w + e : ln_b + e - CM);
  __syncthreads();  // ws, lws visible; buffer 0's byte count set
  if (lane == 0 && blockIdx.x < tiles && full(blockIdx.x)) issue(blockIdx.x, 0);
  // ln_w at this thread's accumulator columns col0 + 8 nt + 2 t + e (lwc: in registers, read from shared
  // memory where it is used for fp32 at CM 256, where registers spilled); ln_w, ln_b at its B-fragment
  // columns col0 + 8 nt + g (product 2's x)
  constexpr bool kLwcRegs = !(kSplit && CM == 256);
  float2 lwr[NT];
  float lwg[NT], lbg[NT];
  auto lwc = [&](int nt) {
    return kLwcRegs ? lwr[nt] : *reinterpret_cast<const float2*>(lws + col0 + 8 * nt + 2 * t);
  };
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if constexpr (kLwcRegs) lwr[nt] = *reinterpret_cast<const float2*>(lws + col0 + 8 * nt + 2 * t);
    lwg[nt] = lws[col0 + 8 * nt + g];
    lbg[nt] = lws[CM + col0 + 8 * nt + g];
  }
  // accw[mt][nt][q]: dW row k = 16 mt + g + 8 (q >> 1), column col0 + 8 nt + 2 t + (q & 1)
  float accw[4][NT][4], dlw[NT][2], dlb[NT][2], dbias = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) dlw[nt][e] = dlb[nt][e] = 0.f;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q) accw[mt][nt][q] = 0.f;
  }
  // threads tid < 32: the mask of row tid of the block's next tile, loaded a tile ahead
  auto mask_at = [&](int64_t tt) {
    return tt < tiles && tt * kLnRows + tid < R ? mask_value(mask, tt * kLnRows + tid, mask_kind) : 0.f;
  };
  float m_next = tid < kLnRows ? mask_at(blockIdx.x) : 0.f;
  unsigned phases = 0u;  // bit buf: the parity of buffer buf's next wait
  int buf = 0;
  for (int64_t tt = blockIdx.x; tt < tiles; tt += gridDim.x, buf ^= 1) {
    const int64_t r0 = tt * kLnRows;
    float* xs = sm + L::xs + buf * kLnRows * LDX;
    float* raw = sm + L::raw + buf * kLnRows * 64;
    // (buffer buf ^ 1's previous phase was waited on by every thread in the previous tile)
    if (tid == 0 && tt + gridDim.x < tiles && full(tt + gridDim.x)) mbar_expect_tx(&bar[buf ^ 1], tile_bytes);
    __syncthreads();  // the previous tile's reads of xs (other buffer), the planes, msk, stat, red are done
    if (lane == 0 && tt + gridDim.x < tiles && full(tt + gridDim.x)) issue(tt + gridDim.x, buf ^ 1);
    if (tid < kLnRows) {
      msk[tid] = m_next;
      m_next = mask_at(tt + gridDim.x);
    }
    if (full(tt)) {
      mbar_wait(&bar[buf], (phases >> buf) & 1u);
      phases ^= 1u << buf;
    } else {  // the partial last tile: plain loads, zeros past R
      if constexpr (std::is_same_v<T, float>) {
        for (int e = tid; e < kLnRows * (CM / 4); e += 256) {
          const int r = e / (CM / 4), q = e % (CM / 4);
          reinterpret_cast<float4*>(xs + r * LDX)[q] =
              r0 + r < R ? __ldg(reinterpret_cast<const float4*>(xin + (r0 + r) * CM) + q) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      } else {  // 16-bit x: 8 values per load into the row's first CM / 2 floats, where the copies put them
        for (int e = tid; e < kLnRows * (CM / 8); e += 256) {
          const int r = e / (CM / 8), q = e % (CM / 8);
          reinterpret_cast<uint4*>(xs + r * LDX)[q] =
              r0 + r < R ? __ldg(reinterpret_cast<const uint4*>(xin + (r0 + r) * CM) + q) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
      for (int e = tid; e < kLnRows * 64; e += 256) {
        const int r = (e % 1024) / 32;
        raw[e] = r0 + r < R ? __ldg((e < 1024 ? da : db) + (r0 + r) * 32 + e % 32) : 0.f;
      }
    }
    __syncthreads();  // the tile (plain loads included) and msk visible to every thread
    // ---- build: the dp planes, this thread's bias sums (channel tid % 64) ----
    float dpv[kLnRows / 4];  // every load before the first store (the planes may alias raw for the compiler)
#pragma unroll
    for (int i = 0; i < kLnRows / 4; ++i) {
      const int r = tid / 64 + 4 * i, k = tid % 64;
      dpv[i] = raw[(k / 32) * kLnRows * 32 + r * 32 + k % 32] * msk[r];
    }
#pragma unroll
    for (int i = 0; i < kLnRows / 4; ++i) {
      const int r = tid / 64 + 4 * i, k = tid % 64;
      const float v = dpv[i];
      dbias += v;
      uint32_t hi, lo;
      split_tf32(v, hi, lo);
      ph[r * LDP + k] = hi;
      if constexpr (kSplit) pl[r * LDP + k] = lo;
      th[k * LDT + r] = hi;
      if constexpr (kSplit) tl[k * LDT + r] = lo;
    }
    // ---- statistics: warp w, rows 4 w .. 4 w + 3, RB at once, in registers: lane l holds the row's elements
    //      128 j + 4 l .. 128 j + 4 l + 3 (one 16-byte load of fp32, 8-byte of T per j); a 16-bit row is
    //      read whole (it sits in the first half of the fp32 row) before xhat overwrites it. RB = 2 for
    //      fp32 at CM 256 (4 spilled there) ----
    constexpr int RB = kSplit && CM == 256 ? 2 : 4, NJ = CM / 128;
#pragma unroll
    for (int rb = 0; rb < 4; rb += RB) {
      float xv[RB][NJ][4], s[RB], q[RB];
#pragma unroll
      for (int rr = 0; rr < RB; ++rr)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const float* row = xs + (4 * warp + rb + rr) * LDX;
          if constexpr (std::is_same_v<T, float>) {
            const float4 v = *reinterpret_cast<const float4*>(row + 128 * j + 4 * lane);
            xv[rr][j][0] = v.x; xv[rr][j][1] = v.y; xv[rr][j][2] = v.z; xv[rr][j][3] = v.w;
          } else {
            const uint2 h = *reinterpret_cast<const uint2*>(reinterpret_cast<const T*>(row) + 128 * j + 4 * lane);
            const float2 lo = to_float2<T>(h.x), hi = to_float2<T>(h.y);
            xv[rr][j][0] = lo.x; xv[rr][j][1] = lo.y; xv[rr][j][2] = hi.x; xv[rr][j][3] = hi.y;
          }
        }
      if constexpr (!std::is_same_v<T, float>) __syncwarp();  // every lane's reads of the 16-bit rows done
#pragma unroll
      for (int rr = 0; rr < RB; ++rr) {
        s[rr] = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[rr] += xv[rr][j][e];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int rr = 0; rr < RB; ++rr) s[rr] += __shfl_xor_sync(0xffffffffu, s[rr], o);
#pragma unroll
      for (int rr = 0; rr < RB; ++rr) {
        s[rr] *= 1.f / CM;  // the mean
        q[rr] = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float d = xv[rr][j][e] - s[rr];
            q[rr] = fmaf(d, d, q[rr]);
          }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int rr = 0; rr < RB; ++rr) q[rr] += __shfl_xor_sync(0xffffffffu, q[rr], o);
#pragma unroll
      for (int rr = 0; rr < RB; ++rr) {
        const int r = 4 * warp + rb + rr;
        const float rstd = r0 + r < R ? rsqrtf(q[rr] / CM + eps) : 0.f;  // rows past R: xhat 0 (also at eps = 0)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
          *reinterpret_cast<float4*>(xs + r * LDX + 128 * j + 4 * lane) =
              make_float4((xv[rr][j][0] - s[rr]) * rstd, (xv[rr][j][1] - s[rr]) * rstd, (xv[rr][j][2] - s[rr]) * rstd,
                          (xv[rr][j][3] - s[rr]) * rstd);
        if (lane == 0) stat[r] = rstd;
      }
    }
    __syncthreads();  // the planes, xhat and stat complete
    // ---- dy = dp . W: acc1[mt][nt][q] at row 16 mt + g + 8 (q >> 1), column col0 + 8 nt + 2 t + (q & 1) ----
    float acc1[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc1[mt][nt][q] = 0.f;
#pragma unroll 2
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t ah[2][4], al[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int o = (16 * mt + g) * LDP + 8 * ks + t;
        ah[mt][0] = ph[o];
        ah[mt][1] = ph[o + 8 * LDP];
        ah[mt][2] = ph[o + 4];
        ah[mt][3] = ph[o + 8 * LDP + 4];
        al[mt][0] = pl[o];
        al[mt][1] = pl[o + 8 * LDP];
        al[mt][2] = pl[o + 4];
        al[mt][3] = pl[o + 8 * LDP + 4];
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float* wp = ws + (8 * ks + t) * LDX + col0 + 8 * nt + g;
        uint32_t bh0, bl0, bh1, bl1;
        split_tf32(wp[0], bh0, bl0);
        split_tf32(wp[4 * LDX], bh1, bl1);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          if constexpr (kSplit) {
            mma_tf32(d, al[mt], bh0, bh1);  // the small terms first
            mma_tf32(d, ah[mt], bl0, bl1);
          }
          mma_tf32(d, ah[mt], bh0, bh1);
#pragma unroll
          for (int q = 0; q < 4; ++q) acc1[mt][nt][q] += d[q];
        }
      }
    }
    // ---- the rows' sums of g = dy ln_w and g xhat over this warp's columns ----
    float2 xh[2][2][NT];  // [mt][hf][nt]: xhat at (row 16 mt + g + 8 hf, columns col0 + 8 nt + 2 t, + 1)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * mt + g + 8 * hf;
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          xh[mt][hf][nt] = *reinterpret_cast<const float2*>(xs + r * LDX + col0 + 8 * nt + 2 * t);
          const float2 w2 = lwc(nt);
          const float g0 = acc1[mt][nt][2 * hf] * w2.x, g1 = acc1[mt][nt][2 * hf + 1] * w2.y;
          s1 += g0 + g1;
          s2 = fmaf(g0, xh[mt][hf][nt].x, fmaf(g1, xh[mt][hf][nt].y, s2));
        }
        s1 = quad_sum(s1);
        s2 = quad_sum(s2);
        if (t == 0) {
          red[r * 8 + warp] = s1;
          red[kLnRows * 8 + r * 8 + warp] = s2;
        }
      }
    // ---- dW += dp^T . x: rows k (A from dp^T), K = the tile's 32 rows, B = x split on load ----
#pragma unroll 1
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t bh[NT][2], bl[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float* xp = xs + (8 * ks + t) * LDX + col0 + 8 * nt + g;
        split_tf32(fmaf(xp[0], lwg[nt], lbg[nt]), bh[nt][0], bl[nt][0]);
        split_tf32(fmaf(xp[4 * LDX], lwg[nt], lbg[nt]), bh[nt][1], bl[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int o = (16 * mt + g) * LDT + 8 * ks + t;
        const uint32_t ah[4] = {th[o], th[o + 8 * LDT], th[o + 4], th[o + 8 * LDT + 4]};
        const uint32_t al[4] = {tl[o], tl[o + 8 * LDT], tl[o + 4], tl[o + 8 * LDT + 4]};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          if constexpr (kSplit) {
            mma_tf32(d, al, bh[nt][0], bh[nt][1]);
            mma_tf32(d, ah, bl[nt][0], bl[nt][1]);
          }
          mma_tf32(d, ah, bh[nt][0], bh[nt][1]);
#pragma unroll
          for (int q = 0; q < 4; ++q) accw[mt][nt][q] += d[q];
        }
      }
    }
    __syncthreads();  // every warp's row sums in red
    // ---- d_x_in, d_ln_w, d_ln_b ----
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * mt + g + 8 * hf;
        const float4 a0 = *reinterpret_cast<const float4*>(red + r * 8);
        const float4 a1 = *reinterpret_cast<const float4*>(red + r * 8 + 4);
        const float4 c0 = *reinterpret_cast<const float4*>(red + kLnRows * 8 + r * 8);
        const float4 c1 = *reinterpret_cast<const float4*>(red + kLnRows * 8 + r * 8 + 4);
        const float s1 = a0.x + a0.y + a0.z + a0.w + a1.x + a1.y + a1.z + a1.w;  // the warps in order
        const float s2 = c0.x + c0.y + c0.z + c0.w + c1.x + c1.y + c1.z + c1.w;
        const float rstd = stat[r], m1 = s1 / CM, m2 = s2 / CM;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float dy0 = acc1[mt][nt][2 * hf], dy1 = acc1[mt][nt][2 * hf + 1];
          const float2 x2 = xh[mt][hf][nt];
          {  // staged in xs (read whole before the barrier above), this warp's columns, as T
            const float2 w2 = lwc(nt);
            const float v0 = rstd * (dy0 * w2.x - m1 - x2.x * m2), v1 = rstd * (dy1 * w2.y - m1 - x2.y * m2);
            if constexpr (std::is_same_v<T, float>)
              *reinterpret_cast<float2*>(xs + r * LDX + col0 + 8 * nt + 2 * t) = make_float2(v0, v1);
            else
              *reinterpret_cast<uint32_t*>(reinterpret_cast<T*>(xs + r * LDX) + col0 + 8 * nt + 2 * t) = pack2_16<T>(v0, v1);
          }
          dlw[nt][0] = fmaf(dy0, x2.x, dlw[nt][0]);
          dlw[nt][1] = fmaf(dy1, x2.y, dlw[nt][1]);
          dlb[nt][0] += dy0;
          dlb[nt][1] += dy1;
        }
      }
    // ---- d_x_in: the warp's columns of the 32 rows by 16-byte loads and stores (CH chunks per row) ----
    __syncwarp();
    {
      constexpr int CH = CM / 8 * int(sizeof(T)) / 16;
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const int e = lane + 32 * i, r = e / CH, q = e % CH;
        if (r0 + r < R)
          *reinterpret_cast<uint4*>(reinterpret_cast<char*>(dx + (r0 + r) * CM + col0) + 16 * q) =
              *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(xs + r * LDX) + sizeof(T) * col0 + 16 * q);
      }
    }
    // this thread's generic writes of xs ordered before the bulk copies that refill it
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  // ---- partials: dW, then d_ln_w / d_ln_b over the lanes g (the columns are this warp's alone), the
  //      bias sums ----
  float* pb = part + static_cast<int64_t>(blockIdx.x) * 64 * CM;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        *reinterpret_cast<float2*>(pb + (16 * mt + g + 8 * hf) * CM + col0 + 8 * nt + 2 * t) =
            make_float2(accw[mt][nt][2 * hf], accw[mt][nt][2 * hf + 1]);
  float* plo = part_ln + static_cast<int64_t>(blockIdx.x) * (2 * CM + 64);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float vw = dlw[nt][e], vb = dlb[nt][e];
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        vw += __shfl_xor_sync(0xffffffffu, vw, off);
        vb += __shfl_xor_sync(0xffffffffu, vb, off);
      }
      if (g == 0) {
        plo[col0 + 8 * nt + 2 * t + e] = vw;
        plo[CM + col0 + 8 * nt + 2 * t + e] = vb;
      }
    }
  float* bsum = sm + L::bsum;
  bsum[tid] = dbias;
  __syncthreads();
  if (tid < 64) plo[2 * CM + tid] = (bsum[tid] + bsum[64 + tid]) + (bsum[128 + tid] + bsum[192 + tid]);
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// out[e] = sum over blocks (in order, in fp64) of part[blk * n + e] for e < n: the blocks' partials of
// opm_bw_ln_kernel (dWa | dWb: n = 64 CM; d_ln_w | d_ln_b | d_ba | d_bb: n = 2 CM + 64, into separate
// outputs by the caller's views) and of opm_colsum_kernel (n = c_z).
__global__ void __launch_bounds__(kThreads) opm_block_sum_kernel(const float* __restrict__ part, float* __restrict__ out,
                                                                 int blocks, int64_t n) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= n) return;
  double s = 0.0;
  for (int b = 0; b < blocks; ++b) s += part[b * n + e];
  out[e] = static_cast<float>(s);
}

// part[blk][c] = sum of g[r][c] over the rows r of block blk's range [blk rpb, (blk + 1) rpb) (out_proj's
//   bias gradient, the column sums of grad_out (rows, cz), G float, __half or __nv_bfloat16): thread (cg =
//   tid % CG, rl = tid / CG), CG = cz / 4 column quads (one 16- or 8-byte load per row), RL = 256 / CG row
//   lanes, sums rows rl, rl + RL, ... of its 4 columns in fp32, then thread cg adds the RL lanes in order.
//   opm_block_sum_kernel adds the blocks' sums.
// Assumptions: 256 threads; cz % 4 == 0, 4 <= cz <= 1024; g 16-byte aligned.
template <typename G>
__global__ void __launch_bounds__(kThreads) opm_colsum_kernel(const G* __restrict__ g, int64_t rows, int cz,
                                                              int64_t rpb, float* __restrict__ part) {
  __shared__ float4 red[kThreads];
  const int CG = cz / 4, RL = kThreads / CG, tid = threadIdx.x, cg = tid % CG, rl = tid / CG;
  const int64_t r0 = blockIdx.x * rpb, r1 = min64(rows, r0 + rpb);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (rl < RL)
    for (int64_t r = r0 + rl; r < r1; r += RL) {
      float4 v;
      if constexpr (std::is_same_v<G, float>) {
        v = __ldg(reinterpret_cast<const float4*>(g + r * cz) + cg);
      } else {  // 4 T in 8 bytes
        const uint2 h = __ldg(reinterpret_cast<const uint2*>(g + r * cz) + cg);
        const float2 lo = to_float2<G>(h.x), hi = to_float2<G>(h.y);
        v = make_float4(lo.x, lo.y, hi.x, hi.y);
      }
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
  red[tid] = acc;
  __syncthreads();
  if (tid < CG) {
    for (int l = 1; l < RL; ++l) {
      const float4 v = red[l * CG + tid];
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    reinterpret_cast<float4*>(part + blockIdx.x * static_cast<int64_t>(cz))[tid] = acc;
  }
}

// =============================================================================================
// Launchers
// =============================================================================================
#if defined(OPM_SM90A)
constexpr bool kBuiltSm90a = true;   // the build has sm_90a code (wgmma)
#else
constexpr bool kBuiltSm90a = false;
#endif
struct DevInfo {
  int sms = 0;
  int smem_optin = 0;
  int major = 0;       // compute capability major
  int minor = 0;
  bool tc_ok = false;  // w_first_tc/_tc2 can run: an sm_80+ device and their code built from sm_80+
                       // PTX (an extension built for older targets runs them JIT-compiled from
                       // that PTX, where the mma is a trap)
  bool wg_ok = false;  // w_first_wg2 can run: a compute capability 9.0 device, this extension built
                       // with sm_90a code (OPM_SM90A: the Python side turns 9.0 into 9.0a), and its
                       // kWgSmemBytes of shared memory per block available
  bool ow_ok = false;  // outer_wg can run: wg_ok and its kOwSmemMax per block available
};
static DevInfo dev_info(int dev) {
  static DevInfo cache[64];
  static bool have[64] = {false};
  if (dev >= 0 && dev < 64 && have[dev]) return cache[dev];
  DevInfo d;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev));
  cudaFuncAttributes fa;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, opm_wfirst_tc_kernel<1>));
  d.tc_ok = d.major >= 8 && fa.ptxVersion >= 80;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev));
  d.wg_ok = kBuiltSm90a && d.major == 9 && d.minor == 0 && kWgSmemBytes <= static_cast<size_t>(d.smem_optin);
  d.ow_ok = d.wg_ok && kOwSmemMax <= static_cast<size_t>(d.smem_optin);
  if (dev >= 0 && dev < 64) { cache[dev] = d; have[dev] = true; }
  return d;
}

static int grid_for(int64_t work_items) {  // grid-stride kernels: cap the grid, loop the rest
  return static_cast<int>(std::min<int64_t>(work_items, 1ll << 30));
}

static size_t prep_smem_bytes(int cm, int CP) {
  const int64_t LDX = round_up(cm, 4);
  const int64_t xs_floats = round_up(std::max<int64_t>(kRows1 * LDX, static_cast<int64_t>(CP) * 65), 4);
  const int64_t ws_floats = static_cast<int64_t>(kKC1) * (2 * CP + 4);
  return static_cast<size_t>(4 * (xs_floats + ws_floats));
}

template <class Kernel>
static void set_smem(Kernel k, size_t bytes, const DevInfo& d, const char* what) {
  TORCH_CHECK(bytes <= static_cast<size_t>(d.smem_optin), "outer_product_mean: ", what, " needs ", std::to_string(bytes),
              " bytes of shared memory per block, the device allows ", std::to_string(d.smem_optin));
  if (bytes > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            static_cast<int>(bytes)));
}

template <int CP>
static void launch_prep(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& ln_w,
                        const at::Tensor& ln_b, const at::Tensor& wa, const at::Tensor& ba, const at::Tensor& wb,
                        const at::Tensor& bb, const at::Tensor& wo, at::Tensor& aT, at::Tensor& bq,
                        at::Tensor& inv_denom, at::Tensor& wpack, int64_t B, int64_t S, int64_t N, int64_t Npad,
                        int cm, int c, int cz, float eps, int pack_mode, int pack_zp, const DevInfo& d,
                        cudaStream_t stream) {
  const int64_t n_row_blocks = cdiv(B * S * N, kRows1);
  const int n_den = static_cast<int>(std::min<int64_t>(cdiv(N, 32), 4 * d.sms));  // 32-column blocks
  const int n_pack = static_cast<int>(std::min<int64_t>(cdiv(static_cast<int64_t>(CP) * CP * pack_zp, kThreads), 2 * d.sms));
  const int64_t row_grid = std::min<int64_t>(n_row_blocks, 64ll * d.sms);
  const size_t smem = prep_smem_bytes(cm, CP);
  set_smem(opm_prep_kernel<CP>, smem, d, "the LayerNorm/projection kernel (64 rows of msa_dim floats)");
  const int grid = grid_for(n_den + n_pack + row_grid);
  if (grid == 0) return;
  opm_prep_kernel<CP><<<grid, kThreads, smem, stream>>>(
      x.data_ptr<float>(), mask.data_ptr(), mask_kind, ln_w.data_ptr<float>(), ln_b.data_ptr<float>(),
      wa.data_ptr<float>(), ba.data_ptr<float>(), wb.data_ptr<float>(), bb.data_ptr<float>(), wo.data_ptr<float>(),
      aT.data_ptr<float>(), bq.data_ptr<float>(), inv_denom.data_ptr<float>(), wpack.data_ptr<float>(), B, S, N,
      Npad, cm, c, cz, eps, n_row_blocks, n_den, n_pack, pack_mode, pack_zp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int CP>
static void launch_outer(const at::Tensor& aT, const at::Tensor& bq, const at::Tensor& inv_denom,
                         const at::Tensor& wt, const at::Tensor& bo, at::Tensor& out, int64_t B, int64_t S,
                         int64_t N, int64_t Npad, int cz, int CZP, const DevInfo& d, cudaStream_t stream) {
  using C = OuterCfg<CP>;
  const int64_t ntile = cdiv(N, C::TI);
  const int64_t total = B * ntile * ntile;
  set_smem(opm_outer_kernel<CP>, C::smem_bytes, d, "the outer-first kernel");
  const int grid = grid_for(total);
  if (grid == 0) return;
  opm_outer_kernel<CP><<<grid, kThreads, C::smem_bytes, stream>>>(
      aT.data_ptr<float>(), bq.data_ptr<float>(), inv_denom.data_ptr<float>(), wt.data_ptr<float>(),
      bo.data_ptr<float>(), out.data_ptr<float>(), B, S, N, Npad, cz, CZP);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// w_first_wg2 (Hopper): aT packed into At (opm_pack_a_kernel), then per j-chunk stage 1 writing the
// tile-order planes (opm_wfirst_proj_wg_kernel) and opm_wfirst_wg_kernel, one block per SM
// (persistent). Pt holds one chunk (wg_chunk_floats).
static int64_t wg_chunk_floats(int64_t B, int64_t JC, int64_t KB, int CZP4) {
  return B * cdiv(JC * CZP4, kWgBRows) * KB * 2 * kWgBPlane;
}
template <int CP>
static void launch_wfirst_wg(const at::Tensor& aT, const at::Tensor& bq, const at::Tensor& inv_denom,
                             const at::Tensor& wk, const at::Tensor& bo, at::Tensor& out, at::Tensor& At,
                             at::Tensor& Pt, int64_t JC, int64_t B, int64_t S, int64_t N, int64_t Npad, int cz,
                             int CZP4, const DevInfo& d, cudaStream_t stream) {
  const int64_t K = S * CP, KB = cdiv(K, kWgBK), MB128 = cdiv(N, 128);
  set_smem(opm_wfirst_wg_kernel, kWgSmemBytes, d, "the wgmma w-first GEMM kernel");
  const size_t smem1 = kProjWgSmemBytes<CP>;
  set_smem(opm_wfirst_proj_wg_kernel<CP>, smem1, d, "the w_first_wg2 stage-1 kernel");
  const int ga = grid_for(std::min<int64_t>(cdiv(B * KB * (kWgBK / 4) * 2 * MB128 * kWgARows, kThreads), 8ll * d.sms));
  if (ga > 0) {
    opm_pack_a_kernel<<<ga, kThreads, 0, stream>>>(aT.data_ptr<float>(), At.data_ptr<float>(), B, N, Npad, K,
                                                   2 * MB128, KB);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (int64_t j0 = 0; j0 < N; j0 += JC) {
    const int64_t JCv = std::min<int64_t>(JC, N - j0), ncols = JCv * CZP4;
    const int64_t NB = cdiv(ncols, kWgBRows);  // 128-column blocks of P in this chunk
    const int64_t Sx = KB * kWgBK / CP, JCx = cdiv(NB * kWgBRows, CZP4);
    const int g1 = grid_for(B * cdiv(Sx, kProjWgSG) * cdiv(JCx, 64) * (CP / 4) * cdiv(CZP4, 32));
    if (g1 > 0) {
      opm_wfirst_proj_wg_kernel<CP><<<g1, kThreads, smem1, stream>>>(bq.data_ptr<float>(), wk.data_ptr<float>(),
                                                                    Pt.data_ptr<float>(), B, S, N, j0, JCv, CZP4,
                                                                    NB, KB);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const int64_t tiles = B * MB128 * NB;
    const int g2 = grid_for(std::min<int64_t>(tiles, d.sms));  // the kernel loops over the rest
    opm_wfirst_wg_kernel<<<g2, kWgThreads, kWgSmemBytes, stream>>>(
        At.numel() ? At.data_ptr<float>() : aT.data_ptr<float>(), Pt.numel() ? Pt.data_ptr<float>() : aT.data_ptr<float>(),
        inv_denom.data_ptr<float>(), bo.data_ptr<float>(), out.data_ptr<float>(), B, N, MB128, NB, KB, j0,
        ncols, cz, CZP4);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// outer_wg (Hopper, CP = 32): opm_ow_params_kernel (Wf, bias', WoP), opm_prep_ow_kernel (msa -> Aow,
// Bow; inv_denom), opm_outer_wg_kernel (one block per SM, persistent).
// The planes' s blocks follow the msa's dtype: sb = 16 s (float32: split TF32 planes) or 32 (fp16 / bf16:
// T planes, ow_block_s).
struct OwDims {
  int64_t KB, NIT, NBB;  // s blocks, i tiles, j tiles
  int nzc, sb;           // z chunks, s per block
};
static OwDims ow_dims(int64_t S, int64_t N, int64_t cz, int sb) {
  return {cdiv(S, sb), cdiv(N, kOwTI), cdiv(N, kOwTJ), static_cast<int>(cdiv(cz, kOwZ)), sb};
}
static int ow_sb(at::ScalarType st) { return st == at::kFloat ? ow_block_s<float>() : ow_block_s<__half>(); }
struct OwPlanes {
  at::Tensor Aow, Bow, WoP;
};
// Aow, Bow in the msa's dtype x (fp32: hi and lo planes; fp16 / bf16: T); WoP fp32 planes, or float16.
static OwPlanes ow_planes(int64_t B, const OwDims& od, const at::TensorOptions& x) {
  const auto f32 = x.dtype(at::kFloat);
  if (od.sb == kOwS16)
    return {at::empty({B * kOwNQ * od.KB * 2 * od.NIT * kOwABlk16}, x), at::empty({B * od.NBB * od.KB * kOwBBlk16}, x),
            at::empty({static_cast<int64_t>(od.nzc) * kOwNQ * kOwHC * kOwWBlk16}, x.dtype(at::kHalf))};
  return {at::empty({B * kOwNQ * od.KB * 2 * od.NIT * 2 * kOwAPlane}, f32),
          at::empty({B * od.NBB * od.KB * 2 * kOwBPlane}, f32),
          at::empty({static_cast<int64_t>(od.nzc) * kOwNQ * kOwHC * 2 * kOwWPlane}, f32)};
}
// out in the msa's dtype (float32, bfloat16 or float16), as the planes.
static void launch_outer_wg_fused(const OwPlanes& p, const at::Tensor& inv_denom, const float* bo, at::Tensor& out,
                                  int64_t B, int64_t N, const OwDims& od, int cz, const DevInfo& d, cudaStream_t stream) {
  auto run = [&](auto kernel, auto* outp, size_t smem) {
    set_smem(kernel, smem, d, "the wgmma outer-first kernel");
    const int64_t tiles = B * od.nzc * od.NBB * od.NIT;  // < 2^31 (the callers' ow_tiles_ok)
    const int g = grid_for(std::min<int64_t>(tiles, d.sms));
    kernel<<<g, kOwThreads, smem, stream>>>(p.Aow.data_ptr(), p.Bow.data_ptr(), p.WoP.data_ptr(),
                                            inv_denom.data_ptr<float>(), bo, outp, B, N, od.KB,
                                            od.NIT, od.NBB, od.nzc, cz);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (out.scalar_type() == at::kBFloat16)
    run(opm_outer_wg_kernel<__nv_bfloat16>, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
        ow_smem_bytes<__nv_bfloat16>());
  else if (out.scalar_type() == at::kHalf)
    run(opm_outer_wg_kernel<__half>, reinterpret_cast<__half*>(out.data_ptr()), ow_smem_bytes<__half>());
  else
    run(opm_outer_wg_kernel<float>, out.data_ptr<float>(), ow_smem_bytes<float>());
}
// opm_prep_ow_kernel's m16 tiles per block (rows / 16): 2 to c_m = 256, else 1 (H200, 2026-12-01,
// prep kernel alone: crop (c_m 256) 146 / 158 / 151 us at 2 / 4 / 1, deep (c_m 512) 506 / 513 us at 1 / 2).
static int po_mt(int cm) { return cm <= 256 ? 2 : 1; }
static size_t po_smem_bytes(int cm, int MT) { return 4ull * po_tile_floats(cm, MT); }
// opm_ow_params_kernel: returns Wf (float32 planes, or Wf16 for a 16-bit msa: w16), then bias' and
// isc (64 floats each) in one tensor, and writes WoP for od.nzc z groups (none with nzc 0: wo and WoP
// are then not read).
// The parameters all float32, or all float16 / bfloat16 (then Wf's tail holds bo as fp32 too: c_z floats
// after isc, the fused kernel's bias); wo, bo: undefined tensors where nzc is 0 (not read).
static int64_t ow_wf_floats(int cm) { return cdiv(cm, 16) * 8 * 256; }  // Wf's weights; bias' follows
static at::Tensor launch_ow_params(const at::Tensor& ln_w, const at::Tensor& ln_b, const at::Tensor& wa,
                                   const at::Tensor& ba, const at::Tensor& wb, const at::Tensor& bb, const at::Tensor& wo,
                                   const at::Tensor& bo, void* WoP, int wo16, int w16, int cm, int c, int cz, int nzc,
                                   const DevInfo& d, cudaStream_t stream) {
  const int64_t U = cdiv(cm, 16);
  const bool p16 = ln_w.scalar_type() != at::kFloat;
  at::Tensor Wf = at::empty({ow_wf_floats(cm) + 128 + (p16 ? cz : 0)}, ln_w.options().dtype(at::kFloat));
  const int64_t nrest = (w16 ? 0 : U * 8 * 32) + static_cast<int64_t>(nzc) * kOwNQ * kOwHC * kOwZ * 8 + (p16 ? cz : 0);
  const int gpar = grid_for(kPoBiasBlocks + std::min<int64_t>(cdiv(nrest, kThreads), 2ll * d.sms));
  float* wf = Wf.data_ptr<float>();
  auto run = [&](auto tag) {
    using P = decltype(tag);
    auto ptr = [](const at::Tensor& t) { return t.defined() ? reinterpret_cast<const P*>(t.data_ptr()) : nullptr; };
    opm_ow_params_kernel<P><<<gpar, kThreads, 0, stream>>>(ptr(ln_w), ptr(ln_b), ptr(wa), ptr(ba), ptr(wb), ptr(bb),
                                                          ptr(wo), ptr(bo), wf, wf + ow_wf_floats(cm),
                                                          p16 ? wf + ow_wf_floats(cm) + 128 : nullptr, WoP, wo16, w16, cm,
                                                          c, cz, nzc);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (ln_w.scalar_type() == at::kBFloat16) run(__nv_bfloat16());
  else if (ln_w.scalar_type() == at::kHalf) run(__half());
  else run(float());
  return Wf;
}
// opm_prep_ow_kernel<MT, T, kPlanes> over every tile of x (float32, bfloat16 or float16; od.sb =
// ow_sb(x's dtype)), beside its inv_denom blocks: the planes Aow, Bow where kPlanes (x's dtype, see
// ow_planes), the rows a_rows, b_rows (B, S, N, 32) fp32 where not null. Wf from launch_ow_params.
// A 16-bit x with c_m % 16 == 0, c_m <= 256 at an 8-byte aligned address goes to opm_prep16_kernel (warp
// tiles), unless block_tiles; everything else to opm_prep_ow_kernel (block tiles).
static bool p16_runs(const at::Tensor& x, int cm, bool block_tiles) {
  return !block_tiles && x.scalar_type() != at::kFloat && cm % 16 == 0 && cm >= 16 && cm <= 16 * kP16MaxU &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0;
}
template <bool kPlanes>
static void launch_prep16(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& Wf, void* Aow,
                          void* Bow, float* a_rows, float* b_rows, int64_t B, int64_t S, int64_t N, int cm, float eps,
                          const OwDims& od, at::Tensor& inv_denom, const DevInfo& d, cudaStream_t stream) {
  const int64_t ntiles = B * (od.sb / 8) * od.KB * (16 * od.NIT / 2);  // warp tiles, < 2^31 (the callers' ow_tiles_ok)
  // inv_denom blocks, then tile blocks: 2 per SM (launch bounds, shared memory under half an SM's), all
  // resident at once
  const int n_den = static_cast<int>(std::min<int64_t>(cdiv(N, 32), std::max(1, d.sms / 4)));
  const int64_t gtiles = std::max<int64_t>(1, std::min<int64_t>(cdiv(ntiles, kP16Warps), 2ll * d.sms - n_den));
  const float* biasf = Wf.data_ptr<float>() + ow_wf_floats(cm);
  auto run = [&](auto kernel, const auto* xp, size_t smem) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    set_smem(kernel, smem, d, "the 16-bit LayerNorm/projection kernel of outer_wg");
    kernel<<<grid_for(n_den + gtiles), kP16Threads, smem, stream>>>(
        xp, mask.data_ptr(), mask_kind, Wf.data_ptr<float>(), biasf, static_cast<T*>(Aow), static_cast<T*>(Bow), B, S,
        N, cm, eps, od.KB, od.NIT, od.NBB, inv_denom.data_ptr<float>(), n_den, a_rows, b_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  const auto* xh = reinterpret_cast<const __half*>(x.data_ptr());
  // (bfloat16 at a compile-time U: ptxas keeps all c_m / 2 widened values of the lane between the
  // statistics and the products and spills 528 bytes, so bfloat16 takes U at run time alone)
  if (x.scalar_type() == at::kBFloat16)
    run(opm_prep16_kernel<__nv_bfloat16, kPlanes, 0>, xb, p16_smem_bytes<__nv_bfloat16>(cm));
  else if (cm == 16 * kP16MaxU) run(opm_prep16_kernel<__half, kPlanes, kP16MaxU>, xh, p16_smem_bytes<__half>(cm));
  else run(opm_prep16_kernel<__half, kPlanes, 0>, xh, p16_smem_bytes<__half>(cm));
}
template <bool kPlanes>
static void launch_prep_ow(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& Wf, void* Aow,
                           void* Bow, float* a_rows, float* b_rows, int64_t B, int64_t S, int64_t N, int cm, float eps,
                           const OwDims& od, at::Tensor& inv_denom, const DevInfo& d, cudaStream_t stream,
                           bool block_tiles = false) {
  TORCH_INTERNAL_ASSERT(od.sb == ow_sb(x.scalar_type()), "outer_product_mean: the planes' s blocks follow msa's dtype");
  if (p16_runs(x, cm, block_tiles)) {
    launch_prep16<kPlanes>(x, mask, mask_kind, Wf, Aow, Bow, a_rows, b_rows, B, S, N, cm, eps, od, inv_denom, d,
                           stream);
    return;
  }
  const int MT = po_mt(cm);
  const int64_t ntiles = B * (od.sb / 4) * od.KB * (16 * od.NIT / (4 * MT));  // < 2^31 (the callers' ow_tiles_ok)
  const size_t smem = po_smem_bytes(cm, MT);
  const int n_den = static_cast<int>(std::min<int64_t>(cdiv(N, 32), 2 * d.sms));  // inv_denom blocks
  // one block per tile (a persistent grid, each block loading its next tile's x and Wf during the
  // current one, measured slower: bfloat16 at crop 122 against 93 us, H200, 2026-12-02)
  const int gprep = grid_for(n_den + ntiles);  // (ntiles = 0 when S = 0: inv_denom still runs)
  if (gprep == 0) return;
  const float* biasf = Wf.data_ptr<float>() + ow_wf_floats(cm);
  auto run = [&](auto kernel, const auto* xp) {
    set_smem(kernel, smem, d, "the tensor-core LayerNorm/projection kernel of outer_wg");
    kernel<<<gprep, kPoThreads, smem, stream>>>(xp, mask.data_ptr(), mask_kind, Wf.data_ptr<float>(), biasf, Aow, Bow, B,
                                                S, N, cm, eps, od.KB, od.NIT, od.NBB, inv_denom.data_ptr<float>(), n_den,
                                                a_rows, b_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
    if (MT == 2) run(opm_prep_ow_kernel<2, __nv_bfloat16, kPlanes>, xp);
    else run(opm_prep_ow_kernel<1, __nv_bfloat16, kPlanes>, xp);
  } else if (x.scalar_type() == at::kHalf) {
    const auto* xp = reinterpret_cast<const __half*>(x.data_ptr());
    if (MT == 2) run(opm_prep_ow_kernel<2, __half, kPlanes>, xp);
    else run(opm_prep_ow_kernel<1, __half, kPlanes>, xp);
  } else {
    const float* xp = x.data_ptr<float>();
    if (MT == 2) run(opm_prep_ow_kernel<2, float, kPlanes>, xp);
    else run(opm_prep_ow_kernel<1, float, kPlanes>, xp);
  }
}
// x and out: float32 (split TF32), or both bfloat16 / float16 (the prep reads x as it is, phase A on the
// 16-bit tensor cores, the fused kernel writes out in that type).
static void launch_outer_wg(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& ln_w,
                            const at::Tensor& ln_b, const at::Tensor& wa, const at::Tensor& ba, const at::Tensor& wb,
                            const at::Tensor& bb, const at::Tensor& wo, const at::Tensor& bo, at::Tensor& inv_denom,
                            at::Tensor& out, int64_t B, int64_t S, int64_t N, int cm, int c, int cz, float eps,
                            float* a_rows, float* b_rows, const DevInfo& d, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(out.scalar_type() == x.scalar_type(), "outer_product_mean: outer_wg's out has msa's dtype");
  const OwDims od = ow_dims(S, N, cz, ow_sb(x.scalar_type()));
  const OwPlanes p = ow_planes(B, od, x.options());
  const int wo16 = x.scalar_type() != at::kFloat;  // 16-bit input: phase B in float16
  const at::Tensor Wf = launch_ow_params(ln_w, ln_b, wa, ba, wb, bb, wo, bo, p.WoP.data_ptr(), wo16, wo16, cm, c, cz,
                                         od.nzc, d, stream);
  // bo as fp32: the parameter itself, or its copy in Wf's tail (16-bit parameters)
  const float* bof = ln_w.scalar_type() == at::kFloat ? bo.data_ptr<float>() : Wf.data_ptr<float>() + ow_wf_floats(cm) + 128;
  launch_prep_ow<true>(x, mask, mask_kind, Wf, p.Aow.data_ptr(), p.Bow.data_ptr(), a_rows, b_rows, B, S, N, cm, eps, od,
                       inv_denom, d, stream);
  launch_outer_wg_fused(p, inv_denom, bof, out, B, N, od, cz, d, stream);
}

// small: stage 2 by opm_wfirst_small_kernel (32 x 64 tiles, K split over warps) instead of the
// 128 x 128 opm_wfirst_gemm_kernel; tc (1 or 2): by opm_wfirst_tc_kernel<tc> (split TF32).
template <int CP>
static void launch_wfirst(const at::Tensor& aT, const at::Tensor& bq, const at::Tensor& inv_denom,
                          const at::Tensor& wk, const at::Tensor& bo, at::Tensor& out, at::Tensor& P, int64_t JC,
                          int64_t B, int64_t S, int64_t N, int64_t Npad, int cz, int CZP4, bool small, int tc,
                          const DevInfo& d, cudaStream_t stream) {
  const size_t smem2 = small ? 4 * kSmallSmemFloats
                       : tc == 1 ? kTcSmemBytes<1>
                       : tc == 2 ? kTcSmemBytes<2>
                                 : 4 * 2 * 2 * kKC * kTile;  // see each kernel
  if (small) set_smem(opm_wfirst_small_kernel, smem2, d, "the small w-first GEMM kernel");
  else if (tc == 1) set_smem(opm_wfirst_tc_kernel<1>, smem2, d, "the split-TF32 w-first GEMM kernel");
  else if (tc == 2) set_smem(opm_wfirst_tc_kernel<2>, smem2, d, "the split-TF32 w-first GEMM kernel (v2)");
  else set_smem(opm_wfirst_gemm_kernel, smem2, d, "the w-first GEMM kernel");
  const int64_t ldp = JC * CZP4;
  const int64_t ncol1 = static_cast<int64_t>(CP) * CZP4;  // stage-1 columns (h, z)
  const float* Pp = P.numel() ? P.data_ptr<float>() : aT.data_ptr<float>();
  for (int64_t j0 = 0; j0 < N; j0 += JC) {
    const int64_t JCv = std::min<int64_t>(JC, N - j0);
    const int g1 = grid_for(B * S * cdiv(JCv, 64) * cdiv(ncol1, 128));
    if (g1 > 0) {
      opm_wfirst_proj_kernel<CP><<<g1, kThreads, 0, stream>>>(bq.data_ptr<float>(), wk.data_ptr<float>(),
                                                             P.data_ptr<float>(), B, S, N, j0, JCv, ldp, CZP4);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (tc) {
      const int g2 = grid_for(B * cdiv(N, kTile) * cdiv(JCv * CZP4, kTile));
      auto kernel = tc == 1 ? opm_wfirst_tc_kernel<1> : opm_wfirst_tc_kernel<2>;
      kernel<<<g2, kTcThreads, smem2, stream>>>(
          aT.data_ptr<float>(), Pp, inv_denom.data_ptr<float>(), bo.data_ptr<float>(), out.data_ptr<float>(),
          B, S, N, Npad, CP, j0, JCv, ldp, cz, CZP4);
    } else if (small) {
      const int g2 = grid_for(B * cdiv(N, kSmM) * cdiv(JCv * CZP4, kSmN));
      opm_wfirst_small_kernel<<<g2, kThreads, smem2, stream>>>(
          aT.data_ptr<float>(), Pp, inv_denom.data_ptr<float>(), bo.data_ptr<float>(), out.data_ptr<float>(),
          B, S, N, Npad, CP, j0, JCv, ldp, cz, CZP4);
    } else {
      const int g2 = grid_for(B * cdiv(N, kTile) * cdiv(JCv * CZP4, kTile));
      opm_wfirst_gemm_kernel<<<g2, kThreads, smem2, stream>>>(
          aT.data_ptr<float>(), Pp, inv_denom.data_ptr<float>(), bo.data_ptr<float>(), out.data_ptr<float>(),
          B, S, N, Npad, CP, j0, JCv, ldp, cz, CZP4);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// =============================================================================================
// Bound function
// =============================================================================================
// Error-message pieces as std::string. Streaming integers, shapes, devices or dtypes through
// c10::str (TORCH_CHECK) from this nvcc-compiled file crashed inside libstdc++
// (std::ostream::_M_insert<long>) on the torch 2.11 GPU image (seen 2026-11-29), so every number,
// shape, device and dtype in a message is converted to std::string first (as contact_map.py does).
template <typename T>
static std::string num(T v) { return std::to_string(v); }
static std::string shape_str(const at::Tensor& t) {
  std::string r = "[";
  const auto s = t.sizes();
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
static std::string dev_str(const at::Tensor& t) { return t.device().str(); }
static std::string dtype_str(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

static int mask_kind_of(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kBool: return kBool;
    case at::kByte: return kU8;
    case at::kChar: return kI8;
    case at::kShort: return kI16;
    case at::kInt: return kI32;
    case at::kLong: return kI64;
    default: return -1;
  }
}

// variant: a Variant id (kAuto or the variant to force). msa: float32, or bfloat16 / float16 with the
// parameters float32 or all of msa's dtype: outer_wg then reads msa (and the parameters) as they are,
// runs both products on the 16-bit tensor cores and writes out in msa's dtype; the other variants run
// on float32 copies and return float32. Returns (out, the id of the variant that ran, a, b,
// inv_denom): with keep_ab, where outer_wg ran with hidden_dim 32, a and b (B, S, N, 32) fp32 as its
// prep computed them (the backward's inputs, opm_backward_rows' outputs) and inv_denom (B, N); else
// undefined tensors (None).
std::tuple<at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor> opm_forward(
    at::Tensor msa, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa, at::Tensor ba, at::Tensor wb,
    at::Tensor bb, at::Tensor wo, at::Tensor bo, double eps, int64_t variant, bool keep_ab) {
  // ---- checks that need no device: rank, dtype, sizes, limits ----
  TORCH_CHECK(msa.dim() == 4, "outer_product_mean: msa_repr must be 4-D (B, S, N, msa_dim), got shape ",
              shape_str(msa));
  TORCH_CHECK(msa.scalar_type() == at::kFloat || msa.scalar_type() == at::kBFloat16 || msa.scalar_type() == at::kHalf,
              "outer_product_mean: msa_repr must be float32, bfloat16 or float16, got ", dtype_str(msa));
  const bool half_input = msa.scalar_type() != at::kFloat;
  const int64_t B = msa.size(0), S = msa.size(1), N = msa.size(2), cm = msa.size(3);
  TORCH_CHECK(ln_w.dim() == 1 && ln_b.dim() == 1 && ln_w.size(0) == cm && ln_b.size(0) == cm,
              "outer_product_mean: msa_repr has msa_dim = ", num(cm), " (shape ", shape_str(msa),
              ") but layer_norm weight/bias have shapes ", shape_str(ln_w), " / ", shape_str(ln_b));
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == S && mask.size(2) == N,
              "outer_product_mean: msa_mask must have shape (B, S, N) = (", num(B), ", ", num(S), ", ", num(N),
              ") to match msa_repr ", shape_str(msa), ", got ", shape_str(mask));
  const int mask_kind = mask_kind_of(mask.scalar_type());
  TORCH_CHECK(mask_kind >= 0, "outer_product_mean: unsupported msa_mask dtype ", dtype_str(mask),
              "; use float32, float16, bfloat16, bool, uint8, int8, int16, int32 or int64");
  TORCH_CHECK(wa.dim() == 2 && wa.size(1) == cm && ba.dim() == 1 && ba.size(0) == wa.size(0),
              "outer_product_mean: proj_a weight must be (hidden_dim, msa_dim = ", num(cm), ") with bias (hidden_dim), got ",
              shape_str(wa), " and ", shape_str(ba));
  const int64_t c = wa.size(0);
  TORCH_CHECK(wb.dim() == 2 && wb.size(0) == c && wb.size(1) == cm && bb.dim() == 1 && bb.size(0) == c,
              "outer_product_mean: proj_b weight must be (", num(c), ", ", num(cm), ") with bias (", num(c), "), got ",
              shape_str(wb), " and ", shape_str(bb));
  TORCH_CHECK(wo.dim() == 2 && wo.size(1) == c * c && bo.dim() == 1 && bo.size(0) == wo.size(0),
              "outer_product_mean: out_proj weight must be (pair_dim, hidden_dim^2 = ", num(c * c),
              ") with bias (pair_dim), got ", shape_str(wo), " and ", shape_str(bo));
  const int64_t cz = wo.size(0);
  TORCH_CHECK(c >= 1 && c <= kMaxHidden, "outer_product_mean: hidden_dim must be in [1, ", num(kMaxHidden), "], got ", num(c));
  TORCH_CHECK(cm >= 1 && cm <= kMaxMsaDim, "outer_product_mean: msa_dim must be in [1, ", num(kMaxMsaDim),
              "] (64 rows of msa are kept in shared memory), got ", num(cm));
  TORCH_CHECK(cz >= 1, "outer_product_mean: pair_dim must be >= 1, got ", num(cz));
  // parameters: float32, or all of msa's dtype where that is float16 / bfloat16 (converted below where
  // the variant is not outer_wg)
  const bool p16 = half_input && ln_w.scalar_type() == msa.scalar_type();
  for (const at::Tensor* p : {&ln_w, &ln_b, &wa, &ba, &wb, &bb, &wo, &bo})
    TORCH_CHECK(p->scalar_type() == (p16 ? msa.scalar_type() : at::kFloat), "outer_product_mean: parameters must be ",
                p16 ? "all " : "", p16 ? dtype_str(msa) : std::string("float32"), p16 ? " like msa_repr" : "", ", got ",
                dtype_str(*p));
  TORCH_CHECK(variant >= 0 && variant < kNumVariants, "outer_product_mean: variant code must be 0-",
              num(kNumVariants - 1), ", got ", num(variant));

  // ---- device checks ----
  TORCH_CHECK(msa.is_cuda(), "outer_product_mean: msa_repr must be a CUDA tensor, got a tensor on ", dev_str(msa),
              " (move the model and inputs with .cuda())");
  TORCH_CHECK(mask.device() == msa.device(), "outer_product_mean: msa_mask is on ", dev_str(mask),
              " but msa_repr is on ", dev_str(msa));
  for (const at::Tensor* p : {&ln_w, &ln_b, &wa, &ba, &wb, &bb, &wo, &bo})
    TORCH_CHECK(p->device() == msa.device(), "outer_product_mean: the parameters are on ", dev_str(*p),
                " but msa_repr is on ", dev_str(msa), " (call model.to(msa_repr.device))");

  const c10::cuda::CUDAGuard guard(msa.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(msa.get_device());
  TORCH_CHECK((variant != kWFirstTc && variant != kWFirstTc2) || d.tc_ok,
              "outer_product_mean: variants w_first_tc and w_first_tc2 need an sm_80+ GPU (TF32 mma.sync) and this "
              "extension built for sm_80+ (TORCH_CUDA_ARCH_LIST); this GPU has compute capability ", num(d.major), ".x");
  TORCH_CHECK(variant != kWFirstWg2 || d.wg_ok, "outer_product_mean: variant w_first_wg2 needs a compute "
              "capability 9.0 GPU (H100/H200: wgmma; this GPU: ", num(d.major), ".", num(d.minor), "), this "
              "extension built with sm_90a code (TORCH_CUDA_ARCH_LIST with 9.0 or 9.0a, not a name such as "
              "Hopper; this build: ", kBuiltSm90a ? "yes" : "no", ") and ", num(kWgSmemBytes), " bytes of "
              "shared memory per block (this GPU: ", num(d.smem_optin), ")");
  // outer_wg's prep decodes its warp tiles (4 s x 4 n each, S padded to its s blocks, N to 16) and its fused
  // kernel its tiles (16 i x 4 j x 128 z) in 32 bits
  const bool ow_tiles_ok = B * round_up(S, ow_sb(msa.scalar_type())) * round_up(N, 16) / 16 < (1ll << 31) &&
                           B * cdiv(N, kOwTI) * cdiv(N, kOwTJ) * cdiv(cz, kOwZ) < (1ll << 31);
  TORCH_CHECK(variant != kOuterWg || ow_tiles_ok, "outer_product_mean: variant outer_wg needs B * S * N / 16 < 2^31 (S "
              "rounded up to 16, or to 32 for float16 / bfloat16, N to 16) and B * N^2 / 64 < 2^31 (per 128 of "
              "pair_dim, N rounded up to 16), got B = ", num(B), ", S = ", num(S), ", N = ", num(N),
              "; use outer_first or w_first_wg2");
  TORCH_CHECK(variant != kOuterWg || (d.ow_ok && c <= 32), "outer_product_mean: variant outer_wg",
              " needs hidden_dim <= 32 "
              "(this model: ", num(c), "), a compute capability 9.0 GPU (this GPU: ", num(d.major), ".", num(d.minor),
              "), this extension built with sm_90a code (this build: ", kBuiltSm90a ? "yes" : "no", ") and ",
              num(kOwSmemMax), " bytes of shared memory per block (this GPU: ", num(d.smem_optin), ")");
  int CP = c <= 16 ? 16 : c <= 32 ? 32 : c <= 64 ? 64 : 128;
  const int64_t Npad = round_up(N, 4);
  const int64_t CZP = round_up(cz, kZC), CZP4 = round_up(cz, 4);

  // contraction order for "auto": the smaller estimated time (FLOPs as executed, i.e. with c padded
  // to CP, over the measured or predicted efficiency of each path, plus a fixed cost per launch);
  // w_first only if one j column of P fits the chunk cap. Constants: see kEff* above.
  const int64_t p_col_bytes = 4 * B * S * CP * CZP4;
  const int64_t JC = std::max<int64_t>(1, std::min<int64_t>(N, kPChunkBytes / std::max<int64_t>(p_col_bytes, 1)));
  // w_first_wg2: a chunk of P's tile-order planes (hi and lo, K padded to kWgBK, columns to whole
  // 128-column blocks) up to kPChunkBytesWg: as many j as fill whole blocks under the cap (>= 1)
  const int64_t KB = cdiv(S * CP, kWgBK);
  const int64_t wg_block_bytes = 4 * B * KB * 2 * kWgBPlane;  // one 128-column block of P, all K
  const bool wg_fits = wg_block_bytes <= kPChunkBytesWg;
  const int64_t JCw = std::max<int64_t>(
      1, std::min<int64_t>(N, kPChunkBytesWg / std::max<int64_t>(wg_block_bytes, 1) * kWgBRows / CZP4));
  const bool w_small = B * cdiv(N, kTile) * cdiv(JC * CZP4, kTile) < d.sms;  // 128-tile grid under one wave
  int64_t used = variant;
  if (variant == kAuto) {
    const double cp = CP, nn = static_cast<double>(B) * N * N, bsn = static_cast<double>(B) * S * N;
    // every path but outer_wg starts with opm_prep_kernel (FMA): 2 B S N c_m 2CP FLOPs at kEffPrep
    const double t_prep = 2.0 * bsn * cm * 2 * cp / kEffPrep + kLaunchS;
    const double t_outer = t_prep + 2.0 * nn * cp * cp * (S + cz) / kEffOuter + kLaunchS;
    const double nchunk = static_cast<double>(cdiv(N, JC));
    // stage 2: the small kernel under one wave of 128 x 128 tiles, else split TF32 on sm_80+
    // (w_first_tc2 where its shared memory fits, else w_first_tc)
    const bool w_tc = !w_small && d.tc_ok;
    const bool tc2_fits = kTcSmemBytes<2> <= static_cast<size_t>(d.smem_optin);  // 136 KB: not the 100 KB parts
    const double t_w = t_prep + 2.0 * bsn * cp * cp * CZP4 / kEffProj +
                       2.0 * nn * S * cp * CZP4 / (w_small ? kEffSmall : w_tc ? (tc2_fits ? kEffWTc : kEffWTc1) : kEffW) +
                       2.0 * nchunk * kLaunchS;
    // w_first_wg2 (Hopper): stage 1 writing the split planes, stage 2 on wgmma; not where its first
    // chunk has fewer 128 x 128 tiles than SMs (those go to w_first_small, as for w_first)
    const bool wg_small = B * cdiv(N, kTile) * cdiv(JCw * CZP4, kTile) < d.sms;
    const double t_wg = d.wg_ok && !wg_small && wg_fits
                            ? t_prep + 2.0 * bsn * cp * cp * CZP4 / kEffProjWg + 2.0 * nn * S * cp * CZP4 / kEffWg +
                                  2.0 * static_cast<double>(cdiv(N, JCw)) * kLaunchS + kLaunchS
                            : 1e30;
    // outer_wg (Hopper, hidden_dim <= 32): whole waves of tiles (one tile per SM at a time), each
    // tile's phase-A and phase-B FLOPs (S, c, c_z padded to 16 (32 in fp16 / bf16), 32, 128) at their
    // own rates (the 16-bit ones for fp16 / bf16 inputs), plus its prep and its three launches
    const OwDims od = ow_dims(S, N, cz, ow_sb(msa.scalar_type()));
    const double ow_rate_a = half_input ? kEffOwA16 : kEffOwA, ow_rate_b = half_input ? kEffOwB16 : kEffOwB;
    const double ow_waves = std::ceil(static_cast<double>(B * od.nzc * od.NBB * od.NIT) / d.sms);
    const double ow_tile_s = kOwNQ * (2.0 * 128 * 128 * od.sb * od.KB / (ow_rate_a / d.sms) +
                                      2.0 * 64 * kOwZ * kOwHC * 32 / (ow_rate_b / d.sms));
    // + its tensor-core prep (opm_prep_ow_kernel): the larger of its bytes (msa read, the Aow / Bow
    // planes written) at kBwPrepOw and its tensor-core FLOPs (x3 for the split; rows and K padded
    // as executed) at kEffPrepOw
    const double el = msa.element_size(), plane_bytes = half_input ? el : 2 * 4.0;  // T, or fp32 hi + lo
    // the prep's passes in TF32 units (its float16 products, m16n8k16, run at twice the TF32 rate)
    const double passes = !half_input ? 3 : msa.scalar_type() == at::kBFloat16 ? 0.5 : 1.5;
    const double ow_prep_bytes = el * bsn * cm + plane_bytes * B * od.sb * od.KB * 32 * (16.0 * od.NIT + 4.0 * od.NBB);
    const double ow_prep_flops = passes * 2.0 * B * od.sb * od.KB * 16.0 * od.NIT * 16.0 * cdiv(cm, 16) * 64;
    const double ow_prep_s = std::max(ow_prep_bytes / kBwPrepOw, ow_prep_flops / kEffPrepOw);
    const double t_ow = d.ow_ok && c <= 32 && ow_tiles_ok ? ow_waves * ow_tile_s + ow_prep_s + 3 * kLaunchS : 1e30;
    const bool w_fits = p_col_bytes <= kPChunkBytes;
    used = (t_w < t_outer && w_fits) ? (w_small ? kWFirstSmall : w_tc ? (tc2_fits ? kWFirstTc2 : kWFirstTc) : kWFirst)
                                     : kOuterFirst;
    if (t_wg < std::min(t_outer, w_fits ? t_w : 1e30)) used = kWFirstWg2;
    if (t_ow < std::min({t_outer, w_fits ? t_w : 1e30, t_wg})) used = kOuterWg;  // (t_ow finite only if ow_tiles_ok)
  }
  if (used == kOuterWg) CP = 32;  // outer_wg's tiles are built for CP = 32 (c <= 32 zero-padded)

  auto f32 = msa.options().dtype(at::kFloat);
  const bool half_io = used == kOuterWg && half_input;  // bfloat16 / float16 in and out
  at::Tensor out = at::empty({B, N, N, cz}, half_io ? msa.options() : f32);
  if (out.numel() == 0) return {out, used, at::Tensor(), at::Tensor(), at::Tensor()};

  // contiguous and 16-byte aligned (the prep kernels' 16-byte loads and bulk copies): a contiguous view
  // at an odd storage offset is copied; bfloat16 msa becomes float32 except for outer_wg
  at::Tensor x = half_io ? msa.contiguous() : msa.contiguous().to(at::kFloat);
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();
  const at::Tensor m = mask.contiguous();
  // 16-bit parameters go to outer_wg's params kernel as they are, as float32 to the other variants
  const bool pf = !p16 || used == kOuterWg;
  auto prm = [&](const at::Tensor& t) { return pf ? t.contiguous() : t.contiguous().to(at::kFloat); };
  const at::Tensor lw = prm(ln_w), lb = prm(ln_b);
  const at::Tensor wa_c = prm(wa), ba_c = prm(ba), wb_c = prm(wb), bb_c = prm(bb);
  const at::Tensor wo_c = prm(wo), bo_c = prm(bo);
  at::Tensor inv_denom = at::empty({B, N}, f32);
  if (used == kOuterWg) {  // outer_wg: its own prep (no aT, bq)
    at::Tensor a, b;
    if (keep_ab && c == 32) {
      a = at::empty({B, S, N, 32}, f32);
      b = at::empty({B, S, N, 32}, f32);
    }
    launch_outer_wg(x, m, mask_kind, lw, lb, wa_c, ba_c, wb_c, bb_c, wo_c, bo_c, inv_denom, out, B, S, N,
                    static_cast<int>(cm), static_cast<int>(c), static_cast<int>(cz), static_cast<float>(eps),
                    a.defined() ? a.data_ptr<float>() : nullptr, b.defined() ? b.data_ptr<float>() : nullptr,
                    d, stream);
    if (!a.defined()) return {out, used, a, b, at::Tensor()};
    return {out, used, a, b, inv_denom};
  }
  at::Tensor aT = at::empty({B, S, CP, Npad}, f32);
  at::Tensor bq = at::empty({B, S, N, CP}, f32);
  const int pack_mode = used == kOuterFirst ? 0 : 1;
  const int64_t pack_zp = used == kOuterFirst ? CZP : CZP4;
  at::Tensor wpack = at::empty({static_cast<int64_t>(CP) * CP * pack_zp}, f32);

#define OPM_DISPATCH(CPV, ...)                               \
  switch (CPV) {                                             \
    case 16: { constexpr int kCP = 16; __VA_ARGS__; break; } \
    case 32: { constexpr int kCP = 32; __VA_ARGS__; break; } \
    case 64: { constexpr int kCP = 64; __VA_ARGS__; break; } \
    default: { constexpr int kCP = 128; __VA_ARGS__; break; } \
  }

  OPM_DISPATCH(CP, launch_prep<kCP>(x, m, mask_kind, lw, lb, wa_c, ba_c, wb_c, bb_c, wo_c, aT, bq, inv_denom, wpack,
                                    B, S, N, Npad, static_cast<int>(cm), static_cast<int>(c), static_cast<int>(cz),
                                    static_cast<float>(eps), pack_mode, static_cast<int>(pack_zp), d, stream));
  if (used == kOuterFirst) {
    OPM_DISPATCH(CP, launch_outer<kCP>(aT, bq, inv_denom, wpack, bo_c, out, B, S, N, Npad, static_cast<int>(cz),
                                       static_cast<int>(CZP), d, stream));
  } else if (used == kWFirstWg2) {
    at::Tensor At = at::empty({B * 2 * cdiv(N, 128) * KB * 2 * kWgAPlane}, f32);
    at::Tensor Pt = at::empty({wg_chunk_floats(B, JCw, KB, static_cast<int>(CZP4))}, f32);
    OPM_DISPATCH(CP, launch_wfirst_wg<kCP>(aT, bq, inv_denom, wpack, bo_c, out, At, Pt, JCw, B, S, N, Npad,
                                           static_cast<int>(cz), static_cast<int>(CZP4), d, stream));
  } else {
    at::Tensor P = at::empty({B * S * CP * JC * CZP4}, f32);
    OPM_DISPATCH(CP, launch_wfirst<kCP>(aT, bq, inv_denom, wpack, bo_c, out, P, JC, B, S, N, Npad,
                                        static_cast<int>(cz), static_cast<int>(CZP4), used == kWFirstSmall,
                                        used == kWFirstTc ? 1 : used == kWFirstTc2 ? 2 : 0, d, stream));
  }
#undef OPM_DISPATCH
  return {out, used, at::Tensor(), at::Tensor(), at::Tensor()};
}

// The backward's a and b (LayerNorm, both projections, the mask: outer_wg's prep with rows out) and
// inv_denom, as the forward computes them: msa (B, S, N, c_m) float32, float16 or bfloat16, mask (B, S, N) of a
// dtype mask_kind_of takes, parameters float32 with hidden_dim 32, c_m <= kMaxMsaDim, CUDA, on a device
// where outer_wg runs, B * S * N / 16 < 2^31 (S, N rounded up to 16). block_tiles: opm_prep_ow_kernel
// even where opm_prep16_kernel would run (launch_prep_ow; the two give bit-equal rows). Returns (a, b
// (B, S, N, 32) fp32, inv_denom (B, N)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> opm_backward_rows(at::Tensor msa, at::Tensor mask, at::Tensor ln_w,
                                                                 at::Tensor ln_b, at::Tensor wa, at::Tensor ba,
                                                                 at::Tensor wb, at::Tensor bb, double eps,
                                                                 bool block_tiles) {
  for (const at::Tensor* t : {&msa, &mask, &ln_w, &ln_b, &wa, &ba, &wb, &bb})
    TORCH_CHECK(t->is_cuda(), "outer_product_mean: opm_backward_rows takes CUDA tensors");
  TORCH_CHECK(msa.dim() == 4 && (msa.scalar_type() == at::kFloat || msa.scalar_type() == at::kHalf ||
                                 msa.scalar_type() == at::kBFloat16),
              "outer_product_mean: opm_backward_rows: msa (B, S, N, c_m) float32, float16 or bfloat16");
  const int64_t B = msa.size(0), S = msa.size(1), N = msa.size(2), cm = msa.size(3);
  TORCH_CHECK(cm >= 1 && cm <= kMaxMsaDim, "outer_product_mean: opm_backward_rows: c_m in [1, ", num(kMaxMsaDim), "]");
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == S && mask.size(2) == N,
              "outer_product_mean: opm_backward_rows: mask (B, S, N)");
  const int mask_kind = mask_kind_of(mask.scalar_type());
  TORCH_CHECK(mask_kind >= 0, "outer_product_mean: opm_backward_rows: unsupported mask dtype ", dtype_str(mask));
  for (const at::Tensor* t : {&ln_w, &ln_b, &wa, &ba, &wb, &bb})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "outer_product_mean: opm_backward_rows: float32 parameters");
  TORCH_CHECK(ln_w.numel() == cm && ln_b.numel() == cm && wa.dim() == 2 && wa.size(0) == 32 && wa.size(1) == cm &&
                  wb.sizes() == wa.sizes() && ba.numel() == 32 && bb.numel() == 32,
              "outer_product_mean: opm_backward_rows: ln_w, ln_b (c_m), wa, wb (32, c_m), ba, bb (32)");
  TORCH_CHECK(B * round_up(S, ow_sb(msa.scalar_type())) * round_up(N, 16) / 16 < (1ll << 31),
              "outer_product_mean: opm_backward_rows: B * S * N / 16 < 2^31");
  const c10::cuda::CUDAGuard guard(msa.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(msa.get_device());
  TORCH_CHECK(d.ow_ok, "outer_product_mean: opm_backward_rows needs a compute capability 9.0 device and an sm_90a build");
  const auto f32 = msa.options().dtype(at::kFloat);
  at::Tensor a = at::empty({B, S, N, 32}, f32), b = at::empty({B, S, N, 32}, f32), inv_denom = at::empty({B, N}, f32);
  if (B == 0 || N == 0) return {a, b, inv_denom};
  at::Tensor x = msa.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();  // 16-byte loads and bulk copies
  const at::Tensor m = mask.contiguous(), lw = ln_w.contiguous(), lb = ln_b.contiguous(), wa_c = wa.contiguous(),
                   ba_c = ba.contiguous(), wb_c = wb.contiguous(), bb_c = bb.contiguous();
  const OwDims od = ow_dims(S, N, 1, ow_sb(x.scalar_type()));
  const at::Tensor Wf = launch_ow_params(lw, lb, wa_c, ba_c, wb_c, bb_c, at::Tensor(), at::Tensor(), nullptr, 0,
                                         x.scalar_type() != at::kFloat, static_cast<int>(cm), 32, 0, 0, d, stream);
  launch_prep_ow<false>(x, m, mask_kind, Wf, nullptr, nullptr, a.data_ptr<float>(), b.data_ptr<float>(), B, S, N,
                        static_cast<int>(cm), static_cast<float>(eps), od, inv_denom, d, stream, block_tiles);
  return {a, b, inv_denom};
}

// The backward's out_proj weight gradient on wgmma: a, b (B, S, N, 32) fp32 (masked), inv_denom (B, N), g
// (B, N, N, c_z), c_z <= 128, CUDA, on a device where outer_wg runs (DevInfo::ow_ok). ops: "split" (split
// TF32, g fp32), "float16" or "bfloat16" (g in that type, c_z % 8 == 0; the products' operands rounded to
// it, opm_bw_wo_kernel<T>). Returns dwo (c_z, 1024) fp32. The G planes go in chunks of i tiles of at most kBwoChunkBytes; each chunk's block partials are added into dwo in order (a
// fixed summation order for a given device).
constexpr int64_t kBwoChunkBytes = 256ll << 20;
at::Tensor opm_backward_wo(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g, const std::string& ops) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && inv_denom.is_cuda() && g.is_cuda(),
              "outer_product_mean: opm_backward_wo takes CUDA tensors");
  const bool half = ops == "float16" || ops == "bfloat16";
  TORCH_CHECK(half || ops == "split", "outer_product_mean: opm_backward_wo: ops is split, float16 or bfloat16, got ", ops);
  for (const at::Tensor* t : {&a, &b, &inv_denom})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "outer_product_mean: opm_backward_wo takes float32, got ", dtype_str(*t));
  TORCH_CHECK(g.scalar_type() == (ops == "float16" ? at::kHalf : ops == "bfloat16" ? at::kBFloat16 : at::kFloat),
              "outer_product_mean: opm_backward_wo: g in ", half ? ops : "float32", ", got ", dtype_str(g));
  TORCH_CHECK(a.dim() == 4 && a.size(3) == 32 && b.sizes() == a.sizes(), "outer_product_mean: opm_backward_wo: a, b (B, S, N, 32)");
  const int64_t B = a.size(0), S = a.size(1), N = a.size(2);
  TORCH_CHECK(g.dim() == 4 && g.size(0) == B && g.size(1) == N && g.size(2) == N && g.size(3) >= 1 && g.size(3) <= 128 &&
                  (!half || g.size(3) % 8 == 0),
              "outer_product_mean: opm_backward_wo: g (B, N, N, c_z <= 128), c_z % 8 == 0 for 16-bit g");
  TORCH_CHECK(inv_denom.dim() == 2 && inv_denom.size(0) == B && inv_denom.size(1) == N,
              "outer_product_mean: opm_backward_wo: inv_denom (B, N)");
  const int cz = static_cast<int>(g.size(3));
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(a.get_device());
  TORCH_CHECK(d.ow_ok && kBwoSmemBytes <= static_cast<size_t>(d.smem_optin),
              "outer_product_mean: opm_backward_wo needs a compute capability 9.0 device and an sm_90a build");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), ic = inv_denom.contiguous();
  at::Tensor gc = g.contiguous();
  if (half && reinterpret_cast<uintptr_t>(gc.data_ptr()) % 8 != 0) gc = gc.clone();  // the prep's 8-byte loads of T
  const auto f32 = a.options();
  at::Tensor dwo = at::zeros({cz, 1024}, f32);
  if (B == 0 || S == 0 || N == 0) return dwo;
  // blocks of kOwSK s (fp32 planes) or kOwS16 (T planes); floats per a block, b block and (b, it, jt) of Gbw
  const int64_t KB16 = cdiv(S, half ? kOwS16 : kOwSK), NIT = cdiv(N, 64), NBB = cdiv(N, 4);
  const int64_t ablk = half ? kOwABlk16 / 2 : 2 * kOwAPlane, bblk = half ? kOwBBlk16 / 2 : 2 * kOwBPlane;
  const int64_t gtile = half ? 4 * 4096 : 8 * kOwStage;
  at::Tensor Abw = at::empty({B * kBwNSL * KB16 * 2 * NIT * ablk}, f32);
  at::Tensor Bbw = at::empty({B * NBB * KB16 * bblk}, f32);
  const int64_t NITc = std::max<int64_t>(1, std::min<int64_t>(NIT, kBwoChunkBytes / (4 * gtile * B * NBB)));
  at::Tensor Gbw = at::empty({B * NITc * NBB * gtile}, f32);
  const int groups = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(B * NITc * NBB, d.sms / kBwNSL)));
  at::Tensor part = at::empty({static_cast<int64_t>(kBwNSL) * groups * 2 * 8192}, f32);
  const auto wo_kernel = !half ? opm_bw_wo_kernel<float>
                         : ops == "float16" ? opm_bw_wo_kernel<__half> : opm_bw_wo_kernel<__nv_bfloat16>;
  const auto wo_prep_kernel = !half ? opm_bw_wo_prep_kernel<float>
                              : ops == "float16" ? opm_bw_wo_prep_kernel<__half> : opm_bw_wo_prep_kernel<__nv_bfloat16>;
  set_smem(wo_kernel, kBwoSmemBytes, d, "the backward's dWo kernel");
  for (int64_t it0 = 0; it0 < NIT; it0 += NITc) {
    const int64_t nitc = std::min<int64_t>(NITc, NIT - it0);
    const bool ab = it0 == 0;
    const int64_t items =
        (ab ? B * kBwNSL * KB16 * 2 * NIT * 256 + B * NBB * KB16 * 512 : 0) + B * nitc * NBB * (half ? 1024 : 8192);
    // (g's elements are T where ops is float16 / bfloat16)
    wo_prep_kernel<<<grid_for(std::min<int64_t>(cdiv(items, kThreads), 8ll * d.sms)), kThreads, 0, stream>>>(
        ac.data_ptr<float>(), bc.data_ptr<float>(), static_cast<const float*>(gc.data_ptr()), ic.data_ptr<float>(),
        Abw.data_ptr<float>(), Bbw.data_ptr<float>(), Gbw.data_ptr<float>(), B, S, N, cz, KB16, NIT, NBB, ab, it0, nitc);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int g_wo = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(B * nitc * NBB, groups)));
    wo_kernel<<<kBwNSL * g_wo, kOwThreads, kBwoSmemBytes, stream>>>(
        Abw.data_ptr<float>(), Bbw.data_ptr<float>(), Gbw.data_ptr<float>(), part.data_ptr<float>(), B, KB16, NIT, NBB,
        it0, nitc);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    opm_bw_wo_sum_kernel<<<static_cast<int>(cdiv(kBwNSL * 64 * 128, kThreads)), kThreads, 0, stream>>>(part.data_ptr<float>(),
                                                                                   dwo.data_ptr<float>(), g_wo, cz);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return dwo;
}

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
                "outer_product_mean: the CUDA driver has no cuTensorMapEncodeTiled (the da / db kernel needs CUDA 12+)");
    fn = reinterpret_cast<EncodeTiledFn>(p);
  }
  return fn;
}

// g (B, N, N, c_z) fp32, fp16 or bf16, contiguous, 16-byte aligned and 16-byte rows (c_z % 4 == 0 in fp32,
// % 8 == 0 in 16 bits), as a 4-D tensor map (c_z, N j, N i, B)
// with boxes of (c_z, box_j, box_i, 1), no swizzle, zeros out of range (opm_bw_ab_kernel's g slots).
CUtensorMap make_g_map(const at::Tensor& g, unsigned box_j, unsigned box_i) {
  CUtensorMap m;
  const cuuint64_t B = g.size(0), N = g.size(1), cz = g.size(3), es = g.element_size();
  const cuuint64_t dims[4] = {cz, N, N, B};
  const cuuint64_t strides[3] = {es * cz, es * cz * N, es * cz * N * N};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(cz), box_j, box_i, 1}, elem[4] = {1, 1, 1, 1};
  const auto type = g.scalar_type() == at::kHalf       ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                    : g.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const CUresult r = encode_tiled()(&m, type, 4, g.data_ptr(), dims, strides, box, elem,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "outer_product_mean: cuTensorMapEncodeTiled failed with CUresult ", static_cast<int>(r));
  return m;
}

// The backward's da and db (before the mask) on wgmma, G recomputed per tile: a, b (B, S, N, 32) fp32
// (masked), inv_denom (B, N), g (B, N, N, c_z) with c_z <= 128 and 16-byte rows (the tensor map's
// strides), wo (c_z, 1024) fp32, CUDA, on a device where outer_wg runs. ops: "split" (split TF32; g fp32,
// c_z % 4 == 0) or "float16" / "bfloat16" (g in that type, c_z % 8 == 0; the products' operands rounded
// to it, opm_bw_ab_kernel<form, T>). Returns (da, db).
std::tuple<at::Tensor, at::Tensor> opm_backward_ab(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g,
                                                   at::Tensor wo, const std::string& ops) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && inv_denom.is_cuda() && g.is_cuda() && wo.is_cuda(),
              "outer_product_mean: opm_backward_ab takes CUDA tensors");
  const bool half = ops == "float16" || ops == "bfloat16";
  TORCH_CHECK(half || ops == "split", "outer_product_mean: opm_backward_ab: ops is split, float16 or bfloat16, got ", ops);
  for (const at::Tensor* t : {&a, &b, &inv_denom, &wo})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "outer_product_mean: opm_backward_ab takes float32, got ", dtype_str(*t));
  TORCH_CHECK(g.scalar_type() == (ops == "float16" ? at::kHalf : ops == "bfloat16" ? at::kBFloat16 : at::kFloat),
              "outer_product_mean: opm_backward_ab: g in ", half ? ops : "float32", ", got ", dtype_str(g));
  TORCH_CHECK(a.dim() == 4 && a.size(3) == 32 && b.sizes() == a.sizes(), "outer_product_mean: opm_backward_ab: a, b (B, S, N, 32)");
  const int64_t B = a.size(0), S = a.size(1), N = a.size(2);
  TORCH_CHECK(g.dim() == 4 && g.size(0) == B && g.size(1) == N && g.size(2) == N && g.size(3) >= 4 && g.size(3) <= 128 &&
                  g.size(3) % (half ? 8 : 4) == 0,
              "outer_product_mean: opm_backward_ab: g (B, N, N, c_z), c_z a multiple of 4 (16-bit g: 8) up to 128");
  TORCH_CHECK(inv_denom.dim() == 2 && inv_denom.size(0) == B && inv_denom.size(1) == N,
              "outer_product_mean: opm_backward_ab: inv_denom (B, N)");
  const int cz = static_cast<int>(g.size(3));
  TORCH_CHECK(wo.dim() == 2 && wo.size(0) == cz && wo.size(1) == 1024, "outer_product_mean: opm_backward_ab: wo (c_z, 1024)");
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(a.get_device());
  TORCH_CHECK(d.ow_ok && kAbSmemBytes <= static_cast<size_t>(d.smem_optin),
              "outer_product_mean: opm_backward_ab needs a compute capability 9.0 device and an sm_90a build");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), ic = inv_denom.contiguous(), wc = wo.contiguous();
  at::Tensor gc = g.contiguous();
  if (reinterpret_cast<uintptr_t>(gc.data_ptr()) % 16 != 0) gc = gc.clone();  // 16-byte aligned: the tensor map
  at::Tensor da = at::empty_like(ac), db = at::empty_like(ac);
  if (B == 0 || S == 0 || N == 0) return {da.zero_(), db.zero_()};
  const int64_t NJT = cdiv(N, 4), SB = cdiv(S, 64), NOT = cdiv(N, 32), NSC = cdiv(SB, 8);
  const int64_t vblk = half ? 4096 : 8192, wsl = half ? 4096 : kAbOperand;  // floats per Vt block, Wt slice
  const auto f32 = a.options();
  at::Tensor Vt = at::empty({2 * B * NJT * SB * vblk}, f32);
  at::Tensor Wt = at::empty({2 * 16 * wsl}, f32);
  const int64_t items = half ? 2 * (B * NJT * SB * 1024 + 16 * 64 * 16) : 2 * (B * NJT * SB * 2048 + 16 * 64 * 32);
  const auto prep = ops == "float16" ? opm_bw_ab_prep_kernel<__half>
                    : ops == "bfloat16" ? opm_bw_ab_prep_kernel<__nv_bfloat16> : opm_bw_ab_prep_kernel<float>;
  prep<<<grid_for(std::min<int64_t>(cdiv(items, kThreads), 8ll * d.sms)), kThreads, 0, stream>>>(
      ac.data_ptr<float>(), bc.data_ptr<float>(), wc.data_ptr<float>(), Vt.data_ptr<float>(), Wt.data_ptr<float>(), B, S,
      N, cz, NJT, SB);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t blocks = B * NOT * 16 * NSC;
  TORCH_CHECK(blocks < (1ll << 31), "outer_product_mean: opm_backward_ab: too many blocks");
  const float* vt = Vt.data_ptr<float>();
  const float* wt = Wt.data_ptr<float>();
  const auto da_kernel = !half ? opm_bw_ab_kernel<0, float>
                         : ops == "float16" ? opm_bw_ab_kernel<0, __half> : opm_bw_ab_kernel<0, __nv_bfloat16>;
  const auto db_kernel = !half ? opm_bw_ab_kernel<1, float>
                         : ops == "float16" ? opm_bw_ab_kernel<1, __half> : opm_bw_ab_kernel<1, __nv_bfloat16>;
  set_smem(da_kernel, kAbSmemBytes, d, "the backward's da kernel");
  da_kernel<<<static_cast<unsigned>(blocks), kOwThreads, kAbSmemBytes, stream>>>(
      vt, wt, make_g_map(gc, 2, 32), ic.data_ptr<float>(), da.data_ptr<float>(), B, S, N, cz, NJT, SB, NOT, NSC);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  set_smem(db_kernel, kAbSmemBytes, d, "the backward's db kernel");
  db_kernel<<<static_cast<unsigned>(blocks), kOwThreads, kAbSmemBytes, stream>>>(
      vt + B * NJT * SB * vblk, wt + 16 * wsl, make_g_map(gc, 32, 2), ic.data_ptr<float>(), db.data_ptr<float>(),
      B, S, N, cz, NJT, SB, NOT, NSC);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {da, db};
}

// The backward's LayerNorm part (opm_bw_ln_kernel): x_in (R, c_m) float32, float16 or bfloat16, da, db
// (R, 32) fp32 (before the mask), mask (R) of a dtype mask_kind_of takes, ln_w, ln_b (c_m), wa, wb (32, c_m)
// fp32, c_m 128 or 256, CUDA, on a device where outer_wg runs. Returns (d_x_in in x_in's dtype, d_ln_w,
// d_ln_b, d_wa, d_ba, d_wb, d_bb); the sums over rows in a fixed order for a given device.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> opm_backward_ln(
    at::Tensor xin, at::Tensor da, at::Tensor db, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa,
    at::Tensor wb, double eps) {
  for (const at::Tensor* t : {&xin, &da, &db, &mask, &ln_w, &ln_b, &wa, &wb})
    TORCH_CHECK(t->is_cuda(), "outer_product_mean: opm_backward_ln takes CUDA tensors");
  for (const at::Tensor* t : {&da, &db, &ln_w, &ln_b, &wa, &wb})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "outer_product_mean: opm_backward_ln takes float32, got ", dtype_str(*t));
  const auto xt = xin.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kHalf || xt == at::kBFloat16,
              "outer_product_mean: opm_backward_ln: x_in float32, float16 or bfloat16, got ", dtype_str(xin));
  TORCH_CHECK(xin.dim() == 2 && (xin.size(1) == 128 || xin.size(1) == 256),
              "outer_product_mean: opm_backward_ln: x_in (R, 128 or 256)");
  const int64_t R = xin.size(0), cm = xin.size(1);
  TORCH_CHECK(da.dim() == 2 && da.size(0) == R && da.size(1) == 32 && db.sizes() == da.sizes(),
              "outer_product_mean: opm_backward_ln: da, db (R, 32)");
  const int mask_kind = mask_kind_of(mask.scalar_type());
  TORCH_CHECK(mask.numel() == R && mask_kind >= 0, "outer_product_mean: opm_backward_ln: mask (R) of float32, bool or an "
              "integer dtype");
  TORCH_CHECK(ln_w.numel() == cm && ln_b.numel() == cm && wa.dim() == 2 && wa.size(0) == 32 && wa.size(1) == cm &&
                  wb.sizes() == wa.sizes(),
              "outer_product_mean: opm_backward_ln: ln_w, ln_b (c_m), wa, wb (32, c_m)");
  const c10::cuda::CUDAGuard guard(xin.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(xin.get_device());
  TORCH_CHECK(d.ow_ok, "outer_product_mean: opm_backward_ln needs a compute capability 9.0 device and an sm_90a build");
  auto aligned = [](at::Tensor t) {  // contiguous at a 16-byte aligned address (the bulk copies' sources)
    t = t.contiguous();
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
  };
  const at::Tensor xc = aligned(xin), dac = aligned(da), dbc = aligned(db), mc = mask.contiguous(),
                   lwc = ln_w.contiguous(), lbc = ln_b.contiguous(), wac = wa.contiguous(), wbc = wb.contiguous();
  const auto f32 = xin.options().dtype(at::kFloat);
  at::Tensor dx = at::empty({R, cm}, xin.options());
  at::Tensor sums = at::zeros({66 * cm + 64}, f32);  // dWa | dWb (64 x c_m), d_ln_w, d_ln_b, d_ba, d_bb
  if (R > 0) {
    const int64_t tiles = cdiv(R, kLnRows);
    const int blocks = static_cast<int>(std::min<int64_t>(tiles, d.sms));
    at::Tensor part = at::empty({blocks * 64 * cm}, f32), part_ln = at::empty({blocks * (2 * cm + 64)}, f32);
    auto run = [&](auto kernel, size_t smem, auto* type) {  // type: a null pointer of x_in's element type
      using T = std::remove_pointer_t<decltype(type)>;
      set_smem(kernel, smem, d, "the backward's LayerNorm kernel");
      kernel<<<blocks, 256, smem, stream>>>(reinterpret_cast<const T*>(xc.data_ptr()), dac.data_ptr<float>(),
                                            dbc.data_ptr<float>(), mc.data_ptr(), mask_kind, lwc.data_ptr<float>(),
                                            lbc.data_ptr<float>(), wac.data_ptr<float>(), wbc.data_ptr<float>(),
                                            reinterpret_cast<T*>(dx.data_ptr()), part.data_ptr<float>(),
                                            part_ln.data_ptr<float>(), R, static_cast<float>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto run_cm = [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      if (cm == 256) run(opm_bw_ln_kernel<256, T>, ln_smem_bytes<256>(), type);
      else run(opm_bw_ln_kernel<128, T>, ln_smem_bytes<128>(), type);
    };
    if (xt == at::kBFloat16) run_cm(static_cast<__nv_bfloat16*>(nullptr));
    else if (xt == at::kHalf) run_cm(static_cast<__half*>(nullptr));
    else run_cm(static_cast<float*>(nullptr));
    opm_block_sum_kernel<<<static_cast<int>(cdiv(64 * cm, kThreads)), kThreads, 0, stream>>>(
        part.data_ptr<float>(), sums.data_ptr<float>(), blocks, 64 * cm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    opm_block_sum_kernel<<<static_cast<int>(cdiv(2 * cm + 64, kThreads)), kThreads, 0, stream>>>(
        part_ln.data_ptr<float>(), sums.data_ptr<float>() + 64 * cm, blocks, 2 * cm + 64);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dx, sums.narrow(0, 64 * cm, cm), sums.narrow(0, 65 * cm, cm), sums.narrow(0, 0, 32 * cm).view({32, cm}),
          sums.narrow(0, 66 * cm, 32), sums.narrow(0, 32 * cm, 32 * cm).view({32, cm}), sums.narrow(0, 66 * cm + 32, 32)};
}

// out_proj's bias gradient: the sum of g (..., c_z) over every dimension but the last (g fp32, fp16 or
// bf16, CUDA; the sums and the result fp32), c_z % 4 == 0 and c_z <= 1024; in a fixed order for a given device (block sums added in order in fp64).
at::Tensor opm_backward_dbo(at::Tensor g) {
  const auto gt = g.scalar_type();
  TORCH_CHECK(g.is_cuda() && (gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16) && g.dim() >= 1,
              "outer_product_mean: opm_backward_dbo takes a float32, float16 or bfloat16 CUDA tensor");
  const int64_t cz = g.size(-1);
  TORCH_CHECK(cz % 4 == 0 && cz >= 4 && cz <= 1024, "outer_product_mean: opm_backward_dbo: c_z a multiple of 4 up to 1024");
  const c10::cuda::CUDAGuard guard(g.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(g.get_device());
  at::Tensor gc = g.contiguous();
  if (reinterpret_cast<uintptr_t>(gc.data_ptr()) % 16 != 0) gc = gc.clone();  // 16-byte loads (8-byte for T)
  const auto f32 = gc.options().dtype(at::kFloat);
  at::Tensor out = at::zeros({cz}, f32);
  const int64_t rows = gc.numel() / cz;
  if (rows == 0) return out;
  const int blocks = static_cast<int>(std::min<int64_t>(4ll * d.sms, cdiv(rows, 64)));
  const int64_t rpb = cdiv(rows, blocks);
  at::Tensor part = at::empty({blocks * cz}, f32);
  if (gt == at::kFloat)
    opm_colsum_kernel<<<blocks, kThreads, 0, stream>>>(gc.data_ptr<float>(), rows, static_cast<int>(cz), rpb,
                                                       part.data_ptr<float>());
  else if (gt == at::kHalf)
    opm_colsum_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const __half*>(gc.data_ptr()), rows,
                                                       static_cast<int>(cz), rpb, part.data_ptr<float>());
  else
    opm_colsum_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(gc.data_ptr()), rows,
                                                       static_cast<int>(cz), rpb, part.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  opm_block_sum_kernel<<<static_cast<int>(cdiv(cz, kThreads)), kThreads, 0, stream>>>(part.data_ptr<float>(),
                                                                                  out.data_ptr<float>(), blocks, cz);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// (tc_ok, wg_ok, ow_ok) of a CUDA device: whether w_first_tc/_tc2, w_first_wg2 and outer_wg can run there.
std::tuple<bool, bool, bool> device_caps(int64_t device) {
  const DevInfo d = dev_info(static_cast<int>(device));
  return {d.tc_ok, d.wg_ok, d.ow_ok};
}

}  // namespace opm

std::tuple<bool, bool, bool> opm_device_caps(int64_t device) { return opm::device_caps(device); }

at::Tensor opm_backward_wo(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g, const std::string& ops) {
  return opm::opm_backward_wo(a, b, inv_denom, g, ops);
}

std::tuple<at::Tensor, at::Tensor> opm_backward_ab(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g,
                                                   at::Tensor wo, const std::string& ops) {
  return opm::opm_backward_ab(a, b, inv_denom, g, wo, ops);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> opm_backward_ln(
    at::Tensor xin, at::Tensor da, at::Tensor db, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa,
    at::Tensor wb, double eps) {
  return opm::opm_backward_ln(xin, da, db, mask, ln_w, ln_b, wa, wb, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> opm_backward_rows(at::Tensor msa, at::Tensor mask, at::Tensor ln_w,
                                                                 at::Tensor ln_b, at::Tensor wa, at::Tensor ba,
                                                                 at::Tensor wb, at::Tensor bb, double eps,
                                                                 bool block_tiles) {
  return opm::opm_backward_rows(msa, mask, ln_w, ln_b, wa, ba, wb, bb, eps, block_tiles);
}

at::Tensor opm_backward_dbo(at::Tensor g) { return opm::opm_backward_dbo(g); }

std::tuple<at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor> opm_forward(
    at::Tensor msa, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa, at::Tensor ba, at::Tensor wb,
    at::Tensor bb, at::Tensor wo, at::Tensor bo, double eps, int64_t variant, bool keep_ab) {
  return opm::opm_forward(msa, mask, ln_w, ln_b, wa, ba, wb, bb, wo, bo, eps, variant, keep_ab);
}
"""

_CPP_SRC = r"""
#include <torch/extension.h>
#include <tuple>
std::tuple<at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor> opm_forward(
    at::Tensor msa, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa, at::Tensor ba, at::Tensor wb,
    at::Tensor bb, at::Tensor wo, at::Tensor bo, double eps, int64_t variant, bool keep_ab);
std::tuple<bool, bool, bool> opm_device_caps(int64_t device);
at::Tensor opm_backward_wo(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g, const std::string& ops);
std::tuple<at::Tensor, at::Tensor> opm_backward_ab(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g,
                                                   at::Tensor wo, const std::string& ops);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> opm_backward_ln(
    at::Tensor xin, at::Tensor da, at::Tensor db, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa,
    at::Tensor wb, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> opm_backward_rows(at::Tensor msa, at::Tensor mask, at::Tensor ln_w,
                                                                 at::Tensor ln_b, at::Tensor wa, at::Tensor ba,
                                                                 at::Tensor wb, at::Tensor bb, double eps,
                                                                 bool block_tiles);
at::Tensor opm_backward_dbo(at::Tensor g);
"""


def _wgmma_asm(n, a_regs=0, ab="tf32"):
    """Body of a wgmma_tf32_m64{n}k8 wrapper (ab "tf32") or of a m64{n}k16 one (ab "bf16" / "f16", both
    operands K-major): the inline PTX with its n/2 accumulator operands spelled out; A from shared
    memory (descriptor `da`) or, with a_regs = 4, from the registers a[0..3]."""
    # 16-bit: imm-trans-b 0 (K-major B), and imm-trans-a 0 where A is in shared memory
    shape, tail = ("k8", "p, 1, 1") if ab == "tf32" else ("k16", "p, 1, 1, 0" if a_regs else "p, 1, 1, 0, 0")
    nacc = n // 2
    regs = ", ".join(f"%{i}" for i in range(nacc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    if a_regs:
        a_ops = "{" + ", ".join(f"%{nacc + i}" for i in range(a_regs)) + "}"
        ins = "".join(f'"r"(a[{i}]), ' for i in range(a_regs)) + '"l"(db), "r"(acc)'
    else:
        a_ops, ins = f"%{nacc}", '"l"(da), "l"(db), "r"(acc)'
    nb, npred = nacc + max(a_regs, 1), nacc + max(a_regs, 1) + 1
    return (f'  asm volatile("{{\\n .reg .pred p;\\n setp.ne.b32 p, %{npred}, 0;\\n"\n'
            f'               "wgmma.mma_async.sync.aligned.m64n{n}{shape}.f32.{ab}.{ab} {{{regs}}}, {a_ops}, %{nb}, {tail};\\n}}\\n"\n'
            f"               : {outs}\n"
            f"               : {ins});\n")


_CUDA_SRC = (_CUDA_SRC.replace("@WGMMA_M64N128K8@", _wgmma_asm(128)).replace("@WGMMA_M64N64K8_RS@", _wgmma_asm(64, 4))
             .replace("@WGMMA_BF16_M64N128K16@", _wgmma_asm(128, ab="bf16"))
             .replace("@WGMMA_F16_M64N128K16@", _wgmma_asm(128, ab="f16"))
             .replace("@WGMMA_F16_M64N64K16_RS@", _wgmma_asm(64, 4, ab="f16"))
             .replace("@WGMMA_BF16_M64N64K16_RS@", _wgmma_asm(64, 4, ab="bf16"))
             .replace("@VARIANT_ENUM@", _variant_enum(_ALL_VARIANTS)))

# =============================================================================================
# Build (load_inline at import; name carries a hash of the source and flags: edit -> rebuild)
# =============================================================================================
def _gencode_flags():
    """nvcc -gencode flags for this build. The architectures PyTorch would build for: TORCH_CUDA_ARCH_LIST
    as PyTorch reads it or, none set (or "native"), the visible GPUs' compute capabilities capped at
    the newest this PyTorch supports (with PTX only for a GPU above that cap). So a machine without a
    GPU (9.0, below) and an H100 / H200 build the same flags, and a KernelBench precompile on a CPU
    machine is found again by the GPU evaluation. Except that 9.0 gets sm_90a code: wgmma
    (w_first_wg2, outer_wg) exists only there, and sm_90a code runs on compute capability 9.0 devices as
    sm_90 code does; "9.0+PTX" keeps its portable compute_90 PTX beside it. With no GPU to detect
    (a CI machine, a laptop) and no list, 9.0 (the H100/H200): PyTorch alone would fail there.
    Flags naming an arch replace PyTorch's own (torch.utils.cpp_extension); TORCH_CUDA_ARCH_LIST
    itself is not changed. Returns [] for lists with names such as "Hopper": PyTorch then builds
    as usual, without sm_90a (no w_first_wg2, no outer_wg)."""
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


_GENCODE = _gencode_flags()
_VERBOSE = os.environ.get("OPM_VERBOSE", "0") not in ("", "0")
_CUDA_FLAGS = (["-O3"] + _GENCODE + (["-DOPM_SM90A"] if any("code=sm_90a" in f for f in _GENCODE) else [])
               + (["-Xptxas", "-v"] if _VERBOSE else []))
_CXX_FLAGS = ["-O3"]


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
    """outer_product_mean_ and a hash of the sources, the flags and _build_environment()."""
    key = _CUDA_SRC + _CPP_SRC + " ".join(_CUDA_FLAGS + _CXX_FLAGS) + "\n" + _build_environment()
    return "outer_product_mean_" + hashlib.sha256(key.encode()).hexdigest()[:12]


_EXT_NAME = _extension_name()


def _is_cached(name):
    """Whether load_inline will find `name` already built (its build directory as PyTorch names it)."""
    build_directory = getattr(torch.utils.cpp_extension, "_get_build_directory", None)
    if build_directory is None:  # a PyTorch without that function: report a build
        return False
    d = build_directory(name, verbose=False)
    return os.path.isdir(d) and any(f.startswith(name) and f.endswith((".so", ".pyd")) for f in os.listdir(d))


def _build():
    """load_inline of the CUDA source (a failed build raises with the compiler's output in its text)."""
    if not _is_cached(_EXT_NAME):
        print(f"building outer_product_mean CUDA extension ({_EXT_NAME}): about 110 s on 2 cores, once "
              "(cached afterwards)",
              file=sys.stderr, flush=True)
    return load_inline(name=_EXT_NAME, cpp_sources=[_CPP_SRC], cuda_sources=[_CUDA_SRC],
                       functions=["opm_forward", "opm_device_caps", "opm_backward_wo", "opm_backward_ab",
                                  "opm_backward_ln", "opm_backward_rows", "opm_backward_dbo"],
                       extra_cuda_cflags=_CUDA_FLAGS, extra_cflags=_CXX_FLAGS, verbose=_VERBOSE)


_ext = _build()

# The Hopper-only variants and the index of their flag in opm_device_caps (tc_ok, wg_ok, ow_ok).
_HOPPER_CAP = {"w_first_wg2": 1, "outer_wg": 2}


def _device_caps_here():
    """opm_device_caps of the current CUDA device; all False without CUDA."""
    if not torch.cuda.is_available():
        return (False, False, False)
    return tuple(bool(x) for x in _ext.opm_device_caps(torch.cuda.current_device()))


class _VariantsHere:
    """ModelNew.VARIANTS: a tuple of the variant names that run on the current CUDA device, computed
    at each access (class or instance)."""

    def __get__(self, obj, owner=None):
        caps = _device_caps_here()
        return tuple(v for v in _ALL_VARIANTS if v not in _HOPPER_CAP or caps[_HOPPER_CAP[v]])


# =============================================================================================
# Backward (nothing saved but the inputs: the wgmma kernels above where they run, else PyTorch ops in
# chunks). _rows_per_chunk is contact_map.py's too: each kernel file stands alone.
# =============================================================================================
def _rows_per_chunk(row_bytes, n, chunk_bytes):
    """Rows of a chunk: as many as fit in chunk_bytes at row_bytes each, at least 1, at most n."""
    return max(1, min(n, int(chunk_bytes) // max(1, int(row_bytes))))


def outer_product_mean_rows(B, S, N, c_m, c, c_z, itemsize, chunk_bytes):
    """(rows i per outer chunk, msa rows per LayerNorm chunk) for outer_product_mean_backward.

    An outer chunk of r rows i holds, per row, B*N positions j of two (c, c) blocks (O or G and its
    permuted copy) and g's c_z values (and their ct copy); a LayerNorm chunk of r of the B*S*N msa rows
    (contiguous in memory) holds per row about 5 c_m + 4 c values (x in ct, the LayerNorm output, its
    gradient, d_msa's, the temporaries; da, db).
    """
    outer = _rows_per_chunk(B * N * (2 * c * c + 2 * c_z) * itemsize, N, chunk_bytes)
    ln = _rows_per_chunk((5 * c_m + 4 * c) * itemsize, B * S * N, chunk_bytes)
    return outer, ln


def _wo_kernel_runs(msa, c, c_z, ct):
    """Whether out_proj's weight gradient goes to opm_bw_wo_kernel (_ext.opm_backward_wo): float32 inputs
    and parameters (ct) on a CUDA device where outer_wg runs, hidden_dim 32, pair_dim up to 128."""
    return (msa.is_cuda and ct == torch.float32 and c == 32 and 1 <= c_z <= 128
            and bool(_ext.opm_device_caps(msa.device.index)[2]))


def _ln_kernel_runs(msa, c, c_m):
    """Whether the LayerNorm part of the backward goes to opm_bw_ln_kernel (_ext.opm_backward_ln): a
    float32, float16 or bfloat16 msa on a CUDA device where outer_wg runs, hidden_dim 32, msa_dim 128 or
    256."""
    return (msa.is_cuda and msa.dtype in _FLOAT_DTYPES and c == 32 and c_m in (128, 256)
            and bool(_ext.opm_device_caps(msa.device.index)[2]))


def _rows_kernel_runs(msa, c, c_m):
    """Whether the backward's a, b and 1 / denom come from outer_wg's prep kernel (_ext.opm_backward_rows):
    a float32, float16 or bfloat16 msa on a CUDA device where outer_wg runs, hidden_dim 32, msa_dim <= 768
    and B * S * N / 16 < 2^31 (S rounded up to 16, or 32 for 16-bit msa, N to 16), as for outer_wg."""
    B, S, N = msa.shape[:3]
    pad = lambda n, m: -(-n // m) * m
    return (msa.is_cuda and msa.dtype in _FLOAT_DTYPES and c == 32 and 1 <= c_m <= 768
            and B * pad(S, 16 if msa.dtype == torch.float32 else 32) * pad(N, 16) // 16 < 2**31 and bool(_ext.opm_device_caps(msa.device.index)[2]))


def _ab_kernel_runs(msa, c, c_z, ct):
    """Whether da and db go to opm_bw_ab_kernel (_ext.opm_backward_ab): as _wo_kernel_runs, with pair_dim
    a multiple of 4 (16-byte strides of grad_out's tensor map)."""
    return _wo_kernel_runs(msa, c, c_z, ct) and c_z % 4 == 0


def outer_product_mean_backward(msa, mask, ln_w, ln_b, eps, wa, ba, wb, bb, wo, bo, grad_out,
                                chunk_bytes=256 << 20, wo_kernel=None, ab_kernel=None, ln_kernel=None,
                                rows_kernel=None, ab=None, parts=None, split=False):
    """Gradients of the outer product mean with respect to msa and every parameter (not the mask).

    Shapes: msa (B, S, N, c_m), mask m (B, S, N) of any float, bool or integer dtype (floating masks
    other than float32 go to the kernels as float32), ln_w / ln_b (c_m,), wa / wb (c, c_m),
    ba / bb (c,), wo (c_z, c*c), bo (c_z,), grad_out g (B, N, N, c_z). Forward:
        x = LayerNorm(msa),  a = (x Wa^T + ba) * m,  b = (x Wb^T + bb) * m                (B, S, N, c)
        O[b,i,j,h,k] = sum_s a[b,s,i,h] b[b,s,j,k],  d[b,i] = max(sum_s m[b,s,i], 1)
        out[b,i,j,z] = bo[z] + sum_{hk} Wo[z, h c + k] O[b,i,j,h,k] / d[b,i]
    Backward:
        dWo[z, hk]     = sum_{b,i,j} g[b,i,j,z] O[b,i,j,hk] / d[b,i],   dbo = sum_{b,i,j} g
        G[b,i,j,hk]    = sum_z g[b,i,j,z] Wo[z, hk] / d[b,i]                             (B, r, N, c*c)
        da[b,s,i,h]    = sum_{j,k} G[b,i,j,h,k] b[b,s,j,k]
        db[b,s,j,k]    = sum_{i,h} G[b,i,j,h,k] a[b,s,i,h]
        dpa = da * m, dpb = db * m:  dWa = sum dpa^T x, dba = sum dpa (b likewise)
        dy  = dpa Wa + dpb Wb (the gradient of x), then the LayerNorm backward (module docstring).
    a, b and 1 / d: ab = (a, b, 1 / d) as the forward computed them (float32, hidden_dim 32), else
    recomputed: by outer_wg's prep kernel (opm_prep_ow_kernel writing rows, the forward's LayerNorm and
    projections) where _rows_kernel_runs holds (rows_kernel None) or rows_kernel is True, elsewhere by
    ATen's LayerNorm (torch.native_layer_norm) and addmm per contiguous chunk of the B*S*N msa rows.

    out_proj's weight gradient runs in a CUDA kernel (opm_bw_wo_kernel: O per tile on chip, wgmma)
    where _wo_kernel_runs holds (wo_kernel None) or wo_kernel is True; da and db likewise
    (opm_bw_ab_kernel: G per tile on chip) where _ab_kernel_runs holds (ab_kernel None) or ab_kernel is
    True. The chunks below form O where dWo has no kernel and G where da, db have none (none with
    both). These two kernels run split TF32 (about fp32's precision) for a float32 msa or where split is
    True; for a float16 / bfloat16 msa they otherwise run on that type's tensor cores (a, b, Wo, g / d
    and the intermediate O and G rounded to it, where the reference in that dtype rounds a, b, O and
    its products; fp32 accumulation) and take grad_out in that type, where pair_dim % 8 == 0 (16-byte
    rows of it; else split TF32 on an fp32 copy). With both, dbo is the column sums of grad_out
    (opm_colsum_kernel), else the chunks' sums. The rest (the mask, dy, the LayerNorm backward, dWa,
    dba, dWb, dbb, d_ln_w, d_ln_b) runs in one sweep over the msa rows (opm_bw_ln_kernel: the msa in its dtype, fp32 math,
    its products split TF32 for a float32 msa and single TF32 for float16 / bfloat16 whatever split
    says) where _ln_kernel_runs holds (ln_kernel None) or ln_kernel is True, else in chunks of rows
    with ATen's native_layer_norm_backward. Takes detached tensors (the autograd Function's backward
    calls it under no_grad). parts: a list to which the names of the parts computed by this file's
    kernels are appended, in this order: "a, b" (given by the forward or by the prep kernel; with `ab`
    given, "a, b" stands for the forward's kernels), "dWo", "da, db", "LayerNorm", appended before they
    run (ModelNew.last_backward holds them as a tuple once the call returns).

    Memory: a, b (B, S, N, c) in ct until da, db are formed, da, db to the end; the outer product and
    G only for r rows i at a time (B, r, N, c, c), r from chunk_bytes (at least 1); x is recomputed per
    chunk of msa rows when needed, never held whole. The denominator sums float masks in fp64 and bool /
    integer masks in int64 (exact for 0/1 masks, as the forward kernel does). Returns (d_msa, d_ln_w,
    d_ln_b, d_wa, d_ba, d_wb, d_bb, d_wo, d_bo), each in its tensor's dtype.
    """
    B, S, N, c_m = msa.shape
    c, c_z = wa.shape[0], wo.shape[0]
    ct = torch.promote_types(msa.dtype, torch.float32)
    dev = msa.device
    lw, lb = ln_w.to(ct), ln_b.to(ct)
    Wa, Ba, Wb, Bb, Wo = (t.to(ct) for t in (wa, ba, wb, bb, wo))
    itemsize = torch.empty((), dtype=ct).element_size()
    rows_outer, rows_ln = outer_product_mean_rows(B, S, N, c_m, c, c_z, itemsize, chunk_bytes)

    wo_in_kernel = _wo_kernel_runs(msa, c, c_z, ct) if wo_kernel is None else wo_kernel
    ab_in_kernel = _ab_kernel_runs(msa, c, c_z, ct) if ab_kernel is None else ab_kernel
    ln_in_kernel = _ln_kernel_runs(msa, c, c_m) if ln_kernel is None else ln_kernel
    rows_in_kernel = ab is not None or (_rows_kernel_runs(msa, c, c_m) if rows_kernel is None else rows_kernel)
    # dWo, da and db's products: split TF32, or in the msa's 16-bit type (grad_out's rows 16-byte aligned
    # in it for the kernels' loads and da, db's tensor map: pair_dim % 8 == 0)
    half = msa.dtype in (torch.float16, torch.bfloat16)
    ops = _dtype_name(msa.dtype) if half and not split and c_z % 8 == 0 else "split"
    if parts is not None:
        parts += [n for n, k in (("a, b", rows_in_kernel), ("dWo", wo_in_kernel), ("da, db", ab_in_kernel),
                                 ("LayerNorm", ln_in_kernel)) if k]
    R = B * S * N
    msa_rows = msa.reshape(R, c_m)
    # the kernels take float32, bool and integer masks as they are
    mask_k = mask.float() if mask.is_floating_point() and mask.dtype != torch.float32 else mask
    if not (rows_in_kernel and ln_in_kernel):
        m_rows = mask.to(ct).reshape(R, 1)
    if not (rows_in_kernel and wo_in_kernel and ab_in_kernel):
        acc = torch.float64 if mask.is_floating_point() else torch.int64
        denom = mask.to(acc).sum(1).clamp(min=1).to(ct)                                # d (B, N)

    # a, b for all positions (B, S, N, c): outer_wg's prep kernel (LayerNorm + projections + mask, and
    # 1 / denom), or LayerNorm recomputed per chunk of rows (ATen's fused LayerNorm: the reference's own
    # kernels; each chunk a contiguous row range) and the projections by addmm
    if ab is not None:
        a, b, inv_d = ab
    elif rows_in_kernel:
        a, b, inv_d = _ext.opm_backward_rows(msa, mask_k, lw, lb, Wa, Ba, Wb, Bb, eps, False)
    else:
        a = torch.empty((B, S, N, c), dtype=ct, device=dev)
        b = torch.empty((B, S, N, c), dtype=ct, device=dev)
        a_rows, b_rows = a.view(R, c), b.view(R, c)
        for r0 in range(0, R, rows_ln):
            r1 = min(R, r0 + rows_ln)
            x = torch.native_layer_norm(msa_rows[r0:r1].to(ct), (c_m,), lw, lb, eps)[0]   # (r, c_m)
            torch.addmm(Ba, x, Wa.t(), out=a_rows[r0:r1]).mul_(m_rows[r0:r1])
            torch.addmm(Bb, x, Wb.t(), out=b_rows[r0:r1]).mul_(m_rows[r0:r1])
            del x
        if wo_in_kernel or ab_in_kernel:
            inv_d = denom.reciprocal()

    # grad_out as the kernels take it: float32 for split TF32, else in the msa's type (no copy where it is)
    g_k = grad_out.to(ct if ops == "split" else msa.dtype).contiguous() if wo_in_kernel or ab_in_kernel else None

    # Outer product and its gradient, chunks of rows i                             (B, r, N, c, c)
    if wo_in_kernel or ab_in_kernel:
        inv_d = inv_d.contiguous()
    if wo_in_kernel:
        d_wo = _ext.opm_backward_wo(a, b, inv_d, g_k, ops)
    else:
        d_wo = torch.zeros((c_z, c * c), dtype=ct, device=dev)
    if ab_in_kernel:
        da, db = _ext.opm_backward_ab(a, b, inv_d, g_k, Wo.contiguous(), ops)
    else:
        da = torch.empty((B, S, N, c), dtype=ct, device=dev)
        db = torch.zeros((B, S, N, c), dtype=ct, device=dev)
    if wo_in_kernel and ab_in_kernel:
        d_bo = _ext.opm_backward_dbo(g_k)  # (c_z % 4 == 0 where the da / db kernel runs)
    else:  # chunks: O for dWo and / or G for da, db, whichever no kernel computes
        d_bo = torch.zeros((c_z,), dtype=ct, device=dev)
        b_flat = b.reshape(B, S, N * c)                                                # (B, S, N c)
        for r0 in range(0, N, rows_outer):
            r1 = min(N, r0 + rows_outer)
            r = r1 - r0
            a_r = a[:, :, r0:r1].reshape(B, S, r * c)                                  # (B, S, r c)
            g = grad_out[:, r0:r1].to(ct)                                              # (B, r, N, c_z)
            d_bo += g.sum((0, 1, 2))
            g = (g / denom[:, r0:r1, None, None]).reshape(B * r * N, c_z)              # g / d (B r N, c_z)
            if not wo_in_kernel:
                # O[b,i,j,h,k]: one product (B, r c, N c) laid out (i, h, j, k), copied to (i, j, h k)
                o = (a_r.transpose(1, 2) @ b_flat).reshape(B, r, c, N, c).permute(0, 1, 3, 2, 4)
                o = o.reshape(B * r * N, c * c)                                        # (B r N, c c)
                d_wo.addmm_(g.t(), o)                                                  # (c_z, c c)
                del o
            if not ab_in_kernel:
                # G[b,i,j,h,k] = sum_z (g / d) Wo, copied to (i, h, j, k) for the two products (B, r c, N c)
                G = (g @ Wo).reshape(B, r, N, c, c).permute(0, 1, 3, 2, 4).reshape(B, r * c, N * c)
                da[:, :, r0:r1] = (b_flat @ G.transpose(1, 2)).reshape(B, S, r, c)     # sum_{j,k} G b
                db += (a_r @ G).reshape(B, S, N, c)                                    # sum_{i,h} G a
                del G
            del g, a_r
        del b_flat
    del a, b, g_k

    # The mask, projections and LayerNorm backward: one CUDA pass where _ln_kernel_runs, else chunks of
    # rows (ATen's LayerNorm backward)
    if ln_in_kernel:
        d_msa, d_ln_w, d_ln_b, d_wa, d_ba, d_wb, d_bb = _ext.opm_backward_ln(
            msa_rows, da.view(R, c), db.view(R, c), mask_k.reshape(R), lw, lb, Wa.contiguous(), Wb.contiguous(), eps)
        d_msa = d_msa.view(B, S, N, c_m)
    else:
        da *= m_rows.view(B, S, N, 1)                                                  # dpa (B, S, N, c)
        db *= m_rows.view(B, S, N, 1)                                                  # dpb
        d_ba = da.sum((0, 1, 2))
        d_bb = db.sum((0, 1, 2))
        d_wa = torch.zeros((c, c_m), dtype=ct, device=dev)
        d_wb = torch.zeros((c, c_m), dtype=ct, device=dev)
        d_ln_w = torch.zeros((c_m,), dtype=ct, device=dev)
        d_ln_b = torch.zeros((c_m,), dtype=ct, device=dev)
        d_msa = torch.empty((B, S, N, c_m), dtype=msa.dtype, device=dev)
        da_rows, db_rows, d_msa_rows = da.view(R, c), db.view(R, c), d_msa.view(R, c_m)
        for r0 in range(0, R, rows_ln):
            r1 = min(R, r0 + rows_ln)
            xin = msa_rows[r0:r1].to(ct)                                               # (r, c_m)
            x, mean, rstd = torch.native_layer_norm(xin, (c_m,), lw, lb, eps)
            dpa, dpb = da_rows[r0:r1], db_rows[r0:r1]                                  # (r, c)
            d_wa.addmm_(dpa.t(), x)                                                    # (c, c_m)
            d_wb.addmm_(dpb.t(), x)
            del x
            dy = (dpa @ Wa).addmm_(dpb, Wb)                                            # (r, c_m)
            dx, dlw, dlb = torch.ops.aten.native_layer_norm_backward(dy, xin, (c_m,), mean, rstd, lw, lb,
                                                                     (True, True, True))
            d_ln_w += dlw
            d_ln_b += dlb
            d_msa_rows[r0:r1] = dx
            del xin, mean, rstd, dy, dx, dlw, dlb

    return (d_msa, d_ln_w.to(ln_w.dtype), d_ln_b.to(ln_b.dtype), d_wa.to(wa.dtype), d_ba.to(ba.dtype),
            d_wb.to(wb.dtype), d_bb.to(bb.dtype), d_wo.to(wo.dtype), d_bo.to(bo.dtype))


# =============================================================================================
# Module
# =============================================================================================
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PARAM_NAMES = ("layer_norm.weight", "layer_norm.bias", "proj_a.weight", "proj_a.bias", "proj_b.weight",
                "proj_b.bias", "out_proj.weight", "out_proj.bias")


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _output_dtype(msa, params):
    """The dtype the reference returns for these tensors: under CUDA autocast the autocast dtype, else
    the one dtype of msa_repr and every parameter (float32, float16 or bfloat16; others raise)."""
    if msa.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"outer_product_mean: msa_repr must be float32, float16 or bfloat16, got "
                           f"{_dtype_name(msa.dtype)}")
    if msa.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    for name, p in zip(_PARAM_NAMES, params):
        if p.dtype != msa.dtype:
            raise RuntimeError(f"outer_product_mean: parameter {name} must be {_dtype_name(msa.dtype)} like "
                               f"msa_repr, got {_dtype_name(p.dtype)} (cast the module and its inputs to one of "
                               "float32, float16, bfloat16)")
    return msa.dtype


def _f32(t):
    """t in float32 (the kernels' dtype), t itself when it is float32 already."""
    return t if t.dtype == torch.float32 else t.float()


def _run_kernels(model, code, msa, mask, params, eps, out_dtype, keep_ab=False):
    """The CUDA forward, returned in out_dtype. Where msa and every parameter are float16 / bfloat16 of one
    dtype they go to the extension as they are: outer_wg reads them and runs both products on the
    16-bit tensor cores (module docstring), the other variants convert them to float32 inside the
    extension. Otherwise they are converted to float32 here. Masks of every dtype the kernels take go as
    they are. Records the variant that ran in model.last_variant. keep_ab: returns (out, (a, b, inv_denom)), the masked projections and 1 / denom
    as outer_wg's prep computed them where outer_wg ran with hidden_dim 32 (the backward then takes them
    instead of recomputing), else (out, None)."""
    half = msa.dtype in (torch.float16, torch.bfloat16) and all(p.dtype == msa.dtype for p in params)
    out, ran, a, b, inv_d = _ext.opm_forward(msa if half else _f32(msa), mask,
                                             *(params if half else (_f32(p) for p in params)), eps, code, keep_ab)
    object.__setattr__(model, "last_variant", _ALL_VARIANTS[ran])
    out = out if out.dtype == out_dtype else out.to(out_dtype)
    if not keep_ab:
        return out
    return out, (None if a is None else (a, b, inv_d))


class _OuterProductMean(torch.autograd.Function):
    """out = OuterProductMean(msa, mask; params): the forward is the CUDA kernels, the backward
    outer_product_mean_backward (its Hopper kernels, else PyTorch ops), given a, b and 1 / denom from the
    forward where outer_wg ran; the parts that ran in kernels go to model.last_backward. No gradient for
    the mask; double backward raises."""

    @staticmethod
    def forward(ctx, model, code, eps, out_dtype, msa, mask, *params):
        ctx.eps, ctx.model = eps, model
        out, ab = _run_kernels(model, code, msa, mask, params, eps, out_dtype, keep_ab=True)
        ctx.save_for_backward(msa, mask, *params, *(ab or (None, None, None)))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        msa, mask, *params = ctx.saved_tensors
        params, ab = params[:8], params[8:]
        parts = []
        grads = outer_product_mean_backward(msa, mask, params[0], params[1], ctx.eps, *params[2:], grad_out,
                                            ab=None if ab[0] is None else tuple(ab), parts=parts)
        object.__setattr__(ctx.model, "last_backward", tuple(parts))
        need = ctx.needs_input_grad[4:5] + ctx.needs_input_grad[6:]
        grads = tuple(g if n else None for g, n in zip(grads, need))
        return (None, None, None, None, grads[0], None) + grads[1:]


class ModelNew(nn.Module):
    """Drop-in for reference/outer_product_mean.py's Model: same submodules, same order, same init.

    float32, float16 or bfloat16 (module and msa_repr in one dtype; any mask dtype the kernels take,
    float16 / bfloat16 included), computed in float16 / bfloat16 by outer_wg on Hopper (module
    docstring), else in float32, and returned in the input's dtype (the autocast dtype under CUDA
    autocast). Differentiable with respect to msa_repr and every parameter; a mask that
    requires grad raises. After a forward last_variant names the variant that ran; after a backward
    last_backward is the tuple of its parts that ran in CUDA kernels (outer_product_mean_backward's
    parts: "a, b", "dWo", "da, db", "LayerNorm"; () where PyTorch ops computed all).
    """

    ALL_VARIANTS = _ALL_VARIANTS  # every name `variant` accepts (VARIANTS: those that run here)

    # The variants that run on the current GPU (what the harness checks by default): the Hopper ones
    # only where they can run; evaluated at each access, so importing makes no CUDA call. Any name
    # of _ALL_VARIANTS may be set; one that cannot run here raises with the reason.
    VARIANTS = _VariantsHere()

    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim)
        self.proj_b = nn.Linear(msa_dim, hidden_dim)
        self.out_proj = nn.Linear(hidden_dim * hidden_dim, pair_dim)
        self.variant = "auto"
        self.last_variant = None
        self.last_backward = None

    def _variant_code(self):
        if self.variant not in _ALL_VARIANTS:
            raise ValueError(f"variant must be one of {_ALL_VARIANTS} (those that run on this GPU: "
                             f"{self.VARIANTS}), got {self.variant!r}")
        return _ALL_VARIANTS.index(self.variant)

    def forward(self, msa_repr, msa_mask):
        code = self._variant_code()
        eps = float(self.layer_norm.eps)
        params = (self.layer_norm.weight, self.layer_norm.bias, self.proj_a.weight, self.proj_a.bias,
                  self.proj_b.weight, self.proj_b.bias, self.out_proj.weight, self.out_proj.bias)
        out_dtype = _output_dtype(msa_repr, params)
        if not torch.is_grad_enabled():
            return _run_kernels(self, code, msa_repr, msa_mask, params, eps, out_dtype)
        if msa_mask.requires_grad:
            raise RuntimeError("outer_product_mean: no gradient for msa_mask (the mask is data here); "
                               "use msa_mask.detach()")
        if msa_repr.requires_grad or any(p.requires_grad for p in params):
            return _OuterProductMean.apply(self, code, eps, out_dtype, msa_repr, msa_mask, *params)
        return _run_kernels(self, code, msa_repr, msa_mask, params, eps, out_dtype)


batch_size = 2
msa_depth = 8
seq_len = 32
msa_dim = 64
hidden_dim = 32
pair_dim = 64


def get_inputs():
    return [torch.randn(batch_size, msa_depth, seq_len, msa_dim), torch.ones(batch_size, msa_depth, seq_len)]


def get_init_inputs():
    return [msa_dim, pair_dim, hidden_dim]
