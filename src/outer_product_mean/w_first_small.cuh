// outer_product_mean: w_first_small, stage 2 for small problems.
#pragma once
#include "w_first_tc.cuh"

namespace opm {

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
}  // namespace opm
