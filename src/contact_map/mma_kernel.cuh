// contact_map: the mma kernel (sm_80+): both products on mma.sync m16n8k8 in split TF32, tiles by cp.async.
#pragma once
#include "fma_kernel.cuh"

namespace contact_map {

// =============================================================================================
// The mma kernel (sm_80+): both products on mma.sync in split TF32, tiles by cp.async
// =============================================================================================
// d += A(16 x 8, row-major) * B(8 x 8, column-major), TF32 inputs, fp32 accumulate (sm_80+).
// Fragments (g = lane / 4, t = lane % 4): a = {A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]},
// b = {B[t][g], B[t+4][g]}, d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// How the tensor-core kernel holds W^T (the B operand): split fragments in shared memory, or the
// global W read through L1 and split on the fly (when the weights do not fit beside the tile).
enum class WFormat { kSplit, kGlobal };

// Stage W1^T and W2^T (W1: H x C, W2: H x H, row-major, global) as split-TF32 B fragments in shared
// memory, W2's right after W1's: dst[(ks * NT + nt) * 32 + lane] = {hi W[n][k], hi W[n][k+4],
// lo W[n][k], lo W[n][k+4]} with n = 8 nt + g, k = 8 ks + t, zero outside (k < n_in, n < H); ks <
// CP / 8 for W1, then HP / 8 for W2; nt < NT = HP / 8. One 16-byte shared-memory load per lane per
// (k step, n tile) in the product, conflict-free. Both matrices in one loop, unrolled by 8, so that a
// thread's loads are in flight together (the prologue is a chain of dependent global round trips).
template <int HP, int NTHR>
__device__ __forceinline__ void stage_weight_fragments(const float* __restrict__ w1, const float* __restrict__ w2,
                                                       int C, int H, int CP, float* dst) {
  constexpr int NT = HP / 8;
  const int n1 = (CP / 8) * NT * 32, n_frag = n1 + (HP / 8) * NT * 32;
#pragma unroll 8
  for (int e = threadIdx.x; e < n_frag; e += NTHR) {
    const bool second = e >= n1;
    const float* W = second ? w2 : w1;
    const int n_in = second ? H : C, ee = second ? e - n1 : e;
    const int lane = ee & 31, f = ee >> 5;
    const int n = (f % NT) * 8 + (lane >> 2), k = (f / NT) * 8 + (lane & 3);
    const bool row_ok = n < H;
    const float v0 = row_ok && k < n_in ? __ldg(W + static_cast<long long>(n) * n_in + k) : 0.f;
    const float v1 = row_ok && k + 4 < n_in ? __ldg(W + static_cast<long long>(n) * n_in + k + 4) : 0.f;
    uint32_t h0, l0, h1, l1;
    split_tf32(v0, h0, l0);
    split_tf32(v1, h1, l1);
    reinterpret_cast<float4*>(dst)[e] =
        make_float4(__uint_as_float(h0), __uint_as_float(h1), __uint_as_float(l0), __uint_as_float(l1));
  }
}

// One warp: acc[nt] += A(16 rows, K) * W^T(K, 8 NTW columns starting at column 8 nt0), split TF32.
// A: shared, row-major with stride lda (lda = 4 mod 8: the scalar fragment loads are conflict-free),
// K a multiple of 8, zero-padded. W^T: split fragments Wf from stage_weight_fragments (NT n tiles per k
// step), or (kGlobal) the global W (n_out x n_in) read through L1 and split here.
// Accumulation: the big products hi*hi of each k step go into a zeroed register set that is then
// added to acc with an ordinary fp32 add (the tensor cores' internal accumulation truncates, so acc
// never goes through it: the promotion FP8 GEMMs use), so the rounding of acc is that of an fp32
// FMA loop. The small products lo*hi and hi*lo (~2^-11 of the big ones) accumulate on the tensor
// cores in two separate register sets over all of K (one set for 8+ n tiles per warp: registers;
// their truncation error is ~2^-33 relative) and are added at the end. Each mma depends on at most
// one earlier mma. (An earlier build chained the three products of every k step into one set; this
// order was meant to shorten the dependency chains but measured ~5% slower: NOTES.md, to re-test.)
template <int NTW, WFormat WF, bool FAST>
__device__ __forceinline__ void tc_gemm(const float* A, int lda, int K, const void* Wf, int NT, int nt0,
                                        const float* __restrict__ Wg, int n_in, int n_out,
                                        float (&acc)[NTW][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float* ap = A + g * lda + t;
  float sm1[NTW][4], sm2[NTW][4];  // lo(A) hi(W), hi(A) lo(W)
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) sm1[nt][q] = sm2[nt][q] = 0.f;
#pragma unroll(NTW >= 8 ? 1 : 2)  // 2 k steps in flight, within the register budget
  for (int ks = 0; ks < K / 8; ++ks) {
    uint32_t ah[4], al[4];
    split<FAST>(ap[8 * ks], ah[0], al[0]);
    split<FAST>(ap[8 * ks + 8 * lda], ah[1], al[1]);
    split<FAST>(ap[8 * ks + 4], ah[2], al[2]);
    split<FAST>(ap[8 * ks + 8 * lda + 4], ah[3], al[3]);
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      uint32_t bh0, bh1, bl0, bl1;
      if constexpr (WF == WFormat::kSplit) {
        const float4 w = reinterpret_cast<const float4*>(Wf)[(ks * NT + nt0 + nt) * 32 + lane];
        bh0 = __float_as_uint(w.x); bh1 = __float_as_uint(w.y);
        bl0 = __float_as_uint(w.z); bl1 = __float_as_uint(w.w);
      } else {
        const int n = (nt0 + nt) * 8 + g, k = ks * 8 + t;
        const float v0 = n < n_out && k < n_in ? __ldg(Wg + static_cast<long long>(n) * n_in + k) : 0.f;
        const float v1 = n < n_out && k + 4 < n_in ? __ldg(Wg + static_cast<long long>(n) * n_in + k + 4) : 0.f;
        split<FAST>(v0, bh0, bl0);
        split<FAST>(v1, bh1, bl1);
      }
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mma_tf32(d, ah, bh0, bh1);
      mma_tf32(sm1[nt], al, bh0, bh1);
      if constexpr (NTW >= 8) mma_tf32(sm1[nt], ah, bl0, bl1);  // register budget: one set
      else mma_tf32(sm2[nt], ah, bl0, bl1);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] += d[q];
    }
  }
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[nt][q] += NTW >= 8 ? sm1[nt][q] : sm1[nt][q] + sm2[nt][q];
}

