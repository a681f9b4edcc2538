"""Variant convention test, shaped like the kernel files' ("auto" plus forced kernels):
VARIANTS = ("auto", "good", "no_symmetrise"). The default "auto" runs the good path and says so in
`last_variant` ("good": the kernel that ran, as a kernel file's "auto" names its kernel); "good" is
right, "no_symmetrise" forgets the symmetrisation. With --variant all (the default) the harness must
fail the file; with --variant good or auto it must pass. ALL_VARIANTS adds "other_gpu", a variant
that does not run on this machine (the harness must say so for --variant other_gpu)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402


class ModelNew(ContactMapBase):
    VARIANTS = ("auto", "good", "no_symmetrise")
    ALL_VARIANTS = VARIANTS + ("other_gpu",)  # a variant this machine cannot run (never selected here)

    def __init__(self, pair_dim, hidden_dim):
        super().__init__(pair_dim, hidden_dim)
        self.variant = "auto"
        self.last_variant = None

    def forward(self, pair_repr):
        ran = "good" if self.variant == "auto" else self.variant
        x = self.layer_norm(pair_repr)
        if ran == "good":
            x = (x + x.permute(0, 2, 1, 3)) / 2.0
        self.last_variant = ran
        return torch.sigmoid(self.mlp(x).squeeze(-1))
