// outer_product_mean: outer_first's fused kernel.
#pragma once
#include "prep_kernel.cuh"

namespace opm {

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
}  // namespace opm
