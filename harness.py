"""Judge a KernelBench-format `ModelNew` against its reference `Model`: build, check, time, table.

    python harness.py contact_map                 # ./contact_map.py against reference/contact_map.py
    python harness.py outer_product_mean --shapes seed,crop --json out.json
    python harness.py path/to/solution.py --ref reference/contact_map.py --device cpu --no-timing

What it does, per named shape of the reference module (`SHAPES`; default: every shape that fits the
device, the others skipped with a note):

Correctness (any device; `--trials` (default 6) fresh input sets, different seeds and distributions:
normal, uniform, Student-t(3), N(100, 1), N(-3, 10^2), N(0, 100^2), one per trial in turn; for inputs
the reference marks "mask" in `INPUT_ROLES`, masks all ones, random 0/1, fractional, bool, positions
masked in every sequence, int32, int64 (with masked positions), uint8, rotated over the trials of all
shapes in turn: 6 trials see 6 of the 8 kinds, shapes in turn see all):
  * KernelBench drop-in: torch.manual_seed(s) before building each of Model and ModelNew gives equal
    parameters without copying (same names, shapes, values).
  * ModelNew built with the same init arguments, load_state_dict(ref.state_dict(), strict=True), then
    every parameter re-drawn to non-trivial random values, the same in both (LayerNorm affine included),
    fresh for every trial (a ModelNew that caches weights at init or across calls fails).
  * the models are built outside inference_mode (parameters requiring grad, as after construction);
    the judged calls run under torch.inference_mode. On trial 0 every variant is also called under
    torch.enable_grad() outside inference_mode on the same inputs (KernelBench calls ModelNew with
    autograd on, and kernel files take another path then: an autograd.Function): that output, detached,
    must pass the same criterion against the same reference, with every check below (it need not be
    bitwise equal to the inference-mode output).
  * pass criterion: torch.allclose(new, ref_fp32, atol=1e-4, rtol=1e-4) with TF32 off; also max abs /
    max rel error against the reference evaluated in float64 on the same device, beside the fp32
    reference's own error. Relative error is |d| / (|ref64| + atol).
  * fails on: ModelNew(...) raising at construction (drop-in check, correctness or timing) or a call
    raising; wrong type, shape, dtype or device; NaN/Inf where the reference is finite; any input or
    ModelNew parameter changed by the call; output aliasing (the previous call's output, still held
    with a clone, changed by the next call or sharing its storage: a reused output buffer); a forced
    variant that did not run (model.variant = v set by the harness, v != "auto", and a non-None
    last_variant w != v after the call: "asked for variant v, last_variant says w"); an oracle too
    weak to judge (reference output spread over all trials below 10 * atol); mismatches (count and
    the first indices, with both values, printed).
  * every kernel variant (ModelNew.VARIANTS) is checked on the same inputs.
  * shapes flagged `reference_may_oom`: the full fp32 reference is tried once (on CUDA) and an OOM is
    reported as expected; ModelNew's full output is compared on `--rows` sampled rows i against
    `reference.forward_rows` in fp32 and fp64.

Timing (CUDA only; all under torch.inference_mode, TF32 off, in the same run for ModelNew, the eager
reference and torch.compile(reference)): warm-up; the L2 flushed before every sample by writing a
preallocated buffer of max(2 * L2, 256 MiB); CUDA events around each call; >= `--samples` (100)
samples, 20 when one call takes over 10 ms, 10 over 1 s; `--input-sets` (3) input sets rotated;
median and p10-p90. Also the GPU-only time from replaying one forward captured in a CUDA graph
('n/a' with the reason when capture fails), the peak device memory of one forward (inputs excluded,
output included), the roofline floor max(FLOPs / `--peak-tflops`, bytes / `--peak-tbs`) with ModelNew's
time as a multiple of it, achieved TFLOP/s and TB/s, speedups over eager and over torch.compile.
torch.compile runs by default only for shapes not named awkward* and not reference_may_oom.

Conventions honoured in the solution file: `ModelNew.VARIANTS` (optional tuple of str) lists kernel
variants (those that run on this machine); `ModelNew.ALL_VARIANTS` (optional) every variant the file
has, for a clearer message when --variant names one that does not run here (e.g. a Hopper-only one);
`model.variant` selects one (its value after construction is the default, else VARIANTS[0]);
`model.last_variant` (optional str) after a forward says what actually ran (shown in the table).

Reference module contract: Model, SHAPES {name: dict}, init_inputs_for(shape), input_shapes_for(shape),
flops(shape), min_bytes(shape); optional INPUT_ROLES ("x" | "mask" per input), peak_bytes(shape),
forward_rows(model, *inputs, rows) for shapes with reference_may_oom.

JSON (--json PATH): {harness_version, command, date, host, python, torch, torch_cuda, solution,
reference, device {type, name, capability, total_bytes, l2_bytes, sms}, settings {trials, seed, atol,
rtol, tf32, variants, samples, input_sets, timing, compile, ...}, build {ok, seconds, extensions |
error}, shapes: [{name, dims, ok, skip_reason, correctness {ok, failures, dropin {ok, detail},
ref_fp32_max_abs_err_fp64, ref_fp32_max_rel_err_fp64, ref_spread, weak_oracle, reference_oom,
rows_checked, variants {name: {ok, failures, last_variants, max_abs_err_fp64, max_rel_err_fp64,
max_abs_diff_fp32, mismatches, grad_checked}}, trials [{trial, seed, distribution, mask, variants
{name: compare() dict}, grad_variants {name: compare() dict} (trial 0)}]}, timing {flops, min_bytes,
floor_s, compile_note, failures, new {variant: T}, eager: T, compile: T + compile_s}}], notes, exit_code, verdict}, where T = {per_call, graph: {n, median_ms,
p10_ms, p90_ms, mean_ms, min_ms} or None, graph_error, peak_bytes, error, oom, and for ModelNew
last_variant, floor_multiple, tflops, tbs, graph_floor_multiple, graph_tflops, graph_tbs,
speedup_vs_eager, speedup_vs_compile}. Times in ms, memory in bytes, non-finite errors as Infinity.

Exit codes:
  0  every check passed.
  1  usage error (bad option or value: negative --atol/--rtol, a --json path that is a directory or
     not writable; unknown target name (the valid names are listed), shape or --shape key, all
     checked before the build; a --variant not in ModelNew.VARIANTS) or a harness bug (an exception
     in the harness or the reference: "HARNESS ERROR" with a traceback; a solution failure seen in
     the same run still gives 3), or nothing was checked (every shape skipped).
  2  the solution file is missing, did not build / import, or defines no ModelNew.
  3  the solution failed any check: wrong results, drop-in, inputs or parameters changed, aliasing,
     variant, grad mode, or ModelNew(...) raising at construction or at a call.
  4  no CUDA device (correctness on the GPU and timing need one; `--device cpu` runs correctness on
     the CPU for pure-PyTorch solutions).

Custom shapes (--shape K=V,...) must have exactly the keys of the reference's named shapes (flags
such as reference_may_oom optional, 0 or 1), dimensions >= 1.

Limits: the fit check is an estimate from the reference's `peak_bytes`; timing numbers on the CPU
(`--cpu-timing`, for testing the harness) mean nothing; the floor uses nominal H200 ceilings.
"""
import argparse
import contextlib
import copy
import datetime
import gc
import hashlib
import importlib.util
import json
import math
import os
import platform
import socket
import sys
import time
import traceback
import types

import numpy as np
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))

EXIT_OK = 0
EXIT_USAGE = 1
EXIT_BUILD = 2
EXIT_WRONG = 3
EXIT_NO_CUDA = 4

DISTRIBUTIONS = ("normal", "uniform", "student_t3", "offset100", "wide", "x100")
MASK_KINDS = ("ones", "random01", "fractional", "bool", "dead_positions", "int32", "int64", "uint8")
FIRST_MISMATCHES = 5


