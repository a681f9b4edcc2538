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
// The pair modes' (s1, s2) per pair: opm_pair_scale_kernel (bool / integer masks; float masks where DMMA is off
// or absent), opm_pair_scale_ring_kernel (float masks, PairCounts kCountsRing, 16-byte aligned rows) or
// opm_pair_scale_dmma_kernel (the other float masks), a float2 (B, N, N) array.
// ---------------------------------------------------------------------------------------------
enum Norm : int { kNormRows = 0, kNormOpenFold = 1, kNormBoltz = 2 };
// How float masks' pair counts are summed (launch_pair_scale): fp64 FMA, DMMA, DMMA fed by a cp.async ring.
// kCountsHmma (Python's default): 16-bit masks by the ring on HMMA (fp32 sums), float32 masks as kCountsRing.
enum PairCounts : int { kCountsFma = 0, kCountsDmma = 1, kCountsRing = 2, kCountsHmma = 3 };
constexpr int kPsT = 32, kPsS = 8, kPsSlices = 8;  // opm_pair_scale_kernel: 32 x 32 pairs, 8 s per slice chunk
constexpr int kPsThreads = 64 * kPsSlices;            // 64 threads (4 x 4 pairs each) per slice
template <typename T>  // fp32 -> T (float: itself)
__device__ __forceinline__ T from_float_any(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return from_float<T>(v);
}

// (s1, s2) of a pair with count n (see "Normalisations"), s1 over inv_denom[row] where inv_denom is not null.
__device__ __forceinline__ float2 pair_scale_of(double n, int norm, double eps, const float* __restrict__ inv_denom,
                                                int64_t row) {
  // NaN counts stay NaN (n < 1.0 is false for NaN)
  const double s1 = norm == kNormOpenFold ? 1.0 / (n + eps) : 1.0 / (n < 1.0 ? 1.0 : n);
  const float s2 = norm == kNormOpenFold ? static_cast<float>(s1) : 1.f;
  const float f1 = inv_denom ? static_cast<float>(s1 / static_cast<double>(inv_denom[row])) : static_cast<float>(s1);
  return make_float2(f1, s2);
}

