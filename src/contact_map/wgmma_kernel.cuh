// contact_map: the wgmma kernel (Hopper, sm_90a) and its parameter-packing kernel.
#pragma once
#include "wgmma_roles.cuh"

namespace contact_map {


// Assumptions: see the section's head. tile_counter: KC = 128's ticket counter (the params kernel zeroes
// it), unused at KC = 64. Shared memory: SmemWg(KC, HP, R, sizeof(T)).total bytes. T: the input's, output's
// and parameters' type (float: split-TF32 products; __half / __nv_bfloat16: the 16-bit build, products in T).
template <typename T, int KC, int HP>
__global__ void __launch_bounds__(kWgThreads<kConsumerWgs<T, KC>>, 1)
contact_map_wgmma_kernel(const __grid_constant__ CUtensorMap tm_tile,    // x as (C, N (j), N (i), B)
                         const __grid_constant__ CUtensorMap tm_mirror,  // x as (C, N (i), N (j), B)
                         T* __restrict__ out,                            // (B, N, N)
                         const float* __restrict__ wpack,                // kWgPackFloats<T, KC, HP>
                         int* __restrict__ tile_counter,                 // tickets handed out (0 at the start)
                         const T* __restrict__ b3,                       // (1)
                         float eps, int B, int N, int C, int H, int R) {
#if defined(CM_WG_DEVICE)
  // The build: KC = 128 takes the streamlined path (ticket walk, evict_first, FFMA terms; ping-pong in fp32)
  static_assert((KC == 64 || KC == 128) && (HP == 32 || HP == 64), "contact_map_wgmma_kernel: KC 64 / 128, HP 32 / 64");
  constexpr bool kWide = KC == 128;
  constexpr bool k16 = WgElem<T>::kHalf;  // the 16-bit build
  constexpr bool kOneSide = k16 && kWide;  // row_stats16 and s = fmaf(db, rb, da ra): outputs from i <= j only
  constexpr int NCW = kConsumerWgs<T, KC>;
  constexpr bool kTurns = kWide && NCW == 2;  // the consumers' products take turns (WgBarrier)
  constexpr int kConsumerRegs = NCW == 3 ? kConsumerRegs3 : kWide ? kConsumerRegs128 : kConsumerRegs64;
  constexpr int kProducerRegs = kWide ? kProducerRegs128 : kProducerRegs64;
  extern __shared__ __align__(16) float smem_raw[];
  const SmemWg L(KC, HP, R, sizeof(T));
  // the ring 1024-byte aligned (the 128-byte swizzle's atom), as an offset from smem_raw so that the compiler
  // keeps these pointers in the shared space (LDS; through an integer cast it emitted generic LD.E)
  float* sm = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) / 4;
  T* ring = reinterpret_cast<T*>(sm);
  float* w1s = sm + L.ring / 4;       // hi plane, then lo plane: 2 x HP x KC (16-bit build: one plane of T)
  float* w2s = w1s + L.w1 / 4;        // 2 x HP x HP (16-bit build: one plane of T)
  float* vec = w2s + L.w2 / 4;        // b1' | b2 | w3 (HP each)
  int4* tinfo = reinterpret_cast<int4*>(vec + 3 * HP);  // (b, I, J, 0) of the tile in slot s
  uint64_t* full = reinterpret_cast<uint64_t*>(tinfo + R);
  uint64_t* empty = full + R;
  uint64_t* wbar = empty + R;  // the parameters' bulk copies
  const Ring<T> rg{ring, tinfo, full, empty, L.slot_elems, R};

