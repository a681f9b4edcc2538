// contact_map's CUDA extension: one translation unit, bundled into contact_map.py's CUDA_SRC by
// tools/bundle.py. The included files hold its parts in order; the binding table is below.
// Each part includes the part before it in this order (not only what it uses), so that it parses alone.
#include "common.cuh"
#include "fma_kernel.cuh"
#include "mma_kernel.cuh"
#include "small_kernel.cuh"
#include "wgmma_layout.cuh"
#include "wgmma_ptx.cuh"
#include "wgmma_tile_math.cuh"
#include "wgmma_roles.cuh"
#include "wgmma_kernel.cuh"
#include "launchers.cuh"
#include "backward_kernel.cuh"
#include "backward_launcher.cuh"
#include "bindings.cuh"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &contact_map::forward,
        "contact-map head forward (CUDA; fp32, fp16 or bf16): (out, the kernel that ran)");
  m.def("backward", &contact_map::backward,
        "contact-map head fused backward (CUDA): [d_pair, d_ln_w, d_ln_b, d_w1, d_b1, d_w2, d_b2, d_w3, d_b3]");
  m.def("small_auto_tiles_per_sm", &contact_map::small_auto_tiles_per_sm,
        "\"auto\" runs the small kernel up to this many tiles per SM (where it runs), for fp16 / bf16 (half) or "
        "fp32 input");
  m.def("backward_supported", &contact_map::backward_supported,
        "whether backward runs for (pair_dim, hidden_dim, device index)");
}
