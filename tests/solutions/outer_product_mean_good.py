"""Known-good outer product mean ModelNew (pure PyTorch) with two variants, as kernel files declare them:
"outer_first" forms the (B, N, N, c, c) outer product, divides it by the denominator and projects, in
the reference's order of operations (so it rounds as the reference does in every dtype); "w_first"
contracts out_proj's weight with b first (never materialising c*c per pair) and scales by 1/denom last.
Both must pass in fp32 (in bf16 w_first, rounding in its own order, misses the harness's check at seed,
awkward_33 and awkward_17); last_variant says which ran. Backward: plain autograd."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    VARIANTS = ("outer_first", "w_first")

    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim)
        self.proj_b = nn.Linear(msa_dim, hidden_dim)
        self.out_proj = nn.Linear(hidden_dim * hidden_dim, pair_dim)
        self.variant = "w_first"
        self.last_variant = None

    def forward(self, msa_repr, msa_mask):
        m = msa_mask.to(msa_repr.dtype)
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x) * m[..., None]                     # (B, S, N, c)
        b = self.proj_b(x) * m[..., None]
        denom = m.sum(1).clamp(min=1)                         # (B, N): depends on i only
        c = a.shape[-1]
        if self.variant == "outer_first":
            outer = torch.einsum("bsih,bsjk->bijhk", a, b) / denom[:, :, None, None, None]
            out = self.out_proj(outer.reshape(*outer.shape[:3], c * c))
        else:
            inv = 1.0 / denom
            w = self.out_proj.weight.view(-1, c, c)           # (c_z, h, k)
            t = torch.einsum("bsjk,zhk->bsjhz", b, w)         # (B, S, N, c, c_z)
            out = torch.einsum("bsih,bsjhz->bijz", a, t) * inv[:, :, None, None] + self.out_proj.bias
        self.last_variant = self.variant
        return out
