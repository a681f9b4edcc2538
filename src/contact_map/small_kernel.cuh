// contact_map: the small kernel (sm_80+): one block of 8 or 16 warps per 8 x 8 tile, the parameters read as they
// are, both products on mma.sync, in one launch.
#pragma once
#include "mma_kernel.cuh"

namespace contact_map {

// =============================================================================================
// The small kernel (pair_dim <= 64, hidden_dim <= 32): for inputs of a few tiles per SM
// =============================================================================================
// The wgmma kernel's path at KernelBench's shape (4 x 36 tiles of 8 x 8 for 132 SMs, one tile per consumer
// warpgroup) is its params kernel, then its main kernel's prologue and one tile: two launches, a dependent wait and
// a copy of the packed weights before the first product. Here every block owns one tile (b, I, J) = (blockIdx.z,
// blockIdx.x, blockIdx.y), I <= J (blocks with I > J return at once), and does everything itself: x[b,i,j,:] and
// x[b,j,i,:] of its 64 positions, LayerNorm's affine, W1, b1, W2, b2, w3, b3 go straight from global memory into
// registers, all loads issued at once; the products run on mma.sync with fp32 accumulation (fp32: split TF32, hi
// hi + hi lo + lo hi; fp16 / bf16: m16n8k16 in T). With one tile per SM the time is one block's chain of dependent
// instructions, so the block's work is split over 128 NK threads, NK = kSmallGroups (2: 8 warps; 4: 16):
//
// Warp w owns the 16 positions (il, jl) = (2 p + r, g), p = w % 4, r = 0 / 1 the fragment rows g / g + 8 (g = lane
// / 4), as an m16 fragment, and the channel group h = w / 4: channels [64 h / NK, 64 (h + 1) / NK), CH = 16 / NK per
// lane t = lane % 4 (c0 = 64 h / NK + CH t) of both rows and both sides. Warps p, p + 4, ... combine through shared
// memory: the LayerNorm sums (a quad's two shuffles, then the groups), GEMM1's partial products (each warp then has
// all of h1 for its rows), and layer 3's partial sums; group h does GEMM2's n-tiles 4 h / NK .. Every warp adds the
// groups in one order, so partners hold the same values. The channel order inside the products is permuted so
// that a lane's channels are exactly its A and B fragment columns (a sum over channels does not depend on their
// order): fp32 k step kk (m16n8k8) reads columns t, t + 4 as channels c0 + 2 kk, + 1; 16-bit k step kk (m16n8k16)
// reads columns 2 t, 2 t + 1, 2 t + 8, 2 t + 9 as channels c0 + 4 kk + 0..3. W1 rows are read in the same order by
// the same lanes. GEMM1's accumulator fragment is GEMM2's A fragment (the hidden order permuted the same way for
// fp32; for 16-bit two n-tiles form one k step, as FlashAttention-2's P V).
//
// Each unordered pair is computed once: an off-diagonal tile writes out[b,i,j] and out[b,j,i] from one value, a
// diagonal tile only its positions il <= jl (both outputs), so the output is exactly symmetric.
constexpr int SMALL_KC = 64;        // channels, in NK groups of 64 / NK (8 or 4 per lane of a quad)
constexpr int SMALL_HP = 32;        // hidden units: 4 n-tiles of 8
constexpr int SMALL_NT = SMALL_HP / 8;

// Element type T's loads (fp32 by float4, 16-bit by 8- or 16-byte words), and a 16-bit value's bits.
template <typename T>
struct SmallElem {
  // the CH (4 or 8) channels [c0, c0 + CH) of the row at p as CH / 2 words of two elements each; zeros past C (C %
  // 8 == 0 and c0 % CH == 0: a vector is all in or all out) and where !ok
  template <int CH>
  static __device__ __forceinline__ void load_words(const T* __restrict__ p, int c0, int C, bool ok,
                                                    uint32_t (&w)[CH / 2]) {
    if constexpr (CH == 8) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (ok && c0 < C) u = *reinterpret_cast<const uint4*>(p + c0);
      w[0] = u.x;
      w[1] = u.y;
      w[2] = u.z;
      w[3] = u.w;
    } else {
      uint2 u = make_uint2(0u, 0u);
      if (ok && c0 < C) u = *reinterpret_cast<const uint2*>(p + c0);
      w[0] = u.x;
      w[1] = u.y;
    }
  }
  // the same channels as fp32
  template <int CH>
  static __device__ __forceinline__ void load(const T* __restrict__ p, int c0, int C, bool ok, float (&v)[CH]) {
    uint32_t w[CH / 2];
    load_words<CH>(p, c0, C, ok, w);
#pragma unroll
    for (int k = 0; k < CH / 2; ++k) {
      const float2 f = unpack2<T>(w[k]);
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  }
  static __device__ __forceinline__ uint32_t bits(T v) { return *reinterpret_cast<const unsigned short*>(&v); }
};

template <>
struct SmallElem<float> {
  template <int CH>
  static __device__ __forceinline__ void load(const float* __restrict__ p, int c0, int C, bool ok, float (&v)[CH]) {
#pragma unroll
    for (int q = 0; q < CH / 4; ++q) {
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
      if (ok && c0 + 4 * q < C) f = *reinterpret_cast<const float4*>(p + c0 + 4 * q);
      v[4 * q] = f.x;
      v[4 * q + 1] = f.y;
      v[4 * q + 2] = f.z;
      v[4 * q + 3] = f.w;
    }
  }
};

// D = A B + D, m16n8k16, A and B fp16 or bf16 (T), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16bit(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Sum over the four lanes of a quad (lanes 4 g .. 4 g + 3).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Shared memory of one block: the channel groups' partial sums, exchanged between warps p, p + 4, ...
template <int NK>
struct SmallSmem {
  float stat[2][NK][4][2][2][8];       // [sweep][group][p][r][side][g]: sum x (sweep 0), sum d (sweep 1)
  float dev2[NK][4][2][2][8];          // [group][p][r][side][g]: sum d^2
  float acc[NK][4][SMALL_NT * 4][32];  // [group][p][n-tile, element][lane]: GEMM1's partial products
  float z[NK][4][2][8];                // [group][p][r][g]: layer 3's partial sums
};

// out (B, N, N) = sigmoid(w3 . relu(W2 relu(W1 s + b1) + b2) + b3), s = (LN(x[b,i,j]) + LN(x[b,j,i])) / 2; x
// (B, N, N, C) contiguous, 8 <= C <= 64 with C % 8 == 0, H <= 32, every pointer 16-byte aligned where read in
// vectors (x, ln_w, ln_b, w1); grid (nT, nT, B) of 128 NK threads: NK channel groups (2 or 4) of 64 / NK channels.
template <typename T, int NK>
__global__ void __launch_bounds__(128 * NK)
    contact_map_small_kernel(const T* __restrict__ x, const T* __restrict__ ln_w, const T* __restrict__ ln_b,
                             const T* __restrict__ w1, const T* __restrict__ b1, const T* __restrict__ w2,
                             const T* __restrict__ b2, const T* __restrict__ w3, const T* __restrict__ b3,
                             T* __restrict__ out, float eps, int N, int C, int H) {
  static_assert(NK == 2 || NK == 4, "channel groups of 32 or 16");
  using E = SmallElem<T>;
  constexpr bool kF32 = std::is_same<T, float>::value;
  constexpr int CH = SMALL_KC / NK / 4;  // channels per lane: 8 or 4
  constexpr int NT2 = SMALL_NT / NK;     // GEMM2 n-tiles per warp: 2 or 1
  constexpr int OUTS = 4 / NK;           // outputs per (p, g) written by each group's quad: 2 or 1
  const int I = blockIdx.x, J = blockIdx.y, b = blockIdx.z;
  if (I > J) return;  // the lower triangle's blocks: each unordered tile once
  __shared__ SmallSmem<NK> sm;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, p = warp & 3, h = warp >> 2, g = lane >> 2,
            t = lane & 3, c0 = (SMALL_KC / NK) * h + CH * t;
  const int j = TILE * J + g;

  // ---- every load at once: both sides of both rows, the parameters this lane's fragments use ----
  float xa[2][CH], xb[2][CH];  // x[b,i,j,c0..], x[b,j,i,c0..] for rows r = 0, 1 (i = 8 I + 2 p + r)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = TILE * I + 2 * p + r;
    const bool ok = i < N && j < N;
    const long long ij = ((static_cast<long long>(b) * N + i) * N + j) * C;
    const long long ji = ((static_cast<long long>(b) * N + j) * N + i) * C;
    E::template load<CH>(x + (ok ? ij : 0), c0, C, ok, xa[r]);
    E::template load<CH>(x + (ok ? ji : 0), c0, C, ok, xb[r]);
  }
  float gam[CH], bet[CH];
  E::template load<CH>(ln_w, c0, C, true, gam);
  E::template load<CH>(ln_b, c0, C, true, bet);
  // b1 at the lane's accumulator columns 8 nt + 2 t, + 1 of every n-tile; b2, w3 at those of this warp's GEMM2
  // n-tiles NT2 h + q
  float bias1[SMALL_NT][2], bias2[NT2][2], wout[NT2][2];
#pragma unroll
  for (int nt = 0; nt < SMALL_NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * nt + 2 * t + e;
      bias1[nt][e] = col < H ? to_f32<T>(b1[col]) : 0.f;
    }
#pragma unroll
  for (int q = 0; q < NT2; ++q)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * (NT2 * h + q) + 2 * t + e;
      bias2[q][e] = col < H ? to_f32<T>(b2[col]) : 0.f;
      wout[q][e] = col < H ? to_f32<T>(w3[col]) : 0.f;
    }

  // ---- LayerNorm statistics of the four rows (corrected two-sweep, ln_stats) over all groups, then s ----
  const float inv_c = 1.f / static_cast<float>(C);
  const bool valid = c0 < C;  // the lane's channels are all in or all out
  float m[2][2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int side = 0; side < 2; ++side) {
      const float(&v)[CH] = side ? xb[r] : xa[r];
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < CH; ++k) sum += v[k];
      sum = quad_sum(sum);
      if (t == 0) sm.stat[0][h][p][r][side][g] = sum;
    }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int side = 0; side < 2; ++side) {
      float tot = sm.stat[0][0][p][r][side][g];
#pragma unroll
      for (int q = 1; q < NK; ++q) tot += sm.stat[0][q][p][r][side][g];
      m[r][side] = tot * inv_c;
      const float(&v)[CH] = side ? xb[r] : xa[r];
      float d1 = 0.f, d2 = 0.f;
#pragma unroll
      for (int k = 0; k < CH; ++k) {
        const float d = valid ? v[k] - m[r][side] : 0.f;  // channels past C are not the row's
        d1 += d;
        d2 = fmaf(d, d, d2);
      }
      d1 = quad_sum(d1);
      d2 = quad_sum(d2);
      if (t == 0) {
        sm.stat[1][h][p][r][side][g] = d1;
        sm.dev2[h][p][r][side][g] = d2;
      }
    }
  __syncthreads();
  float s[2][CH];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mean[2], rstd[2];
