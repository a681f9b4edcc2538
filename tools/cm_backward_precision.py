"""The contact map's backward with its products' operands rounded to a 16-bit type, emulated on the CPU, against the
fused backward's test bound: which operand type a 16-bit backward kernel may use.

    python tools/cm_backward_precision.py [--dtypes bf16,fp16] [--operands fp32,bf16,fp16,fp16s] [--cases all]
                                          [--g-scale 1]

For each case of tests/test_contact_map.py's fused-backward test (its inputs, seeds and distributions) and input dtype:
the backward in float64 with the operands of its six products (h1 = s W1^T, h2 = relu(h1) W2^T, dW2 = dh2^T relu(h1),
dh1 = dh2 W2, dW1 = dh1^T s, ds = dh1 W1) rounded to the operand type (float64 sums stand in for the tensor cores' fp32
accumulation), LayerNorm statistics in fp32 and the ReLU masks of fp64, as the fused kernel takes them; "fp16s": fp16
with dh2 and dh1 multiplied by a power of 2 before rounding (their largest magnitude to 2^12) and the products divided
by it after, as a kernel must where grad_out is small (--g-scale multiplies grad_out: a mean loss gives ~1e-5 per
element, where unscaled fp16 operands underflow). Cases print as (B, N, pair_dim, hidden_dim, distribution). Each
gradient, rounded to the input dtype, is compared with fp64 autograd of reference/contact_map.py: error = max |got -
want| / max |want|, bound = max(2x the error of fp32 autograd rounded to the input dtype (the ops backward's
arithmetic), 2^-8 for bf16 inputs, 2^-11 for fp16). Prints, per case and operand type, the worst error over its bound
(above 1: over; fp32 operands read ~0.5, their error being the ops backward's) and how many of the nine gradients exceed
it, then a summary line per input dtype and operand type. No GPU, no CUDA build."""
import argparse
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import harness  # noqa: E402  (the repository's module loader)
from test_contact_map import FUSED_BACKWARD_CASES, _draw, _randomise, _rel_errs  # noqa: E402  (the test's inputs)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPERANDS = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, False),
            "fp16s": (torch.float16, True)}  # name: (operand type, dh2 / dh1 scaled by a power of 2)
FLOORS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# The fused-backward test's cases (B, N, C, H, distribution), less N = 1.
CASES = [c for c in FUSED_BACKWARD_CASES if c[1] > 1]
F64 = torch.float64


def reference_grads(ref, x, params, g, dtype):
    """Autograd of (Model(x) * g).sum() in dtype: [d_pair, d_param for each parameter in the module's order]."""
    m = ref.Model(x.shape[-1], params[2].shape[0]).to(dtype)
    with torch.no_grad():
        for p, v in zip(m.parameters(), params):
            p.copy_(v.to(dtype))
    xx = x.to(dtype).requires_grad_(True)
    (m(xx) * g.to(dtype)).sum().backward()
    return [xx.grad] + [p.grad for p in m.parameters()]


