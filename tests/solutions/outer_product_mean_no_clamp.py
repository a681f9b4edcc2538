"""WRONG on purpose: divides by sum_s mask[s,i] without the clamp to 1, so a position masked in every
sequence gives 0/0 = NaN (the harness must report NaN where the reference is finite)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * msa_mask.unsqueeze(-1)
        b = self.proj_b(x) * msa_mask.unsqueeze(-1)
        outer = torch.einsum("bsih,bsjk->bijhk", a, b)
        outer = outer / msa_mask.sum(1)[:, :, None, None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
