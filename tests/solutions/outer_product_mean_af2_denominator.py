"""WRONG on purpose: the AlphaFold 2 denominator, sum_s mask[s,i] * mask[s,j] + 1e-3 per pair (i, j),
instead of the reference's clamp(sum_s mask[s,i], min=1) per row i."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        m = msa_mask.to(msa_repr.dtype)
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * m.unsqueeze(-1)
        b = self.proj_b(x) * m.unsqueeze(-1)
        outer = torch.einsum("bsih,bsjk->bijhk", a, b)
        norm = torch.einsum("bsi,bsj->bij", m, m) + 1e-3
        outer = outer / norm[..., None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
