"""A/B of the contact map's fused backward kernel: two builds of contact_map.py on the same inputs, GPU time alone.

    git show COMMIT:contact_map.py > /tmp/cm_old.py
    python tools/cm_backward_ab.py /tmp/cm_old.py [--new contact_map.py] [--dtypes bfloat16,float32,float16]
                                   [--shapes crop,batch,long] [--g-scale 1e-5]

Per dtype and shape of reference/contact_map.py's SHAPES: ModelNew's parameters (default init plus 0.1 N(0, 1),
seed 3) and pair ~ N(0, 1) in the dtype, grad_out ~ N(0, 1) times --g-scale; each build's contact_map_backward_fused
(the fused kernel and the partial sum: two launches) with the module's own settings (BACKWARD_FP16_PRODUCTS, ...).
Each is timed alone in two rounds, the order swapped in the second: per round the median of per-call CUDA-event
times (host launch included) and of CUDA-graph replays (GPU time alone); the best round of each is printed, with
new / old of the graph times and max |new - old| over the nine gradients (0: bit-equal). No L2 flush: the kernel
reads its input once, so only the first tiles meet a warm cache. Needs a CUDA GPU; both builds compile on first use.
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import harness  # noqa: E402  (the repository's module loader)


def _median_us(times_ms):
    times_ms = sorted(times_ms)
    return times_ms[len(times_ms) // 2] * 1e3


def time_call(f, reps):
    """(per-call event median, graph-replay median) of f(), microseconds."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = []
    for _ in range(reps):
        e0.record()
        f()
        e1.record()
        e1.synchronize()
        calls.append(e0.elapsed_time(e1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f()
    replays = []
    for _ in range(reps):
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        replays.append(e0.elapsed_time(e1))
    return _median_us(calls), _median_us(replays)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the baseline build's contact_map.py")
    ap.add_argument("--new", default=os.path.join(ROOT, "contact_map.py"), help="the build to compare")
    ap.add_argument("--dtypes", default="bfloat16,float32,float16")
    ap.add_argument("--shapes", default="crop,batch,long", help="names in reference/contact_map.py's SHAPES")
    ap.add_argument("--g-scale", type=float, default=1.0, help="grad_out ~ N(0, 1) times this")
    args = ap.parse_args()
    ref = harness.load_module(os.path.join(ROOT, "reference", "contact_map.py"), "cm_ab_reference")
    dtypes, shapes = args.dtypes.split(","), args.shapes.split(",")
    bad = ([d for d in dtypes if d not in ("float32", "float16", "bfloat16")]
           + [s for s in shapes if s not in ref.SHAPES])
    if bad:
        ap.error(f"unknown dtype or shape: {', '.join(bad)}")
    if not torch.cuda.is_available():
        sys.exit("cm_backward_ab: needs a CUDA GPU")
    old = harness.load_module(os.path.abspath(args.old), "cm_ab_old")
    new = harness.load_module(os.path.abspath(args.new), "cm_ab_new")
    print(f"{'shape':6s} {'dtype':9s} {'old call/graph us':>18s} {'new call/graph us':>18s}  new/old graph  "
          "max|new-old|")
    for dname in dtypes:
        dt = getattr(torch, dname)
        for name in shapes:
            s = ref.SHAPES[name]
            B, N, C, H = s["B"], s["N"], s["pair_dim"], s["hidden_dim"]
            gen = torch.Generator(device="cuda").manual_seed(3)
            x = torch.randn(B, N, N, C, device="cuda", generator=gen).to(dt)
            model = new.ModelNew(C, H).cuda().to(dt)
            p = [model.layer_norm.weight, model.layer_norm.bias] + [m.weight if k % 2 == 0 else m.bias
                                                                    for m in (model.mlp[0], model.mlp[2], model.mlp[4])
                                                                    for k in range(2)]
            with torch.no_grad():
                for q in p:
                    q.add_(0.1 * torch.randn(q.shape, device="cuda", generator=gen).to(dt))
            g = (torch.randn(B, N, N, device="cuda", generator=gen) * args.g_scale).to(dt)
            runs = {k: (lambda m=m: m.contact_map_backward_fused(x, p[0], p[1], 1e-5, *p[2:], g))
                    for k, m in (("old", old), ("new", new))}
            diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(runs["new"](), runs["old"]()))
            reps = 10 if B * N * N > 1 << 21 else 30
            best = {"old": [], "new": []}
            for order in (("old", "new"), ("new", "old")):
                for k in order:
                    best[k].append(time_call(runs[k], reps))
            best = {k: (min(t[0] for t in v), min(t[1] for t in v)) for k, v in best.items()}
            cell = {k: f"{v[0]:8.1f}/{v[1]:8.1f}" for k, v in best.items()}
            print(f"{name:6s} {dname:9s} {cell['old']:>18s} {cell['new']:>18s}  "
                  f"{best['new'][1] / best['old'][1]:13.3f}  {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
