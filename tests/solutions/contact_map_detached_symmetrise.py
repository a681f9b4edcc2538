"""WRONG on purpose (training only): symmetrises with the transpose detached, (x + x^T.detach()) / 2.
The forward is right, but no gradient flows through x^T: the gradients of the input and of every
parameter before the symmetrisation (LayerNorm affine) are wrong. Only --backward can reject it."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402


class ModelNew(ContactMapBase):
    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3).detach()) / 2.0  # the bug: x^T carries no gradient
        return torch.sigmoid(self.mlp(x).squeeze(-1))
