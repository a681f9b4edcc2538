// outer_product_mean: the backward's LayerNorm part.
#pragma once
#include "backward_ab.cuh"

namespace opm {

// The backward's LayerNorm part, each msa row read once (x_in and d_x_in of type T: float32, float16 or
// bfloat16; the mask of its own kind; everything else fp32; hidden_dim 32, msa_dim CM):
//   xhat = (x_in - mean) rstd,  x = xhat ln_w + ln_b            (recomputed; statistics in two passes
//                                                                over the row in registers)
//   dpa = da * mask, dpb = db * mask                             (per row)
//   dy[r, m]  = sum_c dpa[r, c] Wa[c, m] + dpb[r, c] Wb[c, m]
//   d_x_in    = rstd (g - mean_m g - xhat mean_m(g xhat)),  g = dy ln_w
//   dWa[c, m] = sum_r dpa[r, c] x[r, m] (dWb likewise),  d_ln_w = sum_r dy xhat,  d_ln_b = sum_r dy,
//   d_ba = sum_r dpa, d_bb = sum_r dpb
// Persistent blocks of 256 threads (one per SM) take tiles of 32 rows t = blockIdx.x, + gridDim.x, ...;
// double-buffered: while a tile is computed, the block's next tile (x_in by one bulk copy per row into
// rows of LDX = CM + 8 floats, a 16-bit row in the first CM / 2 of them, da and db by one each, all on
// the other buffer's mbarrier; lane 0 of each warp issues 4 rows, warps 0 and 1 also da, db) is in flight;
// a partial last tile (R % 32) is loaded by plain loads with zeros past R; the mask of the block's next tile
// is loaded a tile ahead (threads 0-31, in registers). Wa | Wb (ws, rows of CM + 8) sit in shared memory
// once per block. Per tile:
//   build: dp = (da | db) rows times the mask, split into TF32 hi / lo planes as dp[r][k] (rows of 68)
//     and dp^T[k][r] (rows of 36; 16-bit x: the hi planes alone); thread tid adds channel tid % 64 of
//     rows tid / 64 + 4 i (bias sums);
//     statistics, warp w for rows 4 w .. 4 w + 3 (2 or 4 at once) from registers (one 16- or 8-byte load
//     per 128 columns per lane, two passes), xhat written in place as fp32;
//   dy = dp . W (32 x CM, K = 64) and dW += dp^T . x (64 x CM, K = 32), both on mma.sync m16n8k8 in
//     split TF32 (the small terms, then hi x hi, into a fresh accumulator per k step, added in fp32;
//     16-bit x: single TF32, hi x hi alone);
//     warp w owns columns [w CM / 8, (w + 1) CM / 8) of both (NT = CM / 64 n8 tiles); W and x (= xhat
//     ln_w + ln_b) are split as their B fragments are loaded;
//   per row, the sums of g and g xhat over the warp's columns (quad shuffles), the 8 warps' added in
//     order through shared memory; d_x_in (rounded once to T) staged in the warp's columns of xs, then
//     written by 16-byte stores; d_ln_w, d_ln_b accumulated.
// Each block writes its partial, kLnPart(CM) floats: dWa | dWb (64 x CM), d_ln_w, d_ln_b over the block's rows
// (lanes added by shuffles), d_ba, d_bb; opm_ln_sum_kernel adds them in block order in fp64. ln_part_at says
// where they live: part[blk][...], or (part null: the caller's da, db consumed) the da and db rows of the
// block's own first tiles, read by then, so that the partials take no memory of their own. Staged in shared
// memory first, they go out in float4 stores (a chunk never splits one).
// Conflict-free shared loads: the padded rows (LDX = CM + 8 for xs and ws, 68, 36 floats) put the 32
// lanes of every fragment load in distinct banks.
// D: da and db's element type, float or T (16-bit T only: the rows copied as they are into the first half of their
//   raw rows, widened as the build reads them).
// Assumptions: 256 threads; x_in, da, db 16-byte aligned (the bulk copies); sm_90a (bulk copies, mbarriers).
// ---------------------------------------------------------------------------------------------
constexpr int kLnRows = 32;
__host__ __device__ constexpr int64_t kLnPart(int64_t cm) { return 66 * cm + 64; }
// Floats of one tile's rows of da (or db) of element type D: a chunk of the partials in place.
template <typename D>
constexpr int64_t kLnChunk = kLnRows * 32 * int64_t(sizeof(D)) / 4;
// Where block blk's partial element e (< n = kLnPart(CM)) lives: part[blk n + e]; with part null, chunk q = e /
// kLnChunk<D> is tile blk + (q / 2) blocks's rows of da (q even) or db (q odd). In place only where every block
// owns that many full tiles (ln_part_fits).
template <typename D>
__device__ __forceinline__ float* ln_part_at(float* part, D* da, D* db, int64_t blk, int64_t blocks, int64_t n,
                                             int64_t e) {
  if (part != nullptr) return part + blk * n + e;
  const int64_t q = e / kLnChunk<D>, tt = blk + (q >> 1) * blocks;
  return reinterpret_cast<float*>(((q & 1) ? db : da) + tt * (kLnRows * 32)) + e % kLnChunk<D>;
}
// Whether the partials of `blocks` blocks over R rows fit in place (every chunk a full tile's).
template <typename D>
bool ln_part_fits(int64_t R, int64_t cm, int64_t blocks) {
  const int64_t chunks = (kLnPart(cm) + kLnChunk<D> - 1) / kLnChunk<D>;
  return (chunks + 1) / 2 * blocks <= R / kLnRows;
}
template <int CM>
struct LnSmem {  // offsets in floats
  static constexpr int LDX = CM + 8, LDP = 68, LDT = 36;
  static constexpr int xs = 0;                            // [2][32][LDX]: x_in, then xhat
  static constexpr int raw = xs + 2 * kLnRows * LDX;      // [2][2][32][32]: da rows, db rows as copied
  static constexpr int ph = raw + 2 * kLnRows * 64;       // dp hi [32][LDP]
  static constexpr int pl = ph + kLnRows * LDP;           // dp lo
  static constexpr int th = pl + kLnRows * LDP;           // dp^T hi [64][LDT]
  static constexpr int tl = th + 64 * LDT;                // dp^T lo
  static constexpr int ws = tl + 64 * LDT;                // [64][LDX]: Wa | Wb
  static constexpr int lws = ws + 64 * LDX;               // [CM] ln_w, [CM] ln_b
  static constexpr int stat = lws + 2 * CM;               // [32] rstd
  static constexpr int red = stat + kLnRows;              // [2][32][8]: per row and warp, sum g, sum g xhat
  static constexpr int msk = red + 2 * kLnRows * 8;       // [32]
  static constexpr int bsum = msk + kLnRows;              // [256]
  static constexpr int floats = bsum + 256;
};
template <int CM>
constexpr size_t ln_smem_bytes() { return 4ull * LnSmem<CM>::floats; }
template <int CM, typename T, typename D = float>
__global__ void __launch_bounds__(256, 1) opm_bw_ln_kernel(
    const T* __restrict__ xin, D* __restrict__ da, D* __restrict__ db,
    const void* __restrict__ mask, int mask_kind, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
    const float* __restrict__ wa, const float* __restrict__ wb, T* __restrict__ dx, float* __restrict__ part,
    int64_t R, float eps) {
#if defined(OPM_WG_DEVICE)
  using L = LnSmem<CM>;
  constexpr int NT = CM / 64, LDX = L::LDX, LDP = L::LDP, LDT = L::LDT;
  constexpr bool kSplit = std::is_same_v<T, float>;  // 16-bit x: single TF32 products (the lo planes unused)
  static_assert(CM == 128 || CM == 256, "CM: 128 or 256");
  static_assert(std::is_same_v<D, float> || std::is_same_v<D, T>, "da, db: float32, or T (16-bit T)");
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  float* ws = sm + L::ws;
  float* lws = sm + L::lws;
  float* stat = sm + L::stat;
  float* red = sm + L::red;
  float* msk = sm + L::msk;
  uint32_t* ph = reinterpret_cast<uint32_t*>(sm + L::ph);
  uint32_t* pl = reinterpret_cast<uint32_t*>(sm + L::pl);
  uint32_t* th = reinterpret_cast<uint32_t*>(sm + L::th);
  uint32_t* tl = reinterpret_cast<uint32_t*>(sm + L::tl);
  __shared__ uint64_t bar[2];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int col0 = warp * (CM / 8);  // this warp's columns of dy and dW
  const int64_t tiles = (R + kLnRows - 1) / kLnRows;
  auto full = [&](int64_t tt) { return (tt + 1) * kLnRows <= R; };
  const unsigned tile_bytes = kLnRows * (unsigned(sizeof(T)) * CM + unsigned(sizeof(D)) * 64);
  // lane 0 of warp w: rows 4 w .. 4 w + 3 of tile tt's x_in, and its da (w = 0) or db (w = 1), into buffer
  // buf (thread 0 set the buffer's byte count before a block barrier). Spread over the warps: one thread
  // issuing all 34 held every warp at the next barrier.
  auto issue = [&](int64_t tt, int buf) {
    float* xs = sm + L::xs + buf * kLnRows * LDX;
    float* raw = sm + L::raw + buf * kLnRows * 64;
#pragma unroll
    for (int r = 4 * warp; r < 4 * warp + 4; ++r)
      bulk_copy(xs + r * LDX, xin + (tt * kLnRows + r) * CM, unsigned(sizeof(T)) * CM, &bar[buf]);
    if (warp < 2)
      bulk_copy(raw + warp * kLnRows * 32, (warp == 0 ? da : db) + tt * kLnRows * 32,
                unsigned(sizeof(D)) * kLnRows * 32, &bar[buf]);
  };
  if (tid == 0) {
    mbar_init(&bar[0], 1);
    mbar_init(&bar[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the barriers initialised before any copy or wait
  if (tid == 0 && blockIdx.x < tiles && full(blockIdx.x)) mbar_expect_tx(&bar[0], tile_bytes);
  for (int e = tid; e < 64 * (CM / 4); e += 256) {
    const int k = e / (CM / 4), q = e % (CM / 4);
    reinterpret_cast<float4*>(ws + k * LDX)[q] =
        __ldg(reinterpret_cast<const float4*>(k < 32 ? wa + k * CM : wb + (k - 32) * CM) + q);
  }
  for (int e = tid; e < 2 * CM; e += 256) lws[e] = __ldg(e < CM ? ln_w + e : ln_b + e - CM);
  __syncthreads();  // ws, lws visible; buffer 0's byte count set
  if (lane == 0 && blockIdx.x < tiles && full(blockIdx.x)) issue(blockIdx.x, 0);
  // ln_w at this thread's accumulator columns col0 + 8 nt + 2 t + e (lwc: in registers, read from shared
  // memory where it is used for fp32 at CM 256, where registers spilled); ln_w, ln_b at its B-fragment
  // columns col0 + 8 nt + g (product 2's x)
  constexpr bool kLwcRegs = !(kSplit && CM == 256);
  float2 lwr[NT];
  float lwg[NT], lbg[NT];
  auto lwc = [&](int nt) {
    return kLwcRegs ? lwr[nt] : *reinterpret_cast<const float2*>(lws + col0 + 8 * nt + 2 * t);
  };
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if constexpr (kLwcRegs) lwr[nt] = *reinterpret_cast<const float2*>(lws + col0 + 8 * nt + 2 * t);
    lwg[nt] = lws[col0 + 8 * nt + g];
    lbg[nt] = lws[CM + col0 + 8 * nt + g];
  }
  // accw[mt][nt][q]: dW row k = 16 mt + g + 8 (q >> 1), column col0 + 8 nt + 2 t + (q & 1)
  float accw[4][NT][4], dlw[NT][2], dlb[NT][2], dbias = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) dlw[nt][e] = dlb[nt][e] = 0.f;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q) accw[mt][nt][q] = 0.f;
  }
  // threads tid < 32: the mask of row tid of the block's next tile, loaded a tile ahead
  auto mask_at = [&](int64_t tt) {
    return tt < tiles && tt * kLnRows + tid < R ? mask_value(mask, tt * kLnRows + tid, mask_kind) : 0.f;
  };
  float m_next = tid < kLnRows ? mask_at(blockIdx.x) : 0.f;
  unsigned phases = 0u;  // bit buf: the parity of buffer buf's next wait
  int buf = 0;
  for (int64_t tt = blockIdx.x; tt < tiles; tt += gridDim.x, buf ^= 1) {
    const int64_t r0 = tt * kLnRows;
    float* xs = sm + L::xs + buf * kLnRows * LDX;
    float* raw = sm + L::raw + buf * kLnRows * 64;
    // (buffer buf ^ 1's previous phase was waited on by every thread in the previous tile)
    if (tid == 0 && tt + gridDim.x < tiles && full(tt + gridDim.x)) mbar_expect_tx(&bar[buf ^ 1], tile_bytes);
    __syncthreads();  // the previous tile's reads of xs (other buffer), the planes, msk, stat, red are done
    if (lane == 0 && tt + gridDim.x < tiles && full(tt + gridDim.x)) issue(tt + gridDim.x, buf ^ 1);
    if (tid < kLnRows) {
      msk[tid] = m_next;
      m_next = mask_at(tt + gridDim.x);
    }
    if (full(tt)) {
      mbar_wait(&bar[buf], (phases >> buf) & 1u);
      phases ^= 1u << buf;
    } else {  // the partial last tile: plain loads, zeros past R
      if constexpr (std::is_same_v<T, float>) {
        for (int e = tid; e < kLnRows * (CM / 4); e += 256) {
          const int r = e / (CM / 4), q = e % (CM / 4);
          reinterpret_cast<float4*>(xs + r * LDX)[q] =
              r0 + r < R ? __ldg(reinterpret_cast<const float4*>(xin + (r0 + r) * CM) + q) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      } else {  // 16-bit x: 8 values per load into the row's first CM / 2 floats, where the copies put them
        for (int e = tid; e < kLnRows * (CM / 8); e += 256) {
          const int r = e / (CM / 8), q = e % (CM / 8);
          reinterpret_cast<uint4*>(xs + r * LDX)[q] =
              r0 + r < R ? __ldg(reinterpret_cast<const uint4*>(xin + (r0 + r) * CM) + q) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
      for (int e = tid; e < kLnRows * 64; e += 256) {
        const int r = (e % 1024) / 32;
        if constexpr (std::is_same_v<D, float>) {
          raw[e] = r0 + r < R ? __ldg((e < 1024 ? da : db) + (r0 + r) * 32 + e % 32) : 0.f;
        } else {  // into the first half of each raw block, where the copies put them
          D* dst = reinterpret_cast<D*>(raw + (e / 1024) * kLnRows * 32) + e % 1024;
          *dst = r0 + r < R ? __ldg((e < 1024 ? da : db) + (r0 + r) * 32 + e % 32) : from_float<D>(0.f);
        }
      }
    }
    __syncthreads();  // the tile (plain loads included) and msk visible to every thread
    // ---- build: the dp planes, this thread's bias sums (channel tid % 64) ----
    float dpv[kLnRows / 4];  // every load before the first store (the planes may alias raw for the compiler)
#pragma unroll
    for (int i = 0; i < kLnRows / 4; ++i) {
      const int r = tid / 64 + 4 * i, k = tid % 64;
      if constexpr (std::is_same_v<D, float>) dpv[i] = raw[(k / 32) * kLnRows * 32 + r * 32 + k % 32] * msk[r];
      else dpv[i] = to_float(reinterpret_cast<const D*>(raw + (k / 32) * kLnRows * 32)[r * 32 + k % 32]) * msk[r];
    }
#pragma unroll
    for (int i = 0; i < kLnRows / 4; ++i) {
      const int r = tid / 64 + 4 * i, k = tid % 64;
      const float v = dpv[i];
      dbias += v;
      uint32_t hi, lo;
      split_tf32(v, hi, lo);
      ph[r * LDP + k] = hi;
      if constexpr (kSplit) pl[r * LDP + k] = lo;
      th[k * LDT + r] = hi;
      if constexpr (kSplit) tl[k * LDT + r] = lo;
    }
    // ---- statistics: warp w, rows 4 w .. 4 w + 3, RB at once, in registers: lane l holds the row's elements
    //      128 j + 4 l .. 128 j + 4 l + 3 (one 16-byte load of fp32, 8-byte of T per j); a 16-bit row is
    //      read whole (it sits in the first half of the fp32 row) before xhat overwrites it. RB = 2 for
    //      fp32 at CM 256 (4 spilled there) ----
    constexpr int RB = kSplit && CM == 256 ? 2 : 4, NJ = CM / 128;
#pragma unroll
    for (int rb = 0; rb < 4; rb += RB) {
      float xv[RB][NJ][4], s[RB], q[RB];
#pragma unroll
      for (int rr = 0; rr < RB; ++rr)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const float* row = xs + (4 * warp + rb + rr) * LDX;
          if constexpr (std::is_same_v<T, float>) {
            const float4 v = *reinterpret_cast<const float4*>(row + 128 * j + 4 * lane);
            xv[rr][j][0] = v.x; xv[rr][j][1] = v.y; xv[rr][j][2] = v.z; xv[rr][j][3] = v.w;
          } else {
            const uint2 h = *reinterpret_cast<const uint2*>(reinterpret_cast<const T*>(row) + 128 * j + 4 * lane);
            const float2 lo = to_float2<T>(h.x), hi = to_float2<T>(h.y);
            xv[rr][j][0] = lo.x; xv[rr][j][1] = lo.y; xv[rr][j][2] = hi.x; xv[rr][j][3] = hi.y;
          }
        }
      if constexpr (!std::is_same_v<T, float>) __syncwarp();  // every lane's reads of the 16-bit rows done
#pragma unroll
      for (int rr = 0; rr < RB; ++rr) {
        s[rr] = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[rr] += xv[rr][j][e];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int rr = 0; rr < RB; ++rr) s[rr] += __shfl_xor_sync(0xffffffffu, s[rr], o);
#pragma unroll
      for (int rr = 0; rr < RB; ++rr) {
        s[rr] *= 1.f / CM;  // the mean
        q[rr] = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float d = xv[rr][j][e] - s[rr];
            q[rr] = fmaf(d, d, q[rr]);
          }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int rr = 0; rr < RB; ++rr) q[rr] += __shfl_xor_sync(0xffffffffu, q[rr], o);
#pragma unroll
      for (int rr = 0; rr < RB; ++rr) {
        const int r = 4 * warp + rb + rr;
        const float rstd = r0 + r < R ? rsqrtf(q[rr] / CM + eps) : 0.f;  // rows past R: xhat 0 (also at eps = 0)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
          *reinterpret_cast<float4*>(xs + r * LDX + 128 * j + 4 * lane) =
              make_float4((xv[rr][j][0] - s[rr]) * rstd, (xv[rr][j][1] - s[rr]) * rstd, (xv[rr][j][2] - s[rr]) * rstd,
                          (xv[rr][j][3] - s[rr]) * rstd);
        if (lane == 0) stat[r] = rstd;
      }
    }
    __syncthreads();  // the planes, xhat and stat complete
    // ---- dy = dp . W: acc1[mt][nt][q] at row 16 mt + g + 8 (q >> 1), column col0 + 8 nt + 2 t + (q & 1) ----
    float acc1[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc1[mt][nt][q] = 0.f;
#pragma unroll 2
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t ah[2][4], al[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int o = (16 * mt + g) * LDP + 8 * ks + t;
        ah[mt][0] = ph[o];
        ah[mt][1] = ph[o + 8 * LDP];
        ah[mt][2] = ph[o + 4];
        ah[mt][3] = ph[o + 8 * LDP + 4];
        al[mt][0] = pl[o];
        al[mt][1] = pl[o + 8 * LDP];
        al[mt][2] = pl[o + 4];
        al[mt][3] = pl[o + 8 * LDP + 4];
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float* wp = ws + (8 * ks + t) * LDX + col0 + 8 * nt + g;
        uint32_t bh0, bl0, bh1, bl1;
        split_tf32(wp[0], bh0, bl0);
        split_tf32(wp[4 * LDX], bh1, bl1);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          if constexpr (kSplit) {
            mma_tf32(d, al[mt], bh0, bh1);  // the small terms first
            mma_tf32(d, ah[mt], bl0, bl1);
          }
          mma_tf32(d, ah[mt], bh0, bh1);
#pragma unroll
          for (int q = 0; q < 4; ++q) acc1[mt][nt][q] += d[q];
        }
      }
    }
    // ---- the rows' sums of g = dy ln_w and g xhat over this warp's columns ----
    float2 xh[2][2][NT];  // [mt][hf][nt]: xhat at (row 16 mt + g + 8 hf, columns col0 + 8 nt + 2 t, + 1)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * mt + g + 8 * hf;
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          xh[mt][hf][nt] = *reinterpret_cast<const float2*>(xs + r * LDX + col0 + 8 * nt + 2 * t);
          const float2 w2 = lwc(nt);
          const float g0 = acc1[mt][nt][2 * hf] * w2.x, g1 = acc1[mt][nt][2 * hf + 1] * w2.y;
          s1 += g0 + g1;
          s2 = fmaf(g0, xh[mt][hf][nt].x, fmaf(g1, xh[mt][hf][nt].y, s2));
        }
        s1 = quad_sum(s1);
        s2 = quad_sum(s2);
        if (t == 0) {
          red[r * 8 + warp] = s1;
          red[kLnRows * 8 + r * 8 + warp] = s2;
        }
      }
    // ---- dW += dp^T . x: rows k (A from dp^T), K = the tile's 32 rows, B = x split on load ----
