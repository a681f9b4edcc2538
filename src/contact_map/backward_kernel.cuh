// contact_map: the fused backward kernel (sm_80+) and the parameter-gradient sum kernel.
#pragma once
#include "launchers.cuh"

namespace contact_map {

// =============================================================================================
// The fused backward (sm_80+): one pass over the pair, the forward recomputed per tile
// =============================================================================================
// A block takes tiles (b, I <= J) in turn (persistent). Per tile, its 64 positions p = (i, j) and both
// sides x[b,i,j], x[b,j,i]: the statistics, s, h1, h2 and out again; dz = w g_s out (1 - out), g_s =
// (g[b,i,j] + g[b,j,i]) / 2 and w = 2 off the diagonal (the position stands for (i, j) and (j, i), whose
// s, activations and masks are the same), 1 on it. dh2 = dz w3 [h2 > 0], dh1 = (dh2 W2) [h1 > 0], ds =
// dh1 W1 (all scaled by w), dy = ds / w on both sides, then the LayerNorm backward of each side's row
// (dx written once per position). dW1 += dh1^T s and dW2 += dh2^T relu(h1) are mma.sync products over
// the tile's positions, added to totals in registers that stay for the block's tiles; dgamma, dbeta and db1
// (column sums by one thread each) and dw3, db2, db3 (per warp) add up in shared memory. Each block writes
// one fp32 partial of every parameter gradient; bw_sum_partials_kernel sums them in fp64. 16 warps of at
// most 128 registers each (4 per scheduler). F16 (bfloat16 input, BACKWARD_FP16_PRODUCTS): the four backward
// products (dW2, dh1, dW1, ds) on fp16 operands (bw_gemm16s), dh2 and dh1 multiplied by a power of 2 per tile
// (bw_pow2_scale of the block's largest |value|) and staged in fp16 (A fragments by ldmatrix), the products divided
// by it; h1 and h2 in split TF32 as always.
//
// The ReLU masks follow fp64's sign: a unit within rounding of 0 takes its kink on either side in two
// evaluations, and one position on the other side changes a weight's gradient by a whole term (several
// times the fp32 reference's whole error). A position with any |h1| or |h2| below kKink (|s| |W_u| +
// |b_u|) (the Cauchy-Schwarz bound on the unit's input; fp32 and split-TF32 rounding of h is about 2^-21
// of that bound / sqrt(K), so 2^-17 leaves a wide margin) is computed again in fp64 from x by its warp
// (0.3-1.6% of the positions at crop and batch with random weights; bw_refine), and its h1, h2 replaced by the
// fp64 values rounded to fp32.
namespace bwd {
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kRows = 64 / kWarps;  // positions per warp in the per-row steps
constexpr int kMaxC = 128, kMaxH = 64;  // pair_dim, hidden_dim: multiples of 16 up to these
constexpr float kKink = 7.62939453125e-6f;  // 2^-17
}  // namespace bwd

template <typename T>
struct BwArgs {
  const T* x;
  const float *g, *gamma, *beta, *w1, *b1, *w2, *b2, *w3, *b3;  // g: (B, N, N) fp32
  T* dx;
  float* part;  // (gridDim.x, bw_partial_len(C, H))
  double eps;
  int B, N, C, H;
};

// One block's partial: dW1 (H x C), dW2 (H x H), dgamma, dbeta (C), dw3, db2 (H), db3, db1 (H).
__host__ __device__ inline int bw_partial_len(int C, int H) { return H * C + H * H + 2 * C + 3 * H + 1; }

// Shared memory, in floats: the two sides' rows (x, then xhat) and s (then dy), 64 x ldx each; W1 (H x ldx),
// W2 (H x ldh); h1 and h2 (then dh2, then dh1), 64 x ldh each; the vectors; the vector gradients' sums; per
// warp C + H doubles (F16: after the kink phase, 64 x (H + 8) fp16 values of dh2, then of dh1, in their place); two
// floats (F16's scales).
// Row strides of 4 times an odd number, mod 32 floats: the m16n8k8 fragment loads of row-major operands are
// conflict-free.
struct BwSmem {
  int ldx, ldh, xa, xb, s, w1, w2, h1, h2, vec, vacc, f64, scl, total;
  __host__ __device__ BwSmem(int C, int H) {
    ldx = C + 4;
    ldh = H + 4;
    xa = 0;
    xb = xa + 64 * ldx;
    s = xb + 64 * ldx;
    w1 = s + 64 * ldx;
    w2 = w1 + H * ldx;
    h1 = w2 + H * ldh;
    h2 = h1 + 64 * ldh;
    vec = h2 + 64 * ldh;  // gamma, beta (C); b1, b2, w3, |W1_u|, |W2_u| (H); rstd_a, rstd_b, |s|, g_s (64)
    vacc = vec + 2 * C + 5 * H + 4 * 64;  // sums: dgamma, dbeta (C), db1 (H); per warp dw3, db2 (H), db3
    f64 = round_up(vacc + 2 * C + H + bwd::kWarps * (2 * H + 1), 4);
    scl = f64 + 2 * bwd::kWarps * (C + H);  // F16: the tile's largest |dh2|, then |dh1|
    total = scl + 2;
  }
};

template <bool RELU>
__device__ __forceinline__ float bw_ld(float v) { return RELU ? fmaxf(v, 0.f) : v; }

// The 16 x 16 strips of a (16 MT) x (16 nb) output (nstrips = MT nb, MT <= 4) that a warp owns: m tile
// warp % MT (its strips share their A fragments, split or loaded once per k step), column blocks warp / MT + r step,
// step = 16 / MT, r < R (R step >= nb: the caller's R), those below nb; warps from MT step on own none (MT = 3:
// warp 15). MTC > 0: MT known at compile time (shifts, not divisions).
template <int MTC>
struct BwStrips {
  int mt, nb0, step, nb;
  __device__ __forceinline__ BwStrips(int MT, int nstrips, int warp) {
    const int m = MTC > 0 ? MTC : MT;
    step = 16 / m;
    mt = warp % m;
    nb = nstrips / m;
    nb0 = warp < m * step ? warp / m : nb;
  }
  __device__ __forceinline__ int block(int r) const { return nb0 + r * step; }  // below nb: a strip
};

// acc[r] += A(16 rows, K) B(K, 16 columns) in split TF32 for the warp's strips (BwStrips: strip r is m tile mt,
// columns 16 block(r) .. + 15, two n tiles). A(m, k) = A[m am + k ak], B(k, n) = B[k bk + n bn], ReLU on load if
// asked. The k steps run in order (R x 2 independent accumulators per step); each mma.sync truncates its fp32
// sum, so a long sum goes into fresh accumulators per tile and is added to its total in fp32 (bias ~2^-24 per
// step of the tile's part instead of the whole sum's).
template <int R, bool RELU_A, bool RELU_B, int MTC = 0>
__device__ __forceinline__ void bw_gemm(float (&acc)[R][2][4], const float* __restrict__ A, int am, int ak,
                                        const float* __restrict__ Bm, int bk, int bn, int MT, int nstrips, int K,
                                        int warp, int lane) {
  const BwStrips<MTC> st(MT, nstrips, warp);
  if (st.nb0 >= st.nb) return;
  asm volatile("" : "+r"(lane));  // the fragment addresses recomputed per call, not held across the tile loop
  const int g = lane >> 2, t = lane & 3;
  const float* pa = A + (st.mt * 16 + g) * am + t * ak;
  const float* pb = Bm + g * bn + t * bk;
#pragma unroll 1
  for (int k0 = 0; k0 < K; k0 += 8) {
    uint32_t ah[4], al[4];
    split_tf32_fast<false>(bw_ld<RELU_A>(pa[k0 * ak]), ah[0], al[0]);
    split_tf32_fast<false>(bw_ld<RELU_A>(pa[k0 * ak + 8 * am]), ah[1], al[1]);
    split_tf32_fast<false>(bw_ld<RELU_A>(pa[(k0 + 4) * ak]), ah[2], al[2]);
    split_tf32_fast<false>(bw_ld<RELU_A>(pa[(k0 + 4) * ak + 8 * am]), ah[3], al[3]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (st.block(r) < st.nb) {
        const float* b = pb + st.block(r) * 16 * bn + k0 * bk;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          uint32_t bh0, bl0, bh1, bl1;
          split_tf32_fast<false>(bw_ld<RELU_B>(b[8 * n * bn]), bh0, bl0);
          split_tf32_fast<false>(bw_ld<RELU_B>(b[4 * bk + 8 * n * bn]), bh1, bl1);
          mma_tf32(acc[r][n], al, bh0, bh1);
          mma_tf32(acc[r][n], ah, bl0, bl1);
          mma_tf32(acc[r][n], ah, bh0, bh1);
        }
      }
    }
  }
}

