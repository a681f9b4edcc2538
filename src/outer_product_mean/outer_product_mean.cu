// outer_product_mean's CUDA extension: one translation unit, bundled into outer_product_mean.py's _CUDA_SRC
// by tools/bundle.py. The included files hold its parts in order; the binding table is below.
// Each part includes the part before it in this order (not only what it uses), so that it parses alone.
#include "common.cuh"
#include "wgmma_common.cuh"
#include "prep_kernel.cuh"
#include "outer_first.cuh"
#include "w_first.cuh"
#include "w_first_tc.cuh"
#include "w_first_small.cuh"
#include "w_first_wg2.cuh"
#include "outer_wg.cuh"
#include "prep_ow_kernel.cuh"
#include "prep16_kernel.cuh"
#include "outer_wg_kernel.cuh"
#include "backward_wo.cuh"
#include "backward_ab.cuh"
#include "backward_ln.cuh"
#include "backward_wo_kept.cuh"
#include "backward_g.cuh"
#include "fused_small.cuh"
#include "pair_norm.cuh"
#include "launchers.cuh"
#include "forward_bindings.cuh"
#include "backward_bindings.cuh"

// The extension's entry points (Python names opm_*), each wrapped as load_inline's `functions=` wraps them:
// torch::wrap_pybind_function turns a TORCH_CHECK failure into the Python exception PyTorch raises for it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("opm_forward", torch::wrap_pybind_function(opm::opm_forward),
        "forward: (out, the variant that ran, a, b, inv_denom where kept for the backward, O times the row's factor "
        "where kept); norm 0 rows, 1 OpenFold (norm_eps), 2 Boltz",
        py::arg("msa"), py::arg("mask"), py::arg("ln_w"), py::arg("ln_b"), py::arg("wa"), py::arg("ba"), py::arg("wb"),
        py::arg("bb"), py::arg("wo"), py::arg("bo"), py::arg("eps"), py::arg("variant"), py::arg("keep_ab"),
        py::arg("norm") = 0, py::arg("norm_eps") = 1e-3, py::arg("pair_fused") = false,
        py::arg("pair_counts") = 0, py::arg("keep_o") = false);
  m.def("opm_device_caps", torch::wrap_pybind_function(opm::device_caps),
        "(tc_ok, wg_ok, ow_ok) of a CUDA device: where w_first_tc / _tc2, w_first_wg2 and outer_wg run");
  m.def("opm_backward_wo", torch::wrap_pybind_function(opm::opm_backward_wo), "backward: dWo on wgmma");
  m.def("opm_backward_ab", torch::wrap_pybind_function(opm::opm_backward_ab),
        "backward: (da, db) on wgmma, G recomputed per tile");
  m.def("opm_backward_ln", torch::wrap_pybind_function(opm::opm_backward_ln), "backward: the LayerNorm part");
  m.def("opm_backward_rows", torch::wrap_pybind_function(opm::opm_backward_rows),
        "backward: (a, b, inv_denom) as the forward computes them");
  m.def("opm_backward_dbo", torch::wrap_pybind_function(opm::opm_backward_dbo), "backward: d bo, the sum of g");
  m.def("opm_backward_wo_kept", torch::wrap_pybind_function(opm::opm_backward_wo_kept),
        "backward: dWo = g^T o over the forward's kept O, on mma.sync (float32)");
  m.def("opm_backward_g", torch::wrap_pybind_function(opm::opm_backward_g),
        "backward: G (B, 32 N, 32 N) in memory, rows (i, h) and columns (j, k), on mma.sync");
  m.def("opm_pair_scale", torch::wrap_pybind_function(opm::opm_pair_scale),
        "a pair mode's (s1, s2) per pair as the forward computes them; counts: 0 fp64 FMA, 1 DMMA, 2 DMMA by a ring");
  m.def("opm_backward_pair_g", torch::wrap_pybind_function(opm::opm_backward_pair_g),
        "backward, pair modes: (s1 g in float32 or g's type, d bo: the sum of s1 g or of g)");
}