#pragma unroll 1
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t bh[NT][2], bl[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float* xp = xs + (8 * ks + t) * LDX + col0 + 8 * nt + g;
        split_tf32(fmaf(xp[0], lwg[nt], lbg[nt]), bh[nt][0], bl[nt][0]);
        split_tf32(fmaf(xp[4 * LDX], lwg[nt], lbg[nt]), bh[nt][1], bl[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int o = (16 * mt + g) * LDT + 8 * ks + t;
        const uint32_t ah[4] = {th[o], th[o + 8 * LDT], th[o + 4], th[o + 8 * LDT + 4]};
        const uint32_t al[4] = {tl[o], tl[o + 8 * LDT], tl[o + 4], tl[o + 8 * LDT + 4]};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          if constexpr (kSplit) {
            mma_tf32(d, al, bh[nt][0], bh[nt][1]);
            mma_tf32(d, ah, bl[nt][0], bl[nt][1]);
          }
          mma_tf32(d, ah, bh[nt][0], bh[nt][1]);
#pragma unroll
          for (int q = 0; q < 4; ++q) accw[mt][nt][q] += d[q];
        }
      }
    }
    __syncthreads();  // every warp's row sums in red
    // ---- d_x_in, d_ln_w, d_ln_b ----
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * mt + g + 8 * hf;
        const float4 a0 = *reinterpret_cast<const float4*>(red + r * 8);
        const float4 a1 = *reinterpret_cast<const float4*>(red + r * 8 + 4);
        const float4 c0 = *reinterpret_cast<const float4*>(red + kLnRows * 8 + r * 8);
        const float4 c1 = *reinterpret_cast<const float4*>(red + kLnRows * 8 + r * 8 + 4);
        const float s1 = a0.x + a0.y + a0.z + a0.w + a1.x + a1.y + a1.z + a1.w;  // the warps in order
        const float s2 = c0.x + c0.y + c0.z + c0.w + c1.x + c1.y + c1.z + c1.w;
        const float rstd = stat[r], m1 = s1 / CM, m2 = s2 / CM;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float dy0 = acc1[mt][nt][2 * hf], dy1 = acc1[mt][nt][2 * hf + 1];
          const float2 x2 = xh[mt][hf][nt];
          {  // staged in xs (read whole before the barrier above), this warp's columns, as T
            const float2 w2 = lwc(nt);
            const float v0 = rstd * (dy0 * w2.x - m1 - x2.x * m2), v1 = rstd * (dy1 * w2.y - m1 - x2.y * m2);
            if constexpr (std::is_same_v<T, float>)
              *reinterpret_cast<float2*>(xs + r * LDX + col0 + 8 * nt + 2 * t) = make_float2(v0, v1);
            else
              *reinterpret_cast<uint32_t*>(reinterpret_cast<T*>(xs + r * LDX) + col0 + 8 * nt + 2 * t) = pack2_16<T>(v0, v1);
          }
          dlw[nt][0] = fmaf(dy0, x2.x, dlw[nt][0]);
          dlw[nt][1] = fmaf(dy1, x2.y, dlw[nt][1]);
          dlb[nt][0] += dy0;
          dlb[nt][1] += dy1;
        }
      }
    // ---- d_x_in: the warp's columns of the 32 rows by 16-byte loads and stores (CH chunks per row) ----
    __syncwarp();
    {
      constexpr int CH = CM / 8 * int(sizeof(T)) / 16;
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const int e = lane + 32 * i, r = e / CH, q = e % CH;
        if (r0 + r < R)
          *reinterpret_cast<uint4*>(reinterpret_cast<char*>(dx + (r0 + r) * CM + col0) + 16 * q) =
              *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(xs + r * LDX) + sizeof(T) * col0 + 16 * q);
      }
    }
    // this thread's generic writes of xs ordered before the bulk copies that refill it
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  // ---- partials, staged in shared memory (xs and raw, free now) in their order: dW, then d_ln_w / d_ln_b
  //      over the lanes g (the columns are this warp's alone), the bias sums; then copied out by float4 ----
  static_assert(kLnPart(CM) <= L::ph - L::xs && kLnPart(CM) % 4 == 0, "the partial staged in xs and raw");
  float* stage = sm + L::xs;
  float* bsum = sm + L::bsum;
  bsum[tid] = dbias;
  __syncthreads();  // every warp's reads of xs (its d_x_in rows) are done; bsum complete
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        *reinterpret_cast<float2*>(stage + (16 * mt + g + 8 * hf) * CM + col0 + 8 * nt + 2 * t) =
            make_float2(accw[mt][nt][2 * hf], accw[mt][nt][2 * hf + 1]);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float vw = dlw[nt][e], vb = dlb[nt][e];
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        vw += __shfl_xor_sync(0xffffffffu, vw, off);
        vb += __shfl_xor_sync(0xffffffffu, vb, off);
      }
      if (g == 0) {
        stage[64 * CM + col0 + 8 * nt + 2 * t + e] = vw;
        stage[65 * CM + col0 + 8 * nt + 2 * t + e] = vb;
      }
    }
  if (tid < 64) stage[66 * CM + tid] = (bsum[tid] + bsum[64 + tid]) + (bsum[128 + tid] + bsum[192 + tid]);
  __syncthreads();
  // In place, the rows written were read by this block's bulk copies, complete before its last tile was
  // used; the fence orders those async-proxy reads before these generic writes all the same.
  if (part == nullptr) asm volatile("fence.proxy.async.global;\n" ::: "memory");