  const int tid = threadIdx.x, wg = tid / 128;
  const int nT = cdiv(N, TILE);
  const long long tiles_per_b = static_cast<long long>(nT) * (nT + 1) / 2;
  const long long total = static_cast<long long>(B) * tiles_per_b;
  if (tid == 0) {
    for (int s = 0; s < R; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 4);
    }
    mbar_init(wbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the mbarriers are initialised before anyone waits on them

  if (wg == NCW) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid == kParamsThread<NCW>) {
      produce_params<T, KC, HP>(w1s, wpack, wbar);
    } else if (tid == kTileThread<NCW>) {
      if constexpr (kWide)
        produce_tiles_by_ticket<T, KC, NCW>(rg, tm_tile, tm_mirror, tile_counter, total, tiles_per_b);
      else produce_tiles_strided<T, KC>(rg, tm_tile, tm_mirror, total, tiles_per_b);
    }
    return;  // no block-wide barrier after this point
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  // ---- consumer warpgroups 0 .. NCW - 1 --------------------------------------------------------
  // The consumer warpgroup wg's tiles: q = wg, wg + NCW, ... of the block (block-local order). KC = 128: the
  // tiles' coordinates from the producer (tinfo), slots and parities kept incrementally, the loop ends at a
  // sentinel; kTurns (fp32, NCW = 2): the products take turns with the other warpgroup: warpgroup w syncs on
  // mma_turn(w) before GEMM1 and after GEMM2 arrives on the other's, warpgroup 1 granting warpgroup 0 the
  // first turn. Every tile's GEMM2 arrives unconditionally; at its sentinel a warpgroup consumes the
  // arrival meant for its next turn, and at the first sentinel gives the other warpgroup the arrival that
  // its own sentinel (the second) will consume, so each barrier phase gets exactly one sync (128 threads)
  // and one arrive (128). Without turns (NCW = 3) a sentinel only ends the loop.
  // KC = 64: a fixed stride of tiles, each decoded here, slot u % R.
  // The loop body stays in the kernel: as a function (or lambda) taking the shared-memory pointers (vec,
  // w1s, the ring's), the compiler derives their addresses differently and the machine code changes
  // write_pair_outputs takes values only.
  constexpr int KS1 = k16 ? KC / 16 : KC / 8, KS2 = HP / 8, NA = HP / 2, NK = KC / 16;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3, w4 = (tid >> 5) & 3;
  const int p0 = 16 * w4 + frag_pair(g);  // this thread's pairs: p0 (fragment row g) and p0 + 8 (row g + 8)
  const float inv_c = 1.f / static_cast<float>(C), bias3 = to_f32(__ldg(b3));
  const uint64_t d1h = plane_desc(w1s), d1l = plane_desc(w1s + HP * KC);
  const uint64_t d2h = plane_desc(w2s), d2l = plane_desc(w2s + HP * HP);

