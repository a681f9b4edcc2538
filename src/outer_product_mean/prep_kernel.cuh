// outer_product_mean: the prep kernel (LayerNorm, both projections, mask, inv_denom, packed Wo).
#pragma once
#include "wgmma_common.cuh"

namespace opm {

// =============================================================================================
// Kernels
// =============================================================================================

// ---------------------------------------------------------------------------------------------
// opm_prep_kernel<CP>: LayerNorm + both projections + mask (role 1), inv_denom (role 2), packed Wo
// (role 3), in one launch.  Blocks [0, n_den) role 2, [n_den, n_den+n_pack) role 3, the rest role 1.
//   x      (R, c_m) rows r = (b*S + s)*N + n, contiguous          mask (B, S, N) contiguous
//   aT     (B, S, CP, Npad):  aT[(b*S+s)*CP + h][n] = a[b,s,n,h]  (h >= c written as 0)
//   bq     (B, S, N, CP):     bq[r][k] = b[b,s,n,k]               (k >= c written as 0)
//   inv_denom (B, N) = 1 / max(sum_s mask[b,s,i], 1)
//   wpack: mode 0 (outer_first): wpack[(h*CP + k)*zp + z] = Wo[z, h*c+k];
//          mode 1 (w_first):     wpack[(k*CP + h)*zp + z] = Wo[z, h*c+k]; 0 where h,k >= c or z >= c_z.
// Role 1 shared memory: xs [64][LDX] (reused as ys [CP][65] for the transposed a store),
//   ws [kKC1][2CP+4] (projection weights, transposed, one K chunk).
// Thread (tr = tid/16, to = tid%16) owns rows tr + 16*u (u < 4) and outputs o = to*RO + v (v < RO),
// RO = 2CP/16; o < CP are a-channels, o >= CP b-channels (RO divides CP, so never both).
// LayerNorm is two-pass over the row held in shared memory: mean, then sum (x-mean)^2: stable for
// large offsets (no E[x^2] - E[x]^2 cancellation).
// Assumptions: 256 threads; c_m <= kMaxMsaDim; dynamic smem as computed by prep_smem_bytes.
// ---------------------------------------------------------------------------------------------
template <int CP>
__global__ void __launch_bounds__(kThreads) opm_prep_kernel(
    const float* __restrict__ x, const void* __restrict__ mask, int mask_kind,
    const float* __restrict__ ln_w, const float* __restrict__ ln_b,
    const float* __restrict__ wa, const float* __restrict__ ba,
    const float* __restrict__ wb, const float* __restrict__ bb,
    const float* __restrict__ wo,
    float* __restrict__ aT, float* __restrict__ bq, float* __restrict__ inv_denom, float* __restrict__ wpack,
    int64_t B, int64_t S, int64_t N, int64_t Npad, int cm, int c, int cz, float eps,
    int64_t n_row_blocks, int n_den, int n_pack, int pack_mode, int pack_zp) {
  constexpr int RO = 2 * CP / 16;
  constexpr int LDW = 2 * CP + 4;
  const int tid = threadIdx.x;
  const int64_t blk = blockIdx.x;

  extern __shared__ float4 smem_f4[];
  // ---- role 2: inv_denom[b,i] = 1 / max(sum_s mask[b,s,i], 1), 32 columns per block iteration; its
  //      partial sums in the dynamic shared memory (>= 4160 bytes: xs alone holds CP * 65 >= 1040 floats) ----
  if (blk < n_den) {
    double* red_f = reinterpret_cast<double*>(smem_f4);
    inv_denom_cols(mask, mask_kind, B, S, N, inv_denom, blk, n_den, red_f,
                   reinterpret_cast<long long*>(red_f + kThreads));
    return;
  }
  // ---- role 3: pack Wo ----
  if (blk < n_den + n_pack) {
    const int64_t total = static_cast<int64_t>(CP) * CP * pack_zp;
    for (int64_t e = (blk - n_den) * kThreads + tid; e < total; e += static_cast<int64_t>(n_pack) * kThreads) {
      const int64_t z = e % pack_zp, xy = e / pack_zp;
      const int xx = static_cast<int>(xy / CP), yy = static_cast<int>(xy % CP);
      const int h = pack_mode == 0 ? xx : yy, k = pack_mode == 0 ? yy : xx;
      wpack[e] = (h < c && k < c && z < cz) ? wo[z * c * c + h * c + k] : 0.f;
    }
    return;
  }

  // ---- role 1: LayerNorm + projections + mask for 64 rows per block iteration ----
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int LDX = static_cast<int>(round_up(cm, 4));
  const int xs_floats = static_cast<int>(round_up(max(kRows1 * LDX, CP * 65), 4));
  float* xs = smem;              // [64][LDX]
  float* ys = smem;              // [CP][65], aliases xs after the GEMM
  float* ws = smem + xs_floats;  // [kKC1][LDW]
  __shared__ float s_mask[kRows1];

  const int64_t R = B * S * N;
  const int tr = tid / 16, to = tid % 16;
  const int warp = tid / 32, lane = tid % 32;
  const int64_t first_row_block = blk - n_den - n_pack;
  const int64_t row_block_stride = gridDim.x - n_den - n_pack;

  for (int64_t rb = first_row_block; rb < n_row_blocks; rb += row_block_stride) {
    const int64_t r0 = rb * kRows1;
    const int nrows = static_cast<int>(min64(kRows1, R - r0));
    const float* src = x + r0 * cm;  // the block's rows are contiguous: nrows * c_m floats
    // x -> xs (rows >= nrows zero); 16-byte loads when c_m % 4 == 0 (row starts stay 16-byte aligned)
    if ((cm & 3) == 0) {
      const int q4 = cm / 4;
      for (int q = tid; q < kRows1 * q4; q += kThreads) {
        const int r = q / q4, col = (q - r * q4) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nrows) v = __ldg(reinterpret_cast<const float4*>(src + static_cast<int64_t>(r) * cm + col));
        *reinterpret_cast<float4*>(xs + r * LDX + col) = v;
      }
    } else {
      for (int q = tid; q < kRows1 * cm; q += kThreads) {
        const int r = q / cm, col = q - r * cm;
        xs[r * LDX + col] = (r < nrows) ? __ldg(src + static_cast<int64_t>(r) * cm + col) : 0.f;
      }
    }
    if (tid < kRows1) s_mask[tid] = (tid < nrows) ? mask_value(mask, r0 + tid, mask_kind) : 0.f;
    __syncthreads();  // xs and s_mask complete before the per-row statistics read them

    // LayerNorm, one warp per row: mean, then centred variance (two passes over shared memory)
    for (int r = warp; r < kRows1; r += kThreads / 32) {
      float* row = xs + r * LDX;
      const float2 st = warp_row_stats(row, cm, eps, lane);
      for (int k = lane; k < cm; k += 32) row[k] = (row[k] - st.x) * st.y * __ldg(ln_w + k) + __ldg(ln_b + k);
    }

    // y[r][o] = sum_m xs[r][m] * Wcat[o][m],  Wcat = [Wa (padded to CP rows); Wb (padded)]
    float acc[4][RO];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int v = 0; v < RO; ++v) acc[u][v] = 0.f;
    for (int k0 = 0; k0 < cm; k0 += kKC1) {
      __syncthreads();  // normalised rows visible (first chunk) / previous ws chunk fully read
      // fixed column kk per thread (256 % kKC1 == 0), rows o = o0 + 8u; unrolled by 4 so four
      // independent loads are in flight together (with unroll 1 they were 8 serial L2 round trips
      // per chunk at CP = 32: ~2.5 us per chunk at the seed shape)
      {
        const int kk = tid % kKC1, k = k0 + kk;
#pragma unroll 4
        for (int o = tid / kKC1; o < 2 * CP; o += kThreads / kKC1) {  // lanes along k: coalesced reads
          const int h = o < CP ? o : o - CP;
          const float* W = o < CP ? wa : wb;
          ws[kk * LDW + o] = (h < c && k < cm) ? __ldg(W + static_cast<int64_t>(h) * cm + k) : 0.f;
        }
      }
      __syncthreads();  // ws chunk complete
      const int kmax = min(kKC1, cm - k0);
      for (int kk = 0; kk < kmax; ++kk) {
        float xv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) xv[u] = xs[(tr + 16 * u) * LDX + k0 + kk];
        float wv[RO];
        if constexpr (RO % 4 == 0) {
#pragma unroll
          for (int v = 0; v < RO; v += 4) {
            const float4 w4 = *reinterpret_cast<const float4*>(ws + kk * LDW + to * RO + v);
            wv[v] = w4.x; wv[v + 1] = w4.y; wv[v + 2] = w4.z; wv[v + 3] = w4.w;
          }
        } else {
#pragma unroll
          for (int v = 0; v < RO; v += 2) {
            const float2 w2 = *reinterpret_cast<const float2*>(ws + kk * LDW + to * RO + v);
            wv[v] = w2.x; wv[v + 1] = w2.y;
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int v = 0; v < RO; ++v) acc[u][v] = fmaf(xv[u], wv[v], acc[u][v]);
      }
    }

