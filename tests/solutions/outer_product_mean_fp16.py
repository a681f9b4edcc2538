"""WRONG on purpose: computes the projections and the outer product in float16, returns float32."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        x = self.layer_norm(msa_repr).half()
        m = msa_mask.half().unsqueeze(-1)
        a = torch.nn.functional.linear(x, self.proj_a.weight.half(), self.proj_a.bias.half()) * m
        b = torch.nn.functional.linear(x, self.proj_b.weight.half(), self.proj_b.bias.half()) * m
        outer = torch.einsum("bsih,bsjk->bijhk", a, b).float()
        outer = outer / msa_mask.sum(1).clamp(min=1)[:, :, None, None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