#pragma unroll
    for (int side = 0; side < 2; ++side) {
      float d1 = sm.stat[1][0][p][r][side][g], d2 = sm.dev2[0][p][r][side][g];
#pragma unroll
      for (int q = 1; q < NK; ++q) {
        d1 += sm.stat[1][q][p][r][side][g];
        d2 += sm.dev2[q][p][r][side][g];
      }
      ln_stats(m[r][side], d1, d2, inv_c, eps, mean[side], rstd[side]);
    }
#pragma unroll
    for (int k = 0; k < CH; ++k)  // gamma, beta are 0 past C: s = 0 there
      s[r][k] = fmaf(gam[k], 0.5f * ((xa[r][k] - mean[0]) * rstd[0] + (xb[r][k] - mean[1]) * rstd[1]), bet[k]);
  }

  // ---- GEMM1 over this group's channels: acc[nt] = s W1^T (rows g, g + 8; columns 8 nt + 2 t, + 1) ----
  float acc[SMALL_NT][4];
#pragma unroll
  for (int nt = 0; nt < SMALL_NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
  if constexpr (kF32) {
    float w1r[SMALL_NT][CH];
#pragma unroll
    for (int nt = 0; nt < SMALL_NT; ++nt)
      E::template load<CH>(w1 + (8 * nt + g < H ? (8 * nt + g) * C : 0), c0, C, 8 * nt + g < H, w1r[nt]);
    float accx[SMALL_NT][4];  // the cross terms hi lo + lo hi
#pragma unroll
    for (int nt = 0; nt < SMALL_NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) accx[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < CH / 2; ++kk) {
      uint32_t ah[4], al[4];
      split_tf32_fast(s[0][2 * kk], ah[0], al[0]);
      split_tf32_fast(s[1][2 * kk], ah[1], al[1]);
      split_tf32_fast(s[0][2 * kk + 1], ah[2], al[2]);
      split_tf32_fast(s[1][2 * kk + 1], ah[3], al[3]);
#pragma unroll
      for (int nt = 0; nt < SMALL_NT; ++nt) {
        uint32_t bh0, bl0, bh1, bl1;
        split_tf32_fast(w1r[nt][2 * kk], bh0, bl0);
        split_tf32_fast(w1r[nt][2 * kk + 1], bh1, bl1);
        mma_tf32(acc[nt], ah, bh0, bh1);
        mma_tf32(accx[nt], ah, bl0, bl1);
        mma_tf32(accx[nt], al, bh0, bh1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < SMALL_NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] += accx[nt][e];
  } else {
    uint32_t w1r[SMALL_NT][CH / 2];
#pragma unroll
    for (int nt = 0; nt < SMALL_NT; ++nt)
      E::template load_words<CH>(w1 + (8 * nt + g < H ? (8 * nt + g) * C : 0), c0, C, 8 * nt + g < H, w1r[nt]);
#pragma unroll
    for (int kk = 0; kk < CH / 4; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[0][4 * kk], s[0][4 * kk + 1]), pack2<T>(s[1][4 * kk], s[1][4 * kk + 1]),
                             pack2<T>(s[0][4 * kk + 2], s[0][4 * kk + 3]),
                             pack2<T>(s[1][4 * kk + 2], s[1][4 * kk + 3])};
#pragma unroll
      for (int nt = 0; nt < SMALL_NT; ++nt) mma_16bit<T>(acc[nt], a, w1r[nt][2 * kk], w1r[nt][2 * kk + 1]);
    }
  }
  // every group's products, added in group order in every warp
#pragma unroll
  for (int nt = 0; nt < SMALL_NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) sm.acc[h][p][4 * nt + e][lane] = acc[nt][e];
  __syncthreads();
#pragma unroll
  for (int nt = 0; nt < SMALL_NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float tot = sm.acc[0][p][4 * nt + e][lane];
#pragma unroll
      for (int q = 1; q < NK; ++q) tot += sm.acc[q][p][4 * nt + e][lane];
      acc[nt][e] = tot;
    }

  // ---- GEMM2, this warp's n-tiles NT2 h + q, then layer 3's partial sums of rows g, g + 8 ----
  float z[2] = {0.f, 0.f};
  if constexpr (kF32) {
    // k step kk is GEMM1's n-tile kk: A = (h1[g][8kk+2t], h1[g+8][8kk+2t], h1[g][8kk+2t+1], h1[g+8][8kk+2t+1])
    uint32_t hh[SMALL_NT][4], hl[SMALL_NT][4];
#pragma unroll
    for (int kk = 0; kk < SMALL_NT; ++kk) {
      const float hv[4] = {relu(acc[kk][0] + bias1[kk][0]), relu(acc[kk][2] + bias1[kk][0]),
                           relu(acc[kk][1] + bias1[kk][1]), relu(acc[kk][3] + bias1[kk][1])};
#pragma unroll
      for (int e = 0; e < 4; ++e) split_tf32_fast(hv[e], hh[kk][e], hl[kk][e]);
    }
#pragma unroll
    for (int q = 0; q < NT2; ++q) {
      const int row = 8 * (NT2 * h + q) + g;
      float d[4] = {0.f, 0.f, 0.f, 0.f}, dx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < SMALL_NT; ++kk) {
        const int k0 = 8 * kk + 2 * t;
        const float wa = row < H && k0 < H ? w2[row * H + k0] : 0.f;
        const float wb = row < H && k0 + 1 < H ? w2[row * H + k0 + 1] : 0.f;
        uint32_t bh0, bl0, bh1, bl1;
        split_tf32_fast(wa, bh0, bl0);
        split_tf32_fast(wb, bh1, bl1);
        mma_tf32(d, hh[kk], bh0, bh1);
        mma_tf32(dx, hh[kk], bl0, bl1);
        mma_tf32(dx, hl[kk], bh0, bh1);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) z[e >> 1] = fmaf(wout[q][e & 1], relu(d[e] + dx[e] + bias2[q][e & 1]), z[e >> 1]);
    }
  } else {
    // k step kk: GEMM1's n-tiles 2 kk (columns 0..7) and 2 kk + 1 (8..15), h1 rounded to T
    uint32_t ha[SMALL_NT / 2][4];
#pragma unroll
    for (int kk = 0; kk < SMALL_NT / 2; ++kk)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float(&c)[4] = acc[2 * kk + half];
        const float(&bb)[2] = bias1[2 * kk + half];
        ha[kk][2 * half] = pack2<T>(relu(c[0] + bb[0]), relu(c[1] + bb[1]));
        ha[kk][2 * half + 1] = pack2<T>(relu(c[2] + bb[0]), relu(c[3] + bb[1]));
      }
