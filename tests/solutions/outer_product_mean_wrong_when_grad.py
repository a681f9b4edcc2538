"""WRONG on purpose: right under torch.no_grad() / inference_mode, zeros when autograd is on (KernelBench
calls ModelNew without no_grad, and kernel files take another Python path then: an autograd.Function
wrapper, chosen by the same test as here: grad enabled and some parameter requiring grad). The harness's
grad-mode check (trial 0, every variant) must reject it."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            # the "autograd wrapper" path, whose output is never written
            B, S, N, _ = msa_repr.shape
            return msa_repr.new_zeros(B, N, N, self.out_proj.out_features)
        m = msa_mask.to(msa_repr.dtype)
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * m[..., None]
        b = self.proj_b(x) * m[..., None]
        outer = torch.einsum("bsih,bsjk->bijhk", a, b) / m.sum(1).clamp(min=1)[:, :, None, None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