def log(msg=""):
    """Print a progress line at once (long steps should show while they run)."""
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Loading modules
# ---------------------------------------------------------------------------------------------
def default_build_env():
    """Without a CUDA device, let load_inline still build: TORCH_CUDA_ARCH_LIST=9.0 (the H200) and
    CUDA_HOME=/usr/local/cuda unless already set. Does nothing when CUDA is available."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        if os.path.isdir("/usr/local/cuda"):
            os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")


def load_module(path, name=None):
    """Import a Python file by path and return the module (registered in sys.modules).

    `path` is absolute or relative to the repository root. Importing a kernel file builds its CUDA
    extension (load_inline), so this can take a minute the first time (default_build_env() is applied
    first). Raises FileNotFoundError when the file is missing, and whatever the module raises while
    importing.
    """
    default_build_env()
    if not os.path.isabs(path) and not os.path.exists(path):
        path = os.path.join(ROOT, path)
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    if name is None:
        stem = os.path.splitext(os.path.basename(path))[0]
        name = f"_loaded_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@contextlib.contextmanager
def _record_extension_builds(calls):
    """Within the block, torch.utils.cpp_extension.load_inline / load append their `name` to calls."""
    import torch.utils.cpp_extension as ce

    originals = {k: getattr(ce, k) for k in ("load_inline", "load")}

    def wrap(fn):
        def wrapper(name, *args, **kwargs):
            calls.append(name)
            return fn(name, *args, **kwargs)

        wrapper.__wrapped__ = fn
        wrapper.__doc__ = fn.__doc__
        return wrapper

    for k, fn in originals.items():
        setattr(ce, k, wrap(fn))
    try:
        yield
    finally:
        for k, fn in originals.items():
            setattr(ce, k, fn)


def _extension_modules(module):
    """__name__ of compiled extension modules (loaded from a .so / .pyd) among a module's globals."""
    found = []
    for key, obj in vars(module).items():
        f = getattr(obj, "__file__", None) if isinstance(obj, types.ModuleType) else None
        if f and f.endswith((".so", ".pyd")) and not getattr(obj, "__name__", "").startswith("torch"):
            found.append(getattr(obj, "__name__", key))
    return found


def resolve_target(target, ref):
    """(solution path, reference path) for a name ('contact_map') or a file path (+ optional --ref).

    A name maps to ROOT/<name>.py and ROOT/reference/<name>.py; a name without both files (a typo)
    is a usage error listing the valid names (reference_names()). For a path without --ref, the
    reference is reference/<stem>.py, else the reference whose name begins the file's stem
    (tests/solutions/contact_map_zeros.py -> reference/contact_map.py). Raises ValueError.
    """
    if not target.endswith(".py") and os.sep not in target and "/" not in target:
        sol = os.path.join(ROOT, target + ".py")
        ref = ref or os.path.join(ROOT, "reference", target + ".py")
        if not os.path.isfile(sol) or not os.path.isfile(ref):
            missing = sol if not os.path.isfile(sol) else ref
            raise ValueError(f"unknown target {target!r} ({missing} does not exist); valid names: "
                             f"{', '.join(reference_names())}, or a path to a .py file")
        return sol, _abs(ref)
    sol = _abs(target)
    if ref:
        return sol, _abs(ref)
    if not os.path.isfile(sol):  # main() reports the missing solution file (exit 2)
        return sol, ""
    stem = os.path.splitext(os.path.basename(sol))[0]
    refdir = os.path.join(ROOT, "reference")
    names = sorted(reference_names(), key=len, reverse=True)
    for n in names:
        if stem == n or stem.startswith(n + "_"):
            return sol, os.path.join(refdir, n + ".py")
    raise ValueError(f"cannot tell the reference of {target}: pass --ref reference/<name>.py")


def reference_names():
    """Names of the reference modules (reference/<name>.py), sorted: the valid target names."""
    refdir = os.path.join(ROOT, "reference")
    return sorted(f[:-3] for f in os.listdir(refdir) if f.endswith(".py") and not f.startswith("_"))


def _abs(p):
    return p if os.path.isabs(p) else os.path.abspath(p)


# ---------------------------------------------------------------------------------------------
# Inputs and parameters
# ---------------------------------------------------------------------------------------------
def make_activation(shape, dist, gen, device):
    """fp32 tensor of `shape` drawn from `dist` (one of DISTRIBUTIONS) with generator `gen`."""
    kw = dict(generator=gen, device=device, dtype=torch.float32)
    if dist == "normal":
        return torch.randn(shape, **kw)
    if dist == "uniform":
        return torch.rand(shape, **kw).mul_(6.0).sub_(3.0)
    if dist == "student_t3":  # z / sqrt(chi2_3 / 3), clipped: heavy tails, finite
        z = torch.randn(shape, **kw)
        chi2 = torch.randn(shape, **kw).square_()
        for _ in range(2):
            chi2.add_(torch.randn(shape, **kw).square_())
        return z.div_(chi2.div_(3.0).sqrt_().clamp_(min=1e-3)).clamp_(-1e3, 1e3)
    if dist == "offset100":
        return torch.randn(shape, **kw).add_(100.0)
    if dist == "wide":
        return torch.randn(shape, **kw).mul_(10.0).sub_(3.0)
    if dist == "x100":  # large magnitude (issue 5's stress input for split-precision products)
        return torch.randn(shape, **kw).mul_(100.0)
    raise ValueError(f"unknown distribution {dist}")


