"""WRONG on purpose (training only): the LayerNorm runs through a custom autograd.Function whose
backward returns the input's gradient but zeros for the affine weight and bias. The forward is
right, so only --backward can reject it (gradient of layer_norm.weight / layer_norm.bias)."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402


class _LayerNormNoAffineGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        with torch.enable_grad():
            xl = x.detach().requires_grad_(True)
            y = F.layer_norm(xl, x.shape[-1:], weight.detach(), bias.detach(), ctx.eps)
            (grad_x,) = torch.autograd.grad(y, xl, grad_out)
        return grad_x, torch.zeros_like(weight), torch.zeros_like(bias), None  # the bug: no affine gradient


class ModelNew(ContactMapBase):
    def forward(self, pair_repr):
        ln = self.layer_norm
        x = _LayerNormNoAffineGrad.apply(pair_repr, ln.weight, ln.bias, ln.eps)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x).squeeze(-1))
