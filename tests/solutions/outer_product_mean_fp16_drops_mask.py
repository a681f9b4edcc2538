"""WRONG on purpose: ignores the mask for float16 input (as a kernel whose fp16 path forgets it),
right in fp32 and bf16. The harness's --dtype all must reject it, in fp16 only."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    def forward(self, msa_repr, msa_mask):
        m = msa_mask.to(msa_repr.dtype)
        if msa_repr.dtype == torch.float16:
            m = torch.ones_like(m)  # the bug
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * m[..., None]
        b = self.proj_b(x) * m[..., None]
        outer = torch.einsum("bsih,bsjk->bijhk", a, b) / m.sum(1).clamp(min=1)[:, :, None, None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
