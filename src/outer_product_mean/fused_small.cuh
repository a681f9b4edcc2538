// outer_product_mean: fused_small, the whole forward in one cooperative launch (small shapes).
#pragma once
#include <cooperative_groups.h>
#include "backward_g.cuh"

namespace opm {

// =============================================================================================
// opm_fused_small_kernel<T>: LayerNorm, projections, mask, 1 / denom, w_first's two products and the
// bias in one launch, reading msa, mask and parameters in their own dtype T (float, __half,
// __nv_bfloat16) and writing out in T; FMA in fp32 throughout. Launched cooperatively (every block
// resident), hidden_dim <= 32 (c zero-padded to kFsCP = 32).
//   phase 1 (grid-stride over groups of kFsRows = 4 msa rows): x -> LayerNorm (two passes, rounded to T
//     as the reference's output is) -> y = x W^T + bias, rounded to T, times the mask, rounded to T
//     (fp32: no rounding) -> a_rows, b_rows (B, S, N, 32) fp32, channels >= c zero. Thread (r, o) =
//     (tid / 64, tid % 64): o < 32 a-channel o, else b-channel o - 32.
//   grid barrier (cooperative_groups: an atomic counter in the driver's per-launch workspace), split: the
//     first task's Wo chunk, bias and mask sums (no phase-1 data) between the block's arrival and its wait.
//   phase 2, grid-stride over tasks (b, 32 rows i, kFsJT = 4 residues j, kFsZT = 8 pair channels z)
//     and for each task over chunks of kFsSC = 8 sequences:
//       stage 1  P[(h, s)][(jj, zz)] = sum_k Wo[z0 + zz, h c + k] b[s, j0 + jj, k]   (K = 32)
//                thread (h, s) = (tid / 8, tid % 8): 4 jj x 8 zz, float4 reads of bs and wos.
//       stage 2  acc[i][(jj, zz)] += sum_{(h, s)} a[s, i, h] P[(h, s)][(jj, zz)]     (K = 256)
//                K split over 4 groups of 64 threads, each thread 4 i x 4 columns; the groups'
//                sums added in a fixed order at the end (deterministic).
//     out[b, i, j0 + jj, z0 + zz] = bo[z] + inv_denom[b, i] * acc; 1 / denom per task from the mask
//     (inv_denom_cols' sums: fp64 for float masks, int64 for integer ones), written to inv_denom by
//     the tasks with j0 = z0 = 0 where inv_denom is not null.
// Work: phase 1 4 B S N c_m 32; per task of one i block 2 S' 32^2 kFsJT kFsZT (stage 1, S' = S rounded
// up to 8) + 2 S' 32^2 kFsJT kFsZT (stage 2) FLOPs: at N <= 32 w_first's FLOPs (c = 32); stage 1 is
// recomputed for every 32-row block of i (N > 32).
// Shared memory (dynamic, floats): wos [8 z][32 h][36] (Wo's chunk; 4 pad floats per h: the 4 h of a
// warp's float4 reads fall on distinct banks), bs [(jj, s)][36], as [(h, s)][32 i] (phase 1's x rows
// and the end's K-group sums alias it), ps [(h, s)][36], then 256 doubles and 256 int64 for the
// denominators' partial sums.
// Assumptions: 256 threads; 16-byte aligned x (the caller copies it otherwise); flags say which
// 4-element loads are legal (kFsVecX: c_m % 4 == 0; kFsVecW: and Wa, Wb 4-element aligned; kFsVecWo:
// c == 32 and Wo 16-byte aligned).
// ---------------------------------------------------------------------------------------------
constexpr int kFsThreads = 256;
constexpr int kFsCP = 32;                 // hidden channels, zero-padded
constexpr int kFsSC = 8;                  // sequences per chunk
constexpr int kFsJT = 4;                  // residues j per task
constexpr int kFsZT = 8;                  // pair channels per task
constexpr int kFsNI = 32;                 // residues i per task
constexpr int kFsRows = 4;                // phase 1: msa rows per block iteration
constexpr int kFsHS = 36;                 // wos: floats per h
constexpr int kFsLDW = kFsCP * kFsHS;     // wos: floats per z
constexpr int kFsLDB = 36, kFsLDA = kFsNI, kFsLDP = 36;
constexpr int kFsK = kFsSC * kFsCP;       // stage 2's K per chunk
constexpr int kFsCols = kFsJT * kFsZT;    // output columns (jj, zz) per task
constexpr int kFsWoFloats = kFsZT * kFsLDW, kFsBFloats = kFsJT * kFsSC * kFsLDB, kFsAFloats = kFsK * kFsLDA,
              kFsPFloats = kFsK * kFsLDP;
constexpr size_t kFsSmemBytes = 4ull * (kFsWoFloats + kFsBFloats + kFsAFloats + kFsPFloats) + 16ull * kFsThreads;
enum FsFlags : int { kFsVecX = 1, kFsVecW = 2, kFsVecWo = 4 };
static_assert(kFsThreads == kFsCP * kFsSC && kFsThreads == 8 * kFsCP, "stage 1: thread (h, s); Wo copies (h, quad)");
static_assert(kFsThreads == 4 * (kFsNI / 4) * (kFsCols / 4), "stage 2: 4 K groups of 8 x 8 threads");
static_assert(kFsThreads == kFsJT * kFsSC * (kFsCP / 4), "b copies: one 16-byte piece per thread");
static_assert(kFsThreads == kFsNI * (kFsCP / 4), "a copies: (i, h quad) per thread and s");
static_assert(kFsThreads == kFsNI * (kFsCols / 4), "epilogue: 4 columns of one i per thread");
static_assert(kFsThreads == kFsRows * 2 * kFsCP, "phase 1: thread (row, output channel)");
static_assert(4 * kFsNI * kFsCols <= kFsAFloats && kFsRows * kMaxMsaDim <= kFsAFloats, "as aliases");

template <typename T>  // 4 consecutive read-only elements as fp32 (16 bytes of float, 8 of a 16-bit T)
__device__ __forceinline__ float4 fs_ld4(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return *reinterpret_cast<const float4*>(p);
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    const float2 lo = to_float2<T>(v.x), hi = to_float2<T>(v.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}
// One element as float by a plain load. The kernel's global loads are plain, not __ldg: the 16-bit and
// vector __ldg overloads are inline asm that the compiler may hoist above the bounds check guarding them
// (it read ln_w[lane + 64] at c_m = 64, past the tensor's end, which memcheck reports).
template <typename T>
__device__ __forceinline__ float fs_ldf(const T* p, int64_t idx) { return to_float(p[idx]); }
template <typename T>  // v rounded to T (to nearest) and back: the reference's rounding of a 16-bit result
__device__ __forceinline__ float fs_round(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return to_float(from_float<T>(v));
}
template <typename T>
__device__ __forceinline__ T fs_out(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return from_float<T>(v);
}

// Wo[z0 .. z0 + 8) -> wos (c == 32, aligned: kFsVecWo). float: cp.async straight into wos (one group,
// waited by fs_wo_finish); 16-bit: 16-byte loads of 8 elements into pf, converted by fs_wo_finish.
// Thread tid: float (h, quad) = (tid / 8, tid % 8) of every z; 16-bit (h, octet) = (tid / 4 % 32, tid % 4)
// of z = 2u + tid / 128.
template <typename T>
__device__ __forceinline__ void fs_wo_issue(const T* __restrict__ wo, int cz, int z0, float* wos, uint4 (&pf)[4],
                                            int tid) {
  if constexpr (std::is_same_v<T, float>) {
    const int h = tid / 8, kq = tid % 8;
#pragma unroll
    for (int zz = 0; zz < kFsZT; ++zz) {
      const bool ok = z0 + zz < cz;
      const float* src = ok ? wo + static_cast<int64_t>(z0 + zz) * (kFsCP * kFsCP) + h * kFsCP + kq * 4 : wo;
      cp_async<16>(wos + zz * kFsLDW + h * kFsHS + kq * 4, src, ok ? 16 : 0);
    }
    cp_async_commit();
  } else {
    const int h = (tid / 4) % kFsCP, ko = tid % 4;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int z = z0 + 2 * u + tid / 128;
      pf[u] = z < cz ? *(reinterpret_cast<const uint4*>(wo + static_cast<int64_t>(z) * (kFsCP * kFsCP) +
                                                            h * kFsCP + ko * 8))
                     : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}
template <typename T>
__device__ __forceinline__ void fs_wo_finish(float* wos, const uint4 (&pf)[4], int tid) {
  if constexpr (std::is_same_v<T, float>) {
    cp_async_wait<0>();
  } else {
    const int h = (tid / 4) % kFsCP, ko = tid % 4;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int zz = 2 * u + tid / 128;
      const float2 f0 = to_float2<T>(pf[u].x), f1 = to_float2<T>(pf[u].y), f2 = to_float2<T>(pf[u].z),
                   f3 = to_float2<T>(pf[u].w);
      float* dst = wos + zz * kFsLDW + h * kFsHS + ko * 8;
      *reinterpret_cast<float4*>(dst) = make_float4(f0.x, f0.y, f1.x, f1.y);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(f2.x, f2.y, f3.x, f3.y);
    }
  }
}
// Wo's chunk for any c <= 32 (zeros where h, k >= c or z >= cz), or by the 4-element path where vec.
template <typename T>
__device__ __forceinline__ void fs_wo_stage(const T* __restrict__ wo, int c, int cz, int z0, float* wos, int tid,
                                            bool vec) {
  if (vec) {
    uint4 pf[4];
    fs_wo_issue<T>(wo, cz, z0, wos, pf, tid);
    fs_wo_finish<T>(wos, pf, tid);
    return;
  }
  for (int e = tid; e < kFsZT * kFsCP * kFsCP; e += kFsThreads) {
    const int k = e % kFsCP, h = (e / kFsCP) % kFsCP, zz = e / (kFsCP * kFsCP), z = z0 + zz;
    wos[zz * kFsLDW + h * kFsHS + k] =
        (z < cz && h < c && k < c) ? fs_ldf(wo, static_cast<int64_t>(z) * c * c + h * c + k) : 0.f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kFsThreads, 1) opm_fused_small_kernel(
    const T* __restrict__ x, const void* __restrict__ mask, int mask_kind, const T* __restrict__ ln_w,
    const T* __restrict__ ln_b, const T* __restrict__ wa, const T* __restrict__ ba, const T* __restrict__ wb,
    const T* __restrict__ bb, const T* __restrict__ wo, const T* __restrict__ bo, float* a_rows, float* b_rows,
    float* __restrict__ inv_denom, T* __restrict__ out, int64_t B, int64_t S, int64_t N, int cm, int c, int cz,
    float eps, int64_t nic, int64_t njc, int nzc, int flags) {
  extern __shared__ float4 fs_smem_f4[];
  float* wos = reinterpret_cast<float*>(fs_smem_f4);
  float* bs = wos + kFsWoFloats;
  float* as = bs + kFsBFloats;
  float* ps = as + kFsAFloats;
  double* red_f = reinterpret_cast<double*>(ps + kFsPFloats);
  long long* red_i = reinterpret_cast<long long*>(red_f + kFsThreads);
  __shared__ float s_mask[kFsRows], s_invd[kFsNI], s_bo[kFsZT];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t njz = njc * nzc, ntasks = B * nic * njz;
  const bool vec_wo = (flags & kFsVecWo) != 0;

  // the first task's Wo chunk in flight during phase 1 and the barrier; the projection weights
  // prefetched into L2 (phase 1 reads them after its rows and their statistics)
  uint4 wo_pf[4];
  if (blockIdx.x < ntasks && vec_wo) fs_wo_issue<T>(wo, cz, static_cast<int>(blockIdx.x % nzc) * kFsZT, wos, wo_pf, tid);
  {
    const int64_t wbytes = static_cast<int64_t>(c) * cm * sizeof(T);
#pragma unroll 1
    for (int64_t off = static_cast<int64_t>(tid) * 128; off < wbytes; off += kFsThreads * 128) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(wa) + off));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(wb) + off));
    }
  }

  // ---- phase 1: LayerNorm, projections, mask -> a_rows, b_rows ----
  {
    const int64_t R = B * S * N;
    const int LDX = (cm + 3) & ~3;
    float* xs = as;  // [kFsRows][LDX]
    const int r = tid / (2 * kFsCP), o = tid % (2 * kFsCP), h = o % kFsCP;
    const bool is_b = o >= kFsCP, live = h < c;
    const T* wr = (is_b ? wb : wa) + static_cast<int64_t>(live ? h : 0) * cm;
    const float bias = live ? fs_ldf(is_b ? bb : ba, h) : 0.f;
    float* dst_rows = is_b ? b_rows : a_rows;
    for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kFsRows; r0 < R;
         r0 += static_cast<int64_t>(gridDim.x) * kFsRows) {
      const int nr = static_cast<int>(min64(kFsRows, R - r0));
      if (flags & kFsVecX) {  // rows r0 .. r0 + 3 are contiguous: 4-element loads (c_m % 4 == 0)
        const int q4 = cm / 4;
        for (int q = tid; q < kFsRows * q4; q += kFsThreads) {
          const int rr = q / q4, col = (q - rr * q4) * 4;
          const float4 v = rr < nr ? fs_ld4(x + (r0 + rr) * cm + col) : make_float4(0.f, 0.f, 0.f, 0.f);
          *reinterpret_cast<float4*>(xs + rr * LDX + col) = v;
        }
      } else {
        for (int q = tid; q < kFsRows * cm; q += kFsThreads) {
          const int rr = q / cm, col = q - rr * cm;
          xs[rr * LDX + col] = rr < nr ? fs_ldf(x, (r0 + rr) * cm + col) : 0.f;
        }
      }
      if (tid < kFsRows) s_mask[tid] = tid < nr ? mask_value(mask, r0 + tid, mask_kind) : 0.f;
      __syncthreads();  // xs, s_mask complete
      if (warp < nr) {  // LayerNorm of row `warp`, in place: mean, then the centred variance
        float* row = xs + warp * LDX;
        const float2 st = warp_row_stats(row, cm, eps, lane);
        for (int k = lane; k < cm; k += 32)
          row[k] = fs_round<T>((row[k] - st.x) * st.y * fs_ldf(ln_w, k) + fs_ldf(ln_b, k));
      }
      __syncthreads();  // normalised rows visible
      if (r < nr) {
        float y = 0.f;
        if (live) {
          const float* xr = xs + r * LDX;
          float acc = 0.f;
          if (flags & kFsVecW) {  // four partial sums (independent chains), added at the end; unrolled so that
            float4 a4 = make_float4(0.f, 0.f, 0.f, 0.f);  // c_m = 64's 16 weight loads are in flight together
#pragma unroll 16
            for (int k = 0; k < cm; k += 4) {
              const float4 w4 = fs_ld4(wr + k), x4 = *reinterpret_cast<const float4*>(xr + k);
              a4.x = fmaf(x4.x, w4.x, a4.x);
              a4.y = fmaf(x4.y, w4.y, a4.y);
              a4.z = fmaf(x4.z, w4.z, a4.z);
              a4.w = fmaf(x4.w, w4.w, a4.w);
            }
            acc = (a4.x + a4.y) + (a4.z + a4.w);
          } else {
            for (int k = 0; k < cm; ++k) acc = fmaf(xr[k], fs_ldf(wr, k), acc);
          }
          y = fs_round<T>(fs_round<T>(acc + bias) * s_mask[r]);
        }
        dst_rows[(r0 + r) * kFsCP + h] = y;
      }
      __syncthreads();  // xs read before the next rows overwrite it
    }
  }

  // grid barrier, split: the first task's prologue (Wo, bias, the denominators' sums: no phase-1 data) runs
  // between this block's arrival and its wait for the others
  const cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  auto token = grid.barrier_arrive();

  // ---- phase 2: tasks (b, i block, j block, z block) ----
  const int64_t nsc = cdiv(S, kFsSC);
  const int g = tid / 64, cg = tid % 8, ig = (tid % 64) / 8;  // stage 2: K group, column and row groups
  auto prologue = [&](int64_t t) {  // Wo's chunk into wos, bo's into s_bo, the denominators' partial sums
    const int zc = static_cast<int>(t % nzc);
    const int64_t ic = (t / njz) % nic, b = t / (njz * nic), i0 = ic * kFsNI;
    const int z0 = zc * kFsZT;
    if (t == blockIdx.x && vec_wo) fs_wo_finish<T>(wos, wo_pf, tid);
    else fs_wo_stage<T>(wo, c, cz, z0, wos, tid, vec_wo);
    if (tid < kFsZT) s_bo[tid] = z0 + tid < cz ? fs_ldf(bo, z0 + tid) : 0.f;
    // thread (sl, il) sums s = sl, sl + 8, ... of row i0 + il (inv_denom_cols' order)
    const int sl = tid / 32, il = tid % 32;
    const int64_t i = i0 + il;
    double af = 0.0;
    long long ai = 0;
    if (i < N) {
      const int64_t base = b * S * N + i;
      if (mask_kind == kF32) {
        for (int64_t s = sl; s < S; s += kFsThreads / 32) af += static_cast<const float*>(mask)[base + s * N];
      } else if (mask_is_float(mask_kind)) {
        for (int64_t s = sl; s < S; s += kFsThreads / 32) af += mask_value(mask, base + s * N, mask_kind);
      } else {
        for (int64_t s = sl; s < S; s += kFsThreads / 32) ai += mask_int(mask, base + s * N, mask_kind);
      }
    }
    red_f[tid] = af;
    red_i[tid] = ai;
  };
  if (blockIdx.x < ntasks) prologue(blockIdx.x);
  grid.barrier_wait(std::move(token));  // a_rows, b_rows complete (release / acquire at gpu scope)

  for (int64_t t = blockIdx.x; t < ntasks; t += gridDim.x) {
    const int zc = static_cast<int>(t % nzc);
    const int64_t jc = (t / nzc) % njc, ic = (t / njz) % nic, b = t / (njz * nic);
    const int z0 = zc * kFsZT;
    const int64_t j0 = jc * kFsJT, i0 = ic * kFsNI;
    if (t != blockIdx.x) prologue(t);
    float acc[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[u][v] = 0.f;

    for (int64_t sc = 0; sc <= nsc; ++sc) {  // (the last pass, sc == nsc, only finishes the denominators)
      const int64_t s0 = sc * kFsSC;
      float4 av[kFsSC];
      if (sc < nsc) {
        {  // b rows (jj, s) -> bs[(jj * 8 + s)][k]: one 16-byte copy per thread (L2: written by phase 1)
          const int row = tid / 8, kq = tid % 8, jj = row / kFsSC, s = row % kFsSC;
          const bool ok = s0 + s < S && j0 + jj < N;
          const float* src = ok ? b_rows + ((b * S + s0 + s) * N + j0 + jj) * kFsCP + kq * 4 : b_rows;
          cp_async<16>(bs + row * kFsLDB + kq * 4, src, ok ? 16 : 0);
          cp_async_commit();
        }
        // a rows -> registers: thread (il, h quad) = (tid % 32, tid / 32) of each s
        const int il = tid % 32, hq = tid / 32;
        const bool iok = i0 + il < N;
#pragma unroll
        for (int s = 0; s < kFsSC; ++s) {
          const bool ok = iok && s0 + s < S;
          av[s] = ok ? __ldcg(reinterpret_cast<const float4*>(a_rows + ((b * S + s0 + s) * N + i0 + il) * kFsCP + hq * 4))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      if (sc == 0) {
        __syncthreads();  // red_f, red_i complete
        if (tid < 32) {
          float dn;
          if (mask_is_float(mask_kind)) {  // fp64 sum, then clamp(min = 1) (NaN stays NaN)
            double sum = 0.0;
            for (int q = 0; q < kFsThreads / 32; ++q) sum += red_f[q * 32 + tid];
            dn = static_cast<float>(sum);
            dn = (dn < 1.f) ? 1.f : dn;
          } else {
            long long sum = 0;
            for (int q = 0; q < kFsThreads / 32; ++q) sum += red_i[q * 32 + tid];
            dn = static_cast<float>(sum < 1 ? 1 : sum);
          }
          s_invd[tid] = 1.f / dn;
          if (inv_denom != nullptr && jc == 0 && zc == 0 && i0 + tid < N) inv_denom[b * N + i0 + tid] = 1.f / dn;
        }
      }
      if (sc == nsc) break;
      {  // a -> as[(h * 8 + s)][il]: lanes along il (conflict-free stores)
        const int il = tid % 32, hq = tid / 32;
#pragma unroll
        for (int s = 0; s < kFsSC; ++s) {
          as[((hq * 4 + 0) * kFsSC + s) * kFsLDA + il] = av[s].x;
          as[((hq * 4 + 1) * kFsSC + s) * kFsLDA + il] = av[s].y;
          as[((hq * 4 + 2) * kFsSC + s) * kFsLDA + il] = av[s].z;
          as[((hq * 4 + 3) * kFsSC + s) * kFsLDA + il] = av[s].w;
        }
      }
      cp_async_wait<0>();
      __syncthreads();  // bs, as (and the first task's wos) complete
      {  // stage 1: thread (h, s), P for 4 jj x 8 zz
        const int h = tid / kFsSC, s = tid % kFsSC;
        float p[kFsJT][kFsZT];
#pragma unroll
        for (int jj = 0; jj < kFsJT; ++jj)
#pragma unroll
          for (int zz = 0; zz < kFsZT; ++zz) p[jj][zz] = 0.f;
#pragma unroll 2
        for (int k = 0; k < kFsCP; k += 4) {
          float4 bv[kFsJT], wv[kFsZT];
#pragma unroll
          for (int jj = 0; jj < kFsJT; ++jj)
            bv[jj] = *reinterpret_cast<const float4*>(bs + (jj * kFsSC + s) * kFsLDB + k);
#pragma unroll
          for (int zz = 0; zz < kFsZT; ++zz)
            wv[zz] = *reinterpret_cast<const float4*>(wos + zz * kFsLDW + h * kFsHS + k);
#pragma unroll
          for (int jj = 0; jj < kFsJT; ++jj)
#pragma unroll
            for (int zz = 0; zz < kFsZT; ++zz) {
              float v = p[jj][zz];
              v = fmaf(bv[jj].x, wv[zz].x, v);
              v = fmaf(bv[jj].y, wv[zz].y, v);
              v = fmaf(bv[jj].z, wv[zz].z, v);
              p[jj][zz] = fmaf(bv[jj].w, wv[zz].w, v);
            }
        }
        float* prow = ps + (h * kFsSC + s) * kFsLDP;
#pragma unroll
        for (int jj = 0; jj < kFsJT; ++jj) {
          *reinterpret_cast<float4*>(prow + jj * kFsZT) = make_float4(p[jj][0], p[jj][1], p[jj][2], p[jj][3]);
          *reinterpret_cast<float4*>(prow + jj * kFsZT + 4) = make_float4(p[jj][4], p[jj][5], p[jj][6], p[jj][7]);
        }
      }
      __syncthreads();  // ps complete
      {  // stage 2: K group g takes rows [64 g, 64 g + 64) of (h, s)
        const float* ap = as + (g * (kFsK / 4)) * kFsLDA + ig * 4;
        const float* pp = ps + (g * (kFsK / 4)) * kFsLDP + cg * 4;
#pragma unroll 8
        for (int kk = 0; kk < kFsK / 4; ++kk) {
          const float4 a4 = *reinterpret_cast<const float4*>(ap + kk * kFsLDA);
          const float4 p4 = *reinterpret_cast<const float4*>(pp + kk * kFsLDP);
          const float av4[4] = {a4.x, a4.y, a4.z, a4.w}, pv4[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
          for (int u = 0; u < 4; ++u)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[u][v] = fmaf(av4[u], pv4[v], acc[u][v]);
        }
      }
      __syncthreads();  // as, bs, ps read before the next chunk's copies (or the sums' stores into as)
    }

    // the K groups' sums through as, added in group order; out = bo + inv_denom * sum
    float* red = as;  // [4][32 i][32 columns]
#pragma unroll
    for (int u = 0; u < 4; ++u)
      *reinterpret_cast<float4*>(red + (g * kFsNI + ig * 4 + u) * kFsCols + cg * 4) =
          make_float4(acc[u][0], acc[u][1], acc[u][2], acc[u][3]);
    __syncthreads();  // red complete
    {
      const int il = tid / 8, cq = tid % 8, jj = cq / 2, zz0 = (cq % 2) * 4;
      float4 v = *reinterpret_cast<const float4*>(red + il * kFsCols + cq * 4);
#pragma unroll
      for (int q = 1; q < 4; ++q) {
        const float4 w = *reinterpret_cast<const float4*>(red + (q * kFsNI + il) * kFsCols + cq * 4);
        v.x += w.x;
        v.y += w.y;
        v.z += w.z;
        v.w += w.w;
      }
      const int64_t i = i0 + il, j = j0 + jj;
      const int z = z0 + zz0;
      if (i < N && j < N && z < cz) {
        const float d = s_invd[il];
        const float o0 = s_bo[zz0] + d * v.x, o1 = s_bo[zz0 + 1] + d * v.y, o2 = s_bo[zz0 + 2] + d * v.z,
                    o3 = s_bo[zz0 + 3] + d * v.w;
        T* dst = out + ((b * N + i) * N + j) * cz + z;
        if (cz % 4 == 0) {  // z % 4 == 0 and z + 3 < cz: one 16-byte (8-byte for 16 bits) store
          if constexpr (std::is_same_v<T, float>) *reinterpret_cast<float4*>(dst) = make_float4(o0, o1, o2, o3);
          else *reinterpret_cast<uint2*>(dst) = pack4_16<T>(o0, o1, o2, o3);
        } else {
          dst[0] = fs_out<T>(o0);
          if (z + 1 < cz) dst[1] = fs_out<T>(o1);
          if (z + 2 < cz) dst[2] = fs_out<T>(o2);
          if (z + 3 < cz) dst[3] = fs_out<T>(o3);
        }
      }
    }
    __syncthreads();  // red, s_invd and s_bo read before the next task
  }
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
