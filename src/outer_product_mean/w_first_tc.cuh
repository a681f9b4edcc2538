// outer_product_mean: w_first_tc / w_first_tc2, stage 2 on mma.sync in split TF32.
#pragma once
#include "w_first.cuh"

namespace opm {

// mma.sync split-TF32 pieces (w_first_tc, w_first_tc2; split_tf32 itself is with the wgmma pieces above).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float lds_volatile(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return v;
}
// d += A(16 x 8, row-major) * B(8 x 8, column-major), TF32 inputs, fp32 accumulate (sm_80+).
// Fragments (g = lane / 4, t = lane % 4): a = {A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]},
// b = {B[t][g], B[t+4][g]}, d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // TF32 mma needs sm_80+: never return a silently wrong product
#endif
}
// d += a b for one m16n8k16 step in float16 (fp32 accumulation): a[0] row g, k 2 t + {0, 1}; a[1] row
// g + 8; a[2] k + 8; a[3] both; b0 k 2 t + {0, 1}, b1 k + 8, column g; d as mma_tf32's.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // f16 mma needs sm_80+
#endif
}
// The same step in bfloat16 (opm_pair_scale_ring_kernel's HMMA counts).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // bf16 mma needs sm_80+
#endif
}

// ---------------------------------------------------------------------------------------------
// opm_wfirst_tc_kernel: opm_wfirst_gemm_kernel's product (w_first stage 2 for the j-chunk
//   [j0, j0 + JCv): out[b,i,j0+jl,z] = bo[z] + inv_denom[b,i] * sum_{k=(s,h)} aT[b][k][i] P[b][k][n],
//   n = jl*CZP4 + z) on the tensor cores in split TF32.
// Block tile 128 (i) x 128 (n), 16 warps of 32 x 32 (2 m16 blocks x 4 n8 tiles each; with 8 warps of
//   64 x 32 the accumulators alone took 128 registers and ptxas spilled), K in stages
//   of kTcKC rows, double-buffered cp.async; the stage rows are kTcLd = 136 floats apart, so the
//   scalar fragment loads (lanes g = 0..7 along i or n, t = 0..3 along k) hit 32 distinct banks.
// Accumulation: each k step's hi*hi into a zeroed set, promoted into acc by an fp32 add (the tensor
//   cores' own accumulation truncates); lo*hi + hi*lo accumulated on the tensor cores over all of K
//   (sm), added at the end.
// VER 2 (variant w_first_tc2): VER 1 is latency-bound (ncu at shallow: tensor pipe 41% busy, issue
//   slots 49%, 1.2 of 4 warps eligible): each k step is one dependent chain from the fragment loads
//   to the promoting adds. VER 2 (a) folds lo*hi and hi*lo into the k step's fresh
//   accumulator before hi*hi (d = lo_a hi_b + hi_a lo_b, then d += hi_a hi_b, then acc += d: the
//   tensor cores' truncation is relative to |d| once per k step, as in VER 1, the small terms first),
//   which frees the 32 registers of sm; (b) loads the next k step's fragments into registers
//   before the current one's splits (ptxas moves them after the products, though); (c) takes K
//   stages of 64 rows (half the barriers): 2% faster than VER 1 at shallow.
// Assumptions: kTcThreads = 512 threads; Npad % 4 == 0; ldp % 4 == 0; JCv*CZP4 % 4 == 0.
// Shared memory (dynamic): As [2][KC][kTcLd], Bs [2][KC][kTcLd] (68 KB at KC = 32, 136 KB at 64).
// ---------------------------------------------------------------------------------------------
constexpr int kTcThreads = 512, kTcLd = kTile + 8;
template <int VER>
constexpr int kTcKC = VER == 1 ? 32 : 64;
template <int VER>
constexpr size_t kTcSmemBytes = 4 * 2 * 2 * kTcKC<VER> * kTcLd;