def make_mask(shape, kind, gen, device):
    """Mask of `shape` (B, S, N) of `kind` (one of MASK_KINDS); float32 except kinds 'bool' and the
    integer ones.

    dead_positions: random 0/1, and about N/8 positions (at least one) masked in every sequence.
    int32, uint8: random 0/1 of that dtype; int64: dead_positions as int64.
    """
    kw = dict(generator=gen, device=device)
    if kind == "ones":
        return torch.ones(shape, device=device)
    if kind == "random01":
        return (torch.rand(shape, **kw) < 0.7).float()
    if kind == "fractional":
        u = torch.rand(shape, **kw)
        return torch.where(torch.rand(shape, **kw) < 0.2, torch.zeros_like(u), u)
    if kind == "bool":
        return torch.rand(shape, **kw) < 0.7
    if kind in ("dead_positions", "int64"):
        m = (torch.rand(shape, **kw) < 0.7).float()
        n = shape[-1]
        dead = torch.randperm(n, generator=gen, device=device)[: max(1, n // 8)]
        m[..., dead] = 0.0
        return m if kind == "dead_positions" else m.to(torch.int64)
    if kind in ("int32", "uint8"):
        return (torch.rand(shape, **kw) < 0.7).to(getattr(torch, kind))
    raise ValueError(f"unknown mask kind {kind}")


def make_inputs(refmod, dims, dist, mask_kind, seed, device):
    """The forward's inputs for shape `dims`, per the reference's INPUT_ROLES ("x" | "mask")."""
    shapes = refmod.input_shapes_for(dims)
    roles = tuple(getattr(refmod, "INPUT_ROLES", ("x",) * len(shapes)))
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out = []
    for shp, role in zip(shapes, roles):
        if role == "mask":
            out.append(make_mask(tuple(shp), mask_kind, gen, device))
        else:
            out.append(make_activation(tuple(shp), dist, gen, device))
    return out


@torch.no_grad()
def redraw_parameters(ref, new, seed):
    """Give every parameter of `ref` new random values and copy the same values into `new`.

    Matrices: N(0, 1/fan_in); 1-D `*bias`: N(0, 0.5^2); other 1-D (LayerNorm weight): 1 + N(0, 0.5^2).
    `new` must hold the same state_dict names (checked before by a strict load_state_dict).
    """
    gen = torch.Generator().manual_seed(seed)
    new_sd = new.state_dict(keep_vars=True)
    for name, p in ref.named_parameters():
        if p.dim() >= 2:
            v = torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p[0].numel())
        elif name.endswith("bias"):
            v = 0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
        else:
            v = 1.0 + 0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
        p.copy_(v)
        new_sd[name].copy_(v)


class SolutionError(Exception):
    """The solution failed outside a judged call (e.g. ModelNew's constructor raised): a check failure
    (exit 3), not a harness error."""


def build_new(NewModel, init):
    """NewModel(*init), or SolutionError("ModelNew(args) raised X: msg") when the constructor raises."""
    try:
        return NewModel(*init)
    except BaseException as e:  # SystemExit too: a solution must not end the harness
        if isinstance(e, KeyboardInterrupt):
            raise
        args = ", ".join(repr(a) for a in init)
        raise SolutionError(f"ModelNew({args}) raised {_short_exc(e)}") from e


def dropin_check(RefModel, NewModel, init, seed=1234):
    """KernelBench drop-in: same seed before building each -> same state_dict? (ok, detail).

    Raises SolutionError when ModelNew's constructor raises."""
    torch.manual_seed(seed)
    ref = RefModel(*init)
    torch.manual_seed(seed)
    new = build_new(NewModel, init)
    rs, ns = ref.state_dict(), new.state_dict()
    if list(rs) != list(ns):
        if set(rs) != set(ns):
            return False, f"state_dict names differ: reference {sorted(rs)} vs ModelNew {sorted(ns)}"
    for k, v in rs.items():
        w = ns[k]
        if tuple(w.shape) != tuple(v.shape):
            return False, f"{k}: shape {tuple(w.shape)} vs reference {tuple(v.shape)}"
        if not torch.equal(w.detach().cpu().to(v.dtype), v.detach().cpu()):
            return False, (f"{k}: values differ after the same torch.manual_seed "
                           "(parameters created in a different order or a different way)")
    return True, "parameters equal after the same torch.manual_seed"


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------
def compare(out, ref32, ref64, atol, rtol, index_offset=None):
    """Judge one output against the fp32 (pass criterion) and fp64 (error report) references.

    Returns a dict: ok, failures (list of str), max_abs_err_fp64, max_rel_err_fp64,
    max_abs_diff_fp32, mismatches, first_mismatches [(index, new, ref32, ref64)], allclose_fp64
    (information only: would it pass against the fp64 reference).
    `index_offset` maps indices of a row sample back to full-output indices (a list of rows).
    """
    r = dict(ok=False, failures=[], max_abs_err_fp64=None, max_rel_err_fp64=None,
             max_abs_diff_fp32=None, mismatches=None, first_mismatches=[], allclose_fp64=None)
    if not torch.is_tensor(out):
        r["failures"].append(f"returned {type(out).__name__}, expected a tensor")
        return r
    if tuple(out.shape) != tuple(ref32.shape):
        r["failures"].append(f"shape {tuple(out.shape)}, expected {tuple(ref32.shape)}")
    if out.dtype != ref32.dtype:
        r["failures"].append(f"dtype {out.dtype}, expected {ref32.dtype}")
    if out.device != ref32.device:
        r["failures"].append(f"device {out.device}, expected {ref32.device}")
    if r["failures"]:
        return r
    ref_finite = torch.isfinite(ref32)
    bad_nonfinite = int((~torch.isfinite(out) & ref_finite).sum())
    if bad_nonfinite:
        r["failures"].append(f"{bad_nonfinite} NaN/Inf values where the reference is finite")
    close = (out - ref32).abs() <= atol + rtol * ref32.abs()
    n_bad = int((~close).sum())
    r["mismatches"] = n_bad
    allclose = torch.allclose(out, ref32, atol=atol, rtol=rtol)
    d32 = (out.double() - ref32.double()).abs()
    r["max_abs_diff_fp32"] = _fmax(d32)
    d64 = (out.double() - ref64.double()).abs()
    r["max_abs_err_fp64"] = _fmax(d64)
    r["max_rel_err_fp64"] = _fmax(d64 / (ref64.double().abs() + atol))
    r["allclose_fp64"] = bool(torch.allclose(out.double(), ref64.double(), atol=atol, rtol=rtol))
    if not allclose:
        idx = (~close).nonzero()[:FIRST_MISMATCHES].tolist()
        for ix in idx:
            t = tuple(ix)
            shown = list(t)
            if index_offset is not None and len(shown) > 1:
                shown[1] = int(index_offset[shown[1]])
            r["first_mismatches"].append(
                (tuple(shown), float(out[t]), float(ref32[t]), float(ref64[t])))
        r["failures"].append(
            f"not allclose(atol={atol:g}, rtol={rtol:g}): {n_bad} of {out.numel()} elements mismatch; first: "
            + "; ".join(f"{i}: new {a:.7g} ref {b:.7g} fp64 {c:.7g}" for i, a, b, c in r["first_mismatches"])
            + (" (note: within atol/rtol of the fp64 reference; the fp32 reference's own rounding decides)"
               if r["allclose_fp64"] else ""))
    r["ok"] = not r["failures"]
    return r


def _fmax(t):
    if t.numel() == 0:
        return 0.0
    v = float(t.max())
    return v if math.isfinite(v) else float("inf")


def _max_none(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _short_exc(e):
    s = f"{type(e).__name__}: {e}".strip()
    lines = [ln for ln in s.splitlines() if ln.strip()]
    return " | ".join(lines[:3])[:400]


def _is_oom(e):
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


# ---------------------------------------------------------------------------------------------
# Correctness of one shape
# ---------------------------------------------------------------------------------------------
def new_correctness():
    """The empty correctness dict of one shape (filled by check_shape; see the module docstring)."""
    return dict(ok=False, failures=[], dropin=None, variants={}, ref_fp32_max_abs_err_fp64=None,
                ref_fp32_max_rel_err_fp64=None, ref_spread=None, weak_oracle=None, reference_oom=None,
                rows_checked=None, trials=[])


def mask_kind_for(shape_index, trial, trials):
    """The mask kind of one trial: MASK_KINDS rotated over the trials of all shapes in turn (with the
    default 6 trials a shape sees 6 of the 8 kinds; shapes in turn see them all)."""
    return MASK_KINDS[(shape_index * trials + trial) % len(MASK_KINDS)]


def _same_values(a, b):
    """a equals b elementwise, NaN matching NaN (for the output-aliasing check)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _shares_storage(a, b):
    try:
        pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    except Exception:
        return False
    return pa != 0 and pa == pb


def check_shape(refmod, solmod, name, dims, shape_index, args, device, variants, res=None):
    """Correctness of ModelNew at one shape over args.trials trials and every variant in `variants`.

    Fills and returns `res` (new_correctness(); the JSON-ready dict described in the module docstring:
    ok, failures, dropin, variants {name: {...}}, ref_fp32_*_err_fp64, ref_spread, weak_oracle,
    reference_oom, trials). Must run outside torch.inference_mode: the models are built in normal mode
    (parameters requiring grad, as after construction); the judged calls run under inference_mode,
    the grad-mode check (trial 0, every variant) under torch.enable_grad().
    """
    if torch.is_inference_mode_enabled():  # inference-tensor parameters would make the grad-mode call fail
        raise RuntimeError("check_shape must be called outside torch.inference_mode")
    init = refmod.init_inputs_for(dims)
    may_oom = bool(dims.get("reference_may_oom"))
    res = new_correctness() if res is None else res

    def fail_construction(msg):
        res["failures"].append(msg)
        log(f"  FAIL: {msg}")
        return res

    try:
        ok, detail = dropin_check(refmod.Model, solmod.ModelNew, init)
    except SolutionError as e:
        return fail_construction(str(e))
    res["dropin"] = dict(ok=ok, detail=detail)
    log(f"  drop-in (same seed -> same parameters): {'yes' if ok else 'NO'}: {detail}")
    if not ok:
        res["failures"].append(f"not a KernelBench drop-in: {detail}")

    ref = refmod.Model(*init).to(device).eval()
    try:
        new = build_new(solmod.ModelNew, init)
    except SolutionError as e:
        return fail_construction(str(e))
    try:
        new = new.to(device).eval()
        new.load_state_dict(ref.state_dict(), strict=True)
    except Exception as e:
        return fail_construction(f"ModelNew .to(device) / load_state_dict(strict=True) failed: {_short_exc(e)}")
    default_variant = getattr(new, "variant", None)
    for v in variants:
        res["variants"][v or "-"] = dict(ok=True, failures=[], last_variants=[], max_abs_err_fp64=None,
                                         max_rel_err_fp64=None, max_abs_diff_fp32=None, mismatches=0,
                                         grad_checked=False)
    spread_lo, spread_hi = math.inf, -math.inf
    roles = getattr(refmod, "INPUT_ROLES", ())
    # aliasing: the last ModelNew output, a clone of it (of the sampled rows for reference_may_oom
    # shapes) and where it came from; the next call must leave it unchanged.
    prev = None

    for t in range(args.trials):
        seed = args.seed * 1_000_003 + shape_index * 1009 + t
        dist = DISTRIBUTIONS[t % len(DISTRIBUTIONS)]
        mask_kind = mask_kind_for(shape_index, t, args.trials)
        with torch.no_grad():
            redraw_parameters(ref, new, seed + 500_000)
            inputs = make_inputs(refmod, dims, dist, mask_kind, seed, device)
            clones = [x.clone() for x in inputs]
        trial = dict(trial=t, seed=seed, distribution=dist,
                     mask=mask_kind if "mask" in roles else None, variants={})
        desc = f"trial {t} seed {seed} {dist}" + (f" mask={mask_kind}" if "mask" in roles else "")

        rows_list = None
        with torch.inference_mode():
            if may_oom:
                if t == 0 and device.type == "cuda":
                    log(f"  {name}: trying the full fp32 reference (flagged reference_may_oom) ...")
                    try:
                        full = ref(*inputs)
                        del full
                        res["reference_oom"] = False
                        log("  the full reference fit in memory; comparing sampled rows anyway")
                    except Exception as e:
                        if not _is_oom(e):
                            raise
                        res["reference_oom"] = True
                        log(f"  reference out of memory, as expected: {_short_exc(e)[:160]}")
                    _free(device)
                n_rows = int(dims["N"])
                g = torch.Generator().manual_seed(seed + 7)
                pick = torch.randperm(n_rows, generator=g)[: max(0, args.rows - 2)].tolist()
                rows_list = sorted(set(pick + [0, n_rows - 1]))
                rows = torch.tensor(rows_list, device=device)
                res["rows_checked"] = len(rows_list)
                ref32 = refmod.forward_rows(ref, *inputs, rows)
                ref64m = copy.deepcopy(ref).double()
                ref64 = refmod.forward_rows(ref64m, *[_to64(x) for x in inputs], rows)
            else:
                ref32 = ref(*inputs)
                ref64m = copy.deepcopy(ref).double()
                ref64 = ref64m(*[_to64(x) for x in inputs])
            del ref64m
        if not all(torch.equal(x, c) for x, c in zip(inputs, clones)):
            raise RuntimeError("the reference changed its inputs; the harness cannot judge this pair")
        d_ref = (ref32.double() - ref64).abs()
        ref_err = _fmax(d_ref)
        res["ref_fp32_max_abs_err_fp64"] = _max_none(res["ref_fp32_max_abs_err_fp64"], ref_err)
        res["ref_fp32_max_rel_err_fp64"] = _max_none(
            res["ref_fp32_max_rel_err_fp64"], _fmax(d_ref / (ref64.abs() + args.atol)))
        fin = ref32[torch.isfinite(ref32)]
        if fin.numel():
            spread_lo, spread_hi = min(spread_lo, float(fin.min())), max(spread_hi, float(fin.max()))
        del d_ref, fin

        def sample(o, rl):
            """The part of an output that is judged: all of it, or the sampled rows i."""
            if rl is not None and o.dim() > 1 and o.shape[1] == dims["N"]:
                return o[:, rl]
            return o

        def judged_call(v, grad):
            """One ModelNew call (inference_mode, or enable_grad outside it) with every check; a compare() dict."""
            nonlocal prev
            if v is not None:
                new.variant = v
            mode = "under torch.enable_grad(): " if grad else ""
            with torch.no_grad():
                before = {k: x.detach().clone() for k, x in new.state_dict().items()}
            try:
                if grad:
                    with torch.enable_grad():
                        out = new(*inputs)
                else:
                    with torch.inference_mode():
                        out = new(*inputs)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:
                return dict(ok=False, failures=[f"{mode}ModelNew raised {_short_exc(e)}"], call_raised=True,
                            max_abs_err_fp64=None, max_rel_err_fp64=None, max_abs_diff_fp32=None,
                            mismatches=None, last_variant=None)
            with torch.no_grad():
                if torch.is_tensor(out):
                    out = out.detach()
                last = getattr(new, "last_variant", None)
                c = compare(sample(out, rows_list) if torch.is_tensor(out) else out, ref32, ref64,
                            args.atol, args.rtol, index_offset=rows_list if rows_list is not None else None)
                if mode:
                    c["failures"] = [mode + m for m in c["failures"]]
                if v is not None and v != "auto" and last is not None and last != v:
                    c["failures"].append(f"{mode}asked for variant {v}, last_variant says {last}")
                changed = [i for i, (x, cl) in enumerate(zip(inputs, clones)) if not torch.equal(x, cl)]
                if changed:
                    c["failures"].append(f"{mode}ModelNew changed its input(s) {changed} in place")
                    for i in changed:
                        inputs[i].copy_(clones[i])  # restore for the next call
                after = new.state_dict()
                moved = [k for k, x in before.items() if k not in after or not torch.equal(after[k], x)]
                if moved:
                    c["failures"].append(f"{mode}ModelNew changed its parameters/buffers {moved[:4]} during forward")
                if prev is not None:
                    p_out, p_snap, p_rows, p_desc = prev
                    if torch.is_tensor(out) and out.numel() and _shares_storage(out, p_out):
                        c["failures"].append(
                            f"{mode}ModelNew returned the storage of its previous output ({p_desc}), which "
                            "the caller still holds: outputs must not alias a buffer reused across calls")
                    elif not _same_values(sample(p_out, p_rows), p_snap):
                        c["failures"].append(
                            f"{mode}this call changed ModelNew's previous output ({p_desc}): outputs must not "
                            "alias a buffer that a later call overwrites")
                prev = None
                if torch.is_tensor(out):
                    prev = (out, sample(out, rows_list).clone(), rows_list,
                            f"{desc}, variant {v or '-'}{' with grad' if grad else ''}")
            c["ok"] = not c["failures"]
            c["last_variant"] = last
            return c

        for v in variants:
            key = v or "-"
            vr = res["variants"][key]
            calls = [False, True] if t == 0 else [False]  # grad mode: trial 0, every variant
            for grad in calls:
                c = judged_call(v, grad)
                last = c.get("last_variant")
                if last is not None and last not in vr["last_variants"]:
                    vr["last_variants"].append(last)
                if grad:
                    vr["grad_checked"] = True
                    trial.setdefault("grad_variants", {})[key] = c
                else:
                    trial["variants"][key] = c
                for f in ("max_abs_err_fp64", "max_rel_err_fp64", "max_abs_diff_fp32"):
                    vr[f] = _max_none(vr[f], c[f])
                vr["mismatches"] += c["mismatches"] or 0
                if not c["ok"]:
                    vr["ok"] = False
                    vr["failures"] += [f"{desc}: {m}" for m in c["failures"]]
                tag = f"[{key}{'->' + last if last and last != key else ''}]" + (" grad" if grad else "")
                status = "ok  " if c["ok"] else "FAIL"
                err = (f"max|d| vs fp64 {_e(c['max_abs_err_fp64'])} (fp32 ref {_e(ref_err)})"
                       if c["max_abs_err_fp64"] is not None else "")
                log(f"  {status} {tag} {desc}: {err}")
                for m in c["failures"]:
                    log(f"       {m}")
        if default_variant is not None:
            new.variant = default_variant
        res["trials"].append(trial)
        inputs = clones = ref32 = ref64 = None  # free before the next trial (judged_call reads these)
        _free(device)
    prev = None

    spread = spread_hi - spread_lo if spread_hi >= spread_lo else 0.0
    res["ref_spread"] = spread
    res["weak_oracle"] = spread < 10 * args.atol
    if res["weak_oracle"]:
        res["failures"].append(
            f"oracle too weak to judge: reference output spread {spread:.3g} over all trials is below "
            f"10*atol = {10 * args.atol:g} (a constant output could pass)")
        log(f"  FAIL {res['failures'][-1]}")
    for key, vr in res["variants"].items():
        res["failures"] += [f"variant {key}: {m}" for m in vr["failures"]]
    res["ok"] = not res["failures"]
    return res


def _to64(x):
    return x.double() if x.is_floating_point() else x


def _e(x):
    return "-" if x is None else f"{x:.1e}"


def _free(device):
    """Return freed device memory to the driver between big steps (CUDA only: gc is slow on the CPU)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def stats(ms):
    """Summary of a list of per-sample times in milliseconds."""
    a = np.asarray(ms, dtype=np.float64)
    return dict(n=int(a.size), median_ms=float(np.median(a)), p10_ms=float(np.percentile(a, 10)),
                p90_ms=float(np.percentile(a, 90)), mean_ms=float(a.mean()), min_ms=float(a.min()))


class Timer:
    """Times a callable: CUDA events with an L2 flush before every sample (or perf_counter on CPU).

    flush: writes a preallocated buffer of max(2 * L2 size, 256 MiB) before each sample.
    """

    def __init__(self, device, samples):
        self.device = device
        self.samples = samples
        self.cuda = device.type == "cuda"
        l2 = 0
        if self.cuda:
            props = torch.cuda.get_device_properties(device)
            l2 = int(getattr(props, "L2_cache_size", 0) or 0)
        self.l2_bytes = l2
        self.flush_bytes = max(2 * l2, 256 << 20) if self.cuda else 64 << 20
        self.flush_buf = torch.empty(self.flush_bytes // 4, dtype=torch.int32, device=device)

    def flush(self):
        self.flush_buf.zero_()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _one(self, fn, args):
        """Seconds of one call (synchronised), used to choose the sample count."""
        self.sync()
        t0 = time.perf_counter()
        fn(*args)
        self.sync()
        return time.perf_counter() - t0

    def n_samples(self, per_call_s):
        if per_call_s > 1.0:
            return min(self.samples, 10)
        if per_call_s > 0.010:
            return min(self.samples, 20)
        return self.samples

    def time_calls(self, fn, input_sets, warmup=3):
        """Per-call times (ms) of fn(*inputs) with inputs rotated over input_sets, L2 flushed before each."""
        for i in range(max(warmup, len(input_sets))):
            fn(*input_sets[i % len(input_sets)])
        est = min(self._one(fn, input_sets[i % len(input_sets)]) for i in range(2))
        n = self.n_samples(est)
        if self.cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            for i in range(n):
                args = input_sets[i % len(input_sets)]
                self.flush()
                starts[i].record()
                fn(*args)
                ends[i].record()
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) for s, e in zip(starts, ends)]
        ms = []
        for i in range(n):
            args = input_sets[i % len(input_sets)]
            self.flush()
            t0 = time.perf_counter()
            fn(*args)
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms

    def time_graph(self, fn, args):
        """GPU-only time (ms per replay) of one forward captured in a CUDA graph, or raises."""
        if not self.cuda:
            raise RuntimeError("CUDA graphs need a CUDA device")
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up on a side stream, as the PyTorch docs show
            for _ in range(3):
                fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        static_out = None
        try:
            with torch.cuda.graph(graph):
                static_out = fn(*args)
            graph.replay()
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize(self.device)
            n = self.n_samples(time.perf_counter() - t0)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            for i in range(n):
                self.flush()
                starts[i].record()
                graph.replay()
                ends[i].record()
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) for s, e in zip(starts, ends)]
        finally:
            del static_out
            del graph

    def peak_bytes(self, fn, args):
        """Peak device bytes allocated during one call beyond what was allocated before (output included)."""
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        out = fn(*args)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del out
        return int(peak)


