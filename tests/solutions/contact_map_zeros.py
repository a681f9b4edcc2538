"""WRONG on purpose: returns zeros of the right shape, dtype and device (a kernel that never writes)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402


class ModelNew(ContactMapBase):
    def forward(self, pair_repr):
        return torch.zeros(pair_repr.shape[:3], dtype=pair_repr.dtype, device=pair_repr.device)