// Queue the copies of rows row0..row1-1 of tile (b, I, J) into shared memory, by nw warps of which the
// caller is warp wid (a warp copies whole rows, so the index arithmetic is per row):
//   raw[p]         = x[b, 8I+ti, 8J+tj, :]   (p = 8 ti + tj, rows 0..63)
//   raw[PAIRS + p] = x[b, 8J+tj, 8I+ti, :]   (the mirror, rows 64..127)
// Rows whose i or j is past N are zero-filled. The kernel queues a tile in two parts (NOTES.md: 3-5%
// faster than all at once): the first rows before or during GEMM1, the rest after it.
__device__ __forceinline__ void load_rows(const float* __restrict__ x, float* raw, int raw_ld, int b, int I,
                                          int J, int N, int C, bool vec, int row0, int row1, int wid, int nw) {
  const int per_row = vec ? C / 4 : C, lane = threadIdx.x & 31;
  for (int rr = row0 + wid; rr < row1; rr += nw) {
    const int p = rr & (PAIRS - 1);
    const int i = I * TILE + (p >> 3), j = J * TILE + (p & 7);
    const bool valid = i < N && j < N;
    const float* src = x + (rr < PAIRS ? (static_cast<long long>(b) * N + i) * N + j
                                       : (static_cast<long long>(b) * N + j) * N + i) * C;
    float* dst = raw + rr * raw_ld;
    if (vec) {
      for (int q = lane; q < per_row; q += 32) cp_async16(dst + 4 * q, valid ? src + 4 * q : x, valid);
    } else {
      for (int q = lane; q < per_row; q += 32) cp_async4(dst + q, valid ? src + q : x, valid);
    }
  }
}

