"""Reference contact-map head (PyTorch, KernelBench format).

    pair (B, N, N, pair_dim) fp32
      -> x = LayerNorm(pair)                       over the last dim, eps from the module
      -> x = (x + x.permute(0, 2, 1, 3)) / 2       symmetrise over (i, j)
      -> MLP pair_dim -> hidden_dim -> hidden_dim -> 1, ReLU between
      -> sigmoid, squeeze(-1)                      -> (B, N, N) fp32

Besides the KernelBench functions (`Model`, `get_inputs`, `get_init_inputs`), this module lists the
named shapes the harness checks and times (`SHAPES`), the constructor arguments and input shapes
of any of them (`init_inputs_for`, `input_shapes_for`), and counts the work of one forward (`flops`, `min_bytes`) for the
roofline.
"""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(
            nn.Linear(pair_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, 1),
        )

    def forward(self, pair_repr):
        x = self.layer_norm(pair_repr)
        x = (x + x.permute(0, 2, 1, 3)) / 2.0
        return torch.sigmoid(self.mlp(x).squeeze(-1))


batch_size = 4
seq_len = 64
pair_dim = 64
hidden_dim = 32


def get_inputs():
    return [torch.randn(batch_size, seq_len, seq_len, pair_dim)]


def get_init_inputs():
    return [pair_dim, hidden_dim]


# ---------------------------------------------------------------------------------------------
# Named shapes (B, N, pair_dim, hidden_dim), input construction and the work of one forward.
# ---------------------------------------------------------------------------------------------
SHAPES = {
    "seed": dict(B=4, N=64, pair_dim=64, hidden_dim=32),
    "crop": dict(B=1, N=384, pair_dim=128, hidden_dim=64),
    "batch": dict(B=8, N=256, pair_dim=128, hidden_dim=32),
    "long": dict(B=1, N=1536, pair_dim=128, hidden_dim=64),
    "awkward_37": dict(B=3, N=37, pair_dim=48, hidden_dim=16),
    "awkward_1": dict(B=1, N=1, pair_dim=64, hidden_dim=32),
    "awkward_129": dict(B=2, N=129, pair_dim=96, hidden_dim=24),
    # Long rows (pair_dim 256, hidden_dim 128): deep products for split-precision kernels, and
    # weights too large to sit beside a tile in shared memory.
    "wide": dict(B=1, N=256, pair_dim=256, hidden_dim=128),
}


def init_inputs_for(shape):
    """Constructor arguments of Model for a shape dict."""
    return [shape["pair_dim"], shape["hidden_dim"]]


def input_shapes_for(shape):
    """Shapes of the forward's tensors, in call order."""
    return [(shape["B"], shape["N"], shape["N"], shape["pair_dim"])]


def flops(shape):
    """FLOPs of one forward, computing each unordered pair {i, j} once (the symmetric MLP input).

    Per pair: LayerNorm of two vectors (~8 * pair_dim), the symmetric mean (2 * pair_dim), the MLP
    (2*c*h + 2*h*h + 2*h, biases and ReLU ignored), the sigmoid (~4).
    """
    B, N, c, h = shape["B"], shape["N"], shape["pair_dim"], shape["hidden_dim"]
    pairs = B * N * (N + 1) // 2
    return pairs * (2 * c * h + 2 * h * h + 2 * h + 18 * c + 4)


def min_bytes(shape):
    """Fewest bytes one forward must move: the input read once, the output written once (fp32)."""
    B, N, c = shape["B"], shape["N"], shape["pair_dim"]
    return 4 * (B * N * N * c + B * N * N)


# ---------------------------------------------------------------------------------------------
# Hints the harness reads (optional in any reference module; defaults in harness.py).
# ---------------------------------------------------------------------------------------------
INPUT_ROLES = ("x",)
"""What each forward input is, in call order: "x" = activations (drawn from several distributions)."""


def peak_bytes(shape):
    """Rough peak device bytes of one fp32 reference forward beyond its inputs (for fit checks).

    LayerNorm output, the symmetrised copy and its halving are live together (3 * input size),
    then two hidden activations (B, N, N, hidden_dim) and the output.
    """
    B, N, c, h = shape["B"], shape["N"], shape["pair_dim"], shape["hidden_dim"]
    return 4 * (3 * B * N * N * c + 2 * B * N * N * h + 2 * B * N * N)
