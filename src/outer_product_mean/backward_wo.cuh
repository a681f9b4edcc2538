// outer_product_mean: the backward's out_proj weight gradient (dWo) on wgmma.
#pragma once
#include "outer_wg_kernel.cuh"

namespace opm {

// The backward's out_proj weight gradient on wgmma, without the (N, N, c*c) outer product in memory:
//   dWo[z, hk] = sum_{b,i,j} gd[b,i,j,z] O[b,i,j,hk],  gd = g inv_denom[b,i],  O[b,i,j,(h,k)] = sum_s a b
// for c = 32 (hk = 1024), c_z <= 128, a, b (B, S, N, 32) fp32 (masked); T float: split TF32 throughout, T
// __half / __nv_bfloat16: the products' operands rounded to T (16-bit wgmma, fp32 accumulation).
// opm_bw_wo_prep_kernel<float> writes three sets of split planes in 16-k core-matrix blocks (element (r, k)
// of a block plane at wo_off16(r, k): 8-row groups 512 bytes apart, k core matrices 128 bytes apart):
//   Abw[(((b*kBwNSL + sl)*KB16 + kb)*MB + mb)*2*kOwAPlane + plane*kOwAPlane + wo_off16(r, s % 16)]
//       = a[b, s, 32 mb + r % 32, 2 sl + r / 32]  (r < 64: rows (hh = r / 32, il = r % 32); MB = 2 NIT)
//   Bbw[((b*NBB + jb)*KB16 + kb)*2*kOwBPlane + plane*kOwBPlane + wo_off16(n, s % 16)]
//       = b[b, s, 4 jb + n / 32, n % 32]  (outer_wg's Bow layout)
//   Gbw[(((b*NITc + it - it0)*NBB + jt)*8 + c)*kOwStage + w*4096 + plane*2048 + wo_off16(z, p % 16)]
//       = gd[b, 64 it + 32 w + p / 4, 4 jt + p % 4, z],  p = 16 c + p % 16  (warpgroup w's pair p)
// (s = 16 kb + s % 16; zeros past S, N and c_z); Abw and Bbw only if ab, Gbw for the i tiles it0 ..
// it0 + NITc - 1 (a chunk; with kSplitJ of one i tile, its j blocks jt0 ..). Work items of 4 consecutive k, one
// store_split4 each.
// 16-bit T: one T plane per set, blocks of 32 s (KB16 then counts them) at ow_off16h (outer_wg's 16-bit
// blocks: 8-row groups 512 bytes apart), 8 consecutive k per item:
//   Abw[(((b*kBwNSL + sl)*KB16 + kb)*MB + mb)*kOwABlk16 + ow_off16h(r, s % 32)]  (s = 32 kb + s % 32)
//   Bbw[((b*NBB + jb)*KB16 + kb)*kOwBBlk16 + ow_off16h(n, s % 32)]
//   Gbw[(((b*NITc + it - it0)*NBB + jt)*4 + c)*8192 + w*4096 + ow_off16h(z, P)] = gd of warpgroup w's
//       pair p = 32 c + wo_pair16(P): 32 pairs per slot, in the order of phase W's A fragments; its items
//       take 4 z (an 8-byte load of g per pair: c_z % 8 == 0 for 16-bit T) and 8 positions.
// (16-bit indices in T elements.) kSplitJ (either type): Gbw holds the chunk's j blocks jt0 .. jt0 + NJc - 1 only,
// NJc in place of NBB and jt - jt0 in place of jt in its index; Abw, Bbw as above.
// ---------------------------------------------------------------------------------------------
constexpr int kBwNSL = 16;        // hk slices of 64 (2 h each)
constexpr int kBwLDO = 64 + 8;    // Os row stride (pairs x hk): 8 mod 32 words, conflict-free A fragments
constexpr int kBwoStages = 4;
constexpr size_t kBwoSmemBytes = 4ull * (kBwoStages * kOwStage + 2 * 128 * kBwLDO) + 16 * kBwoStages;
__host__ __device__ __forceinline__ int wo_off16(int r, int k) { return (r >> 3) * 128 + (k >> 2) * 32 + (r & 7) * 4 + (k & 3); }
// The pair at position P (0..31) of a 16-bit G slot: the A fragment of k position kk = P % 16 of k step
// ks = P / 16 holds Os rows 16 ks + t4 + 4 e + 8 h for kk = 2 t4 + e + 8 h (8 t4 words apart: no bank
// conflicts).
__host__ __device__ __forceinline__ int wo_pair16(int P) {
  const int kk = P & 15;
  return (P & 16) + ((kk & 7) >> 1) + 4 * (kk & 1) + 8 * (kk >> 3);
}
// The A and B items of opm_bw_wo_prep_kernel: an A item e is (b, sl, kb, mb, grp, r) with r fastest, a B item
// f = e - nA is (b, jb, kb, grp, n) with n fastest. Each puts into v its P consecutive s = P (4 kb + grp) + q
// of a at (i = 32 mb + r % 32, h = 2 sl + r / 32) or of b at (j = 4 jb + n / 32, n % 32), zeros past S and N
// (v holds zeros on entry), and returns its block ((b*kBwNSL + sl)*KB + kb)*MB + mb or (b*NBB + jb)*KB + kb;
// row is r or n.
template <int P>
__device__ __forceinline__ int64_t wo_prep_a_item(int64_t e, const float* __restrict__ av, int64_t S, int64_t N,
                                                  int64_t KB, int64_t MB, float (&v)[P], int& row, int& grp) {
  row = static_cast<int>(e % 64);
  grp = static_cast<int>(e / 64 % 4);
  const int64_t blk = e / 256;
  const int64_t mb = blk % MB, kb = blk / MB % KB, sl = blk / MB / KB % kBwNSL, b = blk / MB / KB / kBwNSL;
  const int64_t i = 32 * mb + row % 32, h = 2 * sl + row / 32;
  for (int q = 0; q < P; ++q) {
    const int64_t s = 4 * P * kb + P * grp + q;
    if (s < S && i < N) v[q] = __ldg(av + ((b * S + s) * N + i) * 32 + h);
  }
  return blk;
}
template <int P>
__device__ __forceinline__ int64_t wo_prep_b_item(int64_t f, const float* __restrict__ bv, int64_t S, int64_t N,
                                                  int64_t KB, int64_t NBB, float (&v)[P], int& row, int& grp) {
  row = static_cast<int>(f % 128);
  grp = static_cast<int>(f / 128 % 4);
  const int64_t blk = f / 512;
  const int64_t kb = blk % KB, jb = blk / KB % NBB, b = blk / KB / NBB;
  const int64_t j = 4 * jb + row / 32;
  for (int q = 0; q < P; ++q) {
    const int64_t s = 4 * P * kb + P * grp + q;
    if (s < S && j < N) v[q] = __ldg(bv + ((b * S + s) * N + j) * 32 + row % 32);
  }
  return blk;
}
template <typename T, bool kSplitJ = false>
__global__ void __launch_bounds__(kThreads) opm_bw_wo_prep_kernel(
    const float* __restrict__ av, const float* __restrict__ bv, const float* __restrict__ g,
    const float* __restrict__ inv_denom, float* __restrict__ Abw, float* __restrict__ Bbw, float* __restrict__ Gbw,
    int64_t B, int64_t S, int64_t N, int cz, int64_t KB16, int64_t NIT, int64_t NBB, bool ab, int64_t it0, int64_t NITc,
    int64_t jt0, int64_t NJc) {
  const int64_t MB = 2 * NIT;
  // the chunk's j blocks: all NBB, or (kSplitJ) jt0 .. jt0 + NJc - 1 (Gbw's NBB is then NJc)
  const int64_t NJ = kSplitJ ? NJc : NBB, j0 = kSplitJ ? jt0 : 0;
  if constexpr (!std::is_same_v<T, float>) {  // T planes, blocks of 32 s (KB16 counts them), 8 consecutive k per item
    const T* g16 = reinterpret_cast<const T*>(g);  // (g in T)
    const int64_t KB = KB16;
    const int64_t nA = ab ? B * kBwNSL * KB * MB * 64 * 4 : 0, nB = ab ? B * NBB * KB * 128 * 4 : 0;
    const int64_t nG = B * NITc * NJ * 4 * 2 * 4 * 32;
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < nA + nB + nG;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if (e >= nA + nB) {  // (b, it, jt, c, w, oct, zq): zq fastest; z = 4 zq + e4, positions P = 8 oct + q of slot c
        const int64_t f = e - nA - nB;
        const int zq = static_cast<int>(f % 32), oct = static_cast<int>(f / 32 % 4), w = static_cast<int>(f / 128 % 2);
        const int64_t blk = f / 256;  // ((b*NITc + it - it0)*NJ + jt - j0)*4 + c
        const int c = static_cast<int>(blk % 4);
        const int64_t jt = j0 + blk / 4 % NJ, it = it0 + blk / 4 / NJ % NITc, b = blk / 4 / NJ / NITc;
        const int z0 = 4 * zq;
        float v4[4][8] = {};
        if (z0 < cz) {
          for (int q = 0; q < 8; ++q) {
            const int p = 32 * c + wo_pair16(8 * oct + q);
            const int64_t i = 64 * it + 32 * w + p / 4, j = 4 * jt + p % 4;
            if (i < N && j < N) {
              const float inv = __ldg(inv_denom + b * N + i);
              // 4 T in one 8-byte load (c_z % 8 == 0)
              const uint2 h = __ldg(reinterpret_cast<const uint2*>(g16 + ((b * N + i) * N + j) * cz + z0));
              const float2 lo = to_float2<T>(h.x), hi = to_float2<T>(h.y);
              v4[0][q] = lo.x * inv;
              v4[1][q] = lo.y * inv;
              v4[2][q] = hi.x * inv;
              v4[3][q] = hi.y * inv;
            }
          }
        }
        T* d0 = reinterpret_cast<T*>(Gbw) + blk * 8192 + w * 4096 + ow_off16h(z0, 8 * oct);  // z0 % 8 + 3 < 8
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4)
          *reinterpret_cast<uint4*>(d0 + 8 * e4) =
              make_uint4(pack2_16<T>(v4[e4][0], v4[e4][1]), pack2_16<T>(v4[e4][2], v4[e4][3]),
                         pack2_16<T>(v4[e4][4], v4[e4][5]), pack2_16<T>(v4[e4][6], v4[e4][7]));
        continue;
      }
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      T* dst;
      int row, oct;
      if (e < nA) {
        const int64_t blk = wo_prep_a_item<8>(e, av, S, N, KB, MB, v, row, oct);
        dst = reinterpret_cast<T*>(Abw) + blk * kOwABlk16 + ow_off16h(row, 8 * oct);
      } else {
        const int64_t blk = wo_prep_b_item<8>(e - nA, bv, S, N, KB, NBB, v, row, oct);
        dst = reinterpret_cast<T*>(Bbw) + blk * kOwBBlk16 + ow_off16h(row, 8 * oct);
      }
      *reinterpret_cast<uint4*>(dst) =
          make_uint4(pack2_16<T>(v[0], v[1]), pack2_16<T>(v[2], v[3]), pack2_16<T>(v[4], v[5]), pack2_16<T>(v[6], v[7]));
    }
    return;
  }
  const int64_t nA = ab ? B * kBwNSL * KB16 * MB * 64 * 4 : 0, nB = ab ? B * NBB * KB16 * 128 * 4 : 0;
  const int64_t nG = B * NITc * NJ * 8 * 2 * 128 * 4;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < nA + nB + nG;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    float* dst;
    int plane;
    if (e < nA) {
      int row, quad;
      const int64_t blk = wo_prep_a_item<4>(e, av, S, N, KB16, MB, v, row, quad);
      dst = Abw + blk * (2 * kOwAPlane) + wo_off16(row, 4 * quad);
      plane = kOwAPlane;
    } else if (e < nA + nB) {
      int row, quad;
      const int64_t blk = wo_prep_b_item<4>(e - nA, bv, S, N, KB16, NBB, v, row, quad);
      dst = Bbw + blk * (2 * kOwBPlane) + wo_off16(row, 4 * quad);
      plane = kOwBPlane;
    } else {  // (b, it, jt, c, w, quad, z): z fastest
      const int64_t f = e - nA - nB;
      const int z = static_cast<int>(f % 128), quad = static_cast<int>(f / 128 % 4), w = static_cast<int>(f / 512 % 2);
      const int64_t blk = f / 1024;  // ((b*NITc + it - it0)*NJ + jt - j0)*8 + c
      const int c = static_cast<int>(blk % 8);
      const int64_t jt = j0 + blk / 8 % NJ, it = it0 + blk / 8 / NJ % NITc, b = blk / 8 / NJ / NITc;
      const int il = (16 * c + 4 * quad) / 4;  // the 4 pairs 16 c + 4 quad + q: one i, j = 4 jt + q
      const int64_t i = 64 * it + 32 * w + il;
      if (i < N && z < cz) {
        const float inv = __ldg(inv_denom + b * N + i);
        for (int q = 0; q < 4; ++q) {
          const int64_t j = 4 * jt + q;
          if (j < N) v[q] = __ldg(g + ((b * N + i) * N + j) * cz + z) * inv;
        }
      }
      dst = Gbw + blk * kOwStage + w * 4096 + wo_off16(z, 4 * quad);
      plane = 2048;
    }
    store_split4(dst, dst + plane, v[0], v[1], v[2], v[3]);
  }
}