// Queue the copies of tile (b, I, J) into shared memory:
//   raw[p]         = x[b, 8I+ti, 8J+tj, :]   (p = 8 ti + tj, rows 0..63)
//   raw[PAIRS + p] = x[b, 8J+tj, 8I+ti, :]   (the mirror, rows 64..127)
// Rows whose i or j is past N are zero-filled. Each row of x is C contiguous floats, so a warp's


// LayerNorm statistics of the 128 rows of raw (2 * PAIRS x raw_ld, zero beyond column C), ln_stats'
// corrected two-sweep (a first mean, then the sums of the deviations and their squares):
// stats[r] = mean, stats[2 * PAIRS + r] = 1 / sqrt(var + eps). nq = cdiv(C, 4) float4s per row.
// TPR = NTHR / 128 threads per vector (2 or 4), each summing every TPR-th float4 of the row,
// combined with shuffles. A warp holds 32 / TPR rows: lane l takes row l % (32 / TPR) of them and
// part l / (32 / TPR), so the 8 lanes of a quarter-warp read the same float4 column of 8 consecutive
// rows: conflict-free when raw_ld = 4 (mod 8) words (CP % 8 == 0 here), 2-way otherwise.
template <int NTHR = THREADS>
__device__ __forceinline__ void tile_stats(const float* raw, int raw_ld, int nq, int C, float inv_c,
                                           float eps, float* stats) {
  constexpr int TPR = NTHR / (2 * PAIRS), RPW = 32 / TPR;  // threads per row, rows per warp
  const int lane = threadIdx.x & 31;
  const int r = (threadIdx.x >> 5) * RPW + lane % RPW, part = lane / RPW;
  const float* row = raw + r * raw_ld;
  // Four partial sums per thread (this thread's float4s in turn): shorter rounding chains
  // than one running sum (with one, the error at N = 1 was 7x the fp32 reference's).
  float s4[4] = {0.f, 0.f, 0.f, 0.f};
  for (int q0 = part; q0 < nq; q0 += 4 * TPR) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int q = q0 + TPR * u;
      if (q < nq) {
        const float4 v = *reinterpret_cast<const float4*>(row + 4 * q);
        s4[u] += (v.x + v.y) + (v.z + v.w);  // padding columns are zero
      }
    }
  }
  float s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
#pragma unroll
  for (int o = RPW; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float mean = s * inv_c;
  float m4[4] = {0.f, 0.f, 0.f, 0.f}, e4[4] = {0.f, 0.f, 0.f, 0.f};
  for (int q0 = part; q0 < nq; q0 += 4 * TPR) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int q = q0 + TPR * u;
      if (q < nq) {
        const float4 v = *reinterpret_cast<const float4*>(row + 4 * q);
        const int c = 4 * q;                        // mask the padding: (0 - mean)^2 != 0
        const float dx = v.x - mean;
        const float dy = c + 1 < C ? v.y - mean : 0.f;
        const float dz = c + 2 < C ? v.z - mean : 0.f;
        const float dw = c + 3 < C ? v.w - mean : 0.f;
        m4[u] += (dx * dx + dy * dy) + (dz * dz + dw * dw);
        e4[u] += (dx + dy) + (dz + dw);
      }
    }
  }
  float m2 = (m4[0] + m4[1]) + (m4[2] + m4[3]), d1 = (e4[0] + e4[1]) + (e4[2] + e4[3]);
#pragma unroll
  for (int o = RPW; o < 32; o <<= 1) {
    m2 += __shfl_xor_sync(0xffffffffu, m2, o);
    d1 += __shfl_xor_sync(0xffffffffu, d1, o);
  }
  if (part == 0) {
    float mc, rs;
    ln_stats(mean, d1, m2, inv_c, eps, mc, rs);
    stats[r] = mc;
    stats[2 * PAIRS + r] = rs;
  }
}