  float d0[NA], d1[NA];  // wgmma accumulators (each chunk starts with scale-d 0; zeroed once so they are defined)
#pragma unroll
  for (int e = 0; e < NA; ++e) d0[e] = d1[e] = 0.f;
  bool staged = false;  // this thread has waited for the weights
  if constexpr (kTurns) {
    if (wg == 1) named_bar_arrive(mma_turn(0));  // warpgroup 0's products go first
  }
  unsigned q = wg;  // block-local tile index
  // KC = 128: slot and parity of use u0 = 2q, kept incrementally (u0 advances by 2 NCW per tile; launch_wgmma
  // makes R a multiple of 2 NCW, so one wrap at most, but the two steps below hold for any R >= NCW)
  int cs = static_cast<int>((2u * q) % R);
  unsigned cph = ((2u * q) / R) & 1;
  for (long long t = blockIdx.x + static_cast<long long>(wg) * gridDim.x; kWide || t < total;
       t += static_cast<long long>(NCW) * gridDim.x, q += NCW) {
    int b = 0, I = 0, J = 0;
    if constexpr (!kWide) decode_tile(t, tiles_per_b, b, I, J);
    const unsigned u0 = 2 * q, u1 = 2 * q + 1;
    int s0, s1;
    unsigned ph0, ph1;
    if constexpr (kWide) {
      s0 = cs;
      ph0 = cph;
      s1 = s0 + 1 == R ? 0 : s0 + 1;
      ph1 = s0 + 1 == R ? ph0 ^ 1 : ph0;
      cs += 2 * NCW;
      if (cs >= R) {
        cs -= R;
        cph ^= 1;
      }
      if (cs >= R) {
        cs -= R;
        cph ^= 1;
      }
    } else {
      s0 = static_cast<int>(u0 % R);
      s1 = static_cast<int>(u1 % R);
      ph0 = (u0 / R) & 1;
      ph1 = (u1 / R) & 1;
    }
    const T* tl = ring + s0 * L.slot_elems;
    const T* mi = ring + s1 * L.slot_elems;
    if constexpr (kWide) {  // the tile's coordinates from its producer
      mbar_wait(full + s0, ph0);
      // lane 0, the thread that releases the slot, alone reads the coordinates; the warp gets them by shuffles
      int4 ti = make_int4(0, 0, 0, 0);
      if (lane == 0) ti = tinfo[s0];
      ti.x = __shfl_sync(0xffffffffu, ti.x, 0);
      ti.y = __shfl_sync(0xffffffffu, ti.y, 0);
      ti.z = __shfl_sync(0xffffffffu, ti.z, 0);
      b = ti.x;
      I = ti.y;
      J = ti.z;
      if (b < 0) {  // a sentinel: the block's tiles are done (I = 1: the first of its NCW sentinels)
        if constexpr (kTurns) {
          named_bar_sync(mma_turn(wg));
          if (I != 0) named_bar_arrive(mma_turn(1 - wg));
        }
        break;
      }
    }
    const int i0 = TILE * I + (p0 >> 3), j0 = TILE * J + (p0 & 7);
    const int i1 = i0 + 1;  // p1 = p0 + 8: next tile row, same column
    const bool ok0 = i0 < N && j0 < N, ok1 = i1 < N && j0 < N;
    float mean[4], rstd[4];  // KC = 128: mean[] holds each row's delta, v the rows' d = x - m (row_stats' WIDE;
                             // kOneSide: v gets d, mean[] is unused)
    uint32_t ah[KS1][4], al[k16 ? 1 : KS1][4];  // the 16-bit build: ah only, in T
    {
      // ---- operands: this thread's 4 rows (tile p0, p0 + 8; mirror p0, p0 + 8) into registers, both
      // slots released once this warp has read them, the rows' statistics, and s split into GEMM1's A
      // fragments for all of K. KC = 64 waits for slot s0 here (KC = 128 has waited above, for the tile's
      // coordinates) and KC = 128 computes the tile half's terms before the wait for the mirror, so that
      // less work follows the last copy's arrival.
      float4 v[4][NK];
      if constexpr (!kWide) mbar_wait(full + s0, ph0);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        v[0][kk] = slot_chunk4(tl, p0, kk, t4);
        v[1][kk] = slot_chunk4(tl, p0 + 8, kk, t4);
      }
      if constexpr (kOneSide) half_stats16<NK, 0>(v, C, inv_c, eps, ok0, ok1, rstd);
      else half_stats<NK, 0, kWide>(v, C, inv_c, eps, ok0, ok1, mean, rstd);
      if constexpr (kOneSide) {  // the tile half's terms d ra before the mirror's wait
#pragma unroll
        for (int kk = 0; kk < NK; ++kk)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float r = 0.5f * rstd[h];
            const float4 d = v[h][kk];
            v[h][kk] = make_float4(__fmul_rn(d.x, r), __fmul_rn(d.y, r), __fmul_rn(d.z, r), __fmul_rn(d.w, r));
          }
      } else if constexpr (kWide) {  // the tile half's terms before the mirror's wait
#pragma unroll
        for (int kk = 0; kk < NK; ++kk)
#pragma unroll
          for (int h = 0; h < 2; ++h) v[h][kk] = term_ffma(v[h][kk], mean[h], 0.5f * rstd[h]);
      }
      mbar_wait(full + s1, ph1);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        v[2][kk] = slot_chunk4(mi, p0, kk, t4);
        v[3][kk] = slot_chunk4(mi, p0 + 8, kk, t4);
      }
      __syncwarp();
      if (lane == 0) {  // this warp has read both slots
        mbar_arrive(empty + s0);
        mbar_arrive(empty + s1);
      }
      if constexpr (kOneSide) half_stats16<NK, 2>(v, C, inv_c, eps, ok0, ok1, rstd);
      else half_stats<NK, 2, kWide>(v, C, inv_c, eps, ok0, ok1, mean, rstd);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if constexpr (kOneSide) {
            s_fragments16_fma<T, KS1>(v[h][kk], v[2 + h][kk], 0.5f * rstd[2 + h], kk, h, ah);
          } else if constexpr (k16) {
            const float4 pa = term_sub_mul(v[h][kk], mean[h], 0.5f * rstd[h]);
            s_fragments16<T, KS1>(pa, term_sub_mul(v[2 + h][kk], mean[2 + h], 0.5f * rstd[2 + h]), kk, h, ah);
          } else if constexpr (kWide) {
            s_fragments<KC, false>(v[h][kk], term_ffma(v[2 + h][kk], mean[2 + h], 0.5f * rstd[2 + h]), kk, h, ah, al);
          } else {
            const float4 pa = term_sub_mul(v[h][kk], mean[h], 0.5f * rstd[h]);
            s_fragments<KC, true>(pa, term_sub_mul(v[2 + h][kk], mean[2 + h], 0.5f * rstd[2 + h]), kk, h, ah, al);
          }
    }
    if (!staged) {  // the parameters are in shared memory
      mbar_wait(wbar, 0);
      staged = true;
    }
    // ---- MLP on the tensor cores: GEMM1 acc = s W1'^T; h1 = relu(acc + b1') split in registers into
    // GEMM2's A fragments (gemm2_unit's order); GEMM2 acc = h1 W2^T ----
    if constexpr (kTurns) named_bar_sync(mma_turn(wg));  // this warpgroup's turn on the tensor cores
    float acc[NA];
    if constexpr (k16) {
      // both products in T: GEMM1 into d0; h1 = relu(d0 + b1') rounded to T in the order of the accumulator
      // (d[4 j + e], units 8 j + 2 t + e % 2), which is GEMM2's A layout: k step m's a[r] holds d[8 m + 2 r],
      // d[8 m + 2 r + 1]
      wg_fence(ah);
      wg_gemm16<T, HP, KS1>(ah, d1h, d0);
      wg_fence(ah);
      uint32_t bh[HP / 16][4];
#pragma unroll
      for (int m = 0; m < HP / 16; ++m)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int e0 = 8 * m + 2 * r, unit = 8 * (e0 >> 2) + 2 * t4;
          bh[m][r] = pack2<T>(relu(d0[e0] + vec[unit]), relu(d0[e0 + 1] + vec[unit + 1]));
        }
      wg_fence(bh);
      wg_gemm16<T, HP, HP / 16>(bh, d2h, d0);
      wg_fence(bh);