def time_candidate(timer, label, fn, input_sets, want_graph=True):
    """Per-call stats, CUDA-graph stats and peak memory of one callable; errors reported, not raised."""
    r = dict(per_call=None, graph=None, graph_error=None, peak_bytes=None, error=None, oom=False)
    log(f"    timing {label} ...")
    try:
        r["per_call"] = stats(timer.time_calls(fn, input_sets))  # includes the warm-up
        r["peak_bytes"] = timer.peak_bytes(fn, input_sets[0])
    except Exception as e:
        r["error"] = _short_exc(e)
        r["oom"] = _is_oom(e)
        log(f"    {label}: {'out of memory' if r['oom'] else 'error'}: {r['error'][:200]}")
    if r["error"]:
        _free(timer.device)  # after the except block, so the traceback no longer pins its tensors
        return r
    if want_graph:
        try:
            r["graph"] = stats(timer.time_graph(fn, input_sets[0]))
        except Exception as e:
            r["graph_error"] = _short_exc(e)
            log(f"    {label}: CUDA graph n/a: {r['graph_error'][:200]}")
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(timer.device)
    else:
        r["graph_error"] = "needs CUDA"
    _free(timer.device)
    return r


def time_shape(refmod, solmod, name, dims, shape_index, args, device, timer, time_variants, do_compile,
               ref_oom):
    """Timing of ModelNew (each of time_variants), eager reference and torch.compile(reference)."""
    init = refmod.init_inputs_for(dims)
    res = dict(new={}, eager=None, compile=None, compile_note=None, flops=None, min_bytes=None,
               floor_s=None, failures=[])
    ref = refmod.Model(*init).to(device).eval()
    new = build_new(solmod.ModelNew, init)  # SolutionError when the constructor raises
    try:
        new = new.to(device).eval()
        new.load_state_dict(ref.state_dict(), strict=True)
    except Exception as e:
        raise SolutionError(f"ModelNew .to(device) / load_state_dict(strict=True) failed: {_short_exc(e)}") from e
    redraw_parameters(ref, new, args.seed + 99)
    sets = [make_inputs(refmod, dims, "normal", "random01", args.seed * 7919 + 31 * k + shape_index, device)
            for k in range(args.input_sets)]
    cuda = device.type == "cuda"
    default_variant = getattr(new, "variant", None)
    if time_variants is None:  # the default: what a fresh ModelNew selects, else VARIANTS[0], else none
        declared = tuple(getattr(new, "VARIANTS", ()) or ())
        time_variants = [default_variant if default_variant is not None or not declared else declared[0]]
    for v in time_variants:
        key = v or "-"
        if v is not None:
            new.variant = v
        r = time_candidate(timer, f"ModelNew [{key}]", lambda *a: new(*a), sets, want_graph=cuda)
        r["last_variant"] = getattr(new, "last_variant", None)
        res["new"][key] = r
        if r["error"]:
            res["failures"].append(f"ModelNew [{key}] failed while timing: {r['error']}")
    if default_variant is not None:
        new.variant = default_variant
    if ref_oom:
        res["eager"] = dict(per_call=None, graph=None, graph_error="reference OOM", peak_bytes=None,
                            error="out of memory (seen in correctness)", oom=True)
    else:
        res["eager"] = time_candidate(timer, "eager reference", ref, sets, want_graph=cuda)
    if do_compile and not ref_oom:
        log(f"    compiling torch.compile(reference) for {name} (20-60 s per shape on the GPU machine) ...")
        try:
            torch._dynamo.reset()
            compiled = torch.compile(ref, dynamic=False)
            t0 = time.perf_counter()
            compiled(*sets[0])
            timer.sync()
            log(f"    compiled in {time.perf_counter() - t0:.1f} s")
            res["compile"] = time_candidate(timer, "torch.compile(reference)", compiled, sets, want_graph=cuda)
            res["compile"]["compile_s"] = time.perf_counter() - t0
            del compiled
        except Exception as e:
            res["compile"] = dict(per_call=None, graph=None, error=_short_exc(e), oom=_is_oom(e))
            log(f"    torch.compile failed: {res['compile']['error'][:200]}")
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
    else:
        res["compile_note"] = "reference OOM" if ref_oom else (
            "skipped (--no-compile)" if args.no_compile else "skipped for this shape (default: non-awkward shapes only; --compile-all)")
    fl, by = refmod.flops(dims), refmod.min_bytes(dims)
    res["flops"], res["min_bytes"] = int(fl), int(by)
    res["floor_s"] = max(fl / (args.peak_tflops * 1e12), by / (args.peak_tbs * 1e12))
    for key, r in res["new"].items():
        if not r.get("per_call"):
            continue
        t = r["per_call"]["median_ms"] * 1e-3
        r["floor_multiple"] = t / res["floor_s"] if res["floor_s"] else None
        r["tflops"] = fl / t / 1e12
        r["tbs"] = by / t / 1e12
        if r.get("graph"):
            tg = r["graph"]["median_ms"] * 1e-3
            r["graph_floor_multiple"] = tg / res["floor_s"] if res["floor_s"] else None
            r["graph_tflops"] = fl / tg / 1e12
            r["graph_tbs"] = by / tg / 1e12
        for base in ("eager", "compile"):
            b = res[base]
            r[f"speedup_vs_{base}"] = (b["per_call"]["median_ms"] / r["per_call"]["median_ms"]
                                       if b and b.get("per_call") else None)
    del ref, new, sets
    _free(device)
    return res