// Parameters into shared memory, zero-padded: gamma, beta (CP); b1, b2, w3 (HP). Asynchronous
// s[p][c] = (LN(x[b,i,j])[c] + LN(x[b,j,i])[c]) / 2 (sym_ln4) from the raw
// tile (rows p and PAIRS + p) and its statistics into act (PAIRS x lds, row-major). Consecutive
// threads take consecutive float4s of a row: conflict-free reads and writes when CP % 32 == 0
// (2-way at CP = 8, 16, 24, 48, ...: a quarter-warp then spans two rows).
template <int NTHR = THREADS>
__device__ __forceinline__ void build_s(const float* raw, int raw_ld, const float* stats, const float* gam,
                                        const float* bet, float* act, int lds, int nq) {
  for (int e = threadIdx.x; e < PAIRS * nq; e += NTHR) {
    const int p = e / nq, c = 4 * (e - p * nq);
    const float ma = stats[p], mb = stats[PAIRS + p];
    const float ra = stats[2 * PAIRS + p], rb = stats[3 * PAIRS + p];
    const float4 va = *reinterpret_cast<const float4*>(raw + p * raw_ld + c);
    const float4 vb = *reinterpret_cast<const float4*>(raw + (PAIRS + p) * raw_ld + c);
    const float4 gg = *reinterpret_cast<const float4*>(gam + c);
    const float4 be = *reinterpret_cast<const float4*>(bet + c);
    *reinterpret_cast<float4*>(act + p * lds + c) = sym_ln4(va, vb, ma, ra, mb, rb, gg, be);
  }
}

// At pair_dim <= 64 M: the LayerNorm statistics and s in one sweep, the raw tile read once into
// registers (tile_stats + build_s read it three times and hand the statistics through shared
// memory). Warp w owns pairs 4w..4w+3: their 8 rows (4 tile rows, 4 mirrors) x 4 lanes. Lane bits:
// k = lane & 3 (pair 4w + k), part P = ((lane >> 4) << 1) | ((lane >> 2) & 1), half = (lane >> 3) & 1
// (0: row p, 1: its mirror 64 + p; the partner lane is lane ^ 8). Lane P holds the float4s
// q = 16 m + 4 P + u (m < M, u < 4) of its row, so a quarter-warp (4 rows x 2 parts 16 words apart)
// reads 8 distinct 4-bank groups whenever raw_ld = 4 (mod 8). Same arithmetic as tile_stats (four
// partial sums, corrected two-sweep) and build_s; s for u < 2 is built by the half-0 lane (its own values and
// the mirror's from shared memory), for u >= 2 by the half-1 lane. Needs CP <= 64 M, 512 threads.
// M = 1 where the kernel runs 2 blocks per SM (64 registers per thread), else 2.
template <int M>
__device__ __forceinline__ void stats_build_fused(const float* raw, int raw_ld, int CP, int C, float inv_c,
                                                  float eps, const float* gam, const float* bet, float* act,
                                                  int lds) {
  const int lane = threadIdx.x & 31;
  const int k = lane & 3, half = (lane >> 3) & 1, P = ((lane >> 4) << 1) | ((lane >> 2) & 1);
  const int p = (threadIdx.x >> 5) * 4 + k;
  const int nq = CP / 4;  // columns C..CP-1 are zero in raw
  const float* row = raw + (half * PAIRS + p) * raw_ld;
  float4 v[M][4];
  float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int q = 16 * m + 4 * P + u;
      v[m][u] = q < nq ? *reinterpret_cast<const float4*>(row + 4 * q) : make_float4(0.f, 0.f, 0.f, 0.f);
      s4[u] += (v[m][u].x + v[m][u].y) + (v[m][u].z + v[m][u].w);
    }
  float sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  sum += __shfl_xor_sync(0xffffffffu, sum, 4);   // the 4 parts of the row
  sum += __shfl_xor_sync(0xffffffffu, sum, 16);
  const float mean1 = sum * inv_c;
  float m4[4] = {0.f, 0.f, 0.f, 0.f}, e4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = 4 * (16 * m + 4 * P + u);       // mask the padding: (0 - mean)^2 != 0
      const float dx = c < C ? v[m][u].x - mean1 : 0.f;
      const float dy = c + 1 < C ? v[m][u].y - mean1 : 0.f;
      const float dz = c + 2 < C ? v[m][u].z - mean1 : 0.f;
      const float dw = c + 3 < C ? v[m][u].w - mean1 : 0.f;
      m4[u] += (dx * dx + dy * dy) + (dz * dz + dw * dw);
      e4[u] += (dx + dy) + (dz + dw);
    }
  float m2 = (m4[0] + m4[1]) + (m4[2] + m4[3]), d1 = (e4[0] + e4[1]) + (e4[2] + e4[3]);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 4);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 16);
  d1 += __shfl_xor_sync(0xffffffffu, d1, 4);
  d1 += __shfl_xor_sync(0xffffffffu, d1, 16);
  float mean, rstd;
  ln_stats(mean1, d1, m2, inv_c, eps, mean, rstd);
  const float mean_o = __shfl_xor_sync(0xffffffffu, mean, 8), rstd_o = __shfl_xor_sync(0xffffffffu, rstd, 8);
  const float ma = half ? mean_o : mean, ra = half ? rstd_o : rstd;  // row p
  const float mb = half ? mean : mean_o, rb = half ? rstd : rstd_o;  // row 64 + p
  const float* other = raw + ((1 - half) * PAIRS + p) * raw_ld;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int uu = 0; uu < 2; ++uu) {
      const int q = 16 * m + 4 * P + 2 * half + uu;
      if (q < nq) {
        const float4 own = half ? v[m][2 + uu] : v[m][uu];  // static indices: no local memory
        const float4 oth = *reinterpret_cast<const float4*>(other + 4 * q);
        const float4 va = half ? oth : own, vb = half ? own : oth;
        const float4 gg = *reinterpret_cast<const float4*>(gam + 4 * q);
        const float4 be = *reinterpret_cast<const float4*>(bet + 4 * q);
        *reinterpret_cast<float4*>(act + p * lds + 4 * q) = sym_ln4(va, vb, ma, ra, mb, rb, gg, be);
      }
    }
}

