"""WRONG on purpose: creates the MLP's Linear layers last-to-first. Same names and math, so it passes
after load_state_dict, but with torch.manual_seed(s) before each constructor its parameters differ
from Model's: not a KernelBench drop-in (KernelBench does not copy weights)."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        l3 = nn.Linear(hidden_dim, 1)
        l2 = nn.Linear(hidden_dim, hidden_dim)
        l1 = nn.Linear(pair_dim, hidden_dim)
        self.mlp = nn.Sequential(l1, nn.ReLU(), l2, nn.ReLU(), l3)

    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x).squeeze(-1))