// Four 8 x 8 matrices of 16-bit values from shared memory (ldmatrix .x4): lane l gives the 16-byte aligned address
// of row l % 8 of matrix l / 8; r[i] gets matrix i's element (row lane / 4, columns 2 (lane % 4), + 1), or with TRANS
// (rows 2 (lane % 4), + 1, column lane / 4): the transposed matrix's.
template <bool TRANS>
__device__ __forceinline__ void bw_ldsm_x4(uint32_t (&r)[4], const __half* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// dst[p ldd + u] = fp16(src[p lds + u] sa) for u < H and the tile's 64 positions p: thread t converts 8 values of
// row t / 8 (H <= 64; rows 16-byte aligned: lds % 4 == 0, ldd % 8 == 0), rounded to nearest.
__device__ __forceinline__ void bw_stage16(__half* dst, int ldd, const float* src, int lds, int H, float sa) {
  static_assert(bwd::kThreads == 64 * 8 && bwd::kMaxH <= 8 * 8, "one thread per 8 values of a row");
  const int p = threadIdx.x >> 3, u = (threadIdx.x & 7) * 8;
  if (u < H) {
    const float4 v0 = *reinterpret_cast<const float4*>(src + p * lds + u);
    const float4 v1 = *reinterpret_cast<const float4*>(src + p * lds + u + 4);
    *reinterpret_cast<uint4*>(dst + p * ldd + u) =
        make_uint4(pack2<__half>(v0.x * sa, v0.y * sa), pack2<__half>(v0.z * sa, v0.w * sa),
                   pack2<__half>(v1.x * sa, v1.y * sa), pack2<__half>(v1.z * sa, v1.w * sa));
  }
}

// bw_gemm's product with fp16 operands: each k16 step one m16n8k16 per n tile, fp32 accumulation: acc += A B, A
// from fp16 values in shared memory (bw_stage16's, scaled: A(m, k) = As[m lda + k], or As[k lda + m] where A_T;
// lda % 8 == 0), one ldmatrix per k step, and B rounded to fp16 (round to nearest) as it is loaded; K a multiple of
// 16. The same strips and accumulator layout as bw_gemm (m16n8k16's C fragment is m16n8k8's). For bfloat16 input
// only (BACKWARD_FP16_PRODUCTS): fp16 operands, dh2 and dh1 scaled to [2^11, 2^12) per tile, keep every gradient of
// the fused-backward test within its bound there at any scale of grad_out (tools/cm_backward_precision.py, "fp16s";
// unscaled, a small grad_out underflows), bf16 operands do not, nor do fp16 operands for fp16 input.
template <int R, bool RELU_B, bool A_T, int MTC = 0>
__device__ __forceinline__ void bw_gemm16s(float (&acc)[R][2][4], const __half* __restrict__ As, int lda,
                                           const float* __restrict__ Bm, int bk, int bn, int MT, int nstrips, int K,
                                           int warp, int lane) {
  const BwStrips<MTC> st(MT, nstrips, warp);
  if (st.nb0 >= st.nb) return;
  asm volatile("" : "+r"(lane));  // the fragment addresses recomputed per call, not held across the tile loop
  const int g = lane >> 2, t = lane & 3, mi = lane >> 3, mr = lane & 7;
  // the lane's row of matrix mi: m + 8 (mi & 1) (a1, a3), k + 8 (mi >> 1) (a2, a3)
  const __half* pa = A_T ? As + (mr + 8 * (mi >> 1)) * lda + st.mt * 16 + 8 * (mi & 1)
                         : As + (st.mt * 16 + mr + 8 * (mi & 1)) * lda + 8 * (mi >> 1);
  const int astep = A_T ? 16 * lda : 16;
  const float* pb = Bm + g * bn + 2 * t * bk;
#pragma unroll 1
  for (int k0 = 0; k0 < K; k0 += 16, pa += astep) {
    uint32_t a[4];
    bw_ldsm_x4<A_T>(a, pa);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (st.block(r) < st.nb) {
        const float* b = pb + st.block(r) * 16 * bn + k0 * bk;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const float* bc = b + 8 * n * bn;
          const uint32_t b0 = pack2<__half>(bw_ld<RELU_B>(bc[0]), bw_ld<RELU_B>(bc[bk]));
          const uint32_t b1 = pack2<__half>(bw_ld<RELU_B>(bc[8 * bk]), bw_ld<RELU_B>(bc[9 * bk]));
          mma_16bit<__half>(acc[r][n], a, b0, b1);
        }
      }
    }
  }
}

