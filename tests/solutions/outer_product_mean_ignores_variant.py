"""WRONG on purpose: declares VARIANTS = ("outer_first", "w_first") but always runs w_first (and says so in
last_variant), so the forced variant outer_first is never checked. The results are right; the harness
must still reject it: "asked for variant outer_first, last_variant says w_first"."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opm_base import OPMBase  # noqa: E402


class ModelNew(OPMBase):
    VARIANTS = ("outer_first", "w_first")

    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__(msa_dim, pair_dim, hidden_dim)
        self.variant = "w_first"
        self.last_variant = None

    def forward(self, msa_repr, msa_mask):
        m = msa_mask.to(msa_repr.dtype)
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * m[..., None]
        b = self.proj_b(x) * m[..., None]
        inv = 1.0 / m.sum(1).clamp(min=1)
        c = a.shape[-1]
        w = self.out_proj.weight.view(-1, c, c)                # whatever self.variant says
        t = torch.einsum("bsjk,zhk->bsjhz", b, w)
        out = torch.einsum("bsih,bsjhz->bijz", a, t) * inv[:, :, None, None] + self.out_proj.bias
        self.last_variant = "w_first"
        return out
