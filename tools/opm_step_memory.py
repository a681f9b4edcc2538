"""Peak device memory and time of one ModelNew training step, LOW_MEMORY_BACKWARD off and on, without the reference.

    python tools/opm_step_memory.py [--shapes long] [--dtypes bf16,fp16,fp32] [--rounds 2] [--steps 15]

The harness measures a step's peak beside eager's, but at long the reference's backward needs an H200; this measures
ModelNew's alone on any Hopper GPU. For each named shape of reference/outer_product_mean.py and dtype: a msa of normal
values, a 0 / 1 mask (80% ones), grad_out g of normal values, then --rounds rounds of (off, on): the step is the
harness's (out = model(x, mask), torch.autograd.grad((out * g).sum(), [x] + parameters)); peak = the most device memory
allocated during one step beyond what was allocated before it (out included, the inputs and g not); time = the median
of --steps steps between CUDA events (host time included). Prints one line per shape, dtype, round and setting, with
the backward's parts that ran in kernels. Needs a CUDA device.
"""
import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # the repository root's module loader (it applies the build environment)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measure(opm, step, low, steps):
    """(peak bytes, median ms) of `steps` calls of step with opm.LOW_MEMORY_BACKWARD = low (after one warm-up)."""
    opm.LOW_MEMORY_BACKWARD = low
    step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del grads
    times = []
    for _ in range(steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        step()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return peak, statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="long", help="named shapes of reference/outer_product_mean.py, comma-separated "
                   "(default long)")
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="of bf16, fp16, fp32, comma-separated (default all)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (off, on) per shape and dtype (default 2)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per measurement (default 15)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("opm_step_memory: needs a CUDA device (torch.cuda.is_available() is False)")
    ref = harness.load_module("reference/outer_product_mean.py")
    opm = harness.load_module("outer_product_mean.py")
    default = opm.LOW_MEMORY_BACKWARD
    for name in args.shapes.split(","):
        d = ref.SHAPES[name]
        B, S, N, cm, c, cz = (d[k] for k in ("B", "S", "N", "msa_dim", "hidden_dim", "pair_dim"))
        for dn in args.dtypes.split(","):
            dt = DTYPES[dn]
            gen = torch.Generator(device="cuda").manual_seed(0)
            model = opm.ModelNew(cm, cz, c).cuda().to(dt)
            x = torch.randn(B, S, N, cm, device="cuda", generator=gen).to(dt).requires_grad_(True)
            mask = (torch.rand(B, S, N, device="cuda", generator=gen) > 0.2).to(dt)
            g = torch.randn(B, N, N, cz, device="cuda", generator=gen).to(dt)
            leaves = [x] + list(model.parameters())

            def step():
                out = model(x, mask)
                return torch.autograd.grad((out * g).sum(), leaves)

            for r in range(args.rounds):
                for low in (False, True):
                    peak, ms = measure(opm, step, low, args.steps)
                    print(f"{name} {dn} round {r} LOW_MEMORY_BACKWARD={int(low)}: peak {peak / 2**20:.1f} MiB, "
                          f"step {ms:.3f} ms (median of {args.steps}), {model.last_variant}, {model.last_backward}",
                          flush=True)
            del model, x, mask, g, leaves
    opm.LOW_MEMORY_BACKWARD = default


if __name__ == "__main__":
    main()
