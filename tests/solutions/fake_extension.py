"""Test solution: a correct pure-PyTorch contact map that *looks* like it built a CUDA extension (a
module-level object loaded from a .so). The harness must refuse --device cpu for it (exit 4)."""
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402

_ext = types.ModuleType("fake_cuda_ext")
_ext.__file__ = "/tmp/fake_cuda_ext/fake_cuda_ext.so"


class ModelNew(ContactMapBase):
    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x).squeeze(-1))