// scale[b, i, j] = (s1 / inv_denom[b, i], s2) where inv_denom is not null (the epilogue after kernels
// that applied the row scale), else (s1, s2) (outer_wg's and w_first_wg2's fused pair epilogues). The pair
// count is summed exactly: float masks as fp64 products in fp64 (the product of two floats is exact in fp64), bool /
// integer masks in int64 (Acc long long). Block (kPsThreads = 512): the 32 x 32 pairs of tile t = (b, it,
// jt) in kPsSlices = 8 slices of 64 threads; of chunk ch (64 s), slice q sums s = 8 (8 ch + q) + 0..7, its
// thread (ty, tx) = (l / 8, l % 8), l = tid % 64, the pairs (i0 + 4 ty + r, j0 + 4 tx + c), r, c < 4 (8
// shared loads per 16 products), from the mask's columns i0.. and j0.. in shared memory (as Acc); the next
// chunk's columns are loaded into registers while this one is summed. The slices' sums are then added in
// a fixed tree (q + 4, q + 2, q + 1 into q): the same order on every run. Grid-stride over the tiles.
template <typename Acc>
__global__ void __launch_bounds__(kPsThreads) opm_pair_scale_kernel(const void* __restrict__ mask, int mask_kind,
                                                                    int64_t B, int64_t S, int64_t N, int norm,
                                                                    double eps, const float* __restrict__ inv_denom,
                                                                    float2* __restrict__ scale) {
  constexpr int kChunk = kPsSlices * kPsS * kPsT;  // mask elements of one chunk, per column set
  constexpr int kLoads = kChunk / kPsThreads;      // per thread
  __shared__ __align__(16) Acc msh[2][kChunk];     // [0]: columns i, [1]: columns j; then the slices' sums
  const int tid = threadIdx.x, q = tid / 64, l = tid % 64, tx = l % 8, ty = l / 8;
  const int64_t nt = cdiv(N, kPsT), tiles = B * nt * nt, nchunk = cdiv(S, kPsSlices * kPsS);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t jt = t % nt, it = t / nt % nt, b = t / nt / nt;
    const int64_t i0 = it * kPsT, j0 = jt * kPsT;
    Acc pi[kLoads], pj[kLoads];
    // element e of a chunk: (slice e / 256, s e / 32 % 8, column e % 32), coalesced along i (j)
    auto fetch = [&](int64_t ch) {
#pragma unroll
      for (int r = 0; r < kLoads; ++r) {
        const int e = tid + kPsThreads * r, col = e % kPsT;
        const int64_t s = (ch * kPsSlices + e / (kPsS * kPsT)) * kPsS + e / kPsT % kPsS, i = i0 + col, j = j0 + col;
        const bool sin = s < S;
        if constexpr (std::is_same_v<Acc, double>) {
          pi[r] = sin && i < N ? static_cast<double>(mask_value(mask, (b * S + s) * N + i, mask_kind)) : 0.0;
          pj[r] = sin && j < N ? static_cast<double>(mask_value(mask, (b * S + s) * N + j, mask_kind)) : 0.0;
        } else {
          pi[r] = sin && i < N ? mask_int(mask, (b * S + s) * N + i, mask_kind) : 0;
          pj[r] = sin && j < N ? mask_int(mask, (b * S + s) * N + j, mask_kind) : 0;
        }
      }
    };
    Acc acc[4][4] = {};
    if (nchunk > 0) fetch(0);
    for (int64_t ch = 0; ch < nchunk; ++ch) {
      __syncthreads();  // the previous chunk's (or tile's) reads of msh are done
#pragma unroll
      for (int r = 0; r < kLoads; ++r) {
        msh[0][tid + kPsThreads * r] = pi[r];
        msh[1][tid + kPsThreads * r] = pj[r];
      }
      __syncthreads();  // the chunk in shared memory
      if (ch + 1 < nchunk) fetch(ch + 1);
      const Acc* mi = msh[0] + q * (kPsS * kPsT);
      const Acc* mj = msh[1] + q * (kPsS * kPsT);
#pragma unroll
      for (int sl = 0; sl < kPsS; ++sl) {
        Acc vi[4], vj[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          vi[r] = mi[sl * kPsT + 4 * ty + r];
          vj[r] = mj[sl * kPsT + 4 * tx + r];
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[r][c] += vi[r] * vj[c];
      }
    }
    // the slices' sums: slice q + h adds into slice q for h = 4, 2, 1 (red: (slice - h, r, c, l))
    Acc* red = &msh[0][0];  // both halves: 4 slices x 16 sums x 64 threads
#pragma unroll
    for (int h = kPsSlices / 2; h >= 1; h /= 2) {
      __syncthreads();  // msh's earlier reads are done
      if (q >= h && q < 2 * h) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) red[(((q - h) * 4 + r) * 4 + c) * 64 + l] = acc[r][c];
      }
      __syncthreads();
      if (q < h) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[r][c] += red[((q * 4 + r) * 4 + c) * 64 + l];
      }
    }
    if (q == 0) {
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int64_t i = i0 + 4 * ty + r, j = j0 + 4 * tx + c;
          if (i >= N || j >= N) continue;
          scale[(b * N + i) * N + j] = pair_scale_of(static_cast<double>(acc[r][c]), norm, eps, inv_denom, b * N + i);
        }
    }
  }
}

// The pair counts of a float mask (M: float, __half or __nv_bfloat16) on the fp64 tensor cores (DMMA m8n8k4, sm_80+):
// n[b,i,j] = sum_s m[b,s,i] m[b,s,j], each product exact in fp64, the sum in fp64 in a fixed order (k steps of 4 s in
// order, each DMMA adding its four products to the accumulator; another order than opm_pair_scale_kernel's), then
// (s1, s2) by pair_scale_of. Block (kPdThreads = 256, 8 warps): the 32 x 32 pairs of tile t = (b, it, jt); warp w
// the rows 8 (w / 2).. and columns 16 (w % 2).. (two 8 x 8 accumulators). Chunks of kPdS = 64 s go to shared memory
// as fp64, rows of kPdLd = 36 doubles (the fragment loads conflict-free); lane l of warp w loads column l of the
// rows s = w, w + 8, .. of both sides, the next chunk into registers while this one is multiplied. Grid-stride
// over the tiles. Fragments (PTX ISA, m8n8k4 .f64): A (8 x 4, row) a0 = A[lane / 4][lane % 4]; B (4 x 8, col) b0 =
// B[lane % 4][lane / 4]; C c_e = C[lane / 4][2 (lane % 4) + e].
constexpr int kPdS = 64, kPdThreads = 256, kPdLd = 36;

__device__ __forceinline__ void dmma_m8n8k4(double (&c)[2], double a, double b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+d"(c[0]), "+d"(c[1])
               : "d"(a), "d"(b));
#endif
}

