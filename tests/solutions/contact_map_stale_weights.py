"""WRONG on purpose: packs the first Linear's weight once, at construction, and keeps using that copy
(a kernel that caches prepared weights): stale after load_state_dict or any parameter update."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402


class ModelNew(ContactMapBase):
    def __init__(self, pair_dim, hidden_dim):
        super().__init__(pair_dim, hidden_dim)
        self._w1_t = self.mlp[0].weight.detach().t().contiguous()  # packed once: the bug

    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        x = torch.relu(x @ self._w1_t.to(x.device) + self.mlp[0].bias)
        x = self.mlp[3](self.mlp[2](x))
        return torch.sigmoid(self.mlp[4](x).squeeze(-1))
