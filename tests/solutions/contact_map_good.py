"""Known-good contact map ModelNew (pure PyTorch): same submodules and order as the reference,
the symmetrisation written as 0.5 * (x + x^T) with an explicit transpose. Must pass."""
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
        x = 0.5 * (x + x.transpose(1, 2))
        return torch.sigmoid(self.mlp(x)[..., 0])