#pragma unroll
      for (int e = 0; e < NA; ++e) acc[e] = d0[e];
    } else {
      wg_fence(ah);
      wg_fence(al);
      wg_gemm<HP, KS1>(ah, al, d1h, d1l, d0, d1, acc);
      wg_fence(ah);  // the A registers stay live until every wgmma reading them has completed
      wg_fence(al);

      uint32_t bh[KS2][4], bl[KS2][4];
#pragma unroll
      for (int j = 0; j < KS2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int unit = 8 * j + 2 * t4 + (e & 1);
          const float h = relu(acc[4 * j + e] + vec[unit]);
          const int slot = (e >> 1) | ((e & 1) << 1);  // d[4j + e]: row g + 8 (e / 2), unit + e % 2 -> a[(e/2) + 2 (e%2)]
          split_tf32_fast<!kWide>(h, bh[j][slot], bl[j][slot]);
        }
      wg_fence(bh);
      wg_fence(bl);
      wg_gemm<HP, KS2>(bh, bl, d2h, d2l, d0, d1, acc);
      wg_fence(bh);
      wg_fence(bl);
    }
    if constexpr (kTurns) named_bar_arrive(mma_turn(1 - wg));  // the other warpgroup's turn

    // ---- layer 3: z = sum_u w3[u] relu(h2[u] + b2[u]) over this lane's units, then the output ----
    float z0 = 0.f, z1 = 0.f;
#pragma unroll
    for (int j = 0; j < KS2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int unit = 8 * j + 2 * t4 + e;
        const float bb = vec[HP + unit], ww = vec[2 * HP + unit];
        z0 = fmaf(ww, relu(acc[4 * j + e] + bb), z0);
        z1 = fmaf(ww, relu(acc[4 * j + 2 + e] + bb), z1);
      }
    // kOneSide: a diagonal tile's positions with i > j leave both outputs to their mirror position (s is not
    // symmetric bit for bit there); an off-diagonal tile has i < j everywhere
    write_pair_outputs(z0, z1, t4, ok0 && (!kOneSide || i0 <= j0), ok1 && (!kOneSide || i1 <= j0), i0, i1, j0, b, N,
                       bias3, out);
  }
#else
  __trap();  // built without sm_90a: the host never launches this (wgmma_supported)
#endif
}

}  // namespace contact_map
