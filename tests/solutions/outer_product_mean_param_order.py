"""WRONG on purpose: creates proj_b before proj_a. Same names and math, so it passes after
load_state_dict, but with torch.manual_seed(s) before each constructor proj_a and proj_b hold each
other's values: not a KernelBench drop-in."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.proj_b = nn.Linear(msa_dim, hidden_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim)
        self.out_proj = nn.Linear(hidden_dim * hidden_dim, pair_dim)

    def forward(self, msa_repr, msa_mask):
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * msa_mask.unsqueeze(-1)
        b = self.proj_b(x) * msa_mask.unsqueeze(-1)
        outer = torch.einsum("bsih,bsjk->bijhk", a, b)
        outer = outer / msa_mask.sum(1).clamp(min=1)[:, :, None, None, None]
        return self.out_proj(outer.reshape(*outer.shape[:3], -1))