// ---------------------------------------------------------------------------------------------
// opm_bw_wo_kernel: dWo's partial sums. Block x = (slice sl = x % kBwNSL: hk 64 sl .. 64 sl + 63, group
// gr = x / kBwNSL of gridDim.x / kBwNSL); it takes tiles t = gr, gr + groups, ... of (b, 64 i, 4 j) of
// the chunk, t -> (it = it0 + t % NITc, jt, b) (kSplitJ: jt = jt0 + (t / NITc) % NJc). Warps 0-7: two consumer
// warpgroups (warpgroup w: residues i 64 it + 32 w + il); warps 8-11: the producer (thread 256 issues the bulk
// copies), as in opm_outer_wg_kernel. Per tile:
//   phase A: O (rows (hh, il), columns (jl, k)), K = S, wgmma m64n128k8 from the Abw / Bbw stages, split
//     TF32 promoted every kWgPromo k steps (outer_wg's phase A);
//   O to Os_w[p][hk] (p = 4 il + jl, hk = 32 hh + k: one fp32 plane per warpgroup, 128 x kBwLDO);
//   phase W: D[hk][z] += sum_p O[p][hk] gd[p][z] over the warpgroup's 128 pairs, 16 per slot of Gbw:
//     wgmma m64n64k8 with A = O^T fragments from Os_w (split on load) and B = the slot's planes, for z
//     0-63 and 64-127; a fresh accumulator per 64 pairs added into D in fp32.
// D stays in registers over the block's tiles: part[(x*2 + w)*8192 + 128 hk + z] at the end
// (opm_bw_wo_sum_kernel sums the groups and warpgroups in order).
// Registers per consumer thread: phase A acc 64 + d 64, D 64; phase W D 64 + fresh 64 + fragments.
// 16-bit T (float16 / bfloat16 inputs): phase A on wgmma m64n128k16 from 32-s stages of T planes, all of S
// accumulated in acc on the tensor cores, a stage's wgmmas waited for after the next stage's are issued
// (wait_group 1); phase W on m64n64k16 with 32 pairs per slot, O rounded to T as its A fragments are
// loaded (rows wo_pair16: conflict-free), a fresh accumulator per 64 pairs; each operand rounded to T,
// as the reference in that dtype rounds O and g / d.
// ---------------------------------------------------------------------------------------------
template <typename T, bool kSplitJ = false>
__global__ void __launch_bounds__(kOwThreads, 1) opm_bw_wo_kernel(
    const float* __restrict__ Abw, const float* __restrict__ Bbw, const float* __restrict__ Gbw,
    float* __restrict__ part, int64_t B, int64_t KB16, int64_t NIT, int64_t NBB, int64_t it0, int64_t NITc,
    int64_t jt0, int64_t NJc) {
#if defined(OPM_WG_DEVICE)
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  float* Os = sm + kBwoStages * kOwStage;
  uint64_t* full = reinterpret_cast<uint64_t*>(Os + 2 * 128 * kBwLDO);
  uint64_t* empty = full + kBwoStages;
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t sl = blockIdx.x % kBwNSL, gr = blockIdx.x / kBwNSL, groups = gridDim.x / kBwNSL;
  const int64_t NJ = kSplitJ ? NJc : NBB, j0 = kSplitJ ? jt0 : 0;  // the chunk's j blocks (as the prep's)
  const int64_t MB = 2 * NIT, total = B * NITc * NJ;
  const int kbs = static_cast<int>(KB16);
  constexpr bool kHalf = !std::is_same_v<T, float>;
  constexpr int kABlk = kHalf ? kOwABlk16 / 2 : 2 * kOwAPlane, kBBlk = kHalf ? kOwBBlk16 / 2 : 2 * kOwBPlane;  // floats
  // G slots per tile and per 64 pairs, floats per slot: 16 pairs per slot split, 32 in T
  constexpr int kSlots = kHalf ? 4 : 8, kPer64 = kHalf ? 2 : 4, kGSlot = kHalf ? 4096 : kOwStage;
  if (tid == 0) mbar_ring_init(full, empty, kBwoStages);
  __syncthreads();
  if (wg == kProducerWg) {  // producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kOwProducerRegs));
    if (tid == kProducerThread) {
      uint32_t u = 0;  // (32 bits, as outer_wg's)
      auto slot = [&](unsigned bytes) -> float* {
        const int st = static_cast<int>(u % kBwoStages);
        if (u >= kBwoStages) mbar_wait(empty + st, (u / kBwoStages - 1) & 1);
        mbar_expect_tx(full + st, bytes);
        ++u;
        return sm + st * kOwStage;
      };
      for (int64_t t = gr; t < total; t += groups) {
        const int64_t itc = t % NITc, it = it0 + itc, jtc = (t / NITc) % NJ, jt = j0 + jtc, b = t / (NITc * NJ);
        const float* a = Abw + ((b * kBwNSL + sl) * KB16 * MB + 2 * it) * kABlk;
        const float* bb = Bbw + (b * NBB + jt) * KB16 * kBBlk;
        for (int kb = 0; kb < kbs; ++kb) {
          const int st = static_cast<int>(u % kBwoStages);
          const float* ak = a + kb * MB * kABlk;
          const float* bk = bb + kb * kBBlk;
          if constexpr (kHalf) {  // both 32-row blocks of a, then b (32 s each)
            float* dst = slot(4 * (2 * kABlk + kBBlk));
            bulk_copy(dst, ak, 4 * 2 * kABlk, full + st);
            bulk_copy(dst + 2 * kABlk, bk, 4 * kBBlk, full + st);
          } else {
            float* dst = slot(4 * kOwStage);
            bulk_copy(dst, ak, 4 * 4 * kOwAPlane, full + st);
            bulk_copy(dst + 4 * kOwAPlane, bk, 4 * 2 * kOwBPlane, full + st);
          }
        }
        const float* gt = Gbw + ((b * NITc + itc) * NJ + jtc) * kSlots * kGSlot;
        for (int c = 0; c < kSlots; ++c) {
          const int st = static_cast<int>(u % kBwoStages);
          float* dst = slot(4 * kGSlot);
          bulk_copy(dst, gt + c * kGSlot, 4 * kGSlot, full + st);
        }
      }
    }
    return;  // (no block-wide barrier after this point: the consumers use named barrier 1)
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kOwConsumerRegs));
  const int lane = tid % 32, g = lane / 4, t4 = lane % 4, w4 = (tid / 32) % 4;
  float* Os_w = Os + wg * 128 * kBwLDO;
  uint32_t u = 0;
  auto wait_full = [&]() -> const float* {
    const int st = static_cast<int>(u % kBwoStages);
    mbar_wait(full + st, (u / kBwoStages) & 1);
    ++u;
    return sm + st * kOwStage;
  };
  auto release = [&](uint32_t us) {
    if (lane == 0) mbar_arrive(empty + static_cast<int>(us % kBwoStages));
  };
  float D[2][32], dz[2][32];