// The MLP of one tile on the tensor cores, all NTHR threads; act holds s (PAIRS x lds) on entry.
// The warps are 4 row blocks of 16 pairs x NG column groups of the hidden units (8 warps: NG = 2;
// 16 warps: NG = 4, or 2 at HP = 16 with the other 8 warps idle in the products; PROD: NG = 2, the
// other 8 warps copy). GEMM1 -> h1 (written over s in act, PAIRS x ldh) -> GEMM2 -> layer 3:
// z[p] = sum_g w3[g] relu(h2[p][g] + b2[g]), the column groups' partial sums left in zpart[NG][PAIRS].
// idle_gemm1(w, nw) runs instead of GEMM1 in the warps outside the column groups (w: their index
// among those nw warps; PROD: queue the next tile); after_gemm1() runs in every thread between the two
// products (queue the rest of the next tile). Returns after a barrier.
// PROD (producer warps): NG = 2 column groups; the idle warps queue the next tile's first kProdRows rows.
template <int HP, int NTHR, bool PROD = false>
struct TcLayout {
  static constexpr int NT = HP / 8;                                    // n tiles of 8 hidden units
  static constexpr int NG = PROD ? (NT < 2 ? NT : 2)                   // column groups
                                 : (NTHR / 128 < NT ? NTHR / 128 : NT);
  static constexpr int NTW = NT / NG;                                  // n tiles per warp
  static constexpr bool FAST = NTHR == 512;                            // 16 warps: 4-instruction split
};

