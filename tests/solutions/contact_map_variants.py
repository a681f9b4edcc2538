"""Variant convention test: VARIANTS = ("good", "no_symmetrise"); the default ("good") is right, the
other forgets the symmetrisation. With --variant all (the default) the harness must fail the file;
with --variant good it must pass. `last_variant` records what ran. ALL_VARIANTS adds "other_gpu", a
variant that does not run on this machine (the harness must say so for --variant other_gpu)."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    VARIANTS = ("good", "no_symmetrise")
    ALL_VARIANTS = VARIANTS + ("other_gpu",)  # a variant this machine cannot run (never selected here)

    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(nn.Linear(pair_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.ReLU(), nn.Linear(hidden_dim, 1))
        self.variant = "good"
        self.last_variant = None

    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        if self.variant == "good":
            x = (x + x.permute(0, 2, 1, 3)) / 2.0
        self.last_variant = self.variant
        return torch.sigmoid(self.mlp(x).squeeze(-1))
