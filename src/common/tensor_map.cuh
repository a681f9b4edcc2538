// Host side of the TMA tensor copies: the driver's cuTensorMapEncodeTiled, reached through the runtime.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cuda_runtime.h>

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The driver's cuTensorMapEncodeTiled through the runtime (no -lcuda needed), looked up once. who: the
// error message's prefix ("contact_map", "outer_product_mean").
inline EncodeTiledFn encode_tiled(const char* who) {
  static EncodeTiledFn fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q));
#endif
    TORCH_CHECK(q == cudaDriverEntryPointSuccess && p != nullptr, who,
                ": the CUDA driver has no cuTensorMapEncodeTiled (the Hopper kernels' tensor maps need CUDA 12+)");
    fn = reinterpret_cast<EncodeTiledFn>(p);
  }
  return fn;
}
