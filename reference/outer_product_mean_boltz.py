"""Reference outer product mean, Boltz normalisation (PyTorch, KernelBench format).

The outer product mean of Boltz-1 and Boltz-2 as boltz 2.2.1 writes it
(boltz/model/layers/outer_product_mean.py, class OuterProductMean; both trunks use this one class).

    msa (B, S, N, c_m), msa_mask (B, S, N) of any dtype, cast to the input's dtype first
      x      = LayerNorm(msa)                        over c_m, eps 1e-5
      a      = proj_a(x) * mask[..., None]          (B, S, N, c),  c = hidden_dim, no bias
      b      = proj_b(x) * mask[..., None]          (B, S, N, c),  no bias
      o[b,i,j,(h,k)] = sum_s a[b,s,i,h] b[b,s,j,k]                      (B, N, N, c*c), h major,
                       summed in fp32 at least (a, b upcast from fp16 / bf16)
      norm[b,i,j]    = clamp(sum_s mask[b,s,i] mask[b,s,j], min=1)       the PAIR count, in the input dtype
      out    = proj_o((o / norm[..., None]) cast to the input dtype)    (B, N, N, c_z)
               divided BEFORE the output Linear: the bias is not divided

Parameters: norm, proj_a, proj_b (no bias), proj_o (with bias); Boltz's names and shapes, so a
state_dict loads either way.

Order of operations and dtypes as Boltz's unchunked path (chunk_size=None, and every training step): the
pair count is the sum over s of the elementwise product mask_i * mask_j (not a contraction: for
fractional fp16 / bf16 masks each product is rounded before the sum, as in Boltz); the outer product is
formed in fp32 for fp16 / bf16 inputs (Boltz calls a.float(), b.float()), divided in fp32 and cast back
to the input dtype before proj_o. Boltz's chunked path (chunk_size set in eval mode: both trunks give
chunk_size 4 above 384 residues, const.chunk_size_threshold) gives the same values in fp32 but forms the
outer product in the input dtype: in bf16 it rounds o before the division, so it differs from this
reference by bf16 rounding. The dtypes are those of a model cast with .to(dtype), as KernelBench and the
harness cast it; Boltz-2's own predictions run fp32 weights under bf16 autocast ("bf16-mixed"),
Boltz-1's in fp32.

Deliberate differences from Boltz: the outer product of fp64 inputs stays in fp64 (Boltz's .float()
computes it in fp32 whatever the input, which would make the harness's fp64 oracle an fp32 one);
proj_o keeps nn.Linear's default initialisation (Boltz zeroes it, an all-zero output that would judge
nothing).

Besides the KernelBench functions (`Model`, `get_inputs`, `get_init_inputs`) this module has the
named shapes the harness checks (`SHAPES`, the same as reference/outer_product_mean.py), the
constructor arguments and input shapes of any of them (`init_inputs_for`, `input_shapes_for`), the work
of one forward (`flops`, `min_bytes`), `peak_bytes`, `INPUT_ROLES` and `forward_rows`.
"""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim, bias=False)
        self.proj_b = nn.Linear(msa_dim, hidden_dim, bias=False)
        self.proj_o = nn.Linear(hidden_dim * hidden_dim, pair_dim)

    def forward(self, msa_repr, msa_mask):
        mask = msa_mask.unsqueeze(-1).to(msa_repr)                         # (B, S, N, 1), input dtype
        x = self.norm(msa_repr)
        a = self.proj_a(x) * mask                                          # (B, S, N, c)
        b = self.proj_b(x) * mask
        pair_mask = mask[:, :, None, :] * mask[:, :, :, None]              # (B, S, N, N, 1)
        num_mask = pair_mask.sum(1).clamp(min=1)                           # (B, N, N, 1)
        wide = torch.promote_types(x.dtype, torch.float32)
        z = torch.einsum("bsic,bsjd->bijcd", a.to(wide), b.to(wide))       # (B, N, N, c, c)
        z = z.reshape(*z.shape[:3], -1)
        z = z / num_mask
        return self.proj_o(z.to(x))                                        # (B, N, N, c_z)


batch_size = 2
msa_depth = 8
seq_len = 32
msa_dim = 64
hidden_dim = 32
pair_dim = 64


def get_inputs():
    return [
        torch.randn(batch_size, msa_depth, seq_len, msa_dim),
        torch.ones(batch_size, msa_depth, seq_len),
    ]


def get_init_inputs():
    return [msa_dim, pair_dim, hidden_dim]


