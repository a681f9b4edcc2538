// contact_map: the wgmma kernel's per-tile math: slot reads, LayerNorm statistics, s as A fragments, parameters, products.
#pragma once
#include "wgmma_ptx.cuh"

namespace contact_map {


// One 16-byte chunk of a swizzled slot: channels 16 kk + 4 t .. + 3 of row p.
__device__ __forceinline__ float4 swizzled_chunk4(const float* base, int p, int kk, int t) {
  const int phys = (4 * (kk & 1) + t) ^ (p & 7);
  return reinterpret_cast<const float4*>(base)[(kk >> 1) * 512 + p * 8 + phys];
}
// The same channels of a slot of 16-bit elements (boxes of 64 channels, 128-byte rows, the same swizzle),
// one 8-byte load, as floats.
template <typename T>
__device__ __forceinline__ float4 slot_chunk4(const T* base, int p, int kk, int t) {
  if constexpr (!WgElem<T>::kHalf) {
    return swizzled_chunk4(base, p, kk, t);
  } else {
    const int phys = (2 * (kk & 3) + (t >> 1)) ^ (p & 7);
    const uint2 u = reinterpret_cast<const uint2*>(base)[(kk >> 2) * 1024 + p * 16 + 2 * phys + (t & 1)];
    const float2 lo = unpack2<T>(u.x), hi = unpack2<T>(u.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}
// One row's LayerNorm statistics from the lane's NK chunks (a quad holds the row, its sums combined by
// shuffles; chunks >= nvalid are the zero-filled channels C..KC-1; FULL: C == KC, no such chunks):
// ln_stats' corrected two-sweep. FULL is a template argument so that the full-width path has no
// per-chunk branch (a basic block per chunk would keep the compiler from interleaving the rows'
// independent sums). Invalid pairs (edge tiles, ok = false) get rstd = 0, so that their s is 0.
// WIDE (the KC = 128 build, C > 64): the four partial sums start from the first four chunks instead of 0
// (no adds to 0), the second sweep sums d^2 and d as FFMA / FADD chains (12 instructions per chunk
// instead of 14), and v's valid chunks are overwritten with d = x - m (m: the first sweep's mean) while
// `mean` gets delta = d1 / C, the amount by which ln_stats' mean exceeds m, so that x - mean = d - delta
// (term_ffma).
template <int NK, bool FULL, bool WIDE>
__device__ __forceinline__ void row_stats(float4 (&v)[NK], int nvalid, float inv_c, float eps, bool ok,
                                          float& mean, float& rstd) {
  static_assert(!WIDE || NK >= 4, "the wide statistics start from four chunks");
  float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const float cs = (v[kk].x + v[kk].y) + (v[kk].z + v[kk].w);
    if (WIDE && kk < 4) s4[kk] = cs;  // chunks 0..3 hold channels < 64 < C
    else s4[kk & 3] += cs;
  }
  float sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  const float m = sum * inv_c;
  float m4[4] = {0.f, 0.f, 0.f, 0.f}, e4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    if (FULL || kk < nvalid) {  // channels >= C are zero-filled: (0 - mean)^2 must not count
      const float dx = v[kk].x - m, dy = v[kk].y - m, dz = v[kk].z - m, dw = v[kk].w - m;
      if constexpr (WIDE) v[kk] = make_float4(dx, dy, dz, dw);
      if constexpr (WIDE) {
        float& a = m4[kk & 3];
        float& e = e4[kk & 3];
        if (kk < 4) {
          a = dx * dx;
          e = (dx + dy) + (dz + dw);
        } else {
          a = fmaf(dx, dx, a);
          e = ((e + dx) + dy + dz) + dw;
        }
        a = fmaf(dw, dw, fmaf(dz, dz, fmaf(dy, dy, a)));
      } else {
        m4[kk & 3] += (dx * dx + dy * dy) + (dz * dz + dw * dw);
        e4[kk & 3] += (dx + dy) + (dz + dw);
      }
    }
  }
  float m2 = (m4[0] + m4[1]) + (m4[2] + m4[3]), d1 = (e4[0] + e4[1]) + (e4[2] + e4[3]);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 1);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 2);
  d1 += __shfl_xor_sync(0xffffffffu, d1, 1);
  d1 += __shfl_xor_sync(0xffffffffu, d1, 2);
  float rs;
  ln_stats(m, d1, m2, inv_c, eps, mean, rs);
  if constexpr (WIDE) mean = d1 * inv_c;
  rstd = ok ? rs : 0.f;
}
// The statistics of rows R0, R0 + 1 of v (one half: the tile's or the mirror's rows p0, p0 + 8), with
// one uniform branch on C == KC around both rows. WIDE: row_stats' (mean gets delta, v gets d).
template <int NK, int R0, bool WIDE>
__device__ __forceinline__ void half_stats(float4 (&v)[4][NK], int C, float inv_c, float eps, bool ok0,
                                           bool ok1, float (&mean)[4], float (&rstd)[4]) {
  if (C == 16 * NK) {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r)
      row_stats<NK, true, WIDE>(v[r], NK, inv_c, eps, (r & 1) ? ok1 : ok0, mean[r], rstd[r]);
  } else {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r)
      row_stats<NK, false, WIDE>(v[r], C / 16, inv_c, eps, (r & 1) ? ok1 : ok0, mean[r], rstd[r]);
  }
}
// The 16-bit build's statistics of one row (KC = 128, C > 64; a quad holds the row as in row_stats): a
// first sweep's mean m = sum / C, corrected once by its exact residual fmaf(-m, C, sum) (so that m is the
// row's value on a row of one value at any C: the sum of C equal 16-bit values is exact in fp32), then
// var = sum d^2 / C with d = x - m over the valid channels; v's valid chunks are overwritten with d. m is
// within about an ulp of the mean, so the fp32 build's correction by sum d would move s by ~2^-24 |m| rstd,
// far below the rounding of s to 16 bits that follows; without it the second sweep is one FADD and one
// FFMA per value. Invalid pairs (ok = false) get rstd = 0.
template <int NK, bool FULL>
__device__ __forceinline__ void row_stats16(float4 (&v)[NK], int nvalid, float cf, float inv_c, float eps, bool ok,
                                            float& rstd) {
  static_assert(NK >= 4, "the sums start from four chunks");
  float s4[4];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const float cs = (v[kk].x + v[kk].y) + (v[kk].z + v[kk].w);
    if (kk < 4) s4[kk] = cs;  // chunks 0..3 hold channels < 64 < C
    else s4[kk & 3] += cs;
  }
  float sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  float m = sum * inv_c;
  m = fmaf(fmaf(-m, cf, sum), inv_c, m);
  float a4[4];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    if (FULL || kk < nvalid) {  // channels >= C are zero-filled: (0 - m)^2 must not count
      const float4 d = make_float4(v[kk].x - m, v[kk].y - m, v[kk].z - m, v[kk].w - m);
      v[kk] = d;
      float& a = a4[kk & 3];
      a = kk < 4 ? d.x * d.x : fmaf(d.x, d.x, a);
      a = fmaf(d.w, d.w, fmaf(d.z, d.z, fmaf(d.y, d.y, a)));
    }
  }
  float m2 = (a4[0] + a4[1]) + (a4[2] + a4[3]);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 1);
  m2 += __shfl_xor_sync(0xffffffffu, m2, 2);
  rstd = ok ? rsqrtf(m2 * inv_c + eps) : 0.f;
}
// row_stats16 of rows R0, R0 + 1 of v (one half), one uniform branch on C == KC around both.
template <int NK, int R0>
__device__ __forceinline__ void half_stats16(float4 (&v)[4][NK], int C, float inv_c, float eps, bool ok0, bool ok1,
                                             float (&rstd)[4]) {
  const float cf = static_cast<float>(C);
  if (C == 16 * NK) {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r) row_stats16<NK, true>(v[r], NK, cf, inv_c, eps, (r & 1) ? ok1 : ok0, rstd[r]);
  } else {
#pragma unroll
    for (int r = R0; r < R0 + 2; ++r)
      row_stats16<NK, false>(v[r], C / 16, cf, inv_c, eps, (r & 1) ? ok1 : ok0, rstd[r]);
  }
}
// s = ((xa - ma) ra + (xb - mb) rb) / 2 per channel (the LayerNorm affine is folded into W1; r = rstd / 2
// here) from one term per side. Each product is rounded on its own (no FMA contraction between the
// sides), and both sides of a pair and both roles of a position (tile row, mirror row) go through the
// same expression, so s(i, j) == s(j, i) bit for bit.
// term_sub_mul: (x - mean) r (KC = 64 build).
__device__ __forceinline__ float4 term_sub_mul(const float4& x, float m, float r) {
  return make_float4(__fmul_rn(x.x - m, r), __fmul_rn(x.y - m, r), __fmul_rn(x.z - m, r), __fmul_rn(x.w - m, r));
}
// term_ffma: the same term from the statistics' d = x - m and delta (row_stats' WIDE) as one FFMA per
// channel, fmaf(d, r, -delta r) = (d - delta) r with a single rounding; the mean itself is never rounded.
__device__ __forceinline__ float4 term_ffma(const float4& d, float delta, float r) {
  const float c = -delta * r;
  return make_float4(fmaf(d.x, r, c), fmaf(d.y, r, c), fmaf(d.z, r, c), fmaf(d.w, r, c));
}
// s = pa + pb from the two sides' terms of chunk kk, split into the A fragments of k steps 2 kk and 2 kk + 1
// (fragment row h: 0 for g, 1 for g + 8): column t of k step 2 kk is channel + 0, column t + 4 channel + 1;
// k step 2 kk + 1: + 2, + 3. Split as split_tf32_fast (hi rounded, lo truncated by the mask or the tensor cores).
template <int KC, bool MASK_LO>
__device__ __forceinline__ void s_fragments(const float4& pa, const float4& pb, int kk, int h,
                                            uint32_t (&ah)[KC / 8][4], uint32_t (&al)[KC / 8][4]) {
  split_tf32_fast<MASK_LO>(__fadd_rn(pa.x, pb.x), ah[2 * kk][h], al[2 * kk][h]);
  split_tf32_fast<MASK_LO>(__fadd_rn(pa.y, pb.y), ah[2 * kk][2 + h], al[2 * kk][2 + h]);
  split_tf32_fast<MASK_LO>(__fadd_rn(pa.z, pb.z), ah[2 * kk + 1][h], al[2 * kk + 1][h]);
  split_tf32_fast<MASK_LO>(__fadd_rn(pa.w, pb.w), ah[2 * kk + 1][2 + h], al[2 * kk + 1][2 + h]);
}
// The 16-bit build's s = pa + pb of chunk kk as k step kk's A registers in T (fragment row h): channels + 0,
// + 1 into a[h], + 2, + 3 into a[2 + h] (gemm1_channel16), each sum rounded to T once.
template <typename T, int KS>
__device__ __forceinline__ void s_fragments16(const float4& pa, const float4& pb, int kk, int h, uint32_t (&a)[KS][4]) {
  a[kk][h] = pack2<T>(__fadd_rn(pa.x, pb.x), __fadd_rn(pa.y, pb.y));
  a[kk][2 + h] = pack2<T>(__fadd_rn(pa.z, pb.z), __fadd_rn(pa.w, pb.w));
}
// The 16-bit KC = 128 build's s of chunk kk: the tile half's term ua = da ra (row_stats16's d times r) plus the
// mirror's db rb as one FFMA, s = fmaf(db, rb, ua), rounded to T once (registers as s_fragments16). The two sides
// do not enter alike, so s(i, j) and s(j, i) may differ in the last bit: the kernel writes out[b,i,j] and
// out[b,j,i] from the position with i <= j only (a diagonal tile holds both).
template <typename T, int KS>
__device__ __forceinline__ void s_fragments16_fma(const float4& ua, const float4& db, float rb, int kk, int h,
                                                  uint32_t (&a)[KS][4]) {
  a[kk][h] = pack2<T>(fmaf(db.x, rb, ua.x), fmaf(db.y, rb, ua.y));
  a[kk][2 + h] = pack2<T>(fmaf(db.z, rb, ua.z), fmaf(db.w, rb, ua.w));
}