// A warp's two 8 x 8 DMMA accumulators (C fragments) as (s1, s2): c[n][e] is the count of pair (i, j0 + 8 n + e),
// i this lane's row, j0 its first column.
__device__ __forceinline__ void pd_store_scales(const double (&c)[2][2], int64_t b, int64_t i, int64_t j0, int64_t N,
                                                int norm, double eps, const float* __restrict__ inv_denom,
                                                float2* __restrict__ scale) {
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t j = j0 + 8 * n + e;
      if (i < N && j < N) scale[(b * N + i) * N + j] = pair_scale_of(c[n][e], norm, eps, inv_denom, b * N + i);
    }
}

template <typename M>
__global__ void __launch_bounds__(kPdThreads) opm_pair_scale_dmma_kernel(const M* __restrict__ mask, int64_t B,
                                                                         int64_t S, int64_t N, int norm, double eps,
                                                                         const float* __restrict__ inv_denom,
                                                                         float2* __restrict__ scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kRows = kPdS / (kPdThreads / 32);  // rows s per lane per chunk and side (8)
  __shared__ __align__(16) double msh[2][kPdS * kPdLd];  // [0]: columns i, [1]: columns j; rows s
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = 8 * (warp >> 1), wc = 16 * (warp & 1), fr = lane >> 2, fk = lane & 3;
  const int64_t nt = cdiv(N, kPsT), tiles = B * nt * nt, nchunk = cdiv(S, kPdS);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t jt = t % nt, it = t / nt % nt, b = t / nt / nt;
    const int64_t i0 = it * kPsT, j0 = jt * kPsT;
    const bool i_in = i0 + lane < N, j_in = j0 + lane < N;
    const M* mi_g = mask + b * S * N + i0 + lane;
    const M* mj_g = mask + b * S * N + j0 + lane;
    float vi[kRows], vj[kRows];
    auto fetch = [&](int64_t ch) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t s = ch * kPdS + warp + 8 * r;
        vi[r] = s < S && i_in ? to_float(mi_g[s * N]) : 0.f;
        vj[r] = s < S && j_in ? to_float(mj_g[s * N]) : 0.f;
      }
    };
    double c[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
    if (nchunk > 0) fetch(0);
    for (int64_t ch = 0; ch < nchunk; ++ch) {
      __syncthreads();  // the previous chunk's (or tile's) fragment loads are done
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        msh[0][(warp + 8 * r) * kPdLd + lane] = static_cast<double>(vi[r]);
        msh[1][(warp + 8 * r) * kPdLd + lane] = static_cast<double>(vj[r]);
      }
      __syncthreads();  // the chunk in shared memory
      if (ch + 1 < nchunk) fetch(ch + 1);
      const double* ai = msh[0] + fk * kPdLd + wr + fr;
      const double* bj = msh[1] + fk * kPdLd + wc + fr;
#pragma unroll 4
      for (int k = 0; k < kPdS; k += 4) {
        const double a = ai[k * kPdLd];
        dmma_m8n8k4(c[0], a, bj[k * kPdLd]);
        dmma_m8n8k4(c[1], a, bj[k * kPdLd + 8]);
      }
    }
    pd_store_scales(c, b, i0 + wr + fr, j0 + wc + 2 * fk, N, norm, eps, inv_denom, scale);
  }
#else
  __trap();  // built without sm_80: the host launches it only on devices of compute capability 8.0+
#endif
}

// opm_pair_scale_dmma_kernel's products in its order (the same sums, bit for bit), the mask's columns brought by
// 16-byte cp.async into a ring of kPrStages stages of kPrS = 32 s (float: 4 stages, 16-bit: 8; 40 KB either way),
// up to kPrStages - 1 stages in flight while one is multiplied, where the DMMA kernel holds one 64-s chunk in
// registers. Stage rows kPrLd = 40 elements apart (the fragment loads conflict-free: word 8 fk + fr (float), 20 fk
// + fr / 2 (16-bit)); rows past S and columns past N zero-filled. Assumptions: N sizeof(M) % 16 == 0 and a 16-byte
// aligned mask (launch_pair_scale checks; else the DMMA kernel). Warps, fragments, tiles: as the DMMA kernel.
// kHmma (16-bit M, PairCounts kCountsHmma): the same ring, the products on mma.sync m16n8k16 in M with fp32
// accumulation instead: each product exact in fp32 (two 8- or 11-bit significands), the sum rounded to fp32 at
// each k step of 16 (exact for 0 / 1 masks up to 2^24 sequences; fractional weights to about S 2^-24 relative).
// Warp w the rows 16 (w / 4).. and columns 8 (w % 4).. (one m16n8 accumulator); per stage two k steps, A (rows i,
// k = s) and B (k = s, columns j) by ldmatrix .trans from the stage's [s][column] rows (80-byte rows: the 8 row
// addresses of each 8 x 8 matrix fall in distinct banks). One HMMA per warp per 16 s against 8 DMMAs and their
// 24 fp64 conversions.
constexpr int kPrS = 32, kPrLd = 40, kPrBytes = 40 * 1024;
template <typename M>
constexpr int pr_stages() { return kPrBytes / (2 * kPrS * kPrLd * static_cast<int>(sizeof(M))); }