// The backward's products (dW2, dh1, dW1, ds): bw_gemm on A, or where F16 bw_gemm16s on As (A staged in fp16,
// scaled; A_T: As holds A transposed, as A(m, k) = A[m + k ak] does).
template <bool F16, int R, bool RELU_B, bool A_T, int MTC = 0>
__device__ __forceinline__ void bw_gemm_back(float (&acc)[R][2][4], const float* __restrict__ A, int am, int ak,
                                             const __half* __restrict__ As, int lda, const float* __restrict__ Bm,
                                             int bk, int bn, int MT, int nstrips, int K, int warp, int lane) {
  if constexpr (F16) bw_gemm16s<R, RELU_B, A_T, MTC>(acc, As, lda, Bm, bk, bn, MT, nstrips, K, warp, lane);
  else bw_gemm<R, false, RELU_B, MTC>(acc, A, am, ak, Bm, bk, bn, MT, nstrips, K, warp, lane);
}

// (2^e, 2^-e) bringing top = *m (>= 0: the block's largest |value|, bw_warp_max_store's) to [2^11, 2^12), e in
// [-100, 100]; (1, 1) where top is 0 or not finite. From the bits: top = f 2^(x - 126), f in [0.5, 1), for biased
// exponent x >= 1, so e = 12 - (x - 126); a subnormal top (x = 0) takes e = 100 as frexp's exponent would.
__device__ __forceinline__ float2 bw_pow2_scale(const float* m) {
  const unsigned u = __float_as_uint(*m);
  if (u == 0u || u >= 0x7f800000u) return make_float2(1.f, 1.f);
  const int e = min(max(138 - static_cast<int>(u >> 23), -100), 100);
  return make_float2(__uint_as_float(static_cast<unsigned>(127 + e) << 23),
                     __uint_as_float(static_cast<unsigned>(127 - e) << 23));
}

// *dst = max(*dst, the warp's largest v) (each v >= 0: their bits order as the values; *dst zeroed per tile).
__device__ __forceinline__ void bw_warp_max_store(float v, float* dst, int lane) {
  const unsigned top = __reduce_max_sync(0xffffffffu, __float_as_uint(v));
  if (lane == 0) atomicMax(reinterpret_cast<unsigned*>(dst), top);
}

// total += part, element by element.
template <int R>
__device__ __forceinline__ void bw_add(float (&total)[R][2][4], const float (&part)[R][2][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) total[r][n][e] += part[r][n][e];
}

// acc *= f, element by element.
template <int R>
__device__ __forceinline__ void bw_mul(float (&acc)[R][2][4], float f) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][n][e] *= f;
}

// f(row, column, value) for every accumulator element of bw_gemm's strips (the same MT, nstrips and MTC).
template <int MTC = 0, int R, typename F>
__device__ __forceinline__ void bw_each(const float (&acc)[R][2][4], int MT, int nstrips, int warp, int lane, F&& f) {
  const BwStrips<MTC> st(MT, nstrips, warp);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (st.block(r) < st.nb) {
      const int m = st.mt * 16 + g, n0 = st.block(r) * 16 + 2 * t;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(m + (e >> 1) * 8, n0 + 8 * n + (e & 1), acc[r][n][e]);
    }
  }
}

