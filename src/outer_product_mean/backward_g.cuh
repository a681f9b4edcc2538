// outer_product_mean: the backward's G in memory (G_MEM), on mma.sync, for da and db as two library products.
#pragma once
#include "backward_wo_kept.cuh"

namespace opm {

// opm_bw_g_kernel<T>: G with rows (i, h) and columns (j, k) of one (32 N) x (32 N) matrix per batch (T float16 /
//   bfloat16; g (B, N, N, c_z) and wo (c_z, 1024) row-major in T, inv_denom (B, N) float32):
//     G[((b*N + i)*32 + h)*32 N + 32 j + k] = T(inv_denom[b, i] sum_z g[b, i, j, z] wo[z, 32 h + k])
//   so that da = v_b G^T and db = v_a G over the rows (b, s) (v_a, v_b: a, b as (B, S, 32 N)). Block x =
//   (b*N + i)*JT + jt owns the 128 residues j = 128 jt .. of row i, every h and k: g's 128 rows once, then wo in
//   16 chunks of 64 columns hk (2 h), each copied one chunk ahead into one of two stages. Warp w (j 32 (w % 4) ..,
//   h = 2 hc + w / 4 of chunk hc) runs cdiv(c_z, 16) k steps of m16n8k16 (fp32 accumulation) on 2 x 4 tiles:
//   A = g by ldmatrix.x4 from its rows, B = wo by ldmatrix.x4.trans from its rows z; the sums are scaled by
//   inv_denom in fp32 and rounded to T once (as the fused kernel's G). Rows past N and z past c_z are copied as
//   zeros; rows j past N are not stored. Shared rows of kc + 8 T (g) and 72 T (wo): 16-byte padding puts the 8
//   rows of an 8 x 8 ldmatrix in distinct banks.
// Assumptions: kThreads threads; c_z % 8 == 0 and c_z <= 128 (kGmMaxCz); g, wo 16-byte aligned; sm_80+.
// ---------------------------------------------------------------------------------------------
constexpr int kGmJ = 128, kGmMaxCz = 128, kGmHK = 64, kGmWoLD = kGmHK + 8;
__host__ __device__ __forceinline__ int gm_g_ld(int cz) { return static_cast<int>(round_up(cz, 16)) + 8; }
__host__ __device__ __forceinline__ size_t gm_smem_bytes(int cz, size_t tsize) {
  const size_t kc = round_up(cz, 16);
  return tsize * (kGmJ * static_cast<size_t>(gm_g_ld(cz)) + 2 * kc * kGmWoLD);
}
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) opm_bw_g_kernel(
    const T* __restrict__ g, const T* __restrict__ wo, const float* __restrict__ inv_denom, T* __restrict__ G,
    int64_t N, int cz, int64_t JT) {
  extern __shared__ float4 smem_f4[];
  T* gs = reinterpret_cast<T*>(smem_f4);  // [kGmJ][ld]
  const int ld = gm_g_ld(cz), kc = ld - 8, ksteps = kc / 16;
  T* ws = gs + kGmJ * ld;                 // [2][kc][kGmWoLD]
  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, wm = w % 4, wn = w / 4;
  const int64_t jt = blockIdx.x % JT, bi = blockIdx.x / JT;  // bi = b*N + i
  const int64_t j0 = kGmJ * jt;
  const T* grow = g + (bi * N + j0) * cz;  // g[b, i, j0, 0]
  // g's 128 rows: kc / 8 items of 16 bytes per row
  for (int e = tid; e < kGmJ * (kc / 8); e += kThreads) {
    const int r = e / (kc / 8), c = e % (kc / 8);
    const bool in = j0 + r < N && 8 * c < cz;
    cp_async<16>(gs + r * ld + 8 * c, in ? grow + static_cast<int64_t>(r) * cz + 8 * c : g, in ? 16 : 0);
  }
  // stage st <- wo's columns 64 hc .. (kc rows z, 8 items each)
  auto load_wo = [&](int st, int hc) {
    for (int e = tid; e < kc * 8; e += kThreads) {
      const int z = e / 8, c = e % 8;
      const bool in = z < cz;
      cp_async<16>(ws + (st * kc + z) * kGmWoLD + 8 * c, in ? wo + z * 1024 + kGmHK * hc + 8 * c : wo, in ? 16 : 0);
    }
    cp_async_commit();
  };
  load_wo(0, 0);  // (one group with g's rows)
  const float scale = __ldg(inv_denom + bi);
  const int m = lane / 8, r8 = lane % 8;  // this lane's ldmatrix matrix and row
  T* gout = G + bi * 32 * N * 32;         // G[b, i, h = 0, j = 0, k = 0]
  for (int hc = 0; hc < 1024 / kGmHK; ++hc) {
    const int st = hc & 1;
    if (hc + 1 < 1024 / kGmHK) {
      load_wo(st ^ 1, hc + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // stage st (and g's rows) landed for every thread's copies
    float acc[2][4][4];  // [j m16 tile][k n8 tile][mma accumulator]
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int nn = 0; nn < 4; ++nn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][nn][e] = 0.f;
    const T* wst = ws + st * kc * kGmWoLD;
    for (int ks = 0; ks < ksteps; ++ks) {
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)  // matrices (j 0-7, z 0-7), (j 8-15, z 0-7), (j 0-7, z 8-15), (j 8-15, z 8-15)
        ldmatrix_x4<false>(a[mi], gs + (32 * wm + 16 * mi + 8 * (m & 1) + r8) * ld + 16 * ks + 8 * (m >> 1));
#pragma unroll
      for (int np = 0; np < 2; ++np) {  // matrices (z 0-7, k 0-7), (z 8-15, k 0-7), (z 0-7, k 8-15), (z 8-15, ..):
        uint32_t t[4];                  // the B fragments of n8 tiles 2 np (t[0], t[1]) and 2 np + 1 (t[2], t[3])
        ldmatrix_x4<true>(t, wst + (16 * ks + 8 * (m & 1) + r8) * kGmWoLD + 32 * wn + 16 * np + 8 * (m >> 1));
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            if constexpr (std::is_same_v<T, __half>) mma_f16(acc[mi][2 * np + q], a[mi], t[2 * q], t[2 * q + 1]);
            else mma_bf16(acc[mi][2 * np + q], a[mi], t[2 * q], t[2 * q + 1]);
          }
      }
    }
    __syncthreads();  // every warp is done with stage st before the next chunk's copies refill it
    // acc[mi][nn][2 hh + e]: j = j0 + 32 wm + 16 mi + lane / 4 + 8 hh, h = 2 hc + wn, k = 8 nn + 2 (lane % 4) + e
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t j = j0 + 32 * wm + 16 * mi + lane / 4 + 8 * hh;
        if (j >= N) continue;
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
          const int h = 2 * hc + wn, k = 8 * nn + 2 * (lane % 4);
          *reinterpret_cast<uint32_t*>(gout + (h * N + j) * 32 + k) =
              pack2_16<T>(acc[mi][nn][2 * hh] * scale, acc[mi][nn][2 * hh + 1] * scale);
        }
      }
  }
}

}  // namespace opm
