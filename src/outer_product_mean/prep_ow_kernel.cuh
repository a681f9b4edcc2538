// outer_product_mean: outer_wg's LayerNorm + projections on mma.sync (opm_prep_ow_kernel and its parameters).
#pragma once
#include "outer_wg.cuh"

namespace opm {

// outer_wg's LayerNorm + projections on the tensor cores (mma.sync split TF32), writing Aow and Bow
// directly: no aT / bq in global memory and no pack of them (opm_ow_params_kernel, opm_prep_ow_kernel).
// The LayerNorm affine is folded into the weights:
//   y[r, o] = rstd_r * sum_k (x[r, k] - mean_r) Wg[o, k] + bias'[o],    a / b = y * mask[r]
//   Wg[o, k] = gamma[k] W[o, k],  bias'[o] = bias[o] + sum_k beta[k] W[o, k]   (fp64 sum)
// with o < 32 the a channels (Wa row o) and o >= 32 the b channels (Wb row o - 32), zero where
// o % 32 >= c: the reference's (x_hat gamma + beta) . W + bias, summed in another order.
// Wf: Wg split into TF32 hi / lo planes in mma.sync B-fragment order, zero for k >= c_m:
//   Wf[((u * 8 + nt) * 2 + plane) * 128 + lane * 4 + e] = plane of Wg[8 nt + lane / 4, 16 u + 4 (lane % 4) + e]
// (the k order of opm_prep_ow_kernel: in each 16-k group u, lane t's k = 16u + 4t + {0, 1} make
// mma step 0's columns t and t + 4, and 16u + 4t + {2, 3} step 1's).
// For float16 / bfloat16 msa (w16) the products run on mma.sync m16n8k16 in float16 instead:
//   y[r, o] = isc[o] sum_k xn[r, k] (sc[o] Wg[o, k]) + bias'[o],   xn = (x - mean_r) rstd_r
// with sc[o] = 2^e the power of two that puts max_k |Wg[o, k]| sc[o] in [2^14, 2^15) (no float16
// overflow; the row's large values far above float16's subnormals) and isc[o] = 1 / sc[o]; |xn| <=
// sqrt(c_m), so xn needs no scale. Each operand is rounded to float16 (hi), and for float16 msa also
// split: lo = float16(v - hi), products lo hi + hi lo + hi hi (about 2^-21 relative, as split TF32);
// bfloat16 msa takes hi hi alone (2^-11 per operand, as one TF32 pass, under bfloat16's 2^-8).
// Wf (as float16, U * 8 * 2 * 128 halves, the first half of the float32 layout's space):
//   Wf16[(((u * 8 + nt) * 2 + plane) * 32 + lane) * 4 + e] = plane of sc Wg[8 nt + lane / 4, 16 u + 4 (lane % 4) + e]
// (lane t's k = 16u + 4t + {0, 1} are m16n8k16's k 2t, 2t + 1 (b0), 16u + 4t + {2, 3} its k 2t + 8,
// 2t + 9 (b1), as the x chunk that lane reads: a0 / a2).
// ---------------------------------------------------------------------------------------------
constexpr int kPoLDY = 64 * 4 + 4; // staging row (one n): 64 channels x 4 s, +4: conflict-free stores
constexpr int kPoBiasBlocks = 64;  // opm_ow_params_kernel: one block per channel o

// opm_ow_params_kernel: outer_wg's weight operands in one launch. Blocks [0, kPoBiasBlocks): bias'[o],
//   one block per o (threads over k, fp64), and with w16 also sc[o] and row o of Wf16 (above); the rest,
//   one grid-stride index over Wf's 4-element groups (U * 8 * 32, U = ceil(c_m / 16); none with w16)
//   then WoP's (pack_wop4; with wo16, pack_wop16: float16 blocks), then, where bof is not null, bo as
//   fp32 into bof (c_z). P: the parameters' type (float, __half or __nv_bfloat16), read as fp32.
//   Wf: (U * 8 * 2 * 128) floats (or Wf16) then bias' (64), then isc (64; 1 without w16), as above.
template <typename P>
__global__ void __launch_bounds__(kThreads) opm_ow_params_kernel(
    const P* __restrict__ ln_w, const P* __restrict__ ln_b, const P* __restrict__ wa, const P* __restrict__ ba,
    const P* __restrict__ wb, const P* __restrict__ bb, const P* __restrict__ wo, const P* __restrict__ bo,
    float* __restrict__ Wf, float* __restrict__ biasf, float* __restrict__ bof, void* __restrict__ WoP, int wo16, int w16,
    int cm, int c, int cz, int nzc) {
  const int tid = threadIdx.x;
  const int64_t blk = blockIdx.x;
  const int U = static_cast<int>(cdiv(cm, 16));
  if (blk < kPoBiasBlocks) {
    const int o = static_cast<int>(blk), h = o % 32, lane = tid % 32, warp = tid / 32;
    const P* W = o < 32 ? wa : wb;
    // thread's k = tid + kThreads i: all loads in flight at once, Wg kept for Wf16; the fp64 sums per
    // thread, then per warp by shuffles, then over the warps in order (zeros past c_m add nothing)
    constexpr int KI = kMaxMsaDim / kThreads;
    static_assert(KI * kThreads == kMaxMsaDim, "opm_ow_params_kernel: k chunks cover c_m");
    double acc = 0.0;
    float wg[KI], mx = 0.f;  // Wg[o, k]; max_k |Wg[o, k]|
#pragma unroll
    for (int i = 0; i < KI; ++i) {
      const int k = tid + kThreads * i;
      const bool in = h < c && k < cm;
      const float w = in ? ldg_f(W, static_cast<int64_t>(h) * cm + k) : 0.f;
      acc += static_cast<double>(in ? ldg_f(ln_b, k) : 0.f) * w;
      wg[i] = (in ? ldg_f(ln_w, k) : 0.f) * w;
      mx = fmaxf(mx, fabsf(wg[i]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      acc += __shfl_xor_sync(0xffffffffu, acc, off);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    __shared__ double red_d[kThreads / 32];
    __shared__ float red_m[kThreads / 32];
    if (lane == 0) {
      red_d[warp] = acc;
      red_m[warp] = mx;
    }
    __syncthreads();
    acc = 0.0;
    mx = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      acc += red_d[w];
      mx = fmaxf(mx, red_m[w]);
    }
    // sc = 2^e with mx sc in [2^14, 2^15) (mx = m 2^ex, m in [0.5, 1)); 1 for a zero or non-finite row
    int ex = 0;
    frexpf(mx, &ex);
    const int e = w16 && mx > 0.f && isfinite(mx) ? min(max(15 - ex, -126), 126) : 0;
    if (tid == 0) {
      biasf[o] = h < c ? static_cast<float>(static_cast<double>(ldg_f(o < 32 ? ba : bb, h)) + acc) : 0.f;
      biasf[64 + o] = ldexpf(1.f, -e);
    }
    if (w16) {  // row o of Wf16: k over 16 U (<= kMaxMsaDim), zeros past c_m
      const float sc = ldexpf(1.f, e);
      __half* W16 = reinterpret_cast<__half*>(Wf);
      const int nt = o / 8, g = o % 8;
#pragma unroll
      for (int i = 0; i < KI; ++i) {
        const int k = tid + kThreads * i;
        if (k < 16 * U) {
          const float v = wg[i] * sc;
          const __half hi = from_float<__half>(v), lo = from_float<__half>(v - __half2float(hi));
          const int u = k / 16, t = (k % 16) / 4;
          __half* dst = W16 + ((static_cast<int64_t>(u * 8 + nt) * 2) * 32 + 4 * g + t) * 4 + k % 4;
          dst[0] = hi;
          dst[32 * 4] = lo;
        }
      }
    }
    return;
  }
  const int64_t nF = w16 ? 0 : static_cast<int64_t>(U) * 8 * 32;
  const int64_t nW = static_cast<int64_t>(nzc) * kOwNQ * kOwHC * kOwZ * 8;
  const int64_t nB = bof != nullptr ? cz : 0;  // bo as fp32 (16-bit parameters)
  const int64_t stride = (gridDim.x - kPoBiasBlocks) * static_cast<int64_t>(kThreads);
  for (int64_t e = (blk - kPoBiasBlocks) * kThreads + tid; e < nF + nW + nB; e += stride) {
    if (e >= nF + nW) {
      bof[e - nF - nW] = ldg_f(bo, e - nF - nW);
      continue;
    }
    if (e >= nF) {
      if (wo16) pack_wop16(e - nF, wo, static_cast<__half*>(WoP), c, cz);
      else pack_wop4(e - nF, wo, static_cast<float*>(WoP), c, cz);
      continue;
    }
    const int ln = static_cast<int>(e % 32), nt = static_cast<int>((e / 32) % 8);
    const int64_t u = e / 256;
    const int o = 8 * nt + ln / 4, h = o % 32, k0 = static_cast<int>(16 * u) + 4 * (ln % 4);
    const P* W = o < 32 ? wa : wb;
    float v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      v[q] = (h < c && k0 + q < cm) ? ldg_f(ln_w, k0 + q) * ldg_f(W, static_cast<int64_t>(h) * cm + k0 + q) : 0.f;
    float* dst = Wf + (u * 8 + nt) * 256 + ln * 4;
    store_split4(dst, dst + 128, v[0], v[1], v[2], v[3]);
  }
}

// opm_prep_ow_kernel<MT>'s x tile: 16 MT rows of LDX floats (po_ldx: c_m rounded up to 4, then to
// 16 mod 32 words), or the staging (4 MT rows of kPoLDY) that reuses it.
__host__ __device__ __forceinline__ int po_ldx(int cm) {
  const int l = (cm + 3) & ~3;
  return l + ((16 - l % 32) + 32) % 32;
}
__host__ __device__ __forceinline__ int po_tile_floats(int cm, int MT) {
  const int x = 16 * MT * po_ldx(cm), y = 4 * MT * kPoLDY;
  return x > y ? x : y;
}

#if defined(OPM_WG_DEVICE)
// Tile wt of opm_prep_ow_kernel (4 s x NW n) -> (b, n0, s0) and its valid s / n counts (rows past S or
// N are zeros). 32-bit decode: the host keeps the tile count under 2^31 (64-bit division is a call).
struct PoTile {
  int64_t b, n0, s0;
  int ns, nn;
};
__device__ __forceinline__ PoTile po_tile(int64_t wt, int64_t NNT, int64_t NSQ, int64_t S, int64_t N, int NW) {
  const uint32_t w = static_cast<uint32_t>(wt), nnt = static_cast<uint32_t>(NNT), nsq = static_cast<uint32_t>(NSQ);
  const uint32_t wq = w / nnt;
  PoTile p;
  p.b = wq / nsq;
  p.n0 = static_cast<int64_t>(NW) * (w - wq * nnt);
  p.s0 = 4 * static_cast<int64_t>(wq - static_cast<uint32_t>(p.b) * nsq);
  p.ns = static_cast<int>(min64(4, max64(0, S - p.s0)));
  p.nn = static_cast<int>(min64(NW, max64(0, N - p.n0)));
  return p;
}
__device__ __forceinline__ bool po_row_ok(const PoTile& p, int rho) { return rho % 4 < p.ns && rho / 4 < p.nn; }
__device__ __forceinline__ int64_t po_row(const PoTile& p, int64_t S, int64_t N, int rho) {  // msa row of rho
  return (p.b * S + p.s0 + rho % 4) * N + p.n0 + rho / 4;
}
// 16-bit x of tile p into the x tile as fp32: warp w's rows rho = w + 4 r (r < RPW), the lane's 8
// values at k = 256 c + 8 lane (c < CPL, k < c_m; c_m % 8 == 0), valid rows only (the rest is zeroed
// apart). Every load of the warp is issued before the first conversion (RPW CPL 16-byte loads in
// flight per lane; a loop over the rows kept one).
template <int RPW, int CPL, typename T>
__device__ __forceinline__ void po_load16(float* xs, int LDX, const T* __restrict__ x, const PoTile& p, int64_t S,
                                          int64_t N, int cm, int warp, int lane) {
  uint4 v[RPW][CPL];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int rho = warp + 4 * r;
    const bool ok = po_row_ok(p, rho);
    const T* src = x + (ok ? po_row(p, S, N, rho) * cm : 0);
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int k = 256 * c + 8 * lane;
      v[r][c] = ok && k < cm ? __ldg(reinterpret_cast<const uint4*>(src + k)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int rho = warp + 4 * r;
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int k = 256 * c + 8 * lane;
      if (po_row_ok(p, rho) && k < cm) {
        const float2 f0 = to_float2<T>(v[r][c].x), f1 = to_float2<T>(v[r][c].y);
        const float2 f2 = to_float2<T>(v[r][c].z), f3 = to_float2<T>(v[r][c].w);
        float* dst = xs + rho * LDX + k;
        *reinterpret_cast<float4*>(dst) = make_float4(f0.x, f0.y, f1.x, f1.y);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(f2.x, f2.y, f3.x, f3.y);
      }
    }
  }
}
// The 16-bit preps' A fragment (opm_prep_ow_kernel, opm_prep16_kernel): the lane's 4 values v (k 16 u + 4 t
// .. + 3) of row half hf (rows g, g + 8) as xn = (v - m) rs rounded to float16 into ah[hf] (k + {0, 1}) and
// ah[hf + 2] (k + {2, 3}); kSplit: also lo = float16(xn - hi) into al.
template <bool kSplit>
__device__ __forceinline__ void po_frag16(float4 v, float m, float rs, int hf, uint32_t (&ah)[4], uint32_t (&al)[4]) {
  const float x0 = (v.x - m) * rs, x1 = (v.y - m) * rs, x2 = (v.z - m) * rs, x3 = (v.w - m) * rs;
  ah[hf] = pack2_16<__half>(x0, x1);
  ah[hf + 2] = pack2_16<__half>(x2, x3);
  if constexpr (kSplit) {
    const float2 h01 = to_float2<__half>(ah[hf]), h23 = to_float2<__half>(ah[hf + 2]);
    al[hf] = pack2_16<__half>(x0 - h01.x, x1 - h01.y);
    al[hf + 2] = pack2_16<__half>(x2 - h23.x, x3 - h23.y);
  }
}
// acc += a b for one m16n8k16 step in float16: kSplit lo hi + hi lo + hi hi into a fresh accumulator, then
// added (B fragment hi bh0 / bh1, lo bl0 / bl1); else hi hi straight into acc.
template <bool kSplit>
__device__ __forceinline__ void po_mma16(float (&acc)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                         uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  if constexpr (kSplit) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma_f16(d, al, bh0, bh1);  // the small terms first
    mma_f16(d, ah, bl0, bl1);
    mma_f16(d, ah, bh0, bh1);
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] += d[q];
  } else {
    mma_f16(acc, ah, bh0, bh1);
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// opm_prep_ow_kernel<MT, T>: LayerNorm + both projections + mask for outer_wg, on mma.sync m16n8k8 in split
//   TF32 for float32 x; for float16 / bfloat16 x on m16n8k16 in float16 (Wf16 above: split for float16, one
//   pass for bfloat16, whose a and b are rounded to 2^-8 after it). A block (4 warps) takes tiles of 4 s x
//   NW = 4 MT n (16 MT msa rows) of one b: s in [s0, s0 + 4) (s0 = 4 sq: a quarter of a 16-s block of the
//   fp32 planes, an eighth of a 32-s block of the T planes), n in [n0, n0 + NW); tiles cover s < kSS KBS
//   (kSS = ow_block_s<T>) and n < 16 NIT; rows past S or N are zeros and give zeros (mask 0, rstd 0).
//   Warp w computes channels o in [16 w, 16 w + 16) (two n8 tiles) for all the tile's rows, so each
//   weight fragment feeds MT m16 tiles. Per tile:
//   (1) x rows -> shared memory, row rho = 4 n_l + s_l at rho * LDX (LDX = 16 mod 32 words: the
//       fragment loads below are conflict-free): zeros for rows past S / N and columns [c_m, 16 U),
//       then one bulk copy per row (thread rho) on one mbarrier when c_m % 4 == 0, else plain loads;
//       float16 / bfloat16 x (T): 16-byte loads of 8 values per lane when c_m % 8 == 0, all of a
//       warp's rows in flight at once (po_load16), else one value per load; converted to fp32 into
//       the same tile.
//   (2) statistics, warp w < 2 MT for rows [8 w, 8 w + 8) (at MT 1 warps 2, 3 wait): lane (g, t) sums
//       the 16-byte chunks 4u + t of row 8 w + g; two passes (mean, then the centred sum of squares:
//       no cancellation at large offsets), 2 shuffles each; mean, rstd and the mask to st_s.
//   (3) y = (x - mean) . Wg over K = 16 U: per 16-k group u the lane's x chunk holds its two
//       A-fragment columns of two mma k steps (Wf's k order); B fragments from Wf (L1 / L2) in a
//       register ring of kWR groups (below), its first groups loaded during (2); per k step
//       the small terms, then hi*hi, into a fresh accumulator, promoted into fp32 by ordinary adds
//       (promoting once per group instead measured no faster: 151 vs 146 us at crop); one pass:
//       hi*hi into the running accumulator. 16-bit x: y = xn . (sc Wg), each 16-k group one
//       m16n8k16 k step (the lane's chunk is its a0 / a1 and a2 / a3 pairs), the split's three
//       products per group into a fresh accumulator, promoted as above.
//   (4) y * rstd + bias' (16-bit x: y * isc + bias'), times the mask, staged as ys[n_l][o][s_l] (row
//       kPoLDY) over the x tile, then read as 4 s of one (n, o) (16 bytes), split, and written to both
//       planes of Aow (o < 32) or Bow (o >= 32; j < 4 NBB): 8 lanes write 128 contiguous bytes per plane;
//       for T, rounded to T and written as 8 bytes at ow_off16h of the block (8 lanes: 8 rows of one core
//       matrix).
//       With a_rows (not null; hidden_dim 32), also a and b as rows: a_rows, b_rows (B, S, N, 32) fp32,
//       row po_row, channel o % 32, valid rows only (32 lanes write one row's 128 bytes per s): the a,
//       b that the backward takes. kPlanes false: the rows only (Aow, Bow not written).
// Blocks [0, n_den) compute inv_denom instead (inv_denom_cols), concurrently with the tiles.
// Shared memory (dynamic): po_tile_floats(c_m, MT) floats; static: the mbarrier, st_s.
// Assumptions: 128 threads (kPoThreads); Wf, biasf as opm_ow_params_kernel writes them; c_m <= kMaxMsaDim.
// ---------------------------------------------------------------------------------------------
constexpr int kPoThreads = 128;
// Blocks per SM that ptxas is held to: 5 for 16-bit x (96 registers; 37 KB of shared memory per block
// at c_m 256 allow 5 per SM, 4 above c_m 656; left free, ptxas takes up to 168 registers: 3 blocks; 4 blocks
// measured slower, NOTES.md); none for float32 (0 emits no .minnctapersm).
template <typename T>
constexpr int po_min_blocks() { return std::is_same_v<T, float> ? 0 : 5; }
template <int MT, typename T, bool kPlanes>
__global__ void __launch_bounds__(kPoThreads, po_min_blocks<T>()) opm_prep_ow_kernel(
    const T* __restrict__ x, const void* __restrict__ mask, int mask_kind, const float* __restrict__ Wf,
    const float* __restrict__ biasf, void* __restrict__ Aow_v, void* __restrict__ Bow_v, int64_t B, int64_t S,
    int64_t N, int cm, float eps, int64_t KBS, int64_t NIT, int64_t NBB, float* __restrict__ inv_denom, int n_den,
    float* __restrict__ a_rows, float* __restrict__ b_rows) {
#if defined(OPM_WG_DEVICE)
  constexpr int RT = 16 * MT, NW = 4 * MT;  // rows, residues n per tile
  constexpr bool k16 = !std::is_same_v<T, float>;        // 16-bit input: T planes (ow_off16h)
  constexpr int kSS = ow_block_s<T>();                      // s per plane block
  constexpr bool kSplitProj = !std::is_same_v<T, __nv_bfloat16>;  // bfloat16: one pass (hi hi, below)
  using PT = std::conditional_t<k16, T, float>;
  PT* Aow = static_cast<PT*>(Aow_v);
  PT* Bow = static_cast<PT*>(Bow_v);
  if (blockIdx.x < n_den) {  // blocks [0, n_den): inv_denom, beside the tiles (the fused kernel needs it)
    __shared__ double red_f[kPoThreads];
    __shared__ long long red_i[kPoThreads];
    inv_denom_cols(mask, mask_kind, B, S, N, inv_denom, blockIdx.x, n_den, red_f, red_i);
    return;
  }
  extern __shared__ float4 smem_f4[];
  float* xs = reinterpret_cast<float*>(smem_f4);
  __shared__ uint64_t bar;
  __shared__ float st_s[3][RT];  // per row rho: mean, rstd, mask
  const int LDX = po_ldx(cm), U = static_cast<int>(cdiv(cm, 16)), K16 = 16 * U;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  if (tid == 0) {
    mbar_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const bool bulk = (cm & 3) == 0;  // rows are 16-byte multiples at 16-byte aligned addresses
  const int64_t NNT = 16 * NIT / NW, NSQ = (kSS / 4) * KBS, ntiles = B * NSQ * NNT, MBA = 2 * NIT;
  unsigned phase = 0;
  // Wf's B fragments for (3): a ring of kWR 16-k groups in registers, group u in slot u % kWR,
  // refilled with group u + kWR once read, filled after each tile's x loads (its latency under the
  // statistics); (3) runs kWR groups per loop step so that no slot is copied (a one-group ring moved its
  // registers at every step and so waited there for the load just issued). float32: one group (its
  // prep, 146 us at crop, as before; a deeper ring there is not measured). bfloat16 reads no lo plane:
  // those loads are dead and the compiler drops them. Per lane and group one float4 per n8 tile and
  // plane (two TF32 k steps), or one uint2 (Wf16: one float16 k step of 16).
  constexpr int kWR = std::is_same_v<T, float> ? 1 : kSplitProj ? 2 : 4;
  using WV = std::conditional_t<k16, uint2, float4>;
  const WV* wf = reinterpret_cast<const WV*>(Wf) + (2 * warp) * 64 + lane;  // this warp's n8 tiles 2 warp, 2 warp + 1
  WV wh[kWR][2], wl[kWR][2];
  // 16-bit x with c_m % 8 == 0 (16-byte rows): po_load16 with RPW rows x CPL chunks per lane (MT 2
  // takes c_m <= 256, MT 1 c_m <= 768)
  constexpr int RPW = RT / 4, CPL = MT == 2 ? 1 : 3;
  static_assert(MT != 1 || 256 * CPL >= kMaxMsaDim, "opm_prep_ow_kernel: MT 1's chunks cover c_m");
  const bool ld16 = (cm & 7) == 0 && cm <= 256 * CPL;
  for (int64_t wt = blockIdx.x - n_den; wt < ntiles; wt += gridDim.x - n_den) {
    const PoTile p = po_tile(wt, NNT, NSQ, S, N, NW);
    // ---- (1) x -> xs ----
    for (int rho = warp; rho < RT; rho += kPoThreads / 32) {  // zeros: rows past S / N, columns [c_m, 16 U)
      const int c0 = po_row_ok(p, rho) ? cm : 0;
      for (int k = c0 + lane; k < K16; k += 32) xs[rho * LDX + k] = 0.f;
    }
    if constexpr (k16) {
      if (ld16) {
        po_load16<RPW, CPL, T>(xs, LDX, x, p, S, N, cm, warp, lane);
      } else {
        for (int rho = warp; rho < RT; rho += kPoThreads / 32)
          if (po_row_ok(p, rho)) {
            const T* src = x + po_row(p, S, N, rho) * cm;
            for (int k = lane; k < cm; k += 32) xs[rho * LDX + k] = to_float(src[k]);
          }
      }
    } else if (bulk) {
      if (p.ns * p.nn > 0) {
        if (tid == 0) mbar_expect_tx(&bar, static_cast<unsigned>(p.ns * p.nn * cm * 4));
        __syncthreads();  // the expected bytes are set before any copy can complete
        if (tid < RT && po_row_ok(p, tid))
          bulk_copy(xs + tid * LDX, x + po_row(p, S, N, tid) * cm, static_cast<unsigned>(cm * 4), &bar);
        mbar_wait(&bar, phase);
        phase ^= 1;
      }
    } else {
      for (int rho = warp; rho < RT; rho += kPoThreads / 32)
        if (po_row_ok(p, rho)) {
          const float* src = x + po_row(p, S, N, rho) * cm;
          for (int k = lane; k < cm; k += 32) xs[rho * LDX + k] = __ldg(src + k);
        }
    }
    // the ring's first groups, loading during the barrier and (2)
#pragma unroll
    for (int r = 0; r < kWR; ++r)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int ur = r < U ? r : U - 1;
        wh[r][j] = __ldg(wf + ur * 512 + j * 64);
        wl[r][j] = __ldg(wf + ur * 512 + j * 64 + 32);
      }
    __syncthreads();  // the tile (zeros and plain loads included) visible to every warp
    // ---- (2) statistics of rows 8 warp + g (warps < RT / 8) ----
    if (warp < RT / 8) {
      const int rho = 8 * warp + g;
      const float4* row = reinterpret_cast<const float4*>(xs + rho * LDX) + t;
      float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int u = 0; u < U; ++u) {  // columns >= c_m are zero
        const float4 v = row[4 * u];
        s4.x += v.x; s4.y += v.y; s4.z += v.z; s4.w += v.w;
      }
      const float mu = quad_sum((s4.x + s4.y) + (s4.z + s4.w)) / cm;
      float4 q4 = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int u = 0; u < U; ++u) {
        const float4 v = row[4 * u];
        const int k = 16 * u + 4 * t;
        const float d0 = k < cm ? v.x - mu : 0.f, d1 = k + 1 < cm ? v.y - mu : 0.f;
        const float d2 = k + 2 < cm ? v.z - mu : 0.f, d3 = k + 3 < cm ? v.w - mu : 0.f;
        q4.x = fmaf(d0, d0, q4.x); q4.y = fmaf(d1, d1, q4.y); q4.z = fmaf(d2, d2, q4.z); q4.w = fmaf(d3, d3, q4.w);
      }
      const float s2 = quad_sum((q4.x + q4.y) + (q4.z + q4.w));
      if (t == 0) {
        st_s[0][rho] = mu;
        // rows past S / N: rstd 0, so their y is 0 * 0 + bias' times mask 0 (1 / sqrt(eps) is inf at eps = 0)
        st_s[1][rho] = po_row_ok(p, rho) ? 1.f / sqrtf(s2 / cm + eps) : 0.f;
        st_s[2][rho] = po_row_ok(p, rho) ? mask_value(mask, po_row(p, S, N, rho), mask_kind) : 0.f;
      }
    }
    __syncthreads();  // st_s complete
    // ---- (3) acc[mt][j][2 hf + e] = sum_k (x - mean)[row 16 mt + 8 hf + g][k] Wg[16 warp + 8 j + 2 t + e][k] ----
    // (16-bit x: sum_k xn[row][k] sc Wg[o][k], xn = (x - mean) rstd, on m16n8k16 in float16)
    float mean[MT][2], rstd[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        mean[mt][hf] = st_s[0][16 * mt + 8 * hf + g];
        if constexpr (k16) rstd[mt][hf] = st_s[1][16 * mt + 8 * hf + g];
      }
    float acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mt][j][q] = 0.f;
#pragma unroll 1
    for (int u0 = 0; u0 < U; u0 += kWR) {
#pragma unroll
      for (int r = 0; r < kWR; ++r) {
        const int u = u0 + r;
        if (u >= U) break;
        if constexpr (k16) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t ah[4], al[4];  // m16n8k16 A fragment: the lane's chunk of rows g (hf 0) and g + 8 (hf 1)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              // columns >= c_m hold zeros, so -mean rstd there; Wf16 is zero there (finite values give 0)
              const float4 v = reinterpret_cast<const float4*>(xs + (16 * mt + 8 * hf + g) * LDX)[4 * u + t];
              po_frag16<kSplitProj>(v, mean[mt][hf], rstd[mt][hf], hf, ah, al);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j)
              po_mma16<kSplitProj>(acc[mt][j], ah, al, wh[r][j].x, wh[r][j].y, wl[r][j].x, wl[r][j].y);
          }
        } else {
          const uint32_t bh[2][2][2] = {  // [j][k step][b register]
              {{__float_as_uint(wh[r][0].x), __float_as_uint(wh[r][0].y)}, {__float_as_uint(wh[r][0].z), __float_as_uint(wh[r][0].w)}},
              {{__float_as_uint(wh[r][1].x), __float_as_uint(wh[r][1].y)}, {__float_as_uint(wh[r][1].z), __float_as_uint(wh[r][1].w)}}};
          const uint32_t bl[2][2][2] = {
              {{__float_as_uint(wl[r][0].x), __float_as_uint(wl[r][0].y)}, {__float_as_uint(wl[r][0].z), __float_as_uint(wl[r][0].w)}},
              {{__float_as_uint(wl[r][1].x), __float_as_uint(wl[r][1].y)}, {__float_as_uint(wl[r][1].z), __float_as_uint(wl[r][1].w)}}};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t ah[2][4], al[2][4];  // [k step][fragment register]
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              // columns >= c_m hold zeros, so -mean there; Wg is zero there (finite means give 0)
              const float4 v = reinterpret_cast<const float4*>(xs + (16 * mt + 8 * hf + g) * LDX)[4 * u + t];
              split_tf32(v.x - mean[mt][hf], ah[0][hf], al[0][hf]);
              split_tf32(v.y - mean[mt][hf], ah[0][hf + 2], al[0][hf + 2]);
              split_tf32(v.z - mean[mt][hf], ah[1][hf], al[1][hf]);
              split_tf32(v.w - mean[mt][hf], ah[1][hf + 2], al[1][hf + 2]);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
              for (int st = 0; st < 2; ++st) {
                if constexpr (kSplitProj) {
                  float d[4] = {0.f, 0.f, 0.f, 0.f};
                  mma_tf32(d, al[st], bh[j][st][0], bh[j][st][1]);  // the small terms first
                  mma_tf32(d, ah[st], bl[j][st][0], bl[j][st][1]);
                  mma_tf32(d, ah[st], bh[j][st][0], bh[j][st][1]);
#pragma unroll
                  for (int q = 0; q < 4; ++q) acc[mt][j][q] += d[q];
                } else {
                  mma_tf32(acc[mt][j], ah[st], bh[j][st][0], bh[j][st][1]);
                }
              }
          }
        }
        if (u + kWR < U) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            wh[r][j] = __ldg(wf + (u + kWR) * 512 + j * 64);
            wl[r][j] = __ldg(wf + (u + kWR) * 512 + j * 64 + 32);
          }
        }
      }
    }
    // ---- (4) staging: ys[n_l * kPoLDY + 4 o + s_l], row rho = 16 mt + 8 hf + g -> n_l = rho / 4, s_l = g % 4 ----
    __syncthreads();  // every warp's reads of xs are done: ys overwrites it
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int rho = 16 * mt + 8 * hf + g;
        const float rs = st_s[1][rho], mr = st_s[2][rho];
        float* yrow = xs + (rho / 4) * kPoLDY + rho % 4;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int o = 16 * warp + 8 * j + 2 * t + e;
            // (16-bit x: rstd is in xn, and isc[o], after bias', undoes Wf16's row scale exactly)
            const float f = k16 ? __ldg(biasf + 64 + o) : rs;
            yrow[4 * o] = (acc[mt][j][2 * hf + e] * f + __ldg(biasf + o)) * mr;
          }
      }
    __syncthreads();  // ys complete
    const int64_t kb = p.s0 / kSS, quad = (p.s0 % kOwSK) / 4;  // (quad: the fp32 planes' 16-s blocks)