# ---------------------------------------------------------------------------------------------
# Shape selection and fit
# ---------------------------------------------------------------------------------------------
FLAG_KEYS = ("reference_may_oom",)  # optional shape keys that are flags, not dimensions


def shape_keys(refmod):
    """(required, optional) keys of a custom shape: the keys of the reference's named shapes, less
    the flags (FLAG_KEYS and any key holding a bool), which are optional."""
    keys, flags = [], set(FLAG_KEYS)
    for d in refmod.SHAPES.values():
        for k, v in d.items():
            if k not in keys:
                keys.append(k)
            if isinstance(v, bool):
                flags.add(k)
    return [k for k in keys if k not in flags], [k for k in keys if k in flags]


def parse_custom_shape(text, i, refmod=None):
    """'B=2,N=5,pair_dim=8,hidden_dim=4' -> ('custom0', {...}). Raises ValueError.

    With `refmod`, the keys must be exactly those of the reference's named shapes (flags such as
    reference_may_oom optional), dimensions >= 1 and flags 0 or 1."""
    dims = {}
    for part in text.split(","):
        if not part.strip():
            continue
        k, _, v = part.partition("=")
        if not _:
            raise ValueError(f"--shape expects KEY=INT,...; got {text!r}")
        try:
            dims[k.strip()] = int(v)
        except ValueError:
            raise ValueError(f"--shape {text!r}: {k.strip()}={v.strip()!r} is not an integer") from None
    if refmod is not None:
        required, flags = shape_keys(refmod)
        unknown = [k for k in dims if k not in required and k not in flags]
        missing = [k for k in required if k not in dims]
        if unknown or missing:
            what = "; ".join(x for x in (f"unknown key(s) {', '.join(unknown)}" if unknown else "",
                                         f"missing key(s) {', '.join(missing)}" if missing else "") if x)
            raise ValueError(f"--shape {text!r}: {what}; expected keys {','.join(required)}"
                             + (f" (optional flags: {', '.join(f + '=0|1' for f in flags)})" if flags else ""))
        for k, v in dims.items():
            if k in flags:
                if v not in (0, 1):
                    raise ValueError(f"--shape {text!r}: flag {k} must be 0 or 1")
                dims[k] = bool(v)
            elif v < 1:
                raise ValueError(f"--shape {text!r}: {k} must be >= 1")
    return f"custom{i}", dims


