"""WRONG on purpose: the constructor raises (e.g. a size limit checked at init). The harness must report
it as the solution's failure, "ModelNew(...) raised ValueError: ...", exit 3, not as a harness error."""
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        raise ValueError(f"pair_dim {pair_dim} not supported by this kernel")

    def forward(self, pair_repr):
        return pair_repr