// r = the four 8 x 8 16-bit matrices whose rows lane l's row addresses name (lanes 8 q.. matrix q), transposed:
// lane (g, t) = (l / 4, l % 4) gets rows 2 t, 2 t + 1 of column g of each (PTX ISA, ldmatrix .trans).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(row)))
               : "memory");
}

template <typename M, bool kHmma = false>
__global__ void __launch_bounds__(kPdThreads) opm_pair_scale_ring_kernel(const M* __restrict__ mask, int64_t B,
                                                                         int64_t S, int64_t N, int norm, double eps,
                                                                         const float* __restrict__ inv_denom,
                                                                         float2* __restrict__ scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kStages = pr_stages<M>(), kSide = kPrS * kPrLd;  // stages; elements per side of a stage
  constexpr int kVe = 16 / static_cast<int>(sizeof(M)), kVpr = kPsT / kVe;  // elements per copy; copies per row
  constexpr int kCopies = 2 * kPrS * kVpr / kPdThreads;                     // per thread per stage (float 2, 16-bit 1)
  static_assert(kStages >= 2 && kCopies >= 1 && 2 * kPrS * kVpr == kCopies * kPdThreads, "ring shape");
  static_assert(!kHmma || sizeof(M) == 2, "HMMA counts take 16-bit masks");
  __shared__ __align__(16) M ring[kStages][2][kSide];  // [stage][0: columns i, 1: columns j][row s * kPrLd + column]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = 8 * (warp >> 1), wc = 16 * (warp & 1), fr = lane >> 2, fk = lane & 3;
  [[maybe_unused]] const int mq = lane >> 3, rr = lane & 7, hr = 16 * (warp >> 2), hc = 8 * (warp & 3);  // (kHmma)
  const int64_t nt = cdiv(N, kPsT), tiles = B * nt * nt, nst = cdiv(S, kPrS);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t jt = t % nt, it = t / nt % nt, b = t / nt / nt;
    const int64_t i0 = it * kPsT, j0 = jt * kPsT;
    // stage st into slot st % kStages: copy v of this thread is side v / (kPrS kVpr), row v / kVpr % kPrS,
    // columns kVe (v % kVpr).. (one commit group per stage, empty past the last)
    auto issue = [&](int64_t st) {
      if (st < nst) {
#pragma unroll
        for (int u = 0; u < kCopies; ++u) {
          const int v = tid + kPdThreads * u, side = v / (kPrS * kVpr), r = v / kVpr % kPrS, q = v % kVpr;
          const int64_t s = st * kPrS + r, col = (side ? j0 : i0) + kVe * q;
          const bool ok = s < S && col < N;
          cp_async<16>(&ring[st % kStages][side][r * kPrLd + kVe * q], ok ? mask + (b * S + s) * N + col : mask,
                       ok ? 16 : 0);
        }
      }
      cp_async_commit();
    };
    __syncthreads();  // the previous tile's fragment loads are done before its slots are refilled
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) issue(st);
    // DMMA: two 8 x 8 fp64 accumulators per warp (c); kHmma: one m16n8 fp32 accumulator (ch), fed by ldmatrix
    // rows of lane l: A (k step at s 16 h) matrix mq = l / 8: s 16 h + l % 8 + 8 (mq / 2), columns i hr + 8 (mq % 2)..;
    // B matrix mq: s 8 mq + l % 8, columns j hc..
    double c[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
    float ch[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t st = 0; st < nst; ++st) {
      cp_async_wait<kStages - 2>();  // this thread's copies of stage st have landed
      __syncthreads();               // everyone's; and every fragment load of stage st - 1 is done
      issue(st + kStages - 1);       // into stage st - 1's slot
      if constexpr (kHmma) {
        uint32_t bf[4], af[4];
        ldsm_x4_trans(bf, &ring[st % kStages][1][(8 * mq + rr) * kPrLd + hc]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          ldsm_x4_trans(af, &ring[st % kStages][0][(16 * h + rr + 8 * (mq >> 1)) * kPrLd + hr + 8 * (mq & 1)]);
          if constexpr (std::is_same_v<M, __half>) mma_f16(ch, af, bf[2 * h], bf[2 * h + 1]);
          else mma_bf16(ch, af, bf[2 * h], bf[2 * h + 1]);
        }
      } else {
        const M* ai = &ring[st % kStages][0][fk * kPrLd + wr + fr];
        const M* bj = &ring[st % kStages][1][fk * kPrLd + wc + fr];
#pragma unroll
        for (int k = 0; k < kPrS; k += 4) {
          const double a = static_cast<double>(to_float(ai[k * kPrLd]));
          dmma_m8n8k4(c[0], a, static_cast<double>(to_float(bj[k * kPrLd])));
          dmma_m8n8k4(c[1], a, static_cast<double>(to_float(bj[k * kPrLd + 8])));
        }
      }
    }
    cp_async_wait<0>();  // (only empty groups remain)
    if constexpr (kHmma) {  // ch: rows g, g + 8 (ch[0..1], ch[2..3]), columns 2 t, 2 t + 1 of the warp's 16 x 8
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t i = i0 + hr + fr + 8 * (e >> 1), j = j0 + hc + 2 * fk + (e & 1);
        if (i < N && j < N)
          scale[(b * N + i) * N + j] = pair_scale_of(static_cast<double>(ch[e]), norm, eps, inv_denom, b * N + i);
      }
    } else {
      pd_store_scales(c, b, i0 + wr + fr, j0 + wc + 2 * fk, N, norm, eps, inv_denom, scale);
    }
  }
