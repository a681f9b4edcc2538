// outer_product_mean: the Hopper (sm_90a) routines the wgmma kernels share: tile-order operands, PTX wrappers, wgmma.
#pragma once
#include "common.cuh"
#include "sm90_ptx.cuh"

namespace opm {

// w_first_wg2 (Hopper, sm_90a): w_first's stage 2 on wgmma.
// Operands in *tile order*, pre-split: each 64-row (A = a, rows i) or 128-row (B = P, rows n) by
// kWgBK-deep block of an operand is one contiguous run: the hi plane, then the lo plane, each in the
// unswizzled K-major core-matrix layout wgmma reads (8 rows x 16 bytes per core matrix; element
// (r, k) at float wg_tile_off(r, k); leading-dimension byte offset 128 between the core matrices
// along k, stride byte offset 1024 between 8-row groups). One 1-D bulk copy (TMA engine) moves a
// block into shared memory: no per-thread copy instructions and no splits in the main loop.
//   At[((b*MB64 + mb)*KB + kb)*2*kWgAPlane + plane*kWgAPlane + wg_tile_off(i % 64, k % 32)],  i = 64 mb + r
//   Pt[((b*NB + nb)*KB + kb)*2*kWgBPlane + plane*kWgBPlane + wg_tile_off(n % 128, k % 32)], n = 128 nb + r
// (k = s*CP + h, n = jl*CZP4 + z as in w_first; zeros past N, K = S*CP and the chunk's columns).
// ---------------------------------------------------------------------------------------------
constexpr int kWgBK = 32;                        // k per pipeline stage (4 wgmma k steps of 8)
constexpr int kWgARows = 64, kWgBRows = 128;     // rows of an A block (one warpgroup's), of a B block
constexpr int kWgAPlane = kWgARows * kWgBK;      // floats of one plane of an A block (8 KB)
constexpr int kWgBPlane = kWgBRows * kWgBK;      // floats of one plane of a B block (16 KB)
constexpr int kWgStages = 3;
constexpr int kWgStage = 2 * 2 * kWgAPlane + 2 * kWgBPlane;  // floats per stage: 2 A blocks + 1 B block (64 KB)
// Roles of every Hopper kernel here (w_first_wg2, outer_wg, the backward's dWo and da / db): warpgroups 0 and
// 1 consume (wgmma), warpgroup kProducerWg produces, its first thread kProducerThread issuing the copies.
constexpr int kConsumerWgs = 2, kProducerWg = kConsumerWgs;
constexpr int kConsumerThreads = 128 * kConsumerWgs, kProducerThread = 128 * kProducerWg;
// Named barriers (id 0 is __syncthreads'). kConsumers: the consumer warpgroups' threads only.
enum class WgBarrier : int { kConsumers = 1 };
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(static_cast<int>(WgBarrier::kConsumers)), "n"(kConsumerThreads) : "memory");
}
constexpr int kWgThreads = kConsumerThreads + 32;  // the consumer warpgroups + 1 producer warp
constexpr int kWgPromo = 8;                      // k steps (of 8) per promotion into fp32 (64 k)
constexpr size_t kWgSmemBytes = 4ull * kWgStages * kWgStage + 16 * kWgStages;  // + full/empty mbarriers
__host__ __device__ __forceinline__ int wg_tile_off(int r, int k) {
  return (r >> 3) * 256 + (k >> 2) * 32 + (r & 7) * 4 + (k & 3);
}
// fp16 / bf16 <-> fp32 by the intrinsics (PyTorch builds without the types' conversion operators).
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
template <typename P>  // element idx of a read-only parameter as fp32
__device__ __forceinline__ float ldg_f(const P* p, int64_t idx) { return to_float(__ldg(p + idx)); }
template <typename T>  // (fp16 by the paired conversion: the same F2FP instruction as the single one)
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return __low2half(__floats2half2_rn(v, 0.f));
}
// Two T packed in one register, element 0 in the low half. bfloat16: a shift and a mask, one instruction
// each (the intrinsic took two for the low element).
template <typename T>
__device__ __forceinline__ float2 to_float2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  else return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
template <typename T>  // two fp32 rounded to T (to nearest), element 0 in the low half
__device__ __forceinline__ uint32_t pack2_16(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}
template <typename T>
__device__ __forceinline__ uint2 pack4_16(float v0, float v1, float v2, float v3) {
  return make_uint2(pack2_16<T>(v0, v1), pack2_16<T>(v2, v3));
}