#pragma unroll
    for (int iu = 0; iu < NW * 64 / kPoThreads; ++iu) {  // unit e = (n_l, o): o = e % 64 (lanes along o)
      const int e = tid + kPoThreads * iu, n_l = e / 64, o = e % 64;
      const float4 v = *reinterpret_cast<const float4*>(xs + n_l * kPoLDY + 4 * o);
      const int64_t n = p.n0 + n_l;
      if (a_rows != nullptr && n_l < p.nn) {  // rows (b, s0 + s_l, n): po_row of rho = 4 n_l + s_l
        float* dst = (o < 32 ? a_rows : b_rows) + ((p.b * S + p.s0) * N + n) * 32 + o % 32;
        const int64_t step = N * 32;
        if (p.ns > 0) dst[0] = v.x;
        if (p.ns > 1) dst[step] = v.y;
        if (p.ns > 2) dst[2 * step] = v.z;
        if (p.ns > 3) dst[3 * step] = v.w;
      }
      if (!kPlanes) continue;
      if constexpr (k16) {  // 4 s of one row: 8 bytes at ow_off16h (see "outer_wg": 32-s blocks of T)
        const int ks = static_cast<int>(p.s0 % kSS);
        if (o < 32) {
          const int q = o / 8, hl = o % 8;
          PT* dst = Aow + (((p.b * kOwNQ + q) * KBS + kb) * MBA + n / 8) * kOwABlk16 + ow_off16h(static_cast<int>(n % 8) * 8 + hl, ks);
          *reinterpret_cast<uint2*>(dst) = pack4_16<T>(v.x, v.y, v.z, v.w);
        } else if (n < 4 * NBB) {
          const int k = o - 32;
          PT* dst = Bow + ((p.b * NBB + n / 4) * KBS + kb) * kOwBBlk16 + ow_off16h(static_cast<int>(n % 4) * 32 + k, ks);
          *reinterpret_cast<uint2*>(dst) = pack4_16<T>(v.x, v.y, v.z, v.w);
        }
      } else if (o < 32) {
        const int q = o / 8, hl = o % 8;
        float* dst = Aow + (((p.b * kOwNQ + q) * KBS + kb) * MBA + n / 8) * (2 * kOwAPlane) + (n % 8) * 128 + quad * 32 + hl * 4;
        store_split4(dst, dst + kOwAPlane, v.x, v.y, v.z, v.w);
      } else if (n < 4 * NBB) {
        const int k = o - 32;
        float* dst = Bow + ((p.b * NBB + n / 4) * KBS + kb) * (2 * kOwBPlane) + ((n % 4) * 4 + k / 8) * 128 + quad * 32 + (k % 8) * 4;
        store_split4(dst, dst + kOwBPlane, v.x, v.y, v.z, v.w);
      }
    }
    // every thread's generic accesses of xs ordered before the next tile's bulk copies
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
  }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
