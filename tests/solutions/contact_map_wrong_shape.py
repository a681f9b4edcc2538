"""WRONG on purpose: forgets the squeeze and returns (B, N, N, 1) instead of (B, N, N)."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(nn.Linear(pair_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.ReLU(), nn.Linear(hidden_dim, 1))

    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x))