#else
  __trap();  // built without sm_80: the host launches it only on devices of compute capability 8.0+
#endif
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

// The pair modes' backward input to the row kernels and out_proj's bias gradient, in one pass over grad_out:
//   gk[r][c] = s1[r] g[r][c] (the product in fp32, rounded once to GK: float, or G itself) and part[blk][c] =
//   the sum over block blk's rows of s2 g[r][c], s2 = s1 where S2_IS_S1 (OpenFold: the sum of the unrounded
//   products), else 1 (Boltz). Rows r are the pairs (b, i, j): g (rows, cz) in G (float, __half or
//   __nv_bfloat16), s1 (rows) float32. Threads, row ranges and sums as opm_colsum_kernel (kU = 4 rows' loads in
//   flight per thread, added in row order); opm_block_sum_kernel adds the blocks' sums. Assumptions: 256 threads; cz % 4 == 0, 4 <= cz <=
//   1024; g and gk 16-byte aligned.
template <typename G, typename GK, bool S2_IS_S1>
__global__ void __launch_bounds__(kThreads) opm_pair_grad_kernel(const G* __restrict__ g, const float* __restrict__ s1,
                                                                 int64_t rows, int cz, int64_t rpb, GK* __restrict__ gk,
                                                                 float* __restrict__ part) {
  constexpr int kU = 4;
  __shared__ float4 red[kThreads];
  const int CG = cz / 4, RL = kThreads / CG, tid = threadIdx.x, cg = tid % CG, rl = tid / CG;
  const int64_t r0 = blockIdx.x * rpb, r1 = min64(rows, r0 + rpb);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (rl < RL) {
    for (int64_t r = r0 + rl; r < r1; r += kU * RL) {  // kU rows' loads in flight, then their math in row order
      float4 v[kU];
      float s[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t ru = r + u * RL;
        v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        s[u] = 0.f;
        if (ru < r1) {
          if constexpr (std::is_same_v<G, float>) {
            v[u] = __ldg(reinterpret_cast<const float4*>(g + ru * cz) + cg);
          } else {  // 4 G in 8 bytes
            const uint2 h = __ldg(reinterpret_cast<const uint2*>(g + ru * cz) + cg);
            const float2 lo = to_float2<G>(h.x), hi = to_float2<G>(h.y);
            v[u] = make_float4(lo.x, lo.y, hi.x, hi.y);
          }
          s[u] = __ldg(s1 + ru);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t ru = r + u * RL;
        if (ru < r1) {
          const float4 p = make_float4(s[u] * v[u].x, s[u] * v[u].y, s[u] * v[u].z, s[u] * v[u].w);
          if constexpr (std::is_same_v<GK, float>) reinterpret_cast<float4*>(gk + ru * cz)[cg] = p;
          else reinterpret_cast<uint2*>(gk + ru * cz)[cg] = pack4_16<GK>(p.x, p.y, p.z, p.w);
          const float4 w = S2_IS_S1 ? p : v[u];
          acc.x += w.x; acc.y += w.y; acc.z += w.z; acc.w += w.w;
        }
      }
    }
  }
  colsum_block_store(acc, red, CG, RL, tid, cz, part);
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