def estimate_need(refmod, dims, timing, input_sets=3):
    """Rough device bytes the harness needs for one shape (bytes; an over-estimate by design).

    Inputs `in_b` (sizes from input_shapes_for, 4 bytes each), output `out_b` = min_bytes - in_b.
    Correctness: inputs, clones and fp64 copies; fp32 reference, ModelNew and fp64 outputs, the
    previous ModelNew output and its clone (aliasing check); twice the reference's peak_bytes (fp64).
    Shapes flagged reference_may_oom: inputs and ModelNew outputs only (the current and the previous
    one; the reference runs on sampled rows). Timing adds the rotated input sets and two outputs.
    """
    in_b = 4 * sum(math.prod(s) for s in refmod.input_shapes_for(dims))
    out_b = max(int(refmod.min_bytes(dims)) - in_b, 0)
    if dims.get("reference_may_oom"):
        need = 4 * in_b + 3 * out_b
    else:
        peak = refmod.peak_bytes(dims) if hasattr(refmod, "peak_bytes") else 4 * (in_b + out_b)
        need = 4 * in_b + 7 * out_b + 2 * peak
    if timing:
        need += input_sets * in_b + 2 * out_b
    return int(need)


def available_bytes(device):
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


CPU_MAX_FLOPS = 2e10  # default CPU runs skip shapes heavier than this (slow in fp64 on a few cores)


def select_shapes(refmod, args, device):
    """[(name, dims, skip_reason or None)] in SHAPES order (or --shapes order), customs last."""
    named = dict(refmod.SHAPES)
    chosen = []
    if args.shapes:
        for n in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            if n not in named:
                raise ValueError(f"unknown shape {n!r}; the reference has {', '.join(named)}")
            chosen.append((n, dict(named[n]), True))
    elif not args.shape:
        chosen = [(n, dict(d), False) for n, d in named.items()]
    for i, text in enumerate(args.shape or []):
        n, d = parse_custom_shape(text, i, refmod)
        chosen.append((n, d, True))
    avail = available_bytes(device)
    out = []
    for n, d, forced in chosen:
        need = estimate_need(refmod, d, timing=device.type == "cuda" and not args.no_timing,
                             input_sets=args.input_sets)
        reason = None
        if need > 0.9 * avail:
            reason = f"needs about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB free"
        elif device.type == "cpu" and not forced and refmod.flops(d) > CPU_MAX_FLOPS:
            reason = f"{refmod.flops(d):.1e} FLOP is slow on the CPU; name it in --shapes to force"
        out.append((n, d, reason))
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _ms(r, key="per_call"):
    if not r:
        return "n/a"
    if r.get(key):
        return f"{r[key]['median_ms']:.4g}"
    if key == "graph" and r.get("graph_error"):
        return "n/a"
    return "OOM" if r.get("oom") else "n/a"


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def _mb(b):
    return "-" if b is None else f"{b / 2**20:.0f}"


