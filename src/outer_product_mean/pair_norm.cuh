// outer_product_mean: the pair-count normalisations (AlphaFold / OpenFold, Boltz): the per-pair scales and
// the epilogue that applies them to an output the kernels normalised by rows.
#pragma once
#include "fused_small.cuh"

namespace opm {

// ---------------------------------------------------------------------------------------------
// Normalisations. Every mode is out[b,i,j,z] = s1[b,i,j] acc[b,i,j,z] + s2[b,i,j] bo[z] with acc the
// unnormalised sum_{h,k} Wo[z, h c + k] sum_s a[b,s,i,h] b[b,s,j,k]:
//   kNormRows (0, KernelBench): s1 = 1 / max(sum_s m[b,s,i], 1), s2 = 1 (inv_denom, per row)
//   kNormOpenFold (1): n = sum_s m[b,s,i] m[b,s,j]; s1 = s2 = 1 / (n + eps) (the bias divided too)
//   kNormBoltz (2): s1 = 1 / max(n, 1), s2 = 1
// The pair modes' (s1, s2) per pair: opm_pair_scale_kernel, a float2 (B, N, N) array.
// ---------------------------------------------------------------------------------------------
enum Norm : int { kNormRows = 0, kNormOpenFold = 1, kNormBoltz = 2 };
constexpr int kPsT = 32, kPsS = 32;  // opm_pair_scale_kernel: pairs per block 32 i x 32 j, s per chunk 32
template <typename T>  // fp32 -> T (float: itself)
__device__ __forceinline__ T from_float_any(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return from_float<T>(v);
}

// scale[b, i, j] = (s1 / inv_denom[b, i], s2) where inv_denom is not null (the epilogue after kernels
// that applied the row scale), else (s1, s2) (outer_wg's fused pair epilogue). The pair count is summed
// exactly: float masks as fp64 products in fp64 (the product of two floats is exact in fp64), bool /
// integer masks in int64 (Acc long long). Block (256 threads): the 32 x 32 pairs of tile t = (b, it,
// jt), thread (ty = tid / 16, tx = tid % 16) pairs (i0 + ty + 16 r, j0 + tx + 16 q), r, q < 2 (4 shared
// loads per 4 products); per chunk of 32 s the mask's columns i0.. and j0.. in shared memory (as Acc).
// Grid-stride over the tiles.
template <typename Acc>
__global__ void __launch_bounds__(kThreads) opm_pair_scale_kernel(const void* __restrict__ mask, int mask_kind,
                                                                  int64_t B, int64_t S, int64_t N, int norm, double eps,
                                                                  const float* __restrict__ inv_denom,
                                                                  float2* __restrict__ scale) {
  __shared__ Acc mi[kPsS][kPsT], mj[kPsS][kPsT];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t nt = cdiv(N, kPsT), tiles = B * nt * nt;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t jt = t % nt, it = t / nt % nt, b = t / nt / nt;
    const int64_t i0 = it * kPsT, j0 = jt * kPsT;
    Acc acc[2][2] = {};
    for (int64_t s0 = 0; s0 < S; s0 += kPsS) {
      __syncthreads();  // the previous chunk's reads are done
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // element (sl, col) = (e / 32, e % 32), e = tid + 256 r: coalesced along i (j)
        const int e = tid + kThreads * r, sl = e / kPsT, col = e % kPsT;
        const int64_t s = s0 + sl, i = i0 + col, j = j0 + col;
        const bool sin = s < S;
        if constexpr (std::is_same_v<Acc, double>) {
          mi[sl][col] = sin && i < N ? static_cast<double>(mask_value(mask, (b * S + s) * N + i, mask_kind)) : 0.0;
          mj[sl][col] = sin && j < N ? static_cast<double>(mask_value(mask, (b * S + s) * N + j, mask_kind)) : 0.0;
        } else {
          mi[sl][col] = sin && i < N ? mask_int(mask, (b * S + s) * N + i, mask_kind) : 0;
          mj[sl][col] = sin && j < N ? mask_int(mask, (b * S + s) * N + j, mask_kind) : 0;
        }
      }
      __syncthreads();
#pragma unroll 8
      for (int sl = 0; sl < kPsS; ++sl) {
        Acc vi[2], vj[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          vi[r] = mi[sl][ty + 16 * r];
          vj[r] = mj[sl][tx + 16 * r];
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int q = 0; q < 2; ++q) acc[r][q] += vi[r] * vj[q];
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int64_t i = i0 + ty + 16 * r, j = j0 + tx + 16 * q;
        if (i >= N || j >= N) continue;
        const double n = static_cast<double>(acc[r][q]);
        // NaN counts stay NaN (n < 1.0 is false for NaN)
        const double s1 = norm == kNormOpenFold ? 1.0 / (n + eps) : 1.0 / (n < 1.0 ? 1.0 : n);
        const float s2 = norm == kNormOpenFold ? static_cast<float>(s1) : 1.f;
        const float f1 =
            inv_denom ? static_cast<float>(s1 / static_cast<double>(inv_denom[b * N + i])) : static_cast<float>(s1);
        scale[(b * N + i) * N + j] = make_float2(f1, s2);
      }
  }
}

// out[b,i,j,z] = out[b,i,j,z] * scale[b,i,j].x + scale[b,i,j].y * bo[z], in place, for out of T (float,
// __half or __nv_bfloat16), in fp32 with one rounding to T. kVec: 16-byte vectors of 16 / sizeof(T)
// elements (pair_dim a multiple of that, a 16-byte aligned out), else one element per thread.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) opm_pair_epilogue_kernel(T* __restrict__ out,
                                                                     const float2* __restrict__ scale,
                                                                     const float* __restrict__ bo, int64_t pairs,
                                                                     int cz) {
  constexpr int kVE = kVec ? 16 / static_cast<int>(sizeof(T)) : 1;  // elements per thread
  const int vpp = cz / kVE;                                         // vectors per pair
  const int64_t total = pairs * vpp;
  const bool small = total < (1ll << 32);
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = small ? static_cast<int64_t>(static_cast<uint32_t>(v) / static_cast<uint32_t>(vpp)) : v / vpp;
    const int z0 = static_cast<int>(v - p * vpp) * kVE;
    const float2 f = __ldg(scale + p);
    T* o = out + p * cz + z0;
    if constexpr (!kVec) {
      *o = from_float_any<T>(fmaf(to_float(*o), f.x, f.y * __ldg(bo + z0)));
    } else if constexpr (std::is_same_v<T, float>) {
      float4 x = *reinterpret_cast<const float4*>(o);
      const float4 bb = __ldg(reinterpret_cast<const float4*>(bo + z0));
      x.x = fmaf(x.x, f.x, f.y * bb.x);
      x.y = fmaf(x.y, f.x, f.y * bb.y);
      x.z = fmaf(x.z, f.x, f.y * bb.z);
      x.w = fmaf(x.w, f.x, f.y * bb.w);
      *reinterpret_cast<float4*>(o) = x;
    } else {
      uint4 x = *reinterpret_cast<const uint4*>(o);
      uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 v2 = to_float2<T>(w[e]);
        w[e] = pack2_16<T>(fmaf(v2.x, f.x, f.y * __ldg(bo + z0 + 2 * e)),
                           fmaf(v2.y, f.x, f.y * __ldg(bo + z0 + 2 * e + 1)));
      }
      *reinterpret_cast<uint4*>(o) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
