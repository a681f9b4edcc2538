// outer_product_mean: the backward's dWo over the forward's kept O (KEEP_O), on mma.sync.
#pragma once
#include "backward_ln.cuh"

namespace opm {

// opm_bw_wo_kept_kernel<T>: split partial sums of dWo[z, hk] = sum_p g[p, z] o[p, hk] (T float16 / bfloat16; g
//   (P, c_z) and o (P, 1024), row-major in T: grad_out and the O times the row's factor that outer_wg's kKeepO
//   instances wrote). Block x = (nt = x % 8, zt = x / 8 % ZT, split ks = x / (8 ZT)) owns the 128 z x 128 hk tile
//   (z 128 zt .., hk 128 nt ..) over the pairs [ks PS, (ks + 1) PS) (PS a multiple of 32) and writes it in fp32
//   to part[ks][z][hk] (z < c_z; ZT = cdiv(c_z, 128)); opm_block_sum_kernel adds the splits in order in fp64. A
//   split's 8 hk tiles are neighbouring blocks: they read the same rows of g through L2.
// Per 32 pairs: cp.async copies of the 32 rows of both tiles (16-byte items, zero-filled past the split and c_z)
//   into one of two stages, rows of kWkLD = 136 T (272 bytes: the 8 rows of an 8 x 8 ldmatrix in distinct banks),
//   issued one stage ahead; warp w (z 64 (w / 4) .., hk 32 (w % 4) ..) runs two k steps of m16n8k16 (fp32
//   accumulation) on 4 x 4 tiles: A = g^T by ldmatrix.x4.trans from the g rows, B = o by ldmatrix.x4.trans from
//   the o rows.
// Assumptions: kThreads threads; c_z % 8 == 0; g, o 16-byte aligned; P >= 1; sm_80+.
// ---------------------------------------------------------------------------------------------
constexpr int kWkLD = 136, kWkRows = 32;
// Four 8 x 8 matrices of 16-bit values from shared memory (ldmatrix .x4; kTrans: .trans): lane l gives the 16-byte
// aligned address of row l % 8 of matrix l / 8; register i holds matrix i (lane t: row t / 4, columns 2 (t % 4) and
// 2 (t % 4) + 1; transposed: column t / 4, rows 2 (t % 4) and 2 (t % 4) + 1).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#else
  __trap();  // ldmatrix needs sm_75+ (the kernels' mma sm_80+)
#endif
}
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) opm_bw_wo_kept_kernel(
    const T* __restrict__ g, const T* __restrict__ o, float* __restrict__ part, int64_t P, int cz, int ZT, int64_t PS) {
  __shared__ __align__(16) T gs[2][kWkRows][kWkLD];
  __shared__ __align__(16) T os[2][kWkRows][kWkLD];
  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, wz = w / 4, wn = w % 4;
  const int nt = static_cast<int>(blockIdx.x % 8), zt = static_cast<int>(blockIdx.x / 8 % ZT);
  const int64_t ks = blockIdx.x / (8 * ZT);
  const int64_t p0 = ks * PS, p1 = min64(P, p0 + PS);
  const int z0 = 128 * zt, n0 = 128 * nt;
  // stage st <- the 32 rows from pair pb: items e = tid, tid + 256 (row e / 16, 8 T e % 16) of each tile
  auto load = [&](int st, int64_t pb) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int e = tid + kThreads * q, r = e / 16, c = e % 16, z = z0 + 8 * c;
      const int64_t p = pb + r;
      const bool in = p < p1;
      cp_async<16>(&gs[st][r][8 * c], g + (in ? p : 0) * cz + (z < cz ? z : 0), in && z < cz ? 16 : 0);
      cp_async<16>(&os[st][r][8 * c], o + (in ? p : 0) * 1024 + n0 + 8 * c, in ? 16 : 0);
    }
    cp_async_commit();
  };
  float acc[4][4][4];  // [z m16 tile][hk n8 tile][mma accumulator]
#pragma unroll
  for (int mz = 0; mz < 4; ++mz)
#pragma unroll
    for (int nn = 0; nn < 4; ++nn)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mz][nn][e] = 0.f;
  const int64_t steps = p1 > p0 ? cdiv(p1 - p0, kWkRows) : 0;
  const int m = lane / 8, r8 = lane % 8;  // this lane's ldmatrix matrix and row
  if (steps > 0) load(0, p0);
  for (int64_t it = 0; it < steps; ++it) {
    const int st = static_cast<int>(it & 1);
    if (it + 1 < steps) {
      load(st ^ 1, p0 + kWkRows * (it + 1));
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // stage st has landed for every thread's copies
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {  // k steps of 16 pairs
      uint32_t a[4][4], b[4][2];
#pragma unroll
      for (int mz = 0; mz < 4; ++mz)  // matrices (p 0-7, z 0-7), (p 0-7, z 8-15), (p 8-15, z 0-7), (p 8-15, z 8-15)
        ldmatrix_x4<true>(a[mz], &gs[st][16 * kk + 8 * (m >> 1) + r8][64 * wz + 16 * mz + 8 * (m & 1)]);
#pragma unroll
      for (int np = 0; np < 2; ++np) {  // matrices (p 0-7, hk 0-7), (p 8-15, hk 0-7), (p 0-7, hk 8-15), (p 8-15, ..)
        uint32_t t[4];
        ldmatrix_x4<true>(t, &os[st][16 * kk + 8 * (m & 1) + r8][32 * wn + 16 * np + 8 * (m >> 1)]);
        b[2 * np][0] = t[0];
        b[2 * np][1] = t[1];
        b[2 * np + 1][0] = t[2];
        b[2 * np + 1][1] = t[3];
      }
#pragma unroll
      for (int mz = 0; mz < 4; ++mz)
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
          if constexpr (std::is_same_v<T, __half>) mma_f16(acc[mz][nn], a[mz], b[nn][0], b[nn][1]);
          else mma_bf16(acc[mz][nn], a[mz], b[nn][0], b[nn][1]);
        }
    }
    __syncthreads();  // every warp is done with stage st before the next step's copies refill it
  }
  // acc[mz][nn][2 hh + e]: z = z0 + 64 wz + 16 mz + lane / 4 + 8 hh, hk = n0 + 32 wn + 8 nn + 2 (lane % 4) + e
#pragma unroll
  for (int mz = 0; mz < 4; ++mz)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int z = z0 + 64 * wz + 16 * mz + lane / 4 + 8 * hh;
      if (z >= cz) continue;
      float* row = part + (ks * cz + z) * 1024 + n0 + 32 * wn + 2 * (lane % 4);
#pragma unroll
      for (int nn = 0; nn < 4; ++nn)
        *reinterpret_cast<float2*>(row + 8 * nn) = make_float2(acc[mz][nn][2 * hh], acc[mz][nn][2 * hh + 1]);
    }
}

}  // namespace opm
