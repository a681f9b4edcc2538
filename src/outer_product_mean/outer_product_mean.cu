// outer_product_mean's CUDA extension: one translation unit, bundled into outer_product_mean.py's _CUDA_SRC
// by tools/bundle.py. The included files hold its parts in order; the entry points are below.
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
#include "launchers.cuh"
#include "forward_bindings.cuh"
#include "backward_bindings.cuh"


std::tuple<bool, bool, bool> opm_device_caps(int64_t device) { return opm::device_caps(device); }

at::Tensor opm_backward_wo(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g, const std::string& ops) {
  return opm::opm_backward_wo(a, b, inv_denom, g, ops);
}

std::tuple<at::Tensor, at::Tensor> opm_backward_ab(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g,
                                                   at::Tensor wo, const std::string& ops) {
  return opm::opm_backward_ab(a, b, inv_denom, g, wo, ops);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> opm_backward_ln(
    at::Tensor xin, at::Tensor da, at::Tensor db, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa,
    at::Tensor wb, double eps) {
  return opm::opm_backward_ln(xin, da, db, mask, ln_w, ln_b, wa, wb, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> opm_backward_rows(at::Tensor msa, at::Tensor mask, at::Tensor ln_w,
                                                                 at::Tensor ln_b, at::Tensor wa, at::Tensor ba,
                                                                 at::Tensor wb, at::Tensor bb, double eps,
                                                                 bool block_tiles) {
  return opm::opm_backward_rows(msa, mask, ln_w, ln_b, wa, ba, wb, bb, eps, block_tiles);
}

at::Tensor opm_backward_dbo(at::Tensor g) { return opm::opm_backward_dbo(g); }

std::tuple<at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor> opm_forward(
    at::Tensor msa, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa, at::Tensor ba, at::Tensor wb,
    at::Tensor bb, at::Tensor wo, at::Tensor bo, double eps, int64_t variant, bool keep_ab) {
  return opm::opm_forward(msa, mask, ln_w, ln_b, wa, ba, wb, bb, wo, bo, eps, variant, keep_ab);
}
