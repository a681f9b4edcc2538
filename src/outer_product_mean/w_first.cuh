// outer_product_mean: w_first's stage 1 (projection) and stage 2 (GEMM) kernels.
#pragma once
#include "outer_first.cuh"

namespace opm {

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
}  // namespace opm