template <int HP, WFormat WF, int NTHR, bool PROD, typename IdleGemm1, typename AfterGemm1>
__device__ __forceinline__ void mlp_tc(float* act, int lds, int CP, const void* w1f, const void* w2f,
                                       const float* __restrict__ w1, const float* __restrict__ w2, int C,
                                       int H, const float* b1s, const float* b2s, const float* w3s,
                                       float* zpart, IdleGemm1&& idle_gemm1, AfterGemm1&& after_gemm1) {
  using Lay = TcLayout<HP, NTHR, PROD>;
  constexpr int NT = Lay::NT, NG = Lay::NG, NTW = Lay::NTW;
  const int ldh = HP + 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int mt = warp & 3, cg = warp >> 2;  // row block, column group
  const bool active = cg < NG;

  // h1[p][h] = relu(sum_c s[p][c] W1[h][c] + b1[h]): rows 16 mt.., columns 8 (NTW cg + nt)..
  float acc[NTW][4];
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
  if (active)
    tc_gemm<NTW, WF, Lay::FAST>(act + 16 * mt * lds, lds, CP, w1f, NT, cg * NTW, w1, C, H, acc);
  else
    idle_gemm1(warp - 4 * NG, NTHR / 32 - 4 * NG);
  after_gemm1();
  __syncthreads();  // every warp is done reading s before h1 overwrites it
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int h = (cg * NTW + nt) * 8 + 2 * t4;
      const float bb0 = b1s[h], bb1 = b1s[h + 1];
      float* r0 = act + (16 * mt + g) * ldh + h;
      *reinterpret_cast<float2*>(r0) = make_float2(relu(acc[nt][0] + bb0), relu(acc[nt][1] + bb1));
      *reinterpret_cast<float2*>(r0 + 8 * ldh) =
          make_float2(relu(acc[nt][2] + bb0), relu(acc[nt][3] + bb1));
    }
  }
  __syncthreads();  // h1 complete (padded units: relu(0 + 0) = 0)

  // h2[p][g] = relu(sum_h h1[p][h] W2[g][h] + b2[g]); z[p] = sum_g w3[g] h2[p][g]
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
    tc_gemm<NTW, WF, Lay::FAST>(act + 16 * mt * ldh, ldh, HP, w2f, NT, cg * NTW, w2, H, H, acc);
    float z0 = 0.f, z1 = 0.f;  // rows g and g + 8 of this warp's row block
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int h = (cg * NTW + nt) * 8 + 2 * t4;
      z0 = fmaf(w3s[h], relu(acc[nt][0] + b2s[h]), z0);
      z0 = fmaf(w3s[h + 1], relu(acc[nt][1] + b2s[h + 1]), z0);
      z1 = fmaf(w3s[h], relu(acc[nt][2] + b2s[h]), z1);
      z1 = fmaf(w3s[h + 1], relu(acc[nt][3] + b2s[h + 1]), z1);
    }
    z0 += __shfl_xor_sync(0xffffffffu, z0, 1);  // sum over the quad (t4 = 0..3)
    z0 += __shfl_xor_sync(0xffffffffu, z0, 2);
    z1 += __shfl_xor_sync(0xffffffffu, z1, 1);
    z1 += __shfl_xor_sync(0xffffffffu, z1, 2);
    if (t4 == 0) {
      zpart[cg * PAIRS + 16 * mt + g] = z0;
      zpart[cg * PAIRS + 16 * mt + g + 8] = z1;
    }
  }
  __syncthreads();  // every column group's partial sums are in zpart
}

// out[b,i,j] = out[b,j,i] = sigmoid(z + b3) for the tile's valid pairs (threads 0..63); z is the sum
// of the NG column groups' partial sums.
template <int NG>
__device__ __forceinline__ void write_tile(float* __restrict__ out, const float* zpart, float bias3, int b,
                                           int I, int J, int N) {
  const int p = threadIdx.x;
  if (p < PAIRS) {
    const int i = I * TILE + (p >> 3), j = J * TILE + (p & 7);
    if (i < N && j < N) {
      float z = zpart[p] + zpart[PAIRS + p];
      if constexpr (NG == 4) z += zpart[2 * PAIRS + p] + zpart[3 * PAIRS + p];
      const float o = 1.f / (1.f + expf(-(z + bias3)));
      out[(static_cast<long long>(b) * N + i) * N + j] = o;
      out[(static_cast<long long>(b) * N + j) * N + i] = o;
    }
  }
}

// Shared-memory layout of the tensor-core kernel, in floats (every term a multiple of 4).
struct SmemTC {
  int raw, act, w1f, w2f, vec, stats, zpart, total;
  __host__ __device__ SmemTC(int CP, int HP, WFormat wf) {
    const int wmul = wf == WFormat::kSplit ? 2 : 0;  // hi and lo
    raw = 2 * PAIRS * (CP + 4);                   // x tile and its mirror, rows padded by 4 floats
    act = PAIRS * ((CP > HP ? CP : HP) + 4);      // s (64 x CP), later h1 (64 x HP), row-major
    w1f = wmul * CP * HP;                         // W1^T as B fragments
    w2f = wmul * HP * HP;                         // W2^T likewise
    vec = 2 * CP + 3 * HP;                        // gamma, beta, b1, b2, w3 (zero-padded)
    stats = 4 * PAIRS;                            // mean, rstd of the 128 vectors
    zpart = 4 * PAIRS;                            // layer-3 partial sums of up to 4 column groups
    total = raw + act + w1f + w2f + vec + stats + zpart;
  }
};

