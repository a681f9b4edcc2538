"""Known-good Boltz-family outer product mean ModelNew (pure PyTorch) for
reference/outer_product_mean_boltz.py, written apart from the reference: the pair count as a contraction
over s, the outer product with matmul on (B, N*c, S) x (B, S, N*c), proj_o as an explicit product.
Passes in fp32 and fp16; in bf16 it rounds in its own order and misses the harness's check at a few
elements (tests run it in fp32)."""
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
        dt = msa_repr.dtype
        wide = torch.promote_types(dt, torch.float32)
        m = msa_mask.to(dt)
        x = self.norm(msa_repr)
        a = (self.proj_a(x) * m[..., None]).to(wide)              # (B, S, N, c)
        b = (self.proj_b(x) * m[..., None]).to(wide)
        B, S, N, c = a.shape
        at = a.permute(0, 2, 3, 1).reshape(B, N * c, S)           # rows (i, h)
        bt = b.reshape(B, S, N * c)                               # columns (j, k)
        o = (at @ bt).reshape(B, N, c, N, c).permute(0, 1, 3, 2, 4).reshape(B, N, N, c * c)
        count = torch.einsum("bsi,bsj->bij", m, m).clamp(min=1)   # (B, N, N), the pair count
        o = (o / count[..., None].to(wide)).to(dt)
        return o @ self.proj_o.weight.t() + self.proj_o.bias
