// outer_product_mean: opm_prep16_kernel, the 16-bit prep in warp tiles.
#pragma once
#include "prep_ow_kernel.cuh"

namespace opm {

// opm_prep16_kernel<T, kPlanes, kU>: opm_prep_ow_kernel's work for a 16-bit msa (T float16 / bfloat16) with
//   c_m % 16 == 0 and c_m <= 256, every warp on its own tiles: no block barrier after the block's weights
//   are staged. A warp tile is 8 s x 2 n (16 msa rows) of one b: s in [s0, s0 + 8) (s0 = 8 sq), n in
//   [n0, n0 + 2); tiles cover s < kOwS16 KBS and n < 16 NIT, rows past S or N give zeros (mask 0, rstd 0).
//   Lane (g, t) owns rows (s0 + g, n0 + hf) (hf = 0, 1: m16n8k16's rows g and g + 8) and in each 16-k
//   group u the 4 values k = 16 u + 4 t .. + 3 of both, which are its A fragment in Wf16's k order
//   (fragment registers 0 / 1, rows g / g + 8, hold k 16 u + 4 t + {0, 1}; registers 2 / 3 hold + {2, 3}).
//   Per tile:
//   (1) every 8-byte load of the lane's 2 x c_m / 4 values issued at once (c_m / 2 16-bit values in c_m / 4
//       registers; 64 where U is a run-time value), the rows' mask values;
//   (2) statistics as opm_prep_ow_kernel's: the lane sums its chunk of each row over u (4 partial sums),
//       then the quad by 2 shuffles; two passes (mean, then the centred sum of squares);
//   (3) y = xn . (sc Wg) on m16n8k16 in float16, xn = (x - mean) rstd rounded to float16 (float16 msa:
//       split, lo hi + hi lo + hi hi per group into a fresh accumulator, then added), all 8 n8 tiles of
//       o (a and b channels) per warp, B fragments from the block's copy of Wf16 in shared memory (one
//       16-byte load per lane for two n8 tiles' hi, or one tile's hi and lo);
//   (4) (y isc + bias') mask: where a_rows is not null, written as fp32 rows (as opm_prep_ow_kernel's);
//       where kPlanes, rounded to T and staged as ys[hf][o][s_l] in the warp's shared memory, then each
//       (n, o) written as 16 bytes (8 s: one row of a core matrix) at ow_off16h of the Aow / Bow block.
//   Every operation and its order per a / b value is opm_prep_ow_kernel's, so a and b are bit-equal
//   (the planes hold the same values rounded to T by the same rounding). inv_denom: inv_denom_cols adds
//   blockDim.x / 32 partial sums per column, 8 here against 4 there, so a float mask's fp64 sum can
//   differ in its last bit where it is not exact (integer and bool masks sum exactly in int64).
// Blocks [0, n_den) compute inv_denom instead (inv_denom_cols); the host launches at most 2 blocks per
//   SM in all, so that every block is resident from the start (the tiles are split statically).
// kU: c_m / 16 at compile time (16: c_m 256, no guards per group), or 0 (c_m / 16 at run time).
// Shared memory (dynamic, p16_smem_bytes): Wf16's B fragments of the planes read (hi; float16 msa hi and
//   lo), U * 4 * NP x 32 uint4, bias' and isc (128 floats), then per warp ys [2][64][8] T.
// Assumptions: kP16Threads threads; x 8-byte aligned; Wf, biasf as opm_ow_params_kernel writes them with
//   w16; 16 <= c_m <= 256, c_m % 16 == 0; the tile count under 2^31.
// ---------------------------------------------------------------------------------------------
constexpr int kP16Warps = 8, kP16Threads = 32 * kP16Warps, kP16MaxU = 16;  // kP16MaxU: 16-k groups (c_m <= 256)
template <typename T>
__host__ __device__ constexpr int p16_planes() { return std::is_same_v<T, __half> ? 2 : 1; }
template <typename T>
__host__ __device__ constexpr size_t p16_smem_bytes(int cm) {
  return 8ull * (cm / 16) * 8 * p16_planes<T>() * 32 + 4ull * 128 + 2ull * kP16Warps * 2 * 64 * 8;
}
template <typename T, bool kPlanes, int kU>
__global__ void __launch_bounds__(kP16Threads, 2) opm_prep16_kernel(
    const T* __restrict__ x, const void* __restrict__ mask, int mask_kind, const float* __restrict__ Wf,
    const float* __restrict__ biasf, T* __restrict__ Aow, T* __restrict__ Bow, int64_t B, int64_t S, int64_t N,
    int cm, float eps, int64_t KBS, int64_t NIT, int64_t NBB, float* __restrict__ inv_denom, int n_den,
    float* __restrict__ a_rows, float* __restrict__ b_rows) {
#if defined(OPM_WG_DEVICE)
  constexpr bool kSplit = std::is_same_v<T, __half>;  // float16 msa: split products
  constexpr int NP = p16_planes<T>();
  if (blockIdx.x < n_den) {  // blocks [0, n_den): inv_denom, beside the tiles
    __shared__ double red_f[kP16Threads];
    __shared__ long long red_i[kP16Threads];
    inv_denom_cols(mask, mask_kind, B, S, N, inv_denom, blockIdx.x, n_den, red_f, red_i);
    return;
  }
  extern __shared__ uint4 p16_smem[];
  const int U = kU > 0 ? kU : cm / 16;
  const uint4* ws = p16_smem;                                      // B fragments, 16 bytes per lane
  float* bs = reinterpret_cast<float*>(p16_smem + U * 4 * NP * 32);  // bias'[64], isc[64]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  T* ys = reinterpret_cast<T*>(bs + 128) + warp * (2 * 64 * 8);  // [hf][o][s_l]
  {
    // Wf16: [(u * 8 + nt) * 2 + plane][lane] uint2 -> ws: float16 msa [(u * 8 + nt)][lane] (hi, lo),
    // bfloat16 [(u * 4 + nt / 2)][lane] (hi of nt, hi of nt + 1)
    const uint2* src = reinterpret_cast<const uint2*>(Wf);
    for (int i = tid; i < U * 4 * NP * 32; i += kP16Threads) {
      const int f = i / 32, ln = i % 32;
      const uint2 v0 = __ldg(src + (NP == 2 ? 2 * f : 4 * f) * 32 + ln);
      const uint2 v1 = __ldg(src + (NP == 2 ? 2 * f + 1 : 4 * f + 2) * 32 + ln);
      p16_smem[i] = make_uint4(v0.x, v0.y, v1.x, v1.y);
    }
    if (tid < 128) bs[tid] = __ldg(biasf + tid);
  }
  __syncthreads();  // the block's weights staged; from here on every warp runs alone
  const uint32_t NN2 = static_cast<uint32_t>(8 * NIT), NS8 = static_cast<uint32_t>(4 * KBS);
  const uint32_t ntiles = static_cast<uint32_t>(B) * NS8 * NN2, MBA = static_cast<uint32_t>(2 * NIT);
  const uint32_t stride = static_cast<uint32_t>(gridDim.x - n_den) * kP16Warps;
  for (uint32_t wt = static_cast<uint32_t>(blockIdx.x - n_den) * kP16Warps + warp; wt < ntiles; wt += stride) {
    const uint32_t np = wt % NN2, rest = wt / NN2, sq = rest % NS8;
    const int64_t b = rest / NS8, s = 8 * static_cast<int64_t>(sq) + g, n0 = 2 * static_cast<int64_t>(np);
    const int64_t row0 = (b * S + s) * N + n0;  // msa row of hf 0; hf 1 is row0 + 1
    const bool ok[2] = {s < S && n0 < N, s < S && n0 + 1 < N};
    // ---- (1) the lane's values of both rows, all loads in flight; the rows' mask values ----
    uint2 xr[kP16MaxU][2];
#pragma unroll
    for (int u = 0; u < kP16MaxU; ++u)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        xr[u][hf] = ok[hf] && u < U ? __ldg(reinterpret_cast<const uint2*>(x + (row0 + hf) * cm + 16 * u + 4 * t))
                                    : make_uint2(0u, 0u);
    float mk[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) mk[hf] = ok[hf] ? mask_value(mask, row0 + hf, mask_kind) : 0.f;
    // ---- (2) statistics: mean, rstd of rows hf ----
    float mean[2], rstd[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < kP16MaxU; ++u)
        if (u < U) {
          const float2 v01 = to_float2<T>(xr[u][hf].x), v23 = to_float2<T>(xr[u][hf].y);
          s4.x += v01.x; s4.y += v01.y; s4.z += v23.x; s4.w += v23.y;
        }
      const float mu = quad_sum((s4.x + s4.y) + (s4.z + s4.w)) / cm;
      float4 q4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < kP16MaxU; ++u)
        if (u < U) {
          const float2 v01 = to_float2<T>(xr[u][hf].x), v23 = to_float2<T>(xr[u][hf].y);
          const float d0 = v01.x - mu, d1 = v01.y - mu, d2 = v23.x - mu, d3 = v23.y - mu;
          q4.x = fmaf(d0, d0, q4.x); q4.y = fmaf(d1, d1, q4.y); q4.z = fmaf(d2, d2, q4.z); q4.w = fmaf(d3, d3, q4.w);
        }
      const float s2 = quad_sum((q4.x + q4.y) + (q4.z + q4.w));
      mean[hf] = mu;
      rstd[hf] = ok[hf] ? 1.f / sqrtf(s2 / cm + eps) : 0.f;  // rows past S / N: y = bias' times mask 0
    }
    // ---- (3) acc[nt][2 hf + e] = sum_k xn[row hf][k] sc Wg[8 nt + 2 t + e][k] ----
    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
#pragma unroll
    for (int u = 0; u < kP16MaxU; ++u) {
      if (u >= U) break;
      uint32_t ah[4], al[4];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float2 v01 = to_float2<T>(xr[u][hf].x), v23 = to_float2<T>(xr[u][hf].y);
        po_frag16<kSplit>(make_float4(v01.x, v01.y, v23.x, v23.y), mean[hf], rstd[hf], hf, ah, al);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if constexpr (kSplit) {
          const uint4 w = ws[(u * 8 + nt) * 32 + lane];  // hi, lo
          po_mma16<true>(acc[nt], ah, al, w.x, w.y, w.z, w.w);
        } else if (nt % 2 == 0) {
          const uint4 w = ws[(u * 4 + nt / 2) * 32 + lane];  // hi of nt, of nt + 1
          mma_f16(acc[nt], ah, w.x, w.y);
          mma_f16(acc[nt + 1], ah, w.z, w.w);
        }
      }
    }
    // ---- (4) y = (acc isc + bias') mask: fp32 rows and / or the T planes ----
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int o = 8 * nt + 2 * t;
        const float y0 = (acc[nt][2 * hf] * bs[64 + o] + bs[o]) * mk[hf];
        const float y1 = (acc[nt][2 * hf + 1] * bs[64 + o + 1] + bs[o + 1]) * mk[hf];
        if (a_rows != nullptr && ok[hf])  // (B, S, N, 32) fp32: a for o < 32, b above
          *reinterpret_cast<float2*>((nt < 4 ? a_rows : b_rows) + (row0 + hf) * 32 + o % 32) = make_float2(y0, y1);
        if constexpr (kPlanes) {
          ys[(hf * 64 + o) * 8 + g] = from_float<T>(y0);
          ys[(hf * 64 + o + 1) * 8 + g] = from_float<T>(y1);
        }
      }
    if constexpr (kPlanes) {
      __syncwarp();  // ys complete
      const int64_t kb = sq / 4;
      const int ks = 8 * static_cast<int>(sq % 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // unit e = (hf, o): lanes along o
        const int e = lane + 32 * i, hf = e / 64, o = e % 64;
        const uint4 v = *reinterpret_cast<const uint4*>(ys + e * 8);
        const int64_t n = n0 + hf;
        if (o < 32) {
          const int q = o / 8, hl = o % 8;
          T* dst = Aow + (((b * kOwNQ + q) * KBS + kb) * MBA + n / 8) * kOwABlk16 +
                   ow_off16h(static_cast<int>(n % 8) * 8 + hl, ks);
          *reinterpret_cast<uint4*>(dst) = v;
        } else if (n < 4 * NBB) {
          T* dst = Bow + ((b * NBB + n / 4) * KBS + kb) * kOwBBlk16 +
                   ow_off16h(static_cast<int>(n % 4) * 32 + o - 32, ks);
          *reinterpret_cast<uint4*>(dst) = v;
        }
      }
    }
    __syncwarp();  // ys read before the next tile's stores
  }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
