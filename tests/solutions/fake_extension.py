"""Test helper: a correct pure-PyTorch contact map that *looks* like it built a CUDA extension (a
module-level object loaded from a .so). The harness must refuse --device cpu for it (exit 4)."""
import types

import torch
import torch.nn as nn

_ext = types.ModuleType("fake_cuda_ext")
_ext.__file__ = "/tmp/fake_cuda_ext/fake_cuda_ext.so"


class ModelNew(nn.Module):
    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(nn.Linear(pair_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.ReLU(), nn.Linear(hidden_dim, 1))

    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x).squeeze(-1))