// Four consecutive k of one row, split: 16 bytes into each plane (k % 4 == 0 at dst).
__device__ __forceinline__ void store_split4(float* hi_dst, float* lo_dst, float v0, float v1, float v2, float v3) {
  uint32_t h[4], l[4];
  split_tf32(v0, h[0], l[0]);
  split_tf32(v1, h[1], l[1]);
  split_tf32(v2, h[2], l[2]);
  split_tf32(v3, h[3], l[3]);
  *reinterpret_cast<uint4*>(hi_dst) = make_uint4(h[0], h[1], h[2], h[3]);
  *reinterpret_cast<uint4*>(lo_dst) = make_uint4(l[0], l[1], l[2], l[3]);
}

// sm_90a-only instructions (wgmma, bulk copies, mbarriers), compiled where nvcc targets sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL); elsewhere the kernel using them is a trap, never launched (the host
// runs w_first_wg2 and outer_wg only when the extension was built with sm_90a, OPM_SM90A, on a 9.0 device).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OPM_WG_DEVICE 1
// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride byte
// offsets, each >> 4 in 14 bits; swizzle mode 0 (none) in bits 62-63.
// sbo: bytes between 8-row groups (1024 for 32-k blocks, 512 for outer_wg's 16-k blocks).
__device__ __forceinline__ uint64_t wg_desc(const float* p, unsigned sbo = 1024) {
  return static_cast<uint64_t>((smem_u32(p) & 0x3ffff) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}
// The full / empty mbarriers of a ring of `stages` slots (thread 0; the caller then syncs the block):
// full: one producer arrival (plus the copies' bytes), empty: empty_count arrivals (one per consumer warp, 8,
// unless the kernel says otherwise).
__device__ __forceinline__ void mbar_ring_init(uint64_t* full, uint64_t* empty, int stages, unsigned empty_count = 8) {
  for (int st = 0; st < stages; ++st) {
    mbar_init(full + st, 1);
    mbar_init(empty + st, empty_count);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// d (64 x 128, fp32, this warpgroup's accumulator fragment) = A (64 x 8) B^T (8 x 128) + (acc ? d : 0),
// TF32 operands K-major in shared memory. d[4 j + q]: row 16 (warp % 4) + lane / 4 + 8 (q / 2),
// column 8 j + 2 (lane % 4) + q % 2.
__device__ __forceinline__ void wgmma_tf32_m64n128k8(float (&d)[64], uint64_t da, uint64_t db, int acc) {
@WGMMA_M64N128K8@
}
// The same for one k step of 16 with T (__nv_bfloat16 or __half) operands K-major in shared memory
// (core matrices of 8 rows x 16 bytes); d's layout as m64n128k8's.
template <typename T>
__device__ __forceinline__ void wgmma16_m64n128k16(float (&d)[64], uint64_t da, uint64_t db, int acc) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
@WGMMA_BF16_M64N128K16@
  } else {
@WGMMA_F16_M64N128K16@
  }
}
// Compiler fence on the accumulator registers (CUTLASS's warpgroup_fence_operand): the asynchronous
// wgmma reads and writes them behind the compiler's back, so no access may move across the
// wgmma.fence / wait_group points this is placed at.
template <int NACC>
__device__ __forceinline__ void wg_fence_acc(float (&d)[NACC]) {
#pragma unroll
  for (int q = 0; q < NACC; ++q) asm volatile("" : "+f"(d[q])::"memory");
}
// d (64 x 64, fp32) = A (64 x 8, TF32 in registers) B^T (8 x 64) + (acc ? d : 0); B K-major in shared
// memory. A fragment (CUTLASS's ALayout_64x8): a[0] row 16 (warp % 4) + lane / 4, column lane % 4;
// a[1] row + 8; a[2] column + 4; a[3] both. d[4 j + q]: row 16 (warp % 4) + lane / 4 + 8 (q / 2),
// column 8 j + 2 (lane % 4) + q % 2 (as m64n128k8's).
__device__ __forceinline__ void wgmma_tf32_m64n64k8_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int acc) {
@WGMMA_M64N64K8_RS@
}
// The same for one k step of 16 in fp16: A's fragment as fp16 pairs (mma m16n8k16's A layout per
// warp: a[0] row g, k 2 t4 + {0, 1}; a[1] row g + 8; a[2] k + 8; a[3] both), B K-major.
__device__ __forceinline__ void wgmma_f16_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int acc) {
@WGMMA_F16_M64N64K16_RS@
}
// The same in T (__half or __nv_bfloat16).
template <typename T>
__device__ __forceinline__ void wgmma16_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int acc) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
@WGMMA_BF16_M64N64K16_RS@
  } else {
    wgmma_f16_m64n64k16_rs(d, a, db, acc);
  }
}
// d += A B^T for one k step of 8 in split TF32 (B's hi and lo planes K-major at b_hi, b_lo; sbo bytes
// between 8-row groups): lo_a hi_b, hi_a lo_b, then hi_a hi_b (the small terms first); d is
// overwritten rather than added to where fresh.
__device__ __forceinline__ void wgmma_split_m64n64k8_rs(float (&d)[32], const uint32_t (&ahi)[4],
                                                        const uint32_t (&alo)[4], const float* b_hi,
                                                        const float* b_lo, unsigned sbo, bool fresh) {
  wgmma_tf32_m64n64k8_rs(d, alo, wg_desc(b_hi, sbo), fresh ? 0 : 1);
  wgmma_tf32_m64n64k8_rs(d, ahi, wg_desc(b_lo, sbo), 1);
  wgmma_tf32_m64n64k8_rs(d, ahi, wg_desc(b_hi, sbo), 1);
}
// KS split-TF32 k steps in one wgmma batch with A in registers (k step q's B planes at b + 64 q, hi, and
// b + lo_off + 64 q, lo): into the fresh accumulator d, waited for, then added into sum in fp32.
template <int KS>
__device__ __forceinline__ void wgmma_split_batch_rs(float (&d)[32], float (&sum)[32], uint32_t (&ahi)[KS][4],
                                                     uint32_t (&alo)[KS][4], const float* b, int lo_off, unsigned sbo) {
  wg_fence_acc(d);
#pragma unroll
  for (int q = 0; q < KS; ++q)  // the A fragments are wgmma inputs too: written before the fence
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(ahi[q][e]), "+r"(alo[q][e])::"memory");
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int q = 0; q < KS; ++q)
    wgmma_split_m64n64k8_rs(d, ahi[q], alo[q], b + 64 * q, b + lo_off + 64 * q, sbo, q == 0);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  wg_fence_acc(d);