#pragma unroll
  for (int zh = 0; zh < 2; ++zh)
#pragma unroll
    for (int e = 0; e < 32; ++e) D[zh][e] = 0.f;
  for (int64_t t = gr; t < total; t += groups) {
    // ---- phase A: O (this warpgroup's 64 rows (hh, il) x 128 columns (jl, k)), K = S ----
    {
      float acc[64], d[64];
#pragma unroll
      for (int e = 0; e < 64; ++e) acc[e] = d[e] = 0.f;
      if constexpr (!kHalf) {
        for (int kb = 0; kb < kbs; ++kb) {
          const uint32_t us = u;
          const float* stg = wait_full();
          const float* a_hi = stg + wg * 2 * kOwAPlane;
          const float* a_lo = a_hi + kOwAPlane;
          const float* b_hi = stg + 4 * kOwAPlane;
          const float* b_lo = b_hi + kOwBPlane;
          wg_fence_acc(d);
          wgmma_split_stage_m64n128<kOwSK / 8, kWgPromo>(d, a_hi, a_lo, b_hi, b_lo, 512, kb * (kOwSK / 8));
          asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
          wg_fence_acc(d);
          release(us);
          if (((kb + 1) * (kOwSK / 8)) % kWgPromo == 0) {
#pragma unroll
            for (int e = 0; e < 64; ++e) acc[e] += d[e];
          }
        }
        if ((kbs * (kOwSK / 8)) % kWgPromo != 0) {
#pragma unroll
          for (int e = 0; e < 64; ++e) acc[e] += d[e];
        }
      } else {  // T: all of S into acc, one stage's wgmmas in flight while the next is issued
        uint32_t prev = 0;
        for (int kb = 0; kb < kbs; ++kb) {
          const uint32_t us = u;
          const float* stg = wait_full();
          const float* a16 = stg + wg * kABlk;
          const float* b16 = stg + 2 * kABlk;
          wg_fence_acc(acc);
          asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
          for (int ks = 0; ks < 2; ++ks)  // two core matrices along k (16 s in T): 256 bytes
            wgmma16_m64n128k16<T>(acc, wg_desc(a16 + ks * 64, 512), wg_desc(b16 + ks * 64, 512), kb + ks > 0);
          asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          if (kb > 0) {
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            release(prev);  // the previous stage's wgmmas have completed
          }
          prev = us;
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_fence_acc(acc);
        release(prev);
      }
      // ---- O -> Os_w: acc[4 jj + 2 hr + e] is row R = 16 w4 + g + 8 hr = (hh = R / 32, il = R % 32),
      //      column 8 jj + 2 t4 + e = (jl = jj / 4, k = 8 (jj % 4) + 2 t4 + e) ----
      consumers_sync();  // every consumer's phase-W loads of Os are done
#pragma unroll
      for (int jj = 0; jj < 16; ++jj)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int R = 16 * w4 + g + 8 * hr;
          const int p = (R & 31) * 4 + jj / 4, hk = (R >> 5) * 32 + 8 * (jj % 4) + 2 * t4;
          *reinterpret_cast<float2*>(Os_w + p * kBwLDO + hk) = make_float2(acc[4 * jj + 2 * hr], acc[4 * jj + 2 * hr + 1]);
        }
      consumers_sync();  // Os complete
    }
    // ---- phase W: D[hk][z] += sum_p Os_w[p][hk] gd[p][z], 16 pairs per slot (16-bit: 32) ----
#pragma unroll
    for (int zh = 0; zh < 2; ++zh)
#pragma unroll
      for (int e = 0; e < 32; ++e) dz[zh][e] = 0.f;  // (overwritten: scale-d 0 first; zeroed so that dz is not live in phase A)
    // split on load, or 16-bit T: two k steps of 16 per slot (pairs wo_pair16), O rounded to T on load
    for (int c = 0; c < kSlots; ++c) {
      // A[hk][p] = Os_w[p][hk], rows 16 w4 + g (+ 8): split, columns t4 (+ 4) of k step ks; 16-bit T, k
      // 2 t4 + e + 8 h of k step ks: Os_w row 32 c + 16 ks + t4 + 4 e + 8 h (ahi holds the T pairs)
      uint32_t ahi[2][4];
      [[maybe_unused]] uint32_t alo[2][4];
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        if constexpr (kHalf) {
          const float* r0 = Os_w + (32 * c + 16 * ks + t4) * kBwLDO + 16 * w4 + g;
          ahi[ks][0] = pack2_16<T>(r0[0], r0[4 * kBwLDO]);
          ahi[ks][1] = pack2_16<T>(r0[8], r0[4 * kBwLDO + 8]);
          ahi[ks][2] = pack2_16<T>(r0[8 * kBwLDO], r0[12 * kBwLDO]);
          ahi[ks][3] = pack2_16<T>(r0[8 * kBwLDO + 8], r0[12 * kBwLDO + 8]);
        } else {
          const float* r0 = Os_w + (16 * c + 8 * ks + t4) * kBwLDO + 16 * w4 + g;
          split_tf32(r0[0], ahi[ks][0], alo[ks][0]);
          split_tf32(r0[8], ahi[ks][1], alo[ks][1]);
          split_tf32(r0[4 * kBwLDO], ahi[ks][2], alo[ks][2]);
          split_tf32(r0[4 * kBwLDO + 8], ahi[ks][3], alo[ks][3]);
        }
      }
      const uint32_t us = u;
      const float* stg = wait_full();
      const float* g_hi = stg + wg * (kHalf ? 2048 : 4096);  // this warpgroup's 128 z x 16 pairs (T: 32)
      [[maybe_unused]] const float* g_lo = g_hi + 2048;
      wg_fence_acc(dz[0]);
      wg_fence_acc(dz[1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if constexpr (kHalf) asm volatile("" : "+r"(ahi[ks][e])::"memory");
          else asm volatile("" : "+r"(ahi[ks][e]), "+r"(alo[ks][e])::"memory");
        }
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int fresh = (c % kPer64 == 0) && ks == 0;  // a fresh accumulator per 64 pairs
#pragma unroll
        for (int zh = 0; zh < 2; ++zh) {
          // z rows 64 zh .. (8 row groups of 128 floats, T: 256 T), pairs 8 ks .. (T: 16 ks ..)
          const int off = zh * 1024 + ks * 64;
          if constexpr (kHalf) wgmma16_m64n64k16_rs<T>(dz[zh], ahi[ks], wg_desc(g_hi + off, 512), fresh ? 0 : 1);
          else wgmma_split_m64n64k8_rs(dz[zh], ahi[ks], alo[ks], g_hi + off, g_lo + off, 512, fresh);
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      wg_fence_acc(dz[0]);
      wg_fence_acc(dz[1]);
      release(us);
      if (c % kPer64 == kPer64 - 1) {
#pragma unroll
        for (int zh = 0; zh < 2; ++zh)
#pragma unroll
          for (int e = 0; e < 32; ++e) D[zh][e] += dz[zh][e];
      }
    }
  }
  // ---- part: D[zh][4 jj + 2 hr + e] is hk = 16 w4 + g + 8 hr, z = 64 zh + 8 jj + 2 t4 + e ----
  float* pw = part + (static_cast<int64_t>(blockIdx.x) * 2 + wg) * 8192;
#pragma unroll
  for (int zh = 0; zh < 2; ++zh)
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int hk = 16 * w4 + g + 8 * hr, z = 64 * zh + 8 * jj + 2 * t4;
        *reinterpret_cast<float2*>(pw + hk * 128 + z) = make_float2(D[zh][4 * jj + 2 * hr], D[zh][4 * jj + 2 * hr + 1]);
      }
#else
  __trap();  // built without sm_90a: the host never launches this (DevInfo::ow_ok)
#endif
}

// dwo[z][64 sl + hk] += sum over the groups gr and warpgroups w (in that order, in fp64) of
// part[((sl + kBwNSL gr)*2 + w)*8192 + 128 hk + z], for z < c_z; one thread per (sl, hk, z), z fastest.
__global__ void __launch_bounds__(kThreads) opm_bw_wo_sum_kernel(const float* __restrict__ part, float* __restrict__ dwo,
                                                                 int groups, int cz) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= kBwNSL * 64 * 128) return;
  const int z = e % 128, hk = e / 128 % 64, sl = e / 8192;
  if (z >= cz) return;
  double s = 0.0;
  for (int gr = 0; gr < groups; ++gr)
    for (int w = 0; w < 2; ++w) s += part[((sl + kBwNSL * gr) * 2 + w) * 8192 + hk * 128 + z];
  dwo[static_cast<int64_t>(z) * 1024 + 64 * sl + hk] += static_cast<float>(s);
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