#pragma unroll 1
  for (int e = 4 * tid; e < kLnPart(CM); e += 4 * 256)
    *reinterpret_cast<float4*>(ln_part_at<D>(part, da, db, blockIdx.x, gridDim.x, kLnPart(CM), e)) =
        *reinterpret_cast<const float4*>(stage + e);
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// out[e] = sum over the blocks (in order, in fp64) of opm_bw_ln_kernel's partial element e < n = kLnPart(CM),
// wherever ln_part_at puts it (part, or the consumed da, db).
template <typename D>
__global__ void __launch_bounds__(kThreads) opm_ln_sum_kernel(float* part, D* da, D* db, float* __restrict__ out,
                                                              int blocks, int64_t n) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= n) return;
  double s = 0.0;
  for (int b = 0; b < blocks; ++b) s += *ln_part_at<D>(part, da, db, b, blocks, n, e);
  out[e] = static_cast<float>(s);
}

// out[e] = sum over blocks (in order, in fp64) of part[blk * n + e] for e < n: the blocks' partials of
// opm_colsum_kernel and opm_pair_grad_kernel (n = c_z).
__global__ void __launch_bounds__(kThreads) opm_block_sum_kernel(const float* __restrict__ part, float* __restrict__ out,
                                                                 int blocks, int64_t n) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= n) return;
  double s = 0.0;
  for (int b = 0; b < blocks; ++b) s += part[b * n + e];
  out[e] = static_cast<float>(s);
}

