"""WRONG on purpose: treats the mask as 0/1 (mask > 0), so fractional mask values are lost. Right for
all-ones, 0/1 and bool masks only."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        m = (msa_mask > 0).to(msa_repr.dtype)
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * m.unsqueeze(-1)
        b = self.proj_b(x) * m.unsqueeze(-1)
        outer = torch.einsum("bsih,bsjk->bijhk", a, b)
        outer = outer / m.sum(1).clamp(min=1)[:, :, None, None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
