"""Per-model VARIANTS, shaped like contact_map.py's: the class lists ("auto", "good", "narrow"); a model lists
"narrow" only at pair_dim <= 64, and forcing it elsewhere raises (as a kernel that does not take the dimensions).
Every variant is right. The harness must check and time at each shape only the variants its model lists, and say
which it left out; with --variant narrow a shape where it does not run is skipped. PARAM_ORDER_WRONG = True (set by
the test) creates the MLP's layers last-to-first: not a drop-in, which the harness must report even where no
variant runs."""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402

PARAM_ORDER_WRONG = False


class _VariantsFor:
    def __get__(self, obj, owner=None):
        if obj is None:
            return ("auto", "good", "narrow")
        return ("auto", "good") + (("narrow",) if obj.layer_norm.normalized_shape[0] <= 64 else ())


class ModelNew(ContactMapBase):
    VARIANTS = _VariantsFor()

    def __init__(self, pair_dim, hidden_dim):
        super().__init__(pair_dim, hidden_dim)
        if PARAM_ORDER_WRONG:
            l3, l2, l1 = nn.Linear(hidden_dim, 1), nn.Linear(hidden_dim, hidden_dim), nn.Linear(pair_dim, hidden_dim)
            self.mlp = nn.Sequential(l1, nn.ReLU(), l2, nn.ReLU(), l3)
        self.variant = "auto"
        self.last_variant = None

    def forward(self, pair_repr):
        if self.variant not in self.VARIANTS:
            raise RuntimeError(f"variant {self.variant} does not run at pair_dim {pair_repr.shape[-1]}")
        self.last_variant = "good" if self.variant == "auto" else self.variant
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x).squeeze(-1))
