// outer_product_mean: constants, the variant enum, shared device functions, the cp.async GEMM main loop, split TF32.
#pragma once
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
// LayerNorm statistics of a row of n floats (shared memory), by one warp: (mean, 1 / sqrt(var + eps)),
// the mean first, then the centred variance (two passes), in every lane.
__device__ __forceinline__ float2 warp_row_stats(const float* row, int n, float eps, int lane) {
  float s1 = 0.f;
  for (int k = lane; k < n; k += 32) s1 += row[k];
  const float mean = warp_sum(s1) / n;
  float s2 = 0.f;
  for (int k = lane; k < n; k += 32) {
    const float d = row[k] - mean;
    s2 = fmaf(d, d, s2);
  }
  return make_float2(mean, 1.f / sqrtf(warp_sum(s2) / n + eps));
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
}  // namespace opm
