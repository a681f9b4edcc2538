"""KernelBench's own evaluator on the kernel files: eval_kernel_against_ref, as KernelBench scores an entry.

    python tools/kernelbench_eval.py --kernelbench PATH [--ops contact_map,outer_product_mean]
                                     [--precisions fp32,fp16,bf16] [--trials 5] [--perf-trials 100]
                                     [--build-dir DIR]

PATH: a checkout of ScalingIntelligence/KernelBench (its src/ holds the package `kernelbench`; written against
423217d). For each op and precision: the reference (reference/<op>.py) and the kernel file (<op>.py) as source
text, eval_kernel_against_ref(..., num_correct_trials=--trials, measure_performance=True, precision=...), its
default CUDA-event timing (grad mode on, parameters requiring grad, the L2 flushed before each trial), and the
reference timed the same way (its excessive-speedup check, which times the reference after ModelNew). Prints one
line per run (correct, ModelNew ms, reference ms, speedup) and exits 1 when a run is not correct.

KernelBench's modules import packages its evaluator does not use (its LLM clients: openai, litellm, dotenv; tqdm)
and pydantic for its result record; where one is missing, a stand-in module takes its place (stand_ins()): a
BaseModel whose fields are the class's annotated defaults, tqdm returning its iterable, load_dotenv reading no
.env file (kernelbench.utils calls it on import), the LLM clients' names raising if called.
"""
import argparse
import os
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class _Record:
    """pydantic.BaseModel's part that KernelExecResult uses: keyword fields over the class's defaults (each
    instance gets its own copy of a dict or list default)."""

    def __init__(self, **fields):
        for cls in reversed(type(self).__mro__):
            for name in getattr(cls, "__annotations__", {}):
                if hasattr(cls, name):
                    default = getattr(cls, name)
                    setattr(self, name, type(default)(default) if isinstance(default, (dict, list)) else default)
        for name, value in fields.items():
            setattr(self, name, value)

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _unavailable(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"{name} is a stand-in (tools/kernelbench_eval.py): the package is not installed")
    return call


def stand_ins(importable=None):
    """Modules to put in sys.modules for the packages KernelBench imports that are not installed (importable:
    name -> bool, default: whether the name imports). Returns {module name: stand-in module}."""
    def can_import(name):
        if importable is not None:
            return importable(name)
        import importlib.util
        return name in sys.modules or importlib.util.find_spec(name) is not None

    made = {}
    if not can_import("pydantic"):
        made["pydantic"] = types.ModuleType("pydantic")
        made["pydantic"].BaseModel = _Record
    if not can_import("dotenv"):  # kernelbench.utils calls load_dotenv() on import: no .env file read
        made["dotenv"] = types.ModuleType("dotenv")
        made["dotenv"].load_dotenv = lambda *args, **kwargs: False
    for name, attrs in (("openai", ("OpenAI",)), ("litellm", ("completion",))):
        if not can_import(name):
            made[name] = types.ModuleType(name)
            for attr in attrs:
                setattr(made[name], attr, _unavailable(f"{name}.{attr}"))
    if not can_import("tqdm"):
        made["tqdm"] = types.ModuleType("tqdm")
        made["tqdm"].tqdm = lambda iterable=None, *args, **kwargs: iterable
    return made


def build_dir_for(given, environ):
    """The build folder handed to eval_kernel_against_ref, which points TORCH_EXTENSIONS_DIR at it: given, else
    environ's TORCH_EXTENSIONS_DIR (extensions already built there load without a rebuild, which on a fresh folder
    takes minutes per file and per precision's process), else a new temporary folder."""
    if given:
        return given
    return environ.get("TORCH_EXTENSIONS_DIR") or tempfile.mkdtemp(prefix="kernelbench_eval_")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernelbench", required=True, help="a KernelBench checkout (the folder holding src/kernelbench)")
    p.add_argument("--ops", default="contact_map,outer_product_mean",
                   help="comma-separated kernel files by name (default: both)")
    p.add_argument("--precisions", default="fp32,fp16,bf16", help="comma-separated (default: fp32,fp16,bf16)")
    p.add_argument("--trials", type=int, default=5, help="correctness trials (default 5)")
    p.add_argument("--perf-trials", type=int, default=100, help="timed trials (default 100, KernelBench's)")
    p.add_argument("--build-dir", default=None,
                   help="TORCH_EXTENSIONS_DIR for the builds (default: $TORCH_EXTENSIONS_DIR where set, so that "
                        "extensions built there are reused, else a new folder)")
    args = p.parse_args(argv)
    src = os.path.join(os.path.abspath(args.kernelbench), "src")
    if not os.path.isdir(os.path.join(src, "kernelbench")):
        p.error(f"no src/kernelbench under {args.kernelbench}")
    sys.modules.update({k: v for k, v in stand_ins().items() if k not in sys.modules})
    sys.path.insert(0, src)
    import torch
    from kernelbench import eval as kb_eval

    build_dir = build_dir_for(args.build_dir, os.environ)
    rows, ok = [], True
    for op in args.ops.split(","):
        ref_src = open(os.path.join(ROOT, "reference", f"{op}.py")).read()
        new_src = open(os.path.join(ROOT, f"{op}.py")).read()
        for prec in args.precisions.split(","):
            r = kb_eval.eval_kernel_against_ref(
                ref_src, new_src, num_correct_trials=args.trials, num_perf_trials=args.perf_trials,
                measure_performance=True, build_dir=build_dir, device=torch.cuda.current_device(),
                precision=getattr(torch, PRECISIONS[prec]))
            correct = bool(r is not None and r.compiled and r.correctness)
            ok &= correct
            new_ms = r.runtime if r is not None else -1.0
            ref_ms = r.ref_runtime if r is not None else -1.0
            speedup = ref_ms / new_ms if new_ms > 0 and ref_ms > 0 else float("nan")
            rows.append((op, prec, correct, new_ms, ref_ms, speedup))
            print(f"{op:20s} {prec:5s} correct={correct} ModelNew {new_ms:.4f} ms  reference {ref_ms:.4f} ms  "
                  f"speedup {speedup:.2f}x" + ("" if correct else f"  metadata: {getattr(r, 'metadata', None)}"),
                  flush=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, KernelBench eval_kernel_against_ref, "
          f"{args.trials} correctness trials, {args.perf_trials} timed trials (means, ms):")
    print(f"{'op':20s} {'prec':5s} {'correct':8s} {'ModelNew':>9s} {'reference':>10s} {'speedup':>8s}")
    for op, prec, correct, new_ms, ref_ms, speedup in rows:
        print(f"{op:20s} {prec:5s} {str(correct):8s} {new_ms:9.4f} {ref_ms:10.4f} {speedup:7.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
