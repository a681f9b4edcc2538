// outer_product_mean: w_first_wg2 (Hopper): stage 1 into tile-order planes, the A pack, stage 2 on wgmma.
#pragma once
#include "w_first_small.cuh"

namespace opm {

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
// kPair (a pair mode's scale in this epilogue): out[b,i,j,z] = s2 bo[z] + s1 sum_k ..., (s1, s2) =
//   pair_scale[(b N + i) N + j] (launch_pair_scale without a row scale); inv_denom is not read. Else
//   pair_scale is not read.
// Assumptions: kWgThreads threads; ncols <= NB * 128 < 2^31; At, Pt as opm_pack_a_kernel and the
//   stage-1 kernel opm_wfirst_proj_wg_kernel write them; 16-byte aligned.
// ---------------------------------------------------------------------------------------------
template <bool kPair>
__global__ void __launch_bounds__(kWgThreads, 1) opm_wfirst_wg_kernel(
    const float* __restrict__ At, const float* __restrict__ Pt, const float* __restrict__ inv_denom,
    const float2* __restrict__ pair_scale, const float* __restrict__ bo, float* __restrict__ out, int64_t B,
    int64_t N, int64_t MB128, int64_t NB, int64_t KB, int64_t j0, int64_t ncols, int cz, int CZP4) {
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
  if (wg == kProducerWg) {  // producer warp
    if (tid == kProducerThread) {
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
      const float inv = kPair ? 0.f : inv_denom[b * N + i];
      float* orow = out + ((b * N + i) * N + j0) * cz;
      // kPair: the scale of pair (i, j0 + sj), loaded when a column first needs another j (n < nc: j < N)
      const float2* srow = pair_scale + (b * N + i) * N + j0;
      float2 s = make_float2(0.f, 0.f);
      int sj = -1;
      auto scaled = [&](float v, float bz, int jj) {
        if (!kPair) return bz + inv * v;
        if (jj != sj) {
          s = __ldg(srow + jj);
          sj = jj;
        }
        return s.x * v + s.y * bz;
      };
      int jl = jl0, z = z00;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int n = n0 + 8 * j;
        const float v0 = acc[4 * j + 2 * hr], v1 = acc[4 * j + 2 * hr + 1];
        if (n < nc) {
          if (pair) {
            if (z < cz)
              *reinterpret_cast<float2*>(orow + static_cast<int64_t>(jl) * cz + z) =
                  make_float2(scaled(v0, __ldg(bo + z), jl), scaled(v1, __ldg(bo + z + 1), jl));
          } else {
            if (z < cz) orow[static_cast<int64_t>(jl) * cz + z] = scaled(v0, __ldg(bo + z), jl);
            const int z1 = z + 1 < CZP4 ? z + 1 : 0, jl1 = z + 1 < CZP4 ? jl : jl + 1;  // column n + 1
            if (n + 1 < nc && z1 < cz) orow[static_cast<int64_t>(jl1) * cz + z1] = scaled(v1, __ldg(bo + z1), jl1);
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
}  // namespace opm