# ---------------------------------------------------------------------------------------------
# Named shapes (B, S, N, msa_dim, hidden_dim, pair_dim) and the work of one forward.
# ---------------------------------------------------------------------------------------------
SHAPES = {
    "seed": dict(B=2, S=8, N=32, msa_dim=64, hidden_dim=32, pair_dim=64),
    "crop": dict(B=1, S=512, N=256, msa_dim=256, hidden_dim=32, pair_dim=128),
    "shallow": dict(B=1, S=32, N=512, msa_dim=64, hidden_dim=32, pair_dim=128),
    "long": dict(B=1, S=128, N=1024, msa_dim=256, hidden_dim=32, pair_dim=128),
    "awkward_33": dict(B=1, S=3, N=33, msa_dim=40, hidden_dim=16, pair_dim=24),
    "awkward_17": dict(B=2, S=1, N=17, msa_dim=64, hidden_dim=32, pair_dim=64),
    # Deep and wide: S = 2048 sequences, c_m = 512 (accuracy of long sums, for split-precision kernels).
    "deep": dict(B=1, S=2048, N=128, msa_dim=512, hidden_dim=32, pair_dim=128),
    # The full (B, N, N, c, c) intermediate (107 GB in fp32) does not fit a 141 GB H200 beside its
    # copies; the harness checks sampled rows i through `forward_rows` instead.
    "huge": dict(B=1, S=64, N=5120, msa_dim=64, hidden_dim=32, pair_dim=128, reference_may_oom=True),
}


def forward_rows(model, msa_repr, msa_mask, rows):
    """The reference's output at rows i in `rows` only: out[:, rows] (B, len(rows), N, pair_dim).

    Same operations as Model.forward, with a and the pair count restricted to those rows, so that
    shapes whose full (B, N, N, c, c) intermediate does not fit can still be checked.
    """
    mask = msa_mask.unsqueeze(-1).to(msa_repr)
    x = model.norm(msa_repr)
    a = (model.proj_a(x) * mask)[:, :, rows]                              # (B, S, R, c)
    b = model.proj_b(x) * mask
    pair_mask = mask[:, :, None, :] * mask[:, :, rows, None]              # (B, S, R, N, 1)
    num_mask = pair_mask.sum(1).clamp(min=1)
    wide = torch.promote_types(x.dtype, torch.float32)
    z = torch.einsum("bsic,bsjd->bijcd", a.to(wide), b.to(wide))          # (B, R, N, c, c)
    z = z.reshape(*z.shape[:3], -1) / num_mask
    return model.proj_o(z.to(x))


def init_inputs_for(shape):
    """Constructor arguments of Model for a shape dict."""
    return [shape["msa_dim"], shape["pair_dim"], shape["hidden_dim"]]


def input_shapes_for(shape):
    """Shapes of the forward's tensors, in call order: msa_repr, msa_mask."""
    B, S, N = shape["B"], shape["S"], shape["N"]
    return [(B, S, N, shape["msa_dim"]), (B, S, N)]


def flops(shape):
    """FLOPs of one forward in the cheaper of the two contraction orders (the pair count,
    O(B*S*N^2), and the division are counted in neither).

    LayerNorm + both projections: 2 * B*S*N * c_m * 2c. Then either
    outer first: 2 * B*N^2 * c^2 * (S + c_z), or
    W first:     2 * B*S*N * c^2 * c_z  +  2 * B*N^2 * S*c * c_z.
    """
    B, S, N = shape["B"], shape["S"], shape["N"]
    cm, c, cz = shape["msa_dim"], shape["hidden_dim"], shape["pair_dim"]
    proj = 2 * B * S * N * cm * 2 * c
    outer_first = 2 * B * N * N * c * c * (S + cz)
    w_first = 2 * B * S * N * c * c * cz + 2 * B * N * N * S * c * cz
    return proj + min(outer_first, w_first)


def min_bytes(shape):
    """Fewest bytes one forward must move: msa and mask read once, the output written once (fp32)."""
    B, S, N = shape["B"], shape["S"], shape["N"]
    return 4 * (B * S * N * shape["msa_dim"] + B * S * N + B * N * N * shape["pair_dim"])


# ---------------------------------------------------------------------------------------------
# Hints the harness reads (optional in any reference module; defaults in harness.py).
# ---------------------------------------------------------------------------------------------
FAMILY = "boltz"
"""The normalisation family: a solution file's FAMILIES["boltz"], where it has one, is judged in ModelNew's place."""
OUTPUT_FP64X2 = True
"""Not a KernelBench problem: in fp16 / bf16 the harness passes an output element outside KernelBench's allclose
where its error against fp64 is at most 2x this reference's own there. In bf16 this reference's own max error
against fp64 is 2.5e-2 at shallow and up to 3.3e-2 at seed, past allclose's 1e-2 where two roundings go apart."""


INPUT_ROLES = ("x", "mask")
"""What each forward input is, in call order: "x" = activations (drawn from several distributions),
"mask" = a (B, S, N) mask (all ones, random 0/1, fractional, bool, positions masked in every sequence)."""


def peak_bytes(shape):
    """Rough peak device bytes of one fp32 reference forward beyond its inputs (for fit checks).

    Dominated by the (B, N, N, c, c) outer product: the einsum result, its reshape copy and its
    division can be live together (3 copies); plus the (B, S, N, N) pair mask, the LayerNorm output,
    the two projections and the output.
    """
    B, S, N = shape["B"], shape["S"], shape["N"]
    cm, c, cz = shape["msa_dim"], shape["hidden_dim"], shape["pair_dim"]
    return 4 * (3 * B * N * N * c * c + B * S * N * N + B * S * N * (cm + 4 * c) + B * N * N * cz)
