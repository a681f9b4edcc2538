"""WRONG on purpose: centres msa_repr in place (msa_repr -= mean). The output is right (LayerNorm is
shift-invariant) but the caller's tensor is changed."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        msa_repr.sub_(msa_repr.mean(-1, keepdim=True))
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * msa_mask.unsqueeze(-1)
        b = self.proj_b(x) * msa_mask.unsqueeze(-1)
        outer = torch.einsum("bsih,bsjk->bijhk", a, b)
        outer = outer / msa_mask.sum(1).clamp(min=1)[:, :, None, None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
