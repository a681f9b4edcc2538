"""Known-good OpenFold-family outer product mean ModelNew (pure PyTorch) for
reference/outer_product_mean_openfold.py, written apart from the reference: the outer product with
matmul on (B, N*c, S) x (B, S, N*c), linear_out as an explicit product, the pair count as a
contraction over s, then the division of linear_out's output (bias included) by count + eps. Passes in
fp32 and fp16; in bf16 it rounds in its own order and misses the harness's check at a few elements
(tests run it in fp32)."""
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
        dt = msa_repr.dtype
        m = msa_mask.to(dt)
        x = self.layer_norm(msa_repr)
        a = self.linear_1(x) * m[..., None]                       # (B, S, N, c)
        b = self.linear_2(x) * m[..., None]
        B, S, N, c = a.shape
        at = a.permute(0, 2, 3, 1).reshape(B, N * c, S)           # rows (i, h)
        bt = b.reshape(B, S, N * c)                               # columns (j, k)
        o = (at @ bt).reshape(B, N, c, N, c).permute(0, 1, 3, 2, 4).reshape(B, N, N, c * c)
        out = o @ self.linear_out.weight.t() + self.linear_out.bias
        count = torch.einsum("bsi,bsj->bij", m, m) + self.eps     # (B, N, N), the pair count + eps
        return out / count[..., None]
