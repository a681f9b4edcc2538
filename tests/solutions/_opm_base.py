"""Shared skeleton of the OPM test solutions (not a solution itself): the reference's submodules,
created in the reference's order."""
import torch.nn as nn


class OPMBase(nn.Module):
    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim)
        self.proj_b = nn.Linear(msa_dim, hidden_dim)
        self.out_proj = nn.Linear(hidden_dim * hidden_dim, pair_dim)
