"""WRONG on purpose (training only): a custom autograd.Function whose forward is right but whose
backward is autograd of the same graph without the division by clamp(sum_s mask[s,i], 1), so every
gradient except out_proj.bias's is scaled by the denominator (exact only where it is 1, e.g. S = 1
with a full mask). Only --backward can reject it."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


def _opm(msa, mask, ln_w, ln_b, wa, ba, wb, bb, wo, bo, eps, divide):
    m = mask.to(msa.dtype)[..., None]
    x = F.layer_norm(msa, msa.shape[-1:], ln_w, ln_b, eps)
    a = F.linear(x, wa, ba) * m
    b = F.linear(x, wb, bb) * m
    outer = torch.einsum("bsih,bsjk->bijhk", a, b)
    if divide:
        outer = outer / mask.to(msa.dtype).sum(1).clamp(min=1)[:, :, None, None, None]
    return F.linear(outer.reshape(*outer.shape[:3], -1), wo, bo)


class _NoDenominatorBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, msa, mask, eps, *params):
        ctx.save_for_backward(msa, mask, *params)
        ctx.eps = eps
        return _opm(msa, mask, *params, eps, divide=True)

    @staticmethod
    def backward(ctx, grad_out):
        msa, mask, *params = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (msa, *params)]
            out = _opm(leaves[0], mask, *leaves[1:], ctx.eps, divide=False)  # the bug: no 1/denom
            grads = torch.autograd.grad(out, leaves, grad_out)
        return (grads[0], None, None, *grads[1:])


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        params = (self.layer_norm.weight, self.layer_norm.bias, self.proj_a.weight, self.proj_a.bias,
                  self.proj_b.weight, self.proj_b.bias, self.out_proj.weight, self.out_proj.bias)
        if not torch.is_grad_enabled():
            return _opm(msa_repr, msa_mask, *params, self.layer_norm.eps, divide=True)
        return _NoDenominatorBackward.apply(msa_repr, msa_mask, self.layer_norm.eps, *params)
