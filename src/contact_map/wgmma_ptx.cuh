// contact_map: PTX wrappers of the wgmma kernel (named barriers, matrix descriptors, wgmma); the mbarrier and
// copy wrappers are src/common/sm90_ptx.cuh.
#pragma once
#include "wgmma_layout.cuh"
#include "sm90_ptx.cuh"

namespace contact_map {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CM_WG_DEVICE 1
// Named barriers of the two consumer warpgroups (256 threads: one warpgroup syncs, the other arrives).
__device__ __forceinline__ void named_bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
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
