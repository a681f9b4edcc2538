"""WRONG on purpose: LayerNorm without its weight and bias (right only while they are 1 and 0)."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        x = F.layer_norm(msa_repr, msa_repr.shape[-1:], eps=self.layer_norm.eps)
        a = self.proj_a(x) * msa_mask.unsqueeze(-1)
        b = self.proj_b(x) * msa_mask.unsqueeze(-1)
        outer = torch.einsum("bsih,bsjk->bijhk", a, b)
        outer = outer / msa_mask.sum(1).clamp(min=1)[:, :, None, None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
