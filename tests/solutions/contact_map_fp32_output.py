"""WRONG on purpose: computes in float32 whatever the input dtype and returns float32. Right in fp32
(and its values are close in any dtype), but for bf16 or fp16 input the output must have the input's
dtype, as the reference's has (the harness's --dtype bf16 must reject it)."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contact_map_base import ContactMapBase  # noqa: E402


class ModelNew(ContactMapBase):
    def forward(self, pair_repr):
        ln = self.layer_norm
        x = F.layer_norm(pair_repr.float(), pair_repr.shape[-1:], ln.weight.float(), ln.bias.float(), ln.eps)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        for i in (0, 2):
            x = torch.relu(F.linear(x, self.mlp[i].weight.float(), self.mlp[i].bias.float()))
        x = F.linear(x, self.mlp[4].weight.float(), self.mlp[4].bias.float())
        return torch.sigmoid(x.squeeze(-1))
