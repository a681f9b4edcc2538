"""WRONG on purpose for reference/outer_product_mean_openfold.py: divides the outer product by the pair
count + eps BEFORE linear_out (Boltz's place), so linear_out's bias is not divided; AlphaFold and
OpenFold divide linear_out's output, bias included."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, msa_dim, pair_dim, hidden_dim=32, eps=1e-3, proj_bias=False):
        super().__init__()
        self.eps = eps
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.linear_1 = nn.Linear(msa_dim, hidden_dim, bias=proj_bias)
        self.linear_2 = nn.Linear(msa_dim, hidden_dim, bias=proj_bias)
        self.linear_out = nn.Linear(hidden_dim * hidden_dim, pair_dim)

    def forward(self, msa_repr, msa_mask):
        m = msa_mask.to(msa_repr.dtype)
        x = self.layer_norm(msa_repr)
        a = self.linear_1(x) * m[..., None]
        b = self.linear_2(x) * m[..., None]
        o = torch.einsum("bsih,bsjk->bijhk", a, b).flatten(-2)
        count = torch.einsum("bsi,bsj->bij", m, m) + self.eps
        return self.linear_out(o / count[..., None])