#pragma unroll
    for (int q = 0; q < NT2; ++q) {
      const int row = 8 * (NT2 * h + q) + g;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < SMALL_NT / 2; ++kk) {
        uint32_t bw[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {  // columns 16 kk + 2 t (+ 1), then + 8
          const int k0 = 16 * kk + 2 * t + 8 * u;
          const uint32_t lo = row < H && k0 < H ? E::bits(w2[row * H + k0]) : 0u;
          const uint32_t hi = row < H && k0 + 1 < H ? E::bits(w2[row * H + k0 + 1]) : 0u;
          bw[u] = lo | (hi << 16);
        }
        mma_16bit<T>(d, ha[kk], bw[0], bw[1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) z[e >> 1] = fmaf(wout[q][e & 1], relu(d[e] + bias2[q][e & 1]), z[e >> 1]);
    }
  }

  // ---- layer 3 over the quad and the groups, sigmoid. Output o = 2 r + mirror of position (2 p + r, g): group h's
  // lanes t < OUTS write o = OUTS h + t, out[b,i,j] (mirror 0) or out[b,j,i] (mirror 1) ----
  z[0] = quad_sum(z[0]);
  z[1] = quad_sum(z[1]);
  if (t == 0) {
    sm.z[h][p][0][g] = z[0];
    sm.z[h][p][1][g] = z[1];
  }
  __syncthreads();
  const int o = OUTS * h + t, r = o >> 1, il = 2 * p + r, i = TILE * I + il;
  const bool mirror = o & 1;
  if (t < OUTS && i < N && j < N && (I < J || (mirror ? il < g : il <= g))) {
    float zt = sm.z[0][p][r][g];
#pragma unroll
    for (int q = 1; q < NK; ++q) zt += sm.z[q][p][r][g];
    zt += to_f32<T>(b3[0]);
    const float y = 1.f / (1.f + expf(-zt));
    const long long bn = static_cast<long long>(b) * N;
    const long long at = mirror ? (bn + j) * N + i : (bn + i) * N + j;
    out[at] = from_f32<T>(y);
  }
}

}  // namespace contact_map
