// contact_map: the fma kernel (plain fp32 FMA products), the independent check of the tensor-core kernels.
#pragma once
#include "common.cuh"

namespace contact_map {

// =============================================================================================
// The fma kernel: plain fp32 FMA products, no tensor cores (the check on the other two)
// =============================================================================================
// Hidden unit owned by register r of the thread at hidden-group hg (0..15), RH = HP / 16 units per
// thread. For RH >= 4 the units come in float4 groups interleaved across the 16 threads, so a
// warp's 16-byte weight loads cover one contiguous 256-byte run (no bank conflicts).
template <int RH>
__device__ __forceinline__ int hidden_of(int r, int hg) {
  if constexpr (RH >= 4) return ((r >> 2) * TH_H + hg) * 4 + (r & 3);
  else return hg * RH + r;
}

// w[r] = W^T[k][hidden_of(r, hg)] from a shared-memory matrix row `row` (HP floats, zero-padded).
template <int RH>
__device__ __forceinline__ void load_w_smem(const float* row, int hg, float (&w)[RH]) {
  if constexpr (RH >= 4) {
#pragma unroll
    for (int q = 0; q < RH / 4; ++q) {
      const float4 v = *reinterpret_cast<const float4*>(row + (q * TH_H + hg) * 4);
      w[4 * q + 0] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
    }
  } else if constexpr (RH == 2) {
    const float2 v = *reinterpret_cast<const float2*>(row + hg * 2);
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = row[hg];
  }
}

// Same values from the unpadded row-major global weight W (n_out x n_in): W^T[k][h] = W[h][k],
// zero outside (k < n_in, h < n_out). The fallback when the weights do not fit in shared memory.
template <int RH>
__device__ __forceinline__ void load_w_global(const float* __restrict__ W, int n_in, int n_out, int k,
                                              int hg, float (&w)[RH]) {
#pragma unroll
  for (int r = 0; r < RH; ++r) {
    const int h = hidden_of<RH>(r, hg);
    w[r] = (h < n_out && k < n_in) ? __ldg(W + static_cast<long long>(h) * n_in + k) : 0.f;
  }
}

// acc[m][r] += sum_{k < K} A[k][4*pg + m] * W^T[k][hidden_of(r, hg)]
// A: shared, K x LDP (pair-minor). W^T: shared K x HP when W_SMEM, else the global W (n_out x n_in).
template <int RH, bool W_SMEM>
__device__ __forceinline__ void mlp_gemm(const float* A, int K, const float* WT, int HP,
                                         const float* __restrict__ Wg, int n_in, int n_out, int pg,
                                         int hg, float (&acc)[RM][RH]) {
#pragma unroll 4
  for (int k = 0; k < K; ++k) {
    const float4 a = *reinterpret_cast<const float4*>(A + k * LDP + pg * RM);
    float w[RH];
    if constexpr (W_SMEM) load_w_smem<RH>(WT + k * HP, hg, w);
    else load_w_global<RH>(Wg, n_in, n_out, k, hg, w);
#pragma unroll
    for (int r = 0; r < RH; ++r) {
      acc[0][r] = fmaf(a.x, w[r], acc[0][r]);
      acc[1][r] = fmaf(a.y, w[r], acc[1][r]);
      acc[2][r] = fmaf(a.z, w[r], acc[2][r]);
      acc[3][r] = fmaf(a.w, w[r], acc[3][r]);
    }
  }
}

// Queue the copies of tile (b, I, J) into shared memory:
//   raw[p]         = x[b, 8I+ti, 8J+tj, :]   (p = 8 ti + tj, rows 0..63)
//   raw[PAIRS + p] = x[b, 8J+tj, 8I+ti, :]   (the mirror, rows 64..127)
// Rows whose i or j is past N are zero-filled. Each row of x is C contiguous floats, so consecutive
// threads' copies are consecutive chunks of a row: coalesced. A flat walk over (row, chunk) indices.
__device__ __forceinline__ void load_tile_flat(const float* __restrict__ x, float* raw, int raw_ld, int b, int I,
                                               int J, int N, int C, bool vec) {
  const int per_row = vec ? C / 4 : C;
  for (int e = threadIdx.x; e < 2 * PAIRS * per_row; e += THREADS) {
    const int q = e % per_row, rr = e / per_row;
    const int p = rr % PAIRS, mirror = rr / PAIRS;
    const int i = I * TILE + (p >> 3), j = J * TILE + (p & 7);
    const bool valid = i < N && j < N;
    const long long row = mirror ? (static_cast<long long>(b) * N + j) * N + i
                                 : (static_cast<long long>(b) * N + i) * N + j;
    if (vec) cp_async16(raw + rr * raw_ld + 4 * q, valid ? x + row * C + 4 * q : x, valid);
    else cp_async4(raw + rr * raw_ld + q, valid ? x + row * C + q : x, valid);
  }
}

// Shared-memory layout of the fma kernel, in floats (every term a multiple of 4: 16-byte aligned).
struct Smem {
  int raw, st, w1t, w2t, vec, stats, total;
  __host__ __device__ Smem(int CP, int HP, bool w_smem) {
    raw = 2 * PAIRS * (CP + 4);                   // x tile and its mirror, rows padded by 4 floats
    st = (CP > HP ? CP : HP) * LDP;               // s^T (CP x 64), later h1^T (HP x 64)
    w1t = w_smem ? CP * HP : 0;                   // W1^T zero-padded
    w2t = w_smem ? HP * HP : 0;                   // W2^T zero-padded
    vec = 2 * CP + 3 * HP;                        // gamma, beta, b1, b2, w3 (zero-padded)
    stats = 4 * PAIRS;                            // mean, rstd of the 128 vectors
    total = raw + st + w1t + w2t + vec + stats;
  }
};

// Persistent; one 256-thread block per resident slot walks tiles (b, I <= J) with a stride of
// gridDim.x. Per tile: stats -> s^T -> prefetch next tile -> GEMM1 -> h1^T -> GEMM2 -> layer 3.
// Assumptions: C = pair_dim <= 256, CP = round_up(C, 4); H = hidden_dim <= HP (padded hidden);
// vec => C % 4 == 0 and x 16-byte aligned. Shared memory: Smem(CP, HP, W_SMEM).total floats.
template <int HP, bool W_SMEM>
__global__ void __launch_bounds__(THREADS, 1)
contact_map_fma_kernel(const float* __restrict__ x,       // (B, N, N, C)
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
  constexpr int RH = HP / TH_H;
  extern __shared__ __align__(16) float smem[];
  const Smem L(CP, HP, W_SMEM);
  const int raw_ld = CP + 4;
  float* raw = smem;                      // 2*PAIRS x raw_ld
  float* st = raw + L.raw;                // max(CP, HP) x LDP
  float* w1t = st + L.st;                 // CP x HP
  float* w2t = w1t + L.w1t;               // HP x HP
  float* gam = w2t + L.w2t;               // CP
  float* bet = gam + CP;                  // CP
  float* b1s = bet + CP;                  // HP
  float* b2s = b1s + HP;                  // HP
  float* w3s = b2s + HP;                  // HP
  float* stats = w3s + HP;                // mean[128], rstd[128]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hg = tid & (TH_H - 1), pg = tid / TH_H;  // GEMM layout: a warp holds 2 pair groups
  const int nT = cdiv(N, TILE);
  const long long tiles_per_b = static_cast<long long>(nT) * (nT + 1) / 2;
  const long long total = static_cast<long long>(B) * tiles_per_b;

  // Zero the raw rows once: their padding columns (c >= C) are never copied into and must stay 0.
  for (int e = tid; e < L.raw; e += THREADS) raw[e] = 0.f;
  __syncthreads();  // the zeros must land before any cp.async writes the same rows

  long long t = blockIdx.x;
  if (t < total) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    load_tile_flat(x, raw, raw_ld, b, I, J, N, C, vec);
  }
  cp_async_commit();