def table_rows(report):
    """Rows (list of str lists) of the final table, one per (shape, checked variant); header first.

    result and err64 are the variant's own; the timing columns are filled for timed variants.
    """
    rows = [["shape", "variant", "result", "err64 new/ref", "new ms", "graph ms", "eager ms", "compile ms",
             "vs eager", "vs compile", "x floor", "peak MB new/ref"]]
    for s in report["shapes"]:
        if s.get("skip_reason"):
            rows.append([s["name"], "-", "skipped"] + [""] * 9)
            continue
        c = s.get("correctness") or {}
        tm = s.get("timing") or {}
        news = tm.get("new") or {}
        eager, comp = tm.get("eager"), tm.get("compile")
        ref_err = _e(c.get("ref_fp32_max_abs_err_fp64"))
        shape_fail = bool(c.get("failures")) and not any(v.get("failures") for v in (c.get("variants") or {}).values())
        keys = list(c.get("variants") or {}) or list(news) or ["-"]
        keys += [k for k in news if k not in keys]
        for key in keys:
            v = (c.get("variants") or {}).get(key, {})
            r = news.get(key)
            lasts = list(v.get("last_variants") or [])
            if r and r.get("last_variant") and r["last_variant"] not in lasts:
                lasts.append(r["last_variant"])
            shown = [x for x in lasts if x != key]
            vname = key if not shown else ("/".join(shown) if key == "-" else f"{key}->{'/'.join(shown)}")
            ok = s.get("ok") if len(keys) == 1 else (v.get("ok", False) and not shape_fail
                                                      and not (r or {}).get("error"))
            row = [s["name"], vname, "PASS" if ok else "FAIL", f"{_e(v.get('max_abs_err_fp64'))}/{ref_err}"]
            if r is None:
                rows.append(row + ["-"] * 8)
                continue
            comp_ms = _ms(comp) if comp else ("skip" if tm.get("compile_note") else "n/a")
            rows.append(row + [_ms(r), _ms(r, "graph"), _ms(eager), comp_ms,
                               _x(r.get("speedup_vs_eager")), _x(r.get("speedup_vs_compile")),
                               "-" if r.get("floor_multiple") is None else f"{r['floor_multiple']:.1f}",
                               f"{_mb(r.get('peak_bytes'))}/{_mb((eager or {}).get('peak_bytes'))}"])
    return rows


def format_table(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser():
    p = _Parser(prog="harness.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="exit codes: 0 pass, 1 usage error or harness bug (or nothing checked), 2 missing file / "
                       "build or import failure / no ModelNew, 3 the solution failed a check (incl. raising at "
                       "construction or call), 4 no CUDA device")
    p.add_argument("target", help="a name (contact_map -> ./contact_map.py vs reference/contact_map.py) "
                                  "or a path to a file defining ModelNew")
    p.add_argument("--ref", help="reference module path (default: from the name / file name)")
    p.add_argument("--shapes", help="comma-separated named shapes (default: all that fit the device)")
    p.add_argument("--shape", action="append", metavar="K=V,...",
                   help="an extra custom shape with the keys of the reference's SHAPES, e.g. "
                        "B=2,N=5,pair_dim=8,hidden_dim=4 (repeatable)")
    p.add_argument("--trials", type=int, default=len(DISTRIBUTIONS),
                   help=f"correctness trials per shape (default {len(DISTRIBUTIONS)}: one per input distribution)")
    p.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    p.add_argument("--json", metavar="PATH", help="write every number as JSON to PATH")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    p.add_argument("--compile-all", action="store_true", help="torch.compile for awkward shapes too")
    p.add_argument("--no-timing", action="store_true", help="correctness only")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default cuda; cpu runs correctness of "
                                                              "pure-PyTorch solutions on the CPU")
    p.add_argument("--variant", default=None, help="NAME or all (default: all when ModelNew.VARIANTS exists)")
    p.add_argument("--time-variants", action="store_true", help="time every checked variant, not only the default")
    p.add_argument("--samples", type=int, default=100, help="timing samples (default 100; 20 over 10 ms, 10 over 1 s)")
    p.add_argument("--input-sets", type=int, default=3, help="input sets rotated while timing (default 3)")
    p.add_argument("--rows", type=int, default=8, help="rows sampled for reference_may_oom shapes (default 8)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance, >= 0 (default 1e-4)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance, >= 0 (default 1e-4)")
    p.add_argument("--peak-tflops", type=float, default=50.0, help="fp32 ceiling for the floor (default 50)")
    p.add_argument("--peak-tbs", type=float, default=4.0, help="memory ceiling in TB/s (default 4.0)")
    p.add_argument("--cpu-timing", action="store_true",
                   help="with --device cpu: run the timing code with perf_counter (tests the harness only)")
    return p