template <int R>
__device__ __forceinline__ void bw_zero(float (&acc)[R][2][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][n][e] = 0.f;
}

// Both sides of tile (b, I, J) into xa / xb (= xa + 64 ldx) as fp32: row p = 8 a + c of side 0 is
// x[b, 8I + a, 8J + c], of side 1 x[b, 8J + c, 8I + a]; zeros outside N. Consecutive 16-byte chunks read one
// global run of 8 positions (C contiguous values each). fp32: cp.async, all in flight at once; fp16 / bf16:
// four loads per thread in flight (all of a tile at pair_dim 128), converted on the way into shared memory.
template <typename T>
__device__ __forceinline__ void bw_load_sides(const T* __restrict__ x, int N, int C, int b, int I, int J, float* xa,
                                              int ldx) {
  // chunk e: side e / (64 W), row q = (e / W) % 64, chunk cc = e % W of the row, W = kMaxC / V (a power of 2:
  // shifts, no division; chunks cc >= C / V are skipped)
  constexpr int V = 16 / static_cast<int>(sizeof(T)), U = 4, W = bwd::kMaxC / V, total = 2 * 64 * W;
  const int cpr = C / V;
  auto chunk = [&](int e, int& dst) -> const T* {
    const unsigned u = static_cast<unsigned>(e);
    const int side = u / (64 * W), q = (u / W) % 64, cc = u % W;
    const int hi = q >> 3, lo = q & 7;
    const int gi = (side ? J : I) * 8 + hi, gj = (side ? I : J) * 8 + lo;
    dst = side * 64 * ldx + (side ? lo * 8 + hi : hi * 8 + lo) * ldx + cc * V;
    return (gi < N && gj < N) ? x + ((static_cast<long long>(b) * N + gi) * N + gj) * C + cc * V : nullptr;
  };
  if constexpr (std::is_same<T, float>::value) {
#pragma unroll 1
    for (int e = threadIdx.x; e < total; e += bwd::kThreads) {
      if ((e & (W - 1)) >= cpr) continue;
      int dst;
      const float* src = chunk(e, dst);
      cp_async16(xa + dst, src ? src : x, src != nullptr);
    }
    cp_async_commit();
    cp_async_wait_all();
  } else {
    for (int e0 = threadIdx.x; e0 < total; e0 += U * bwd::kThreads) {
      uint4 v[U];
      int dst[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int e = e0 + k * bwd::kThreads;
        v[k] = make_uint4(0u, 0u, 0u, 0u);
        dst[k] = -1;
        if (e < total && (e & (W - 1)) < cpr) {
          const T* src = chunk(e, dst[k]);
          if (src) v[k] = __ldg(reinterpret_cast<const uint4*>(src));
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (dst[k] >= 0) {
          const float2 p0 = unpack2<T>(v[k].x), p1 = unpack2<T>(v[k].y), p2 = unpack2<T>(v[k].z),
                       p3 = unpack2<T>(v[k].w);
          *reinterpret_cast<float4*>(xa + dst[k]) = make_float4(p0.x, p0.y, p1.x, p1.y);
          *reinterpret_cast<float4*>(xa + dst[k] + 4) = make_float4(p2.x, p2.y, p3.x, p3.y);
        }
    }
  }
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// fp64 to fp32 keeping the sign a ReLU mask reads (a positive value below fp32's range stays positive).
__device__ __forceinline__ float bw_kink_f32(double v) {
  const float f = static_cast<float>(v);
  return (v > 0.0 && !(f > 0.f)) ? 1.17549435e-38f : f;
}

// Position (b, i, j) again in fp64 by one warp, from x and the fp32 parameters (exact copies): h1 and h2
// (pre-activation) into the rows h1r, h2r. s64 / a64: the warp's C + H doubles. Short dependency chains (while
// one warp recomputes, the block's other 15 wait at the next barrier): the lane's values of both rows read from
// global memory once (C <= 128: 4 per lane) for the statistics and s; each h1 and h2 dot product in 4 partial sums
// (k mod 4) added pairwise, then the bias.
template <typename T>
__device__ __forceinline__ void bw_refine(const BwArgs<T>& a, int b, int i, int j, const float* gam,
                                          const float* bet, const float* w1s, const float* w2s, const float* b1s,
                                          const float* b2s, int ldx, int ldh, double* s64, float* h1r, float* h2r,
                                          int lane) {
  static_assert(bwd::kMaxC <= 4 * 32, "four values of a row per lane");
  const int C = a.C, H = a.H, N = a.N;
  const T* ra = a.x + ((static_cast<long long>(b) * N + i) * N + j) * C;
  const T* rb = a.x + ((static_cast<long long>(b) * N + j) * N + i) * C;
  double* a64 = s64 + C;
  float va[4], vb[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int c = lane + 32 * q;
    va[q] = c < C ? to_f32(ra[c]) : 0.f;
    vb[q] = c < C ? to_f32(rb[c]) : 0.f;
  }
  double sa = 0.0, sb = 0.0;
#pragma unroll
  for (int q = 0; q < 4; ++q)
    if (lane + 32 * q < C) {
      sa += static_cast<double>(va[q]);
      sb += static_cast<double>(vb[q]);
    }
  const double ma = warp_sum_d(sa) / C, mb = warp_sum_d(sb) / C;
  double qa = 0.0, qb = 0.0;
#pragma unroll
  for (int q = 0; q < 4; ++q)
    if (lane + 32 * q < C) {
      const double da = static_cast<double>(va[q]) - ma, db = static_cast<double>(vb[q]) - mb;
      qa += da * da;
      qb += db * db;
    }
  const double rsa = 1.0 / sqrt(warp_sum_d(qa) / C + a.eps), rsb = 1.0 / sqrt(warp_sum_d(qb) / C + a.eps);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int c = lane + 32 * q;
    if (c < C) {
      const double gc = gam[c], bc = bet[c];
      const double ya = (static_cast<double>(va[q]) - ma) * rsa * gc + bc;
      const double yb = (static_cast<double>(vb[q]) - mb) * rsb * gc + bc;
      s64[c] = 0.5 * (ya + yb);
    }
  }
  __syncwarp();
  // sum_k w[k] v[k] over K (a multiple of 4) in 4 partial sums; w 16-byte aligned, v's pairs 16-byte aligned
  auto dot4 = [](const float* w, const double* v, int K) {
    double p0 = 0.0, p1 = 0.0, p2 = 0.0, p3 = 0.0;
#pragma unroll 2
    for (int k = 0; k < K; k += 4) {
      const float4 wk = *reinterpret_cast<const float4*>(w + k);
      const double2 v01 = *reinterpret_cast<const double2*>(v + k), v23 = *reinterpret_cast<const double2*>(v + k + 2);
      p0 += static_cast<double>(wk.x) * v01.x;
      p1 += static_cast<double>(wk.y) * v01.y;
      p2 += static_cast<double>(wk.z) * v23.x;
      p3 += static_cast<double>(wk.w) * v23.y;
    }
    return (p0 + p1) + (p2 + p3);
  };
#pragma unroll 1
  for (int u = lane; u < H; u += 32) {
    const double h = dot4(w1s + u * ldx, s64, C) + b1s[u];
    h1r[u] = bw_kink_f32(h);
    a64[u] = h > 0.0 ? h : 0.0;
  }
  __syncwarp();
#pragma unroll 1
  for (int u = lane; u < H; u += 32) h2r[u] = bw_kink_f32(dot4(w2s + u * ldh, a64, H) + b2s[u]);
  __syncwarp();
}

template <typename T, bool F16>
__global__ void __launch_bounds__(bwd::kThreads, 1) contact_map_backward_kernel(const BwArgs<T> a) {
  using namespace bwd;
  extern __shared__ __align__(16) float sm[];
  const int C = a.C, H = a.H, N = a.N;
  const BwSmem L(C, H);
  const int ldx = L.ldx, ldh = L.ldh;
  float *xa = sm + L.xa, *xb = sm + L.xb, *ss = sm + L.s, *w1s = sm + L.w1, *w2s = sm + L.w2;
  float *h1s = sm + L.h1, *h2s = sm + L.h2;
  float *gam = sm + L.vec, *bet = gam + C, *b1s = bet + C, *b2s = b1s + H, *w3s = b2s + H, *w1n = w3s + H,
        *w2n = w1n + H, *rsa = w2n + H, *rsb = rsa + 64, *snorm = rsb + 64, *gsym = snorm + 64;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float *cacc = sm + L.vacc, *wacc = cacc + 2 * C + H + warp * (2 * H + 1);  // see BwSmem
  double* s64 = reinterpret_cast<double*>(sm + L.f64) + warp * (C + H);
  float* scl = sm + L.scl;  // F16 only
  __half* stg = reinterpret_cast<__half*>(sm + L.f64);  // F16: dh2, then dh1, staged (over s64, unused then)

  for (int e = tid; e < H * C; e += kThreads) w1s[(e / C) * ldx + e % C] = a.w1[e];
  for (int e = tid; e < H * H; e += kThreads) w2s[(e / H) * ldh + e % H] = a.w2[e];
  for (int c = tid; c < C; c += kThreads) {
    gam[c] = a.gamma[c];
    bet[c] = a.beta[c];
  }
  for (int u = tid; u < H; u += kThreads) {
    b1s[u] = a.b1[u];
    b2s[u] = a.b2[u];
    w3s[u] = a.w3[u];
  }
  for (int e = tid; e < 2 * C + H + kWarps * (2 * H + 1); e += kThreads) cacc[e] = 0.f;
  __syncthreads();
  for (int u = warp; u < H; u += kWarps) {
    float q1 = 0.f, q2 = 0.f;
    for (int c = lane; c < C; c += 32) q1 += w1s[u * ldx + c] * w1s[u * ldx + c];
    for (int k = lane; k < H; k += 32) q2 += w2s[u * ldh + k] * w2s[u * ldh + k];
    q1 = warp_sum(q1);
    q2 = warp_sum(q2);
    if (lane == 0) {
      w1n[u] = sqrtf(q1);
      w2n[u] = sqrtf(q2);
    }
  }
  const float b3 = a.b3[0], inv_c = 1.f / static_cast<float>(C), eps = static_cast<float>(a.eps);
  const int MH = H / 16;  // m tiles of the weight-gradient products

  float dw1[2][2][4], dw2[1][2][4];  // dW1 (MH x C / 16 strips), dW2 (MH x H / 16 strips)
  bw_zero(dw1);
  bw_zero(dw2);

  const int nT = cdiv(N, TILE);
  const long long tiles_per_b = static_cast<long long>(nT) * (nT + 1) / 2, tiles = tiles_per_b * a.B;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    const bool diag = I == J;
    bw_load_sides<T>(a.x, N, C, b, I, J, xa, ldx);
    if (tid < 64) {
      const int i = I * 8 + (tid >> 3), j = J * 8 + (tid & 7);
      gsym[tid] = (i < N && j < N) ? 0.5f * (a.g[(static_cast<long long>(b) * N + i) * N + j] +
                                             a.g[(static_cast<long long>(b) * N + j) * N + i])
                                   : 0.f;
    }
    if constexpr (F16)
      if (tid < 2) scl[tid] = 0.f;  // (the previous tile's reads are two barriers behind)
    __syncthreads();

    // statistics of both sides, xhat in place, s and |s|; warp w: positions kRows w .. kRows (w + 1) - 1
    for (int k = 0; k < kRows; ++k) {
      const int p = warp * kRows + k;
      float* ra = xa + p * ldx;
      float* rb = xb + p * ldx;
      float va[4], vb[4], sa = 0.f, sb = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int c = lane + 32 * q;
        va[q] = c < C ? ra[c] : 0.f;
        vb[q] = c < C ? rb[c] : 0.f;
        sa += va[q];
        sb += vb[q];
      }
      const float m0a = warp_sum(sa) * inv_c, m0b = warp_sum(sb) * inv_c;
      float d1a = 0.f, d2a = 0.f, d1b = 0.f, d2b = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (lane + 32 * q < C) {
          const float da = va[q] - m0a, db = vb[q] - m0b;
          d1a += da;
          d2a += da * da;
          d1b += db;
          d2b += db * db;
        }
      float ma, rs_a, mb, rs_b;
      ln_stats(m0a, warp_sum(d1a), warp_sum(d2a), inv_c, eps, ma, rs_a);
      ln_stats(m0b, warp_sum(d1b), warp_sum(d2b), inv_c, eps, mb, rs_b);
      float sq = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int c = lane + 32 * q;
        if (c < C) {
          const float xha = (va[q] - ma) * rs_a, xhb = (vb[q] - mb) * rs_b;
          ra[c] = xha;
          rb[c] = xhb;
          const float s = 0.5f * ((xha * gam[c] + bet[c]) + (xhb * gam[c] + bet[c]));
          ss[p * ldx + c] = s;
          sq += s * s;
        }
      }
      sq = warp_sum(sq);
      if (lane == 0) {
        rsa[p] = rs_a;
        rsb[p] = rs_b;
        snorm[p] = sqrtf(sq);
      }
    }
    __syncthreads();

    {  // h1 = s W1^T + b1                                                          (64 x H)
      float acc[1][2][4];
      bw_zero(acc);
      bw_gemm<1, false, false, 4>(acc, ss, ldx, 1, w1s, 1, ldx, 4, H / 4, C, warp, lane);
      bw_each<4>(acc, 4, H / 4, warp, lane, [&](int p, int u, float v) { h1s[p * ldh + u] = v + b1s[u]; });
    }
    __syncthreads();
    {  // h2 = relu(h1) W2^T + b2                                                   (64 x H)
      float acc[1][2][4];
      bw_zero(acc);
      bw_gemm<1, true, false, 4>(acc, h1s, ldh, 1, w2s, 1, ldh, 4, H / 4, H, warp, lane);
      bw_each<4>(acc, 4, H / 4, warp, lane, [&](int p, int u, float v) { h2s[p * ldh + u] = v + b2s[u]; });
    }
    __syncthreads();

    // per position (warp w: kRows w .. kRows (w + 1) - 1, all kRows at once: their reductions interleaved):
    // the kink test, then the fp64 recomputation of the positions near a kink, then out, dz and dh2 (into h2s)
    const float wgt = diag ? 1.f : 2.f;
    unsigned near_rows = 0u;  // bit k: position kRows w + k has a unit near a kink
    {
      float q[kRows];
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const float* h1r = h1s + (warp * kRows + k) * ldh;
        q[k] = 0.f;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int u = lane + 32 * m;
          if (u < H) q[k] += fmaxf(h1r[u], 0.f) * fmaxf(h1r[u], 0.f);
        }
      }
      warp_sum_n(q);
      unsigned mine = 0u;
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const int p = warp * kRows + k, i = I * 8 + (p >> 3), j = J * 8 + (p & 7);
        const float* h1r = h1s + p * ldh;
        const float* h2r = h2s + p * ldh;
        const float anorm = sqrtf(q[k]), sn = snorm[p];
        bool near = false;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int u = lane + 32 * m;
          if (u < H)
            near |= fabsf(h1r[u]) < kKink * (sn * w1n[u] + fabsf(b1s[u])) ||
                    fabsf(h2r[u]) < kKink * (anorm * w2n[u] + fabsf(b2s[u]));
        }
        if (near && i < N && j < N) mine |= 1u << k;
      }
      near_rows = __reduce_or_sync(0xffffffffu, mine);
    }
    for (; near_rows; near_rows &= near_rows - 1) {
      const int k = __ffs(near_rows) - 1, p = warp * kRows + k;
      bw_refine(a, b, I * 8 + (p >> 3), J * 8 + (p & 7), gam, bet, w1s, w2s, b1s, b2s, ldx, ldh, s64,
                h1s + p * ldh, h2s + p * ldh, lane);
    }
    {
      float dz[kRows];  // o, then dz
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const float* h2r = h2s + (warp * kRows + k) * ldh;
        dz[k] = 0.f;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int u = lane + 32 * m;
          if (u < H) dz[k] += fmaxf(h2r[u], 0.f) * w3s[u];
        }
      }
      warp_sum_n(dz);
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const int p = warp * kRows + k, i = I * 8 + (p >> 3), j = J * 8 + (p & 7);
        const float out = 1.f / (1.f + __expf(-(dz[k] + b3)));
        dz[k] = (i < N && j < N) ? wgt * gsym[p] * out * (1.f - out) : 0.f;
      }
      // dw3 += dz relu(h2), db2 += dh2 over the warp's positions, then one shared-memory update per unit
      float dmax = 0.f;  // F16: the largest |dh2| of the lane's
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int u = lane + 32 * m;
        if (u < H) {
          const float w3u = w3s[u];
          float s3 = 0.f, s2 = 0.f;
#pragma unroll
          for (int k = 0; k < kRows; ++k) {
            float* h2r = h2s + (warp * kRows + k) * ldh;
            const float h2 = h2r[u], d = h2 > 0.f ? dz[k] * w3u : 0.f;
            s3 += dz[k] * fmaxf(h2, 0.f);
            s2 += d;
            h2r[u] = d;
            if constexpr (F16) dmax = fmaxf(dmax, fabsf(d));
          }
          float* wv = sm + BwSmem(C, H).vacc + 2 * C + H + warp * (2 * H + 1);  // wacc (recomputed: registers)
          wv[u] += s3;
          wv[H + u] += s2;
        }
      }
      if (lane == 0) {
        float t = 0.f;
#pragma unroll
        for (int k = 0; k < kRows; ++k) t += dz[k];
        wacc[2 * H] += t;
      }
      if constexpr (F16) bw_warp_max_store(dmax, scl, lane);
    }
    __syncthreads();
    if constexpr (F16) {  // dh2 times its scale, in fp16, into stg
      bw_stage16(stg, H + 8, h2s, ldh, H, bw_pow2_scale(scl).x);
      __syncthreads();
    }

    {  // dW2 += dh2^T relu(h1) (K = 64 positions); dh1 = (dh2 W2) [h1 > 0] into h2s (F16: from stg, dh2 scaled)
      // (the scale read again from shared memory where it is needed: fewer live registers)
      float acc[1][2][4];
      bw_zero(acc);
      bw_gemm_back<F16, 1, true, true>(acc, h2s, 1, ldh, stg, H + 8, h1s, ldh, 1, MH, MH * (H / 16), 64, warp, lane);
      if constexpr (F16) bw_mul(acc, bw_pow2_scale(scl).y);
      bw_add(dw2, acc);
      bw_zero(acc);
      bw_gemm_back<F16, 1, false, false, 4>(acc, h2s, ldh, 1, stg, H + 8, w2s, ldh, 1, 4, H / 4, H, warp, lane);
      const float inv2 = F16 ? bw_pow2_scale(scl).y : 1.f;
      __syncthreads();
      float dmax = 0.f;  // F16: the largest |dh1| of the lane's
      bw_each<4>(acc, 4, H / 4, warp, lane, [&](int p, int u, float v) {
        if constexpr (F16) v *= inv2;
        const float d = h1s[p * ldh + u] > 0.f ? v : 0.f;
        h2s[p * ldh + u] = d;
        if constexpr (F16) dmax = fmaxf(dmax, fabsf(d));
      });
      if constexpr (F16) bw_warp_max_store(dmax, scl + 1, lane);
    }
    __syncthreads();
    if constexpr (F16) {  // dh1 times its scale, in fp16, into stg
      bw_stage16(stg, H + 8, h2s, ldh, H, bw_pow2_scale(scl + 1).x);
      __syncthreads();
    }
    {  // dW1 += dh1^T s, db1; ds = dh1 W1, dy = ds / w into ss (F16: from stg, dh1 scaled)
      float acc[2][2][4];
      bw_zero(acc);
      bw_gemm_back<F16, 2, false, true>(acc, h2s, 1, ldh, stg, H + 8, ss, ldx, 1, MH, MH * (C / 16), 64, warp, lane);
      if constexpr (F16) bw_mul(acc, bw_pow2_scale(scl + 1).y);
      bw_add(dw1, acc);
      if (tid < H) {
        float d = 0.f;
        for (int p = 0; p < 64; ++p) d += h2s[p * ldh + tid];
        cacc[2 * C + tid] += d;
      }
      bw_zero(acc);
      bw_gemm_back<F16, 2, false, false, 4>(acc, h2s, ldh, 1, stg, H + 8, w1s, ldx, 1, 4, C / 4, H, warp, lane);
      float inv_w = diag ? 1.f : 0.5f;
      if constexpr (F16) inv_w *= bw_pow2_scale(scl + 1).y;
      __syncthreads();
      bw_each<4>(acc, 4, C / 4, warp, lane, [&](int p, int c, float v) { ss[p * ldx + c] = v * inv_w; });
    }
    __syncthreads();

    // dgamma += sum_p dy (xhat_a + xhat_b), dbeta += 2 sum_p dy (one side on the diagonal): thread c
    if (tid < C) {
      float sg = 0.f, sb = 0.f;
      for (int p = 0; p < 64; ++p) {
        const float d = ss[p * ldx + tid];
        sg += d * (diag ? xa[p * ldx + tid] : xa[p * ldx + tid] + xb[p * ldx + tid]);
        sb += d;
      }
      cacc[tid] += sg;
      cacc[C + tid] += diag ? sb : 2.f * sb;
    }
    // LayerNorm backward of each side's row: dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)),
    // dxhat = gamma dy; side 1 only off the diagonal (on it, (j, i) is a position of the tile itself)
    for (int k = 0; k < kRows; ++k) {
      const int p = warp * kRows + k, i = I * 8 + (p >> 3), j = J * 8 + (p & 7);
      if (i >= N || j >= N) continue;
      float dy[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) dy[q] = lane + 32 * q < C ? ss[p * ldx + lane + 32 * q] : 0.f;
      // mean(dxhat) is the same for both sides: one interleaved reduction of it and of both sides' dxhat . xhat
      float r[3] = {0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int c = lane + 32 * q;
        if (c < C) {
          const float d = gam[c] * dy[q];
          r[0] += d;
          r[1] += d * xa[p * ldx + c];
          r[2] += d * xb[p * ldx + c];
        }
      }
      warp_sum_n(r);
      for (int side = 0; side < (diag ? 1 : 2); ++side) {
        const float* xh = (side ? xb : xa) + p * ldx;
        const float m1 = r[0] * inv_c, m2 = (side ? r[2] : r[1]) * inv_c, rs = side ? rsb[p] : rsa[p];
        T* dst = a.dx + ((static_cast<long long>(b) * N + (side ? j : i)) * N + (side ? i : j)) * C;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int c = lane + 32 * q;
          if (c < C) dst[c] = from_f32<T>(rs * (gam[c] * dy[q] - m1 - xh[c] * m2));
        }
      }
    }
    __syncthreads();
  }

  // the block's partial (see bw_partial_len); per-warp sums through shared memory, in warp order
  float* part = a.part + static_cast<long long>(blockIdx.x) * bw_partial_len(C, H);
  bw_each(dw1, MH, MH * (C / 16), warp, lane, [&](int u, int c, float v) { part[u * C + c] = v; });
  bw_each(dw2, MH, MH * (H / 16), warp, lane, [&](int u, int k, float v) { part[H * C + u * H + k] = v; });
  float* vec_part = part + H * C + H * H;  // dgamma, dbeta, dw3, db2, db3, db1
  for (int e = tid; e < 2 * C; e += kThreads) vec_part[e] = cacc[e];
  if (tid < H) vec_part[2 * C + 2 * H + 1 + tid] = cacc[2 * C + tid];
  const int nv = 2 * H + 1;
  for (int e = tid; e < nv; e += kThreads) {  // the warps' dw3, db2, db3 in warp order
    float v = 0.f;
    for (int w = 0; w < kWarps; ++w) v += cacc[2 * C + H + w * nv + e];
    vec_part[2 * C + e] = v;
  }
}