// Persistent; one block of NTHR threads (512: 16 warps; 256: 8 warps, at HP = 256 with the weights
// from global memory) per resident slot walks tiles (b, I <= J) with a stride of gridDim.x. Per tile:
// statistics and s (fused at small pair_dim), the two products on the tensor cores in split TF32
// (mlp_tc), layer 3, both outputs. Weights staged once per block as split fragments (WF = kSplit) or read
// through L1 (kGlobal). One raw buffer: the next tile's copies are queued once s is built (rows
// 0..63 before GEMM1, the mirror half after it; PROD: rows 0..kProdRows-1 by the warps idle in GEMM1,
// the rest after it) and overlap the products.
// MINB: the blocks per SM the registers are budgeted for (__launch_bounds__): 2 at HP <= 32 and 512
// threads when two blocks' shared memory fits on an SM (64 registers per thread), else 1; the
// launcher picks 1 at HP <= 32 when only one block fits anyway (batch: pair_dim 128, 146 KB), which
// lets the fused statistics sweep (FM = 2) and the producer warps (PROD) run there.
// Assumptions: C = pair_dim <= 256, CP = round_up(C, 8); H = hidden_dim <= HP (HP in 16..256, a
// power of two); vec => C % 4 == 0 and x 16-byte aligned. Shared memory: SmemTC(CP, HP, WF).total.
template <int HP, int NTHR>
constexpr int kMinBlocksTC = (NTHR == 256 && HP <= 64) || (NTHR == 512 && HP <= 32) ? 2 : 1;

// PROD: the rows of the next tile that the producer warps queue during GEMM1 (64 measured best of
// 48 / 64 / 80 / 96 at batch on the H200: NOTES.md).
constexpr int kProdRows = 64;

