"""WRONG on purpose for reference/outer_product_mean_boltz.py: AlphaFold's pair count + 1e-3 instead of
Boltz's clamp(pair count, min=1). Equal where the count is 0 (the numerator is 0 there too) and close
for large counts; fractional masks, with pair counts below 1, tell them apart."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim, bias=False)
        self.proj_b = nn.Linear(msa_dim, hidden_dim, bias=False)
        self.proj_o = nn.Linear(hidden_dim * hidden_dim, pair_dim)

    def forward(self, msa_repr, msa_mask):
        m = msa_mask.to(msa_repr.dtype)
        x = self.norm(msa_repr)
        a = self.proj_a(x) * m[..., None]
        b = self.proj_b(x) * m[..., None]
        o = torch.einsum("bsih,bsjk->bijhk", a, b).flatten(-2)
        count = torch.einsum("bsi,bsj->bij", m, m) + 1e-3
        return self.proj_o(o / count[..., None])