    // epilogue: (y + bias) * mask; b-channels straight to bq, a-channels via ys to aT (transposed)
    __syncthreads();  // every thread finished reading xs before it is overwritten as ys
    const int o0 = to * RO;
    const bool is_a = o0 < CP;
    const int h0 = is_a ? o0 : o0 - CP;
    float bias[RO];
#pragma unroll
    for (int v = 0; v < RO; ++v) {
      const int h = h0 + v;
      bias[v] = h < c ? __ldg((is_a ? ba : bb) + h) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int r = tr + 16 * u;
      const float m = s_mask[r];
      float y[RO];
#pragma unroll
      for (int v = 0; v < RO; ++v) y[v] = (acc[u][v] + bias[v]) * m;
      if (is_a) {
#pragma unroll
        for (int v = 0; v < RO; ++v) ys[(h0 + v) * 65 + r] = y[v];
      } else if (r < nrows) {
        float* dst = bq + (r0 + r) * CP + h0;
        if constexpr (RO % 4 == 0) {
#pragma unroll
          for (int v = 0; v < RO; v += 4)
            *reinterpret_cast<float4*>(dst + v) = make_float4(y[v], y[v + 1], y[v + 2], y[v + 3]);
        } else {
#pragma unroll
          for (int v = 0; v < RO; v += 2) *reinterpret_cast<float2*>(dst + v) = make_float2(y[v], y[v + 1]);
        }
      }
    }
    __syncthreads();  // ys complete before the transposed store reads it
    for (int q = tid; q < CP * kRows1; q += kThreads) {
      const int h = q / kRows1, r = q % kRows1;  // lanes along rows: consecutive n, coalesced
      if (r < nrows) {
        const int64_t rg = r0 + r, bs = rg / N, n = rg - bs * N;
        aT[(bs * CP + h) * Npad + n] = ys[h * 65 + r];
      }
    }
    __syncthreads();  // ys read completely before the next row block overwrites xs
  }
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
