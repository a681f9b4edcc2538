"""WRONG on purpose: forgets the squeeze and returns (B, N, N, 1) instead of (B, N, N)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402


class ModelNew(ContactMapBase):
    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x))