template <int VER>
__global__ void __launch_bounds__(kTcThreads, 1) opm_wfirst_tc_kernel(
    const float* __restrict__ aT, const float* __restrict__ P, const float* __restrict__ inv_denom,
    const float* __restrict__ bo, float* __restrict__ out,
    int64_t B, int64_t S, int64_t N, int64_t Npad, int CP, int64_t j0, int64_t JCv, int64_t ldp, int cz, int CZP4) {
  constexpr int KC = kTcKC<VER>;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  float* As = smem;                          // [2][KC][kTcLd]: As[k][i]
  float* Bs = smem + 2 * KC * kTcLd;         // [2][KC][kTcLd]: Bs[k][n]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t4 = lane % 4;
  const int wm = warp / 4, wn = warp % 4;    // warp tile: rows 32 wm.., columns 32 wn..
  const WfirstTiles tiles(B, S, N, CP, JCv, CZP4);
  const int64_t ncols = tiles.ncols;
  const int64_t nchunks = cdiv(tiles.K, KC);
  for (int64_t tt = blockIdx.x; tt < tiles.total; tt += gridDim.x) {
    int64_t b, i0, n0;
    tiles.tile(tt, b, i0, n0);
    const WfirstCopy copy(aT, P, tid, b, i0, n0, N, tiles.K, Npad, ldp, ncols);
    auto load_stage = [&](int buf, int64_t ch) {
      copy.stage<KC, kTcThreads / 32, kTcLd>(As + buf * KC * kTcLd, Bs + buf * KC * kTcLd, ch);
    };
    float acc[2][4][4], sm[2][4][4];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mb][nt][q] = sm[mb][nt][q] = 0.f;

    if (nchunks > 0) {
      load_stage(0, 0);
      cp_async_commit();
    }
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int buf = static_cast<int>(ch & 1);
      if (ch + 1 < nchunks) {
        load_stage(buf ^ 1, ch + 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // every thread's copies of chunk ch are visible to all threads
      const float* a = As + buf * KC * kTcLd + wm * 32 + g;
      const float* bm = Bs + buf * KC * kTcLd + wn * 32 + g;
      if constexpr (VER == 2) {
        // fragments of k step ks (raw fp32): fa[mb] = A rows g, g+8 at k = t, t+4; fb[nt] = B at k = t, t+4.
        // Volatile loads, meant to keep the next step's loads ahead of this step's products; in the
        // SASS ptxas still issues them after the HMMAs, among the promoting adds (so the loads
        // overlap the adds, not the products).
        auto load_frag = [&](int ks, float (&fa)[2][4], float (&fb)[4][2]) {
          const int r0 = (ks * 8 + t4) * kTcLd, r1 = r0 + 4 * kTcLd;
#pragma unroll
          for (int mb = 0; mb < 2; ++mb) {
            fa[mb][0] = lds_volatile(a + r0 + mb * 16);
            fa[mb][1] = lds_volatile(a + r0 + mb * 16 + 8);
            fa[mb][2] = lds_volatile(a + r1 + mb * 16);
            fa[mb][3] = lds_volatile(a + r1 + mb * 16 + 8);
          }
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            fb[nt][0] = lds_volatile(bm + r0 + nt * 8);
            fb[nt][1] = lds_volatile(bm + r1 + nt * 8);
          }
        };
        float fa[2][4], fb[4][2];
        load_frag(0, fa, fb);
#pragma unroll 1
        for (int ks = 0; ks < KC / 8; ++ks) {
          float na[2][4], nb[4][2];
          load_frag(ks + 1 < KC / 8 ? ks + 1 : ks, na, nb);  // the next step's (last step: reloaded)
          uint32_t ah[2][4], al[2][4], bh[4][2], bl[4][2];
#pragma unroll
          for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int q = 0; q < 4; ++q) split_tf32(fa[mb][q], ah[mb][q], al[mb][q]);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            split_tf32(fb[nt][0], bh[nt][0], bl[nt][0]);
            split_tf32(fb[nt][1], bh[nt][1], bl[nt][1]);
          }
#pragma unroll
          for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              float d[4] = {0.f, 0.f, 0.f, 0.f};
              mma_tf32(d, al[mb], bh[nt][0], bh[nt][1]);  // the small terms first
              mma_tf32(d, ah[mb], bl[nt][0], bl[nt][1]);
              mma_tf32(d, ah[mb], bh[nt][0], bh[nt][1]);
#pragma unroll
              for (int q = 0; q < 4; ++q) acc[mb][nt][q] += d[q];
            }
#pragma unroll
          for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int q = 0; q < 4; ++q) fa[mb][q] = na[mb][q];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            fb[nt][0] = nb[nt][0];
            fb[nt][1] = nb[nt][1];
          }
        }
      } else {
#pragma unroll 1  // one k step's fragments live at a time (register budget: 128 at 512 threads)
        for (int ks = 0; ks < KC / 8; ++ks) {
          const int r0 = (ks * 8 + t4) * kTcLd, r1 = r0 + 4 * kTcLd;  // k = 8 ks + t, 8 ks + t + 4
          uint32_t ah[2][4], al[2][4], bh[4][2], bl[4][2];
#pragma unroll
          for (int mb = 0; mb < 2; ++mb) {
            split_tf32(a[r0 + mb * 16], ah[mb][0], al[mb][0]);
            split_tf32(a[r0 + mb * 16 + 8], ah[mb][1], al[mb][1]);
            split_tf32(a[r1 + mb * 16], ah[mb][2], al[mb][2]);
            split_tf32(a[r1 + mb * 16 + 8], ah[mb][3], al[mb][3]);
          }
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            split_tf32(bm[r0 + nt * 8], bh[nt][0], bl[nt][0]);
            split_tf32(bm[r1 + nt * 8], bh[nt][1], bl[nt][1]);
          }
#pragma unroll
          for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              float d[4] = {0.f, 0.f, 0.f, 0.f};
              mma_tf32(d, ah[mb], bh[nt][0], bh[nt][1]);
              mma_tf32(sm[mb][nt], al[mb], bh[nt][0], bh[nt][1]);
              mma_tf32(sm[mb][nt], ah[mb], bl[nt][0], bl[nt][1]);
#pragma unroll
              for (int q = 0; q < 4; ++q) acc[mb][nt][q] += d[q];
            }
        }
      }  // VER 1
      __syncthreads();  // stage buf fully read before iteration ch+1 prefetches chunk ch+2 into it
    }

    // Epilogue: d[q] of (mb, nt) is row i0 + 32 wm + 16 mb + g + 8 (q / 2), column
    // n0 + 32 wn + 8 nt + 2 t + (q % 2).
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int64_t i = i0 + wm * 32 + mb * 16 + g + 8 * hr;
        if (i >= N) continue;
        const float inv = inv_denom[b * N + i];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int hc = 0; hc < 2; ++hc) {
            const int64_t n = n0 + wn * 32 + nt * 8 + 2 * t4 + hc;
            if (n >= ncols) continue;
            const int64_t jl = n / CZP4;
            const int z = static_cast<int>(n - jl * CZP4);
            if (z >= cz) continue;
            const int q = 2 * hr + hc;
            out[((b * N + i) * N + j0 + jl) * cz + z] = __ldg(bo + z) + inv * (acc[mb][nt][q] + sm[mb][nt][q]);
          }
      }
    // (the K loop ends with a barrier, so the next tile's first copies cannot race this one's reads)
  }
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