bool backward_fits(int64_t C, int64_t H, const DeviceFacts& dev) {
  return C % 16 == 0 && H % 16 == 0 && C >= 16 && H >= 16 && C <= bwd::kMaxC && H <= bwd::kMaxH &&
         dev.major >= 8 &&
         sizeof(float) * BwSmem(static_cast<int>(C), static_cast<int>(H)).total <= static_cast<size_t>(dev.max_smem);
}

// Whether backward() runs for pair_dim C, hidden_dim H on `device`.
bool backward_supported(int64_t C, int64_t H, int64_t device) {
  return backward_fits(C, H, device_facts(static_cast<int>(device)));
}

// The parameter gradients from the blocks' partials: segment k of the partial (bw_partial_len's order) is
// gradient k, of dtype kind[k] (0 float32, 1 float16, 2 bfloat16, 3 float64).
struct BwGrads {
  void* ptr[8];
  int begin[9];  // segment k: partial elements [begin[k], begin[k + 1])
  int kind[8];
};

// grads = sum over the blocks of part (blocks x P, fp32) in fp64, rounded once to each gradient's dtype. A
// block takes 32 consecutive elements; warp w sums the partials of blocks w, w + 8, ... in order (coalesced
// 128-byte rows), then warp 0 adds the 8 warps' sums in warp order: the result does not depend on the launch.
__global__ void __launch_bounds__(256) bw_sum_partials_kernel(const float* __restrict__ part, int blocks, int P,
                                                              BwGrads g) {
  __shared__ double red[8][32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, e = blockIdx.x * 32 + lane;
  double v = 0.0;
  if (e < P)
    for (int b = w; b < blocks; b += 8) v += part[static_cast<long long>(b) * P + e];
  red[w][lane] = v;
  __syncthreads();
  if (w != 0 || e >= P) return;
  double t = 0.0;
#pragma unroll
  for (int k = 0; k < 8; ++k) t += red[k][lane];
  int k = 0;
  while (e >= g.begin[k + 1]) ++k;
  const int o = e - g.begin[k];
  switch (g.kind[k]) {
    case 0: static_cast<float*>(g.ptr[k])[o] = static_cast<float>(t); break;
    case 1: static_cast<__half*>(g.ptr[k])[o] = __double2half(t); break;
    case 2: static_cast<__nv_bfloat16*>(g.ptr[k])[o] = __double2bfloat16(t); break;
    default: static_cast<double*>(g.ptr[k])[o] = t; break;
  }
}

template <typename T, bool F16>
void launch_backward(const BwArgs<T>& a, int grid, size_t smem, int device, cudaStream_t stream) {
  ensure_max_dynamic_smem(reinterpret_cast<const void*>(&contact_map_backward_kernel<T, F16>), device,
                          static_cast<int>(smem));
  contact_map_backward_kernel<T, F16><<<grid, bwd::kThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace contact_map