#pragma unroll
  for (int e = 0; e < 32; ++e) sum[e] += d[e];
}
// The same for KS k steps of 16 in T (k step q's B at b + 64 q floats, K-major core matrices of 8 rows x
// 16 bytes, sbo bytes between 8-row groups).
template <int KS, typename T>
__device__ __forceinline__ void wgmma16_batch_rs(float (&d)[32], float (&sum)[32], uint32_t (&a)[KS][4], const float* b,
                                                 unsigned sbo) {
  wg_fence_acc(d);
#pragma unroll
  for (int q = 0; q < KS; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[q][e])::"memory");
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int q = 0; q < KS; ++q)
    wgmma16_m64n64k16_rs<T>(d, a[q], wg_desc(b + 64 * q, sbo), q > 0);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  wg_fence_acc(d);
#pragma unroll
  for (int e = 0; e < 32; ++e) sum[e] += d[e];
}
// One ring stage of a 64 x 128 product in split TF32 (operands K-major in shared memory, sbo bytes
// between 8-row groups): KSTEPS k steps of 8, each lo_a hi_b, hi_a lo_b, then hi_a hi_b (the small terms
// first) into d and its own commit group; d restarts (scale-d 0) at k steps k0 + ks that are multiples
// of PROMO (w_first_wg2's stage 2 and dWo's phase A; outer_wg's phase A writes the same loop out).
template <int KSTEPS, int PROMO>
__device__ __forceinline__ void wgmma_split_stage_m64n128(float (&d)[64], const float* a_hi, const float* a_lo,
                                                          const float* b_hi, const float* b_lo, unsigned sbo,
                                                          int k0) {
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const int off = ks * 64;  // two core matrices along k (8 k): 256 bytes
    const int fresh = (k0 + ks) % PROMO == 0;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    wgmma_tf32_m64n128k8(d, wg_desc(a_lo + off, sbo), wg_desc(b_hi + off, sbo), fresh ? 0 : 1);
    wgmma_tf32_m64n128k8(d, wg_desc(a_hi + off, sbo), wg_desc(b_lo + off, sbo), 1);
    wgmma_tf32_m64n128k8(d, wg_desc(a_hi + off, sbo), wg_desc(b_hi + off, sbo), 1);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  }
}
#endif

}  // namespace opm