template <int HP, WFormat WF, int NTHR, int MINB = kMinBlocksTC<HP, NTHR>, bool PROD = false>
__global__ void __launch_bounds__(NTHR, MINB)
contact_map_mma_kernel(const float* __restrict__ x,       // (B, N, N, C)
                       float* __restrict__ out,           // (B, N, N)
                      const float* __restrict__ ln_w,    // (C)
                      const float* __restrict__ ln_b,    // (C)
                      const float* __restrict__ w1,      // (H, C)
                      const float* __restrict__ b1,      // (H)
                      const float* __restrict__ w2,      // (H, H)
                      const float* __restrict__ b2,      // (H)
                      const float* __restrict__ w3,      // (1, H)
                      const float* __restrict__ b3,      // (1)
                      float eps, int B, int N, int C, int H, int CP, bool vec) {
  extern __shared__ __align__(16) float smem[];
  const SmemTC L(CP, HP, WF);
  const int raw_ld = CP + 4, lds = CP + 4;
  float* raw = smem;                                        // 2*PAIRS x raw_ld
  float* act = raw + L.raw;                                 // s: PAIRS x lds; h1: PAIRS x (HP + 4)
  float* w1f = act + L.act;                                 // (CP/8) x (HP/8) x 32 fragments
  float* w2f = w1f + L.w1f;                                 // (HP/8) x (HP/8) x 32
  float* gam = w2f + L.w2f;                                 // gamma, beta (CP), b1, b2, w3 (HP)
  float* stats = gam + L.vec;                               // mean[128], rstd[128]
  float* zpart = stats + L.stats;                           // [NG][64]

  const int tid = threadIdx.x;
  const int nT = cdiv(N, TILE);
  const long long tiles_per_b = static_cast<long long>(nT) * (nT + 1) / 2;
  const long long total = static_cast<long long>(B) * tiles_per_b;

  // Columns C..CP-1 of the raw rows are read (padding) but never copied into: zero them once. The
  // copies write columns < C only, so no barrier is needed between the two.
  const int pad = CP - C;
  for (int e = tid; e < 2 * PAIRS * pad; e += NTHR) raw[(e / pad) * raw_ld + C + e % pad] = 0.f;

  long long t = blockIdx.x;
  int b = 0, I = 0, J = 0;  // the tile being processed, decoded once (when its copies are queued)
  if (t < total) {
    decode_tile(t, tiles_per_b, b, I, J);
    load_rows(x, raw, raw_ld, b, I, J, N, C, vec, 0, 2 * PAIRS, threadIdx.x >> 5, NTHR / 32);
  }
  cp_async_commit();

  stage_vectors<NTHR>(ln_w, ln_b, b1, b2, w3, C, H, CP, HP, gam);  // asynchronous, like the tile
  if constexpr (WF == WFormat::kSplit) {  // overlaps the first tile's copies
    stage_weight_fragments<HP, NTHR>(w1, w2, C, H, CP, w1f);  // w2f = w1f + L.w1f follows
  }
  const float bias3 = __ldg(b3);
  const float inv_c = 1.f / static_cast<float>(C);

  for (; t < total; t += gridDim.x) {
    cp_async_wait_all();
    __syncthreads();  // this tile's copies (all threads') and the parameters are in shared memory
    // Statistics and s fused at pair_dim <= 64 FM with 16 warps (with the weights from global memory
    // only at HP = 128). FM = 2 needs more than 64 registers (it spilled 12 bytes there).
    constexpr int FM = MINB == 2 ? 1 : 2;
    bool fused = false;
    if constexpr (NTHR == 512 && (WF == WFormat::kSplit || HP == 128)) fused = CP <= 64 * FM;
    if (fused) {
      stats_build_fused<FM>(raw, raw_ld, CP, C, inv_c, eps, gam, gam + CP, act, lds);
    } else {
      tile_stats<NTHR>(raw, raw_ld, cdiv(C, 4), C, inv_c, eps, stats);
      __syncthreads();  // statistics visible to all threads
      build_s<NTHR>(raw, raw_ld, stats, gam, gam + CP, act, lds, CP / 4);
    }
    __syncthreads();  // s complete; the raw buffers are free for the next tile

    // The next tile's copies: by every thread in two halves, rows 0..63 now, the mirror rows after
    // GEMM1 (issued at once they took 3000-5000 cycles per tile at crop and batch; in halves the loop
    // is 3-5% faster). Issuing costs a warp ~340 cycles per 16-byte copy per thread whatever the other
    // warps do (NOTES.md), so PROD gives rows 0..kProdRows-1 to the 8 warps idle in GEMM1 (about
    // GEMM1's length at batch) and the rest to all 16 warps after it.
    const bool more = t + gridDim.x < total;
    int nb = 0, nI = 0, nJ = 0;
    if (more) decode_tile(t + gridDim.x, tiles_per_b, nb, nI, nJ);
    constexpr int row_split = PROD ? kProdRows : PAIRS;  // rows queued before / during GEMM1
    if (!PROD && more) load_rows(x, raw, raw_ld, nb, nI, nJ, N, C, vec, 0, PAIRS, threadIdx.x >> 5, NTHR / 32);
    mlp_tc<HP, WF, NTHR, PROD>(
        act, lds, CP, w1f, w2f, w1, w2, C, H, gam + 2 * CP, gam + 2 * CP + HP, gam + 2 * CP + 2 * HP, zpart,
        [&](int w, int nw) {
          if (PROD && more) load_rows(x, raw, raw_ld, nb, nI, nJ, N, C, vec, 0, row_split, w, nw);
        },
        [&] {
          if (more)
            load_rows(x, raw, raw_ld, nb, nI, nJ, N, C, vec, row_split, 2 * PAIRS, threadIdx.x >> 5, NTHR / 32);
          cp_async_commit();
        });
    // The next iteration's barriers order these reads of zpart before it is written again.
    write_tile<TcLayout<HP, NTHR, PROD>::NG>(out, zpart, bias3, b, I, J, N);
    b = nb; I = nI; J = nJ;
  }
  cp_async_wait_all();  // no copy may be left in flight when the block exits
}
}  // namespace contact_map