// A block's column sums into part[blockIdx.x][4 cg .. 4 cg + 3]: red[tid] = acc (the float4 partial of column quad
// cg = tid % CG and row lane tid / CG), then thread cg < CG adds the RL lanes' partials in lane order
// (opm_colsum_kernel, opm_pair_grad_kernel).
__device__ __forceinline__ void colsum_block_store(float4 acc, float4* red, int CG, int RL, int tid, int cz,
                                                   float* __restrict__ part) {
  red[tid] = acc;
  __syncthreads();
  if (tid < CG) {
    for (int l = 1; l < RL; ++l) {
      const float4 v = red[l * CG + tid];
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    reinterpret_cast<float4*>(part + blockIdx.x * static_cast<int64_t>(cz))[tid] = acc;
  }
}

// part[blk][c] = sum of g[r][c] over the rows r of block blk's range [blk rpb, (blk + 1) rpb) (out_proj's
//   bias gradient, the column sums of grad_out (rows, cz), G float, __half or __nv_bfloat16): thread (cg =
//   tid % CG, rl = tid / CG), CG = cz / 4 column quads (one 16- or 8-byte load per row), RL = 256 / CG row
//   lanes, sums rows rl, rl + RL, ... of its 4 columns in fp32, then thread cg adds the RL lanes in order.
//   opm_block_sum_kernel adds the blocks' sums.
// Assumptions: 256 threads; cz % 4 == 0, 4 <= cz <= 1024; g 16-byte aligned.
template <typename G>
__global__ void __launch_bounds__(kThreads) opm_colsum_kernel(const G* __restrict__ g, int64_t rows, int cz,
                                                              int64_t rpb, float* __restrict__ part) {
  __shared__ float4 red[kThreads];
  const int CG = cz / 4, RL = kThreads / CG, tid = threadIdx.x, cg = tid % CG, rl = tid / CG;
  const int64_t r0 = blockIdx.x * rpb, r1 = min64(rows, r0 + rpb);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (rl < RL)
    for (int64_t r = r0 + rl; r < r1; r += RL) {
      float4 v;
      if constexpr (std::is_same_v<G, float>) {
        v = __ldg(reinterpret_cast<const float4*>(g + r * cz) + cg);
      } else {  // 4 T in 8 bytes
        const uint2 h = __ldg(reinterpret_cast<const uint2*>(g + r * cz) + cg);
        const float2 lo = to_float2<G>(h.x), hi = to_float2<G>(h.y);
        v = make_float4(lo.x, lo.y, hi.x, hi.y);
      }
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
  colsum_block_store(acc, red, CG, RL, tid, cz, part);
}

}  // namespace opm
