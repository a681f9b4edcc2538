"""GPU time of the pair-count kernels alone: outer_product_mean's opm_pair_scale with each PairCounts code.

    python tools/pair_counts_time.py [--shapes crop,shallow,long] [--masks bf16,fp32] [--calls 20]

For each named shape of reference/outer_product_mean_openfold.py (B, S, N) and mask dtype: a 0 / 1 mask (80% ones),
then opm_pair_scale(mask, 1 (OpenFold), 1e-3, code) for code 3 (HMMA: 16-bit masks on the ring's HMMA instance; float32
masks as 2), 2 (the DMMA ring), 1 (DMMA), 0 (fp64 FMA), each timed by CUDA-graph replay: --calls launches captured in
one graph, the best of 5 replays divided by --calls (GPU time alone, no host launch overhead). Prints one line per
shape and mask dtype, in microseconds. Needs a CUDA device.
"""
import argparse
import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODES = (("hmma", 3), ("ring", 2), ("dmma", 1), ("fma", 0))
MASKS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def graph_us(fn, calls):
    """GPU microseconds per call of fn: `calls` calls captured in one CUDA graph, the best of 5 replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1000 / calls)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="crop,shallow,long")
    ap.add_argument("--masks", default="bf16,fp32", help="comma-separated: bf16, fp16, fp32")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pair_counts_time.py: needs a CUDA device")
    shapes = _load(os.path.join(ROOT, "reference", "outer_product_mean_openfold.py")).SHAPES
    opm = _load(os.path.join(ROOT, "outer_product_mean.py"))
    print(f"{torch.cuda.get_device_name()}; us per call (CUDA-graph replay)")
    for name in args.shapes.split(","):
        d = shapes[name]
        for m in args.masks.split(","):
            mask = (torch.rand(d["B"], d["S"], d["N"], device="cuda") < 0.8).to(MASKS[m])
            t = {k: graph_us(lambda c=c: opm._ext.opm_pair_scale(mask, 1, 1e-3, c), args.calls) for k, c in CODES}
            print(f"{name:8s} {m:5s} " + "  ".join(f"{k} {v:6.1f}" for k, v in t.items()), flush=True)


if __name__ == "__main__":
    main()