def _set_precision():
    """TF32 off everywhere (the pass criterion is an fp32 one)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _device_info(device):
    if device is None or device.type != "cuda":
        return dict(type=device.type if device is not None else None)
    p = torch.cuda.get_device_properties(device)
    return dict(type="cuda", name=p.name, capability=f"{p.major}.{p.minor}", total_bytes=int(p.total_memory),
                l2_bytes=int(getattr(p, "L2_cache_size", 0) or 0), sms=p.multi_processor_count)


def check_json_path(path):
    """Usage check of --json PATH before any work: not a directory, its folder creatable and writable.
    Returns an error message or None (creates the folder)."""
    if os.path.isdir(path):
        return f"--json {path}: is a directory (give a file path, e.g. {os.path.join(path, 'report.json')})"
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        return f"--json {path}: cannot create its folder: {e}"
    if not os.access(d, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"--json {path}: not writable"
    return None


def _write_json(path, report):
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    log(f"wrote {path}")


def main(argv=None):
    """Run the harness; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    report = dict(harness_version=1, command=["harness.py"] + list(sys.argv[1:] if argv is None else argv),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  host=socket.gethostname(), python=platform.python_version(), torch=torch.__version__,
                  torch_cuda=torch.version.cuda, solution=None, reference=None, device=None,
                  settings=None, build=None, shapes=[], notes=[], exit_code=None, verdict=None)

    def finish(code, verdict):
        report["exit_code"], report["verdict"] = code, verdict
        log(verdict)
        _write_json(args.json, report)
        return code

    if args.json:
        bad = check_json_path(args.json)
        if bad:
            args.json = None  # nothing can be written there
            return finish(EXIT_USAGE, f"usage: {bad}")
    if args.trials < 1 or args.samples < 1 or args.input_sets < 1 or args.rows < 2:
        return finish(EXIT_USAGE, "usage: --trials, --samples, --input-sets must be >= 1 and --rows >= 2")
    if not (args.atol >= 0 and args.rtol >= 0 and math.isfinite(args.atol) and math.isfinite(args.rtol)):
        return finish(EXIT_USAGE, f"usage: --atol and --rtol must be finite and >= 0 (got {args.atol:g}, {args.rtol:g})")
    if not (args.peak_tflops > 0 and args.peak_tbs > 0):
        return finish(EXIT_USAGE, "usage: --peak-tflops and --peak-tbs must be > 0")
    if args.trials < len(DISTRIBUTIONS):
        report["notes"].append(f"only {args.trials} trials: not every input distribution is tried "
                               f"(the default is {len(DISTRIBUTIONS)}, one per distribution)")
    try:
        sol_path, ref_path = resolve_target(args.target, args.ref)
    except ValueError as e:
        return finish(EXIT_USAGE, f"usage: {e}")
    report["solution"], report["reference"] = sol_path, ref_path
    for p in (sol_path, ref_path):
        if not os.path.isfile(p):
            return finish(EXIT_USAGE if p == ref_path else EXIT_BUILD, f"no such file: {p}")

    have_cuda = torch.cuda.is_available()
    default_build_env()  # without a GPU, load_inline still builds for sm_90
    _set_precision()

    refmod = load_module(ref_path)
    try:  # shape names and custom shapes are usage errors: say so before the (slow) build
        names = [n.strip() for n in (args.shapes or "").split(",") if n.strip()]
        for n in names:
            if n not in refmod.SHAPES:
                raise ValueError(f"unknown shape {n!r}; the reference has {', '.join(refmod.SHAPES)}")
        for i, text in enumerate(args.shape or []):
            parse_custom_shape(text, i, refmod)
    except ValueError as e:
        return finish(EXIT_USAGE, f"usage: {e}")
    log(f"building {os.path.relpath(sol_path)} (imports it; a CUDA extension compiles with nvcc: one to a "
        f"few minutes the first time, seconds when cached) ...")
    t0 = time.perf_counter()
    calls = []
    try:
        with _record_extension_builds(calls):
            solmod = load_module(sol_path)
    except BaseException as e:  # SystemExit too: a solution must not end the harness
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        report["build"] = dict(ok=False, seconds=time.perf_counter() - t0, error=tb)
        log(tb.rstrip())
        return finish(EXIT_BUILD, f"BUILD FAILED: importing {sol_path} raised {_short_exc(e)}")
    exts = sorted(set(calls) | set(_extension_modules(solmod)))
    report["build"] = dict(ok=True, seconds=time.perf_counter() - t0, extensions=exts)
    log(f"built in {report['build']['seconds']:.1f} s" + (f" (extensions: {', '.join(exts)})" if exts else
                                                          " (pure PyTorch: no extension built)"))
    if not isinstance(getattr(solmod, "ModelNew", None), type):
        return finish(EXIT_BUILD, f"BUILD FAILED: {sol_path} defines no class ModelNew")

    # A --variant the solution does not declare is a usage error, on any machine (before the device check).
    NewModel = solmod.ModelNew
    declared = tuple(getattr(NewModel, "VARIANTS", ()) or ())
    if args.variant in (None, "all"):
        variants = list(declared) or [None]
    elif not declared:
        return finish(EXIT_USAGE, f"usage: --variant {args.variant}: ModelNew declares no VARIANTS")
    elif args.variant not in declared:
        if args.variant in tuple(getattr(NewModel, "ALL_VARIANTS", ()) or ()):
            return finish(EXIT_USAGE, f"usage: --variant {args.variant}: in ModelNew.ALL_VARIANTS but it does not run "
                                      f"on this machine (ModelNew.VARIANTS here: {declared})")
        return finish(EXIT_USAGE, f"usage: --variant {args.variant}: not in ModelNew.VARIANTS {declared}")
    else:
        variants = [args.variant]

    want = args.device or "cuda"
    if want == "cuda" and not have_cuda:
        report["device"] = dict(type=None)
        return finish(EXIT_NO_CUDA,
                      "NO CUDA DEVICE: the solution built/imported, but correctness on the GPU and timing need "
                      "a CUDA device. (Pure-PyTorch solutions can be checked with --device cpu --no-timing.)")
    if want == "cpu" and exts:
        report["device"] = dict(type="cpu")
        return finish(EXIT_NO_CUDA,
                      f"NO CUDA DEVICE: {os.path.basename(sol_path)} builds a CUDA extension ({', '.join(exts)}); "
                      "its correctness and timing need a CUDA device (--device cpu is for pure-PyTorch files).")
    device = torch.device("cuda", torch.cuda.current_device()) if want == "cuda" else torch.device("cpu")
    report["device"] = _device_info(device)
    timing = not args.no_timing and (device.type == "cuda" or args.cpu_timing)
    if device.type == "cpu" and not args.no_timing and not args.cpu_timing:
        report["notes"].append("timing needs a CUDA device: skipped on the CPU")

    report["settings"] = dict(trials=args.trials, seed=args.seed, atol=args.atol, rtol=args.rtol, tf32=False,
                              variants=[v or "-" for v in variants], samples=args.samples,
                              input_sets=args.input_sets, timing=timing, compile=not args.no_compile,
                              compile_all=args.compile_all, peak_tflops=args.peak_tflops, peak_tbs=args.peak_tbs)

    try:
        shapes = select_shapes(refmod, args, device)
    except ValueError as e:
        return finish(EXIT_USAGE, f"usage: {e}")
    timer = Timer(device, args.samples) if timing else None
    if timer is not None and timer.cuda:
        log(f"L2 {timer.l2_bytes / 2**20:.0f} MiB; flush buffer {timer.flush_bytes / 2**20:.0f} MiB")

    any_checked, all_ok = False, True
    harness_errors = []  # exceptions in the harness or the reference (not the solution's failures)
    for si, (name, dims, skip) in enumerate(shapes):
        entry = dict(name=name, dims=dims, ok=False, skip_reason=skip, correctness=None, timing=None)
        report["shapes"].append(entry)
        shown = ", ".join(f"{k}={v}" for k, v in dims.items() if k != "reference_may_oom")
        if skip:
            log(f"\n== {name} ({shown}): skipped: {skip}")
            report["notes"].append(f"{name} skipped: {skip}")
            continue
        log(f"\n== {name} ({shown}) on {device}")
        any_checked = True
        c = new_correctness()
        try:  # outside inference_mode: check_shape runs the grad-mode check itself
            check_shape(refmod, solmod, name, dims, si, args, device, variants, res=c)
        except Exception as e:
            c["ok"] = False
            for key, vr in c["variants"].items():  # the solution's failures seen before the error
                c["failures"] += [f"variant {key}: {m}" for m in vr["failures"]]
            c["failures"].append(f"harness error: {_short_exc(e)}")
            harness_errors.append(f"{name}: {_short_exc(e)}")
            log(traceback.format_exc().rstrip())
        entry["correctness"] = c
        ok = c["ok"]
        if timing:
            is_default = not name.startswith("awkward") and not dims.get("reference_may_oom")
            do_compile = not args.no_compile and (args.compile_all or is_default)
            tv = variants if (args.time_variants or args.variant not in (None, "all")) else None
            log(f"  timing {name}: ModelNew ({'variants ' + ','.join(v or '-' for v in tv) if tv else 'default variant'}), "
                f"eager reference" + (", torch.compile(reference)" if do_compile else ""))
            try:
                with torch.inference_mode():
                    tm = time_shape(refmod, solmod, name, dims, si, args, device, timer, tv, do_compile,
                                    bool(c.get("reference_oom")))
            except SolutionError as e:
                tm = dict(failures=[str(e)], new={})
            except Exception as e:
                tm = dict(failures=[f"harness error (timing): {_short_exc(e)}"], new={})
                harness_errors.append(f"{name} (timing): {_short_exc(e)}")
                log(traceback.format_exc().rstrip())
            entry["timing"] = tm
            if tm["failures"]:
                ok = False
                for f in tm["failures"]:
                    log(f"  FAIL {f}")
            if device.type == "cpu":
                report["notes"].append("timing ran on the CPU (--cpu-timing): numbers mean nothing")
        entry["ok"] = ok
        all_ok &= ok
        log(f"== {name}: {'PASS' if ok else 'FAIL'}")
        _free(device)
        if timing and device.type == "cuda":
            with contextlib.suppress(Exception):
                torch._dynamo.reset()

    if timing and not args.no_compile and not args.compile_all:
        report["notes"].append("torch.compile ran only for shapes not named awkward* nor flagged reference_may_oom; "
                               "--compile-all for all")
    failed_shapes = [s for s in report["shapes"] if not s.get("ok") and not s.get("skip_reason")]
    if failed_shapes:
        log("\nFailures:")
        for s in failed_shapes:
            fs = list((s.get("correctness") or {}).get("failures") or []) + list((s.get("timing") or {}).get("failures") or [])
            for f in fs[:4]:
                log(f"  {s['name']}: {f[:300]}")
            if len(fs) > 4:
                log(f"  {s['name']}: ... {len(fs) - 4} more (see above / --json)")
    log("\n" + format_table(table_rows(report)))
    log("err64 = max abs error vs the reference in float64 (ModelNew / fp32 reference); times are medians; "
        "x floor = ModelNew time / roofline floor; peak = one forward, inputs excluded")
    for n in dict.fromkeys(report["notes"]):
        log(f"note: {n}")
    if not any_checked:
        return finish(EXIT_USAGE, "NOTHING CHECKED: every selected shape was skipped")
    if not all_ok:
        failed = [s["name"] for s in report["shapes"] if not s.get("ok") and not s.get("skip_reason")]
        solution_failed = any(not f.startswith("harness error")
                              for s in report["shapes"]
                              for f in list((s.get("correctness") or {}).get("failures") or [])
                              + list((s.get("timing") or {}).get("failures") or []))
        if harness_errors and not solution_failed:
            return finish(EXIT_USAGE, f"HARNESS ERROR (a bug in the harness or the reference, not a verdict on "
                                      f"the solution): {'; '.join(harness_errors)[:600]}")
        return finish(EXIT_WRONG, f"FAIL: wrong results or failed checks at {', '.join(failed)}"
                      + (f" (and harness errors: {'; '.join(harness_errors)[:300]})" if harness_errors else ""))
    return finish(EXIT_OK, "PASS: every check passed")


if __name__ == "__main__":
    sys.exit(main())