// The wgmma kernel's parameters, packed once per call into the layout the kernel keeps in shared memory (one bulk
// copy per block then). fp32 input: wpack = [W1' hi | W1' lo (HP x KC each, plane_offset order of rows n,
// logical k) | W2 hi | W2 lo (HP x HP) | b1' | b2 | w3 (HP each)]; 16-bit input T: [W1' | W2 (T, plane_offset16
// order) | b1' | b2 | w3 (fp32)]. Zero outside n < H, c < C. One thread per weight element (W1' = W1 gamma in
// fp32, then split or rounded to T once), then one warp per hidden unit n for b1'[n] = b1[n] + sum_c W1[n][c]
// beta[c] (fp64). The parameters are T, like the input.
// Weight v at (n, k) of a plane of NR rows: fp32 split into hi at plane and lo at plane + lo_off
// (plane_offset), 16-bit T rounded once (plane_offset16).
template <typename T>
__device__ __forceinline__ void pack_weight(float* plane, int lo_off, int NR, int n, int k, float v) {
  if constexpr (WgElem<T>::kHalf) {
    reinterpret_cast<T*>(plane)[plane_offset16(n, k, NR)] = from_f32<T>(v);
  } else {
    uint32_t hi, lo;
    split_tf32(v, hi, lo);
    plane[plane_offset(n, k, NR)] = __uint_as_float(hi);
    plane[lo_off + plane_offset(n, k, NR)] = __uint_as_float(lo);
  }
}
template <typename T, int KC, int HP>
constexpr int kWgPackFloats = WgElem<T>::kHalf ? (HP * KC + HP * HP) / 2 + 3 * HP : 2 * HP * KC + 2 * HP * HP + 3 * HP;
template <typename T, int KC, int HP>
__global__ void __launch_bounds__(256) contact_map_wgmma_params_kernel(
    const T* __restrict__ ln_w, const T* __restrict__ ln_b, const T* __restrict__ w1,
    const T* __restrict__ b1, const T* __restrict__ w2, const T* __restrict__ b2,
    const T* __restrict__ w3, int C, int H, float* __restrict__ wpack, int* __restrict__ tile_counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the wgmma kernel may start its tile copies
#endif
  constexpr bool kHalf = WgElem<T>::kHalf;
  const int e = blockIdx.x * 256 + threadIdx.x;
  if (e == 0 && tile_counter != nullptr) *tile_counter = 0;  // the tile tickets (read after griddepcontrol.wait)
  float* w2p = wpack + (kHalf ? HP * KC / 2 : 2 * HP * KC);
  float* vec = w2p + (kHalf ? HP * HP / 2 : 2 * HP * HP);
  if (e < HP * KC) {
    const int n = e / KC, k = e % KC, c = kHalf ? gemm1_channel16(k) : gemm1_channel(k);
    const float v = n < H && c < C ? to_f32(__ldg(w1 + static_cast<long long>(n) * C + c)) * to_f32(__ldg(ln_w + c)) : 0.f;
    pack_weight<T>(wpack, HP * KC, HP, n, k, v);
  } else if (e < HP * KC + HP * HP) {
    const int ee = e - HP * KC, n = ee / HP, k = ee % HP, h = kHalf ? k : gemm2_unit(k);
    const float v = n < H && h < H ? to_f32(__ldg(w2 + static_cast<long long>(n) * H + h)) : 0.f;
    pack_weight<T>(w2p, HP * HP, HP, n, k, v);
  } else {
    const int n = (e - HP * KC - HP * HP) >> 5, lane = threadIdx.x & 31;  // whole warps (HP * KC + HP * HP % 32 == 0)
    if (n >= HP) return;
    double acc = 0.0;
    if (n < H)
      for (int c = lane; c < C; c += 32)
        acc += static_cast<double>(to_f32(__ldg(w1 + static_cast<long long>(n) * C + c))) *
               static_cast<double>(to_f32(__ldg(ln_b + c)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
      vec[n] = n < H ? static_cast<float>(static_cast<double>(to_f32(__ldg(b1 + n))) + acc) : 0.f;
      vec[HP + n] = n < H ? to_f32(__ldg(b2 + n)) : 0.f;
      vec[2 * HP + n] = n < H ? to_f32(__ldg(w3 + n)) : 0.f;
    }
  }
}


#if defined(CM_WG_DEVICE)
// k steps per promotion (16 k): the tensor cores' own accumulation truncates, so each chunk of
// kPromoSteps k steps (lo*hi, hi*lo, hi*hi each) goes into a fresh accumulator that is then added to acc
// in fp32. (64 k per chunk, as outer_wg, measured up to 3.1x the fp32 reference's max error against
// fp64 here; 16 k: at most 1.55x; NOTES.md.)
constexpr int kPromoSteps = 2;
template <int NA>
__device__ __forceinline__ void wg_promote(float (&acc)[NA], float (&d)[NA], bool first) {
  wg_fence(d);
#pragma unroll
  for (int e = 0; e < NA; ++e) acc[e] = first ? d[e] : acc[e] + d[e];
}
template <int HP, int KS>
__device__ __forceinline__ void wg_chunk(float (&d)[HP / 2], const uint32_t (&ah)[KS][4], const uint32_t (&al)[KS][4],
                                          int c0, uint64_t dh, uint64_t dl) {
  constexpr uint64_t kStep = (HP * 8 * 4) >> 4;  // descriptor increment per k step (HP x 8 floats)
  wg_fence(d);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int i = 0; i < kPromoSteps; ++i) {
    const int ks = c0 + i;
    wgmma_rs<HP>(d, al[ks], dh + ks * kStep, i == 0 ? 0 : 1);  // the small terms first
    wgmma_rs<HP>(d, ah[ks], dl + ks * kStep, 1);
    wgmma_rs<HP>(d, ah[ks], dh + ks * kStep, 1);
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// acc = A B^T over KS k steps: chunks alternate between d0 and d1, so that one is on the tensor cores
// while the other is promoted.
template <int HP, int KS>
__device__ __forceinline__ void wg_gemm(const uint32_t (&ah)[KS][4], const uint32_t (&al)[KS][4], uint64_t dh,
                                         uint64_t dl, float (&d0)[HP / 2], float (&d1)[HP / 2], float (&acc)[HP / 2]) {
  constexpr int NCH = KS / kPromoSteps;
  static_assert(KS % kPromoSteps == 0, "k steps per chunk");
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    if (c & 1) wg_chunk<HP, KS>(d1, ah, al, c * kPromoSteps, dh, dl);
    else wg_chunk<HP, KS>(d0, ah, al, c * kPromoSteps, dh, dl);
    if (c > 0) {
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // chunk c - 1 is done
      if ((c - 1) & 1) wg_promote(acc, d1, c == 1);
      else wg_promote(acc, d0, c == 1);
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  if ((NCH - 1) & 1) wg_promote(acc, d1, NCH == 1);
  else wg_promote(acc, d0, NCH == 1);
}
// The 16-bit build's acc = A B^T over KS k steps of 16 in T, one accumulation chain (the operands are
// rounded to T already: the tensor cores' truncating accumulation adds little to that), B by descriptor db.
template <typename T, int HP, int KS>
__device__ __forceinline__ void wg_gemm16(const uint32_t (&a)[KS][4], uint64_t db, float (&acc)[HP / 2]) {
  constexpr uint64_t kStep = (HP * 16 * 2) >> 4;  // descriptor increment per k step (HP x 16 elements)
  wg_fence(acc);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) wgmma_rs16<T, HP>(acc, a[ks], db + ks * kStep, ks == 0 ? 0 : 1);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  wg_fence(acc);
}
#endif

}  // namespace contact_map