  // Parameters, zero-padded, once per block (overlaps the first tile's copies): W^T walked in
  // shared-memory order (the global reads are strided by C: simple, not fast).
  if constexpr (W_SMEM) {
    for (int e = tid; e < CP * HP; e += THREADS) {
      const int k = e / HP, h = e % HP;
      w1t[e] = (k < C && h < H) ? __ldg(w1 + static_cast<long long>(h) * C + k) : 0.f;
    }
    for (int e = tid; e < HP * HP; e += THREADS) {
      const int k = e / HP, h = e % HP;
      w2t[e] = (k < H && h < H) ? __ldg(w2 + static_cast<long long>(h) * H + k) : 0.f;
    }
  }
  stage_vectors(ln_w, ln_b, b1, b2, w3, C, H, CP, HP, gam);  // gam | bet | b1s | b2s | w3s
  const float bias3 = __ldg(b3);
  const float inv_c = 1.f / static_cast<float>(C);

  for (; t < total; t += gridDim.x) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    cp_async_wait_all();
    __syncthreads();  // this tile's copies (all threads') and the parameters are in shared memory

    // LayerNorm statistics of the 128 vectors (ln_stats' corrected two-sweep over shared memory), one
    // warp per vector: 16 vectors per warp in sequence, each ending in 5-step shuffle reductions.
    for (int r = warp; r < 2 * PAIRS; r += THREADS / 32) {
      const float* row = raw + r * raw_ld;
      float s = 0.f;
      for (int c = lane; c < C; c += 32) s += row[c];
      const float mean = warp_sum(s) * inv_c;
      float v = 0.f, e = 0.f;
      for (int c = lane; c < C; c += 32) {
        const float d = row[c] - mean;
        v = fmaf(d, d, v);
        e += d;
      }
      const float d2 = warp_sum(v), d1 = warp_sum(e);
      if (lane == 0) {
        float mc, rs;
        ln_stats(mean, d1, d2, inv_c, eps, mc, rs);
        stats[r] = mc;
        stats[2 * PAIRS + r] = rs;
      }
    }
    __syncthreads();  // statistics visible to all threads

