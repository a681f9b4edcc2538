"""WRONG on purpose: computes in float16 and casts the result back to float32 (silent half precision)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402


class ModelNew(ContactMapBase):
    def forward(self, pair_repr):
        h = lambda m: {k: v.half() for k, v in m.state_dict().items()}  # noqa: E731
        ln = h(self.layer_norm)
        x = torch.nn.functional.layer_norm(pair_repr.half(), pair_repr.shape[-1:], ln["weight"], ln["bias"],
                                           self.layer_norm.eps)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        m = h(self.mlp)
        x = torch.relu(torch.nn.functional.linear(x, m["0.weight"], m["0.bias"]))
        x = torch.relu(torch.nn.functional.linear(x, m["2.weight"], m["2.bias"]))
        x = torch.nn.functional.linear(x, m["4.weight"], m["4.bias"])
        return torch.sigmoid(x.squeeze(-1)).float()