def emulated_grads(x, params, g, operand, scaled=False):
    """The fused backward's arithmetic with the six products' operands rounded to `operand` (float32, float16 or
    bfloat16), in float64 otherwise: [d_pair, d_ln_w, d_ln_b, d_w1, d_b1, d_w2, d_b2, d_w3, d_b3]. scaled: dh2 and dh1
    rounded as t 2^e (e such that max |t| 2^e is in [2^11, 2^12)), the products divided by 2^e."""
    rd = lambda t: t.to(operand).to(F64)  # noqa: E731

    def rd_dh(t):  # (the rounded operand, the factor the product is divided by)
        top = t.abs().max().item()
        if not scaled or top == 0.0:
            return rd(t), 1.0
        f = 2.0 ** (11 - math.floor(math.log2(top)))
        return rd(t * f), f

    lw, lb, w1, b1, w2, b2, w3, b3 = (p.to(F64) for p in params)
    x32 = x.to(torch.float32)
    mean = x32.mean(-1, keepdim=True)
    rstd = torch.rsqrt(((x32 - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    xhat = ((x32 - mean) * rstd).to(F64)
    y = xhat * lw + lb
    s = 0.5 * (y + y.transpose(1, 2))
    h1_64 = s @ w1.T + b1
    m1, m2 = h1_64 > 0, (torch.relu(h1_64) @ w2.T + b2) > 0  # the masks of fp64
    a1 = torch.where(m1, rd(s) @ rd(w1).T + b1, 0.0)
    a2 = torch.where(m2, rd(a1) @ rd(w2).T + b2, 0.0)
    out = torch.sigmoid(a2 @ w3.T + b3)
    dz = g.to(F64)[..., None] * out * (1 - out)
    dh2 = torch.where(m2, dz * w3, 0.0)
    dh2_r, f2 = rd_dh(dh2)
    dh1 = torch.where(m1, dh2_r @ rd(w2), 0.0) / f2
    dh1_r, f1 = rd_dh(dh1)
    ds = dh1_r @ rd(w1) / f1
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    d_w2 = flat(dh2_r).T @ rd(flat(a1)) / f2
    d_w1 = flat(dh1_r).T @ rd(flat(s)) / f1
    dy = 0.5 * (ds + ds.transpose(1, 2))  # s is symmetric in (i, j)
    dxhat = dy * lw
    d_pair = rstd.to(F64) * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    sums = (0, 1, 2)
    return [d_pair, (dy * xhat).sum(sums), dy.sum(sums), d_w1, dh1.sum(sums), d_w2, dh2.sum(sums),
            (dz * a2).sum(sums)[None], dz.sum()[None]]


def check_case(ref, case, dtype, operands, g_scale=1.0):
    """{operand name: (worst error / bound, gradients over the bound)} for one case and input dtype, grad_out
    multiplied by g_scale (after its rounding to dtype, then rounded again)."""
    B, N, C, H, dist = case
    gen = torch.Generator().manual_seed(B * 1000 + N + C + H)  # the test's seed and draw order
    m = ref.Model(C, H)
    _randomise(m, gen)
    params = [p.detach().to(dtype) for p in m.parameters()]
    x = _draw((B, N, N, C), dist, gen).to(dtype)
    g = (torch.randn((B, N, N), generator=gen).to(dtype).to(F64) * g_scale).to(dtype)
    want = reference_grads(ref, x, params, g, F64)
    bounds = [max(2 * e, FLOORS[dtype])
              for e in _rel_errs([t.to(dtype) for t in reference_grads(ref, x, params, g, torch.float32)], want)]
    result = {}
    for name in operands:
        errs = _rel_errs([t.to(dtype) for t in emulated_grads(x, params, g, *OPERANDS[name])], want)
        ratios = [e / b for e, b in zip(errs, bounds)]
        result[name] = (max(ratios), sum(r > 1 for r in ratios))
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp16", help="input dtypes: bf16, fp16")
    ap.add_argument("--operands", default="fp32,bf16,fp16,fp16s", help="operand types of the products: " +
                    ", ".join(OPERANDS))
    ap.add_argument("--cases", default="all", help=f"'all' or comma-separated indices 0-{len(CASES) - 1} into CASES")
    ap.add_argument("--g-scale", type=float, default=1.0, help="grad_out's scale (default 1: normal values)")
    args = ap.parse_args(argv)
    for name in args.dtypes.split(","):
        if DTYPES.get(name) not in FLOORS:
            ap.error(f"--dtypes: bf16 or fp16, got {name!r}")
    for name in args.operands.split(","):
        if name not in OPERANDS:
            ap.error(f"--operands: one of {', '.join(OPERANDS)}, got {name!r}")
    if args.cases != "all" and not all(i.isdigit() and int(i) < len(CASES) for i in args.cases.split(",")):
        ap.error(f"--cases: 'all' or indices 0-{len(CASES) - 1}, got {args.cases!r}")
    ref = harness.load_module(os.path.join(ROOT, "reference", "contact_map.py"))
    cases = CASES if args.cases == "all" else [CASES[int(i)] for i in args.cases.split(",")]
    operands = args.operands.split(",")
    summary = {}
    for dname in args.dtypes.split(","):
        for case in cases:
            for op, (worst, over) in check_case(ref, case, DTYPES[dname], operands, args.g_scale).items():
                print(f"{dname} inputs, case {case}, {op} operands: worst error / bound {worst:.2f}, {over} of 9 over",
                      flush=True)
                w, o, n = summary.get((dname, op), (0.0, 0, 0))
                summary[(dname, op)] = (max(w, worst), o + over, n + 9)
    for (dname, op), (w, o, n) in summary.items():
        print(f"== {dname} inputs, {op} operands: worst error / bound {w:.2f}, {o} of {n} gradients over")
    return summary


if __name__ == "__main__":
    main()