    // s^T[c][p] = (LN(x[b,i,j])[c] + LN(x[b,j,i])[c]) / 2; thread: pair p = tid % 64, c in float4
    // steps of 4. Reads 16 B per row (conflict-free: row stride = 4 mod 32 words), writes one
    // column of s^T (consecutive p across the warp: conflict-free).
    {
      const int p = tid & (PAIRS - 1);
      const float ma = stats[p], mb = stats[PAIRS + p];
      const float ra = stats[2 * PAIRS + p], rb = stats[3 * PAIRS + p];
      const float* ra_row = raw + p * raw_ld;
      const float* rb_row = raw + (PAIRS + p) * raw_ld;
      for (int c4 = tid / PAIRS; c4 < CP / 4; c4 += THREADS / PAIRS) {
        const float4 va = *reinterpret_cast<const float4*>(ra_row + 4 * c4);
        const float4 vb = *reinterpret_cast<const float4*>(rb_row + 4 * c4);
        const float4 g = *reinterpret_cast<const float4*>(gam + 4 * c4);
        const float4 be = *reinterpret_cast<const float4*>(bet + 4 * c4);
        float* col = st + 4 * c4 * LDP + p;
        const float4 o = sym_ln4(va, vb, ma, ra, mb, rb, g, be);
        col[0 * LDP] = o.x;
        col[1 * LDP] = o.y;
        col[2 * LDP] = o.z;
        col[3 * LDP] = o.w;
      }
    }
    __syncthreads();  // s^T complete; the raw buffers are free for the next tile

    if (t + gridDim.x < total) {
      int nb, nI, nJ;
      decode_tile(t + gridDim.x, tiles_per_b, nb, nI, nJ);
      load_tile_flat(x, raw, raw_ld, nb, nI, nJ, N, C, vec);
    }
    cp_async_commit();

    // h1[p][h] = relu(sum_c s[p][c] W1[h][c] + b1[h])
    float acc[RM][RH];
#pragma unroll
    for (int m = 0; m < RM; ++m)
#pragma unroll
      for (int r = 0; r < RH; ++r) acc[m][r] = 0.f;
    mlp_gemm<RH, W_SMEM>(st, CP, w1t, HP, w1, C, H, pg, hg, acc);
    __syncthreads();  // every thread is done reading s^T before h1^T overwrites it
#pragma unroll
    for (int r = 0; r < RH; ++r) {
      const int h = hidden_of<RH>(r, hg);
      const float bb = b1s[h];
      float4 v;
      v.x = relu(acc[0][r] + bb);
      v.y = relu(acc[1][r] + bb);
      v.z = relu(acc[2][r] + bb);
      v.w = relu(acc[3][r] + bb);
      *reinterpret_cast<float4*>(st + h * LDP + pg * RM) = v;  // padded units: relu(0 + 0) = 0
    }
    __syncthreads();  // h1^T complete

    // h2[p][g] = relu(sum_h h1[p][h] W2[g][h] + b2[g]); z[p] = sum_g w3[g] h2[p][g]
#pragma unroll
    for (int m = 0; m < RM; ++m)
#pragma unroll
      for (int r = 0; r < RH; ++r) acc[m][r] = 0.f;
    mlp_gemm<RH, W_SMEM>(st, HP, w2t, HP, w2, H, H, pg, hg, acc);
    float z[RM];
#pragma unroll
    for (int m = 0; m < RM; ++m) {
      z[m] = 0.f;
#pragma unroll
      for (int r = 0; r < RH; ++r) {
        const int h = hidden_of<RH>(r, hg);
        z[m] = fmaf(w3s[h], relu(acc[m][r] + b2s[h]), z[m]);
      }
      // sum over the 16 hidden groups: lanes hg = 0..15 of this half-warp
#pragma unroll
      for (int o = TH_H / 2; o > 0; o >>= 1) z[m] += __shfl_xor_sync(0xffffffffu, z[m], o);
    }
    // out[b,i,j] = out[b,j,i] = sigmoid(z + b3). The next iteration's first barrier orders this
    // tile's reads of h1^T before the next s^T is written.
    if (hg == 0) {
#pragma unroll
      for (int m = 0; m < RM; ++m) {
        const int p = pg * RM + m;
        const int i = I * TILE + (p >> 3), j = J * TILE + (p & 7);
        if (i < N && j < N) {
          const float o = 1.f / (1.f + expf(-(z[m] + bias3)));
          out[(static_cast<long long>(b) * N + i) * N + j] = o;
          out[(static_cast<long long>(b) * N + j) * N + i] = o;
        }
      }
    }
  }
  cp_async_wait_all();  // no copy may be left in flight when the block exits
}

}  // namespace contact_map
