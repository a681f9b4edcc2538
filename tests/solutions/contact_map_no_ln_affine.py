"""WRONG on purpose: LayerNorm without its weight and bias (right only while they are 1 and 0)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(nn.Linear(pair_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.ReLU(), nn.Linear(hidden_dim, 1))

    def forward(self, pair_repr):
        x = F.layer_norm(pair_repr, pair_repr.shape[-1:], eps=self.layer_norm.eps)  # no affine
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x).squeeze(-1))
