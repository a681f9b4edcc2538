// contact_map: PTX wrappers of the wgmma kernel (mbarrier, named barriers, bulk and tensor copies, wgmma).
#pragma once
#include "wgmma_layout.cuh"

namespace contact_map {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CM_WG_DEVICE 1
__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {  // until the phase of this parity completes
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}
// Named barriers of the two consumer warpgroups (256 threads: one warpgroup syncs, the other arrives).
__device__ __forceinline__ void named_bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
// bytes % 16 == 0, both addresses 16-byte aligned; completes `bytes` transactions on bar.
__device__ __forceinline__ void bulk_copy(float* smem, const float* gmem, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// One box of a 4-D tensor map (coordinates innermost first) into shared memory, completing on bar.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_u32(bar))
      : "memory");
}
// tma_load_4d with an L2 cache policy (createpolicy's 64-bit value) on the reads (PTX ISA: .L2::cache_hint).
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address >> 4, LBO = 128 bytes (the
// two 4-k core matrices), SBO = 256 bytes (8-row groups), no swizzle.
__device__ __forceinline__ uint64_t plane_desc(const void* p) {
  return static_cast<uint64_t>((smem_u32(p) & 0x3ffff) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}
// d (64 x N, fp32, the warpgroup's accumulator fragment) = A (64 x 8, TF32 in registers) B^T (8 x N)
// + (acc ? d : 0), B K-major in shared memory. A fragment: a[0] row 16 (warp % 4) + lane / 4, column
// lane % 4; a[1] row + 8; a[2] column + 4; a[3] both. d[4 j + q]: row 16 (warp % 4) + lane / 4 + 8 (q / 2),
// column 8 j + 2 (lane % 4) + q % 2.
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int acc) {
  if constexpr (N == 64) {
@WGMMA_RS_64@
  } else {
    static_assert(N == 32, "wgmma_rs: N = 32 or 64");
@WGMMA_RS_32@
  }
}
// wgmma_rs for 16-bit T: A (64 x 16 in T, registers as gemm1_channel16 describes) B^T (16 x N), B K-major.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int acc) {
  static_assert(N == 32 || N == 64, "wgmma_rs16: N = 32 or 64");
  if constexpr (std::is_same<T, __half>::value) {
    if constexpr (N == 64) {
@WGMMA_RS_F16_64@
    } else {
@WGMMA_RS_F16_32@
    }
  } else {
    if constexpr (N == 64) {
@WGMMA_RS_BF16_64@
    } else {
@WGMMA_RS_BF16_32@
    }
  }
}
template <int NACC>
__device__ __forceinline__ void wg_fence(float (&d)[NACC]) {  // CUTLASS's warpgroup_fence_operand
#pragma unroll
  for (int q = 0; q < NACC; ++q) asm volatile("" : "+f"(d[q])::"memory");
}
template <int KS>
__device__ __forceinline__ void wg_fence(uint32_t (&a)[KS][4]) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[ks][e])::"memory");
}
#endif
}  // namespace contact_map
