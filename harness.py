"""Judge a KernelBench-format `ModelNew` against its reference `Model`: build, check, time, table.

    python harness.py contact_map                 # ./contact_map.py against reference/contact_map.py
    python harness.py outer_product_mean --shapes seed,crop --json out.json
    python harness.py path/to/solution.py --ref reference/contact_map.py --device cpu --no-timing
    python harness.py contact_map --dtype all --backward   # fp32, fp16, bf16 in turn; gradients too

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
  * pass criterion (fp32; fp16/bf16 under Precision): torch.allclose(new, ref_fp32, atol=1e-4,
    rtol=1e-4) with TF32 off; also max abs / max rel error against the reference evaluated in
    float64 on the same device, beside the fp32 reference's own error. Relative error is
    |d| / (|ref64| + atol).
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

Timing (CUDA only; TF32 off; ModelNew, the eager reference and torch.compile(reference) in the same
run), first under torch.inference_mode: warm-up; the L2 flushed before every sample by writing a
preallocated buffer of max(2 * L2, 256 MiB); CUDA events around each call; >= `--samples` (100)
samples, 20 when one call takes over 10 ms, 10 over 1 s; `--input-sets` (3) input sets rotated;
median and p10-p90. Also the GPU-only time from replaying one forward captured in a CUDA graph
('n/a' with the reason when capture fails), the peak device memory of one forward (inputs excluded,
output included), the roofline floor max(FLOPs / `--peak-tflops`, bytes / `--peak-tbs`) with ModelNew's
time as a multiple of it, achieved TFLOP/s and TB/s, speedups over eager and over torch.compile.
torch.compile runs by default only for shapes not named awkward* and not reference_may_oom.
Then KernelBench's number ("KB"), ModelNew and the eager reference timed as KernelBench's
eval_kernel_against_ref times them: outside inference_mode, grad mode on, parameters requiring grad (so a
kernel file's autograd.Function path runs), one input set drawn like get_inputs() (normal, masks all
ones), every tensor cast with .to(dtype) (masks too); its time_execution_with_cuda_event (KernelBench
commit 423217d): 3 warm-up calls each synchronised, torch.cuda.empty_cache(), then per trial:
synchronize, its L2 clear (a 256 MiB int64 tensor allocated and filled), start event, the call, end
event, synchronize; the first trial discarded; as many trials as per-call samples above, at most 100
(the count its scripts use; so 100 for calls under 10 ms by default). Reported: the mean (its runtime), the speedup eager mean /
ModelNew mean, and the host time per call: time.perf_counter around the call, nothing synchronised in
between, the device idle before each, median. torch.compile(reference) is not timed this way (KernelBench's
baseline measure_ref_program_time times eager and compiled references under no_grad).

Precision (`--dtype fp32|fp16|bf16|all`, default fp32; all: the three in turn, failing if any fails):
  * the reference Model and ModelNew are cast with .to(device, dtype), and in fp16/bf16 every input
    tensor too, masks included, as KernelBench's eval does (in fp32 masks keep their kind: bool and
    integer masks are checked as such, which KernelBench's cast to fp32 would hide).
  * pass criterion in fp16/bf16: KernelBench's allclose(new, ref, atol=1e-2, rtol=1e-2) against the
    reference run in that dtype (evaluated on the exact fp32 upcast of both), and the output's dtype
    equal to the reference's, which is the input dtype. Beside it, the max errors of both (the
    reference in that dtype and the solution) against the reference in float64 (the cast parameters
    and inputs, upcast). --atol / --rtol, when given, replace the tolerance of every dtype.
  * a reference with OUTPUT_FP64X2 = True (a model family's, not a KernelBench problem): in fp16/bf16
    an element outside that allclose also passes where its error against float64 is at most 2x the
    reference's own there (the gradients' fp64x2 rule, per element); the line says "held: fp64x2".
  * every other check, the grad-mode call, --backward and the timing run in that dtype.

Training (`--backward`; shapes flagged reference_may_oom are not checked):
  * per shape, trial and variant: the gradients of (out * g).sum(), g a fresh standard normal per
    trial, for every floating input of role "x" and every parameter (autograd through ModelNew),
    against the reference's autograd in the checked dtype and in float64 (the reference and the
    inputs upcast). Masks get no gradient requirement (none is asked of them).
  * pass criterion per gradient: allclose(atol, rtol) to the reference's gradient in the checked
    dtype (the dtype's tolerance above), OR a max abs error against fp64 at most 2x the reference's
    own; both are reported, and which held ("allclose", "fp64x2" or "both").
  * fails on: a gradient that is None, of the wrong shape or dtype, or NaN/Inf where the
    reference's is finite; a parameter that does not require grad; an output that does not require
    grad; the step raising, changing an input or a parameter, or running another variant.
  * timing: forward + backward (torch.autograd.grad of the same loss) of ModelNew, the eager
    reference and torch.compile(reference) in the same run, per call and as one step captured in a
    CUDA graph (replays: GPU time alone; a step that cannot be captured says so in graph_error), and
    the peak device memory of one training step (torch.cuda.max_memory_allocated around it, inputs
    excluded); graph and peak are n/a on the CPU.

Conventions honoured in the solution file: `ModelNew.VARIANTS` (optional tuple of str) lists kernel
variants (those that run on this machine; a model's own VARIANTS may leave out those that do not run for
its dimensions: each shape checks and times only the variants its model lists); `ModelNew.ALL_VARIANTS`
(optional) every variant the file has, for a clearer message when --variant names one that does not run
here (e.g. a Hopper-only one);
`model.variant` selects one (its value after construction is the default, else VARIANTS[0]);
`model.last_variant` (optional str) after a forward says what actually ran (shown in the table).

Reference module contract: Model, SHAPES {name: dict}, init_inputs_for(shape), input_shapes_for(shape),
flops(shape), min_bytes(shape); optional INPUT_ROLES ("x" | "mask" per input), peak_bytes(shape),
forward_rows(model, *inputs, rows) for shapes with reference_may_oom, FAMILY (str): where the solution
file maps it in FAMILIES {family: class}, that class is judged in ModelNew's place (one kernel file,
several references: `python harness.py outer_product_mean --ref reference/outer_product_mean_boltz.py`).

JSON (--json PATH): {harness_version, command, date, host, python, torch, torch_cuda, solution,
reference, device {type, name, capability, total_bytes, l2_bytes, sms}, settings {trials, seed, atol,
rtol (of the first dtype), tolerances {dtype: [atol, rtol]}, dtype, dtypes, backward, tf32, variants,
samples, input_sets, timing, compile, ...}, build {ok, seconds, extensions | error}, shapes: [{name,
dtype, atol, rtol, dims, ok, skip_reason, correctness {ok, failures, dropin {ok, detail},
ref_fp32_max_abs_err_fp64, ref_fp32_max_rel_err_fp64 ("fp32" in these names and in max_abs_diff_fp32:
the reference run in the checked dtype), ref_spread, weak_oracle, reference_oom, rows_checked, variants_not_run
(variants outside the model's own VARIANTS, not checked), variants {name:
{ok, failures, last_variants, max_abs_err_fp64, max_rel_err_fp64, max_abs_diff_fp32, mismatches,
grad_checked}}, trials [{trial, seed, distribution, mask, variants {name: compare() dict},
grad_variants {name: compare() dict} (trial 0), backward {name: {ok, failures, last_variant, grads
{name: G}}}}], backward {ok, failures, skipped, variants {name: {ok, failures, grads {name: {held
{label: count}, max_abs_err_fp64, ref_max_abs_err_fp64, max_abs_diff_ref}}}}} (None without
--backward)}, timing {flops, min_bytes, floor_s, compile_note, kb_note, failures, new {variant: T},
eager: T, compile: T + compile_s, train {compile_note, failures, new {variant: T}, eager: T, compile: T +
compile_s} (--backward)}}], notes, exit_code, verdict}, where T = {per_call, graph: {n, median_ms,
p10_ms, p90_ms, mean_ms, min_ms} or None, graph_error, peak_bytes, error, oom, for ModelNew and the
eager forward also kb: {the same keys, std_ms, max_ms} or None, host: {the same keys as graph} or None,
kb_error, kb_oom, and for ModelNew last_variant, kb_last_variant (after the grad-mode calls),
floor_multiple, tflops, tbs, graph_floor_multiple, graph_tflops, graph_tbs, speedup_vs_eager,
speedup_vs_compile, kb_speedup_vs_eager}, G = compare_grad()'s dict {ok, failures, held,
max_abs_err_fp64, ref_max_abs_err_fp64, max_abs_diff_ref}. Times in ms, memory in bytes,
non-finite errors as Infinity.

Exit codes:
  0  every check passed.
  1  usage error (bad option or value: negative --atol/--rtol, a --json path that is a directory or
     not writable; unknown target name (the valid names are listed), shape or --shape key, all
     checked before the build; a --variant not in ModelNew.VARIANTS) or a harness bug (an exception
     in the harness or the reference: "HARNESS ERROR" with a traceback; a solution failure seen in
     the same run still gives 3), or nothing was checked (every shape skipped).
  2  the solution file is missing, did not build / import, or defines no ModelNew.
  3  the solution failed any check: wrong results, drop-in, inputs or parameters changed, aliasing,
     variant, grad mode, gradients (--backward), in any dtype checked, or ModelNew(...) raising at
     construction or at a call.
  4  no CUDA device (correctness on the GPU and timing need one; `--device cpu` runs correctness on
     the CPU for pure-PyTorch solutions).

Custom shapes (--shape K=V,...) must have exactly the keys of the reference's named shapes (flags
such as reference_may_oom optional, 0 or 1), dimensions >= 1.

Limits: the fit check is an estimate from the reference's `peak_bytes` (fp32 sizes in every dtype);
timing numbers on the CPU (`--cpu-timing`, for testing the harness) mean nothing; the floor uses
nominal H200 ceilings, fp32 ones in every dtype; the KernelBench-style timing runs the models in
eval() mode (KernelBench leaves them in training mode; the references have no dropout or batch norm)
and gives no CUDA-graph figure.
"""
import argparse
import contextlib
import copy
import datetime
import gc
import hashlib
import importlib.util
import inspect
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
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_TOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 1e-2}  # atol = rtol per dtype: KernelBench's
GRAD_FP64_FACTOR = 2.0  # --backward: a gradient passes when its fp64 error is at most this x the reference's
# (and, per element, a 16-bit output of an OUTPUT_FP64X2 reference: compare())


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
    if dist == "x100":  # large magnitude: a stress input for split-precision products
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


def input_roles(refmod, n):
    """The reference's INPUT_ROLES ("x" | "mask" per forward input), all "x" when it has none."""
    return tuple(getattr(refmod, "INPUT_ROLES", ("x",) * n))


def make_inputs(refmod, dims, dist, mask_kind, seed, device, dtype=torch.float32):
    """The forward's inputs for shape `dims`, per the reference's INPUT_ROLES ("x" | "mask").

    Drawn in fp32 (masks in their kind's dtype); for another `dtype` every tensor, masks too, is then
    cast with .to(device, dtype), as KernelBench's eval does."""
    shapes = refmod.input_shapes_for(dims)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out = []
    for shp, role in zip(shapes, input_roles(refmod, len(shapes))):
        if role == "mask":
            out.append(make_mask(tuple(shp), mask_kind, gen, device))
        else:
            out.append(make_activation(tuple(shp), dist, gen, device))
    if dtype != torch.float32:
        out = [x.to(device=device, dtype=dtype) for x in out]
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


def build_pair(refmod, solmod, dims, device, dtype=torch.float32):
    """(ref, new): Model and ModelNew built with the shape's init arguments, moved to `device` (and
    cast to `dtype` unless fp32, with .to(device, dtype) as KernelBench does), ModelNew loaded with
    load_state_dict(ref.state_dict(), strict=True). Call outside inference_mode to get parameters
    that require grad. Raises SolutionError when ModelNew's constructor, .to or the load fails."""
    init = refmod.init_inputs_for(dims)
    ref = _to_device(refmod.Model(*init), device, dtype).eval()
    new = build_new(solmod.ModelNew, init)
    try:
        new = _to_device(new, device, dtype).eval()
        new.load_state_dict(ref.state_dict(), strict=True)
    except Exception as e:
        raise SolutionError(f"ModelNew .to(device) / load_state_dict(strict=True) failed: {_short_exc(e)}") from e
    return ref, new


def _to_device(module, device, dtype):
    """module.to(device) in fp32 (a solution's own buffers keep their dtype), .to(device, dtype) otherwise."""
    return module.to(device) if dtype == torch.float32 else module.to(device=device, dtype=dtype)


def dropin_check(RefModel, NewModel, init, seed=42):
    """KernelBench drop-in: same seed (42, as KernelBench) before building each -> same state_dict?
    Returns (ok, detail).

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
def _fp64x2_outputs(refmod, dtype):
    """Whether outputs are judged per element by allclose or fp64x2 (compare): fp16 / bf16 against a reference
    that declares OUTPUT_FP64X2 = True (a model family's, not a KernelBench problem)."""
    return dtype in (torch.float16, torch.bfloat16) and getattr(refmod, "OUTPUT_FP64X2", False) is True


def compare(out, ref32, ref64, atol, rtol, index_offset=None, fp64x2=False):
    """Judge one output against the reference in the checked dtype (`ref32`: the pass criterion; fp32
    unless --dtype says otherwise) and in fp64 (error report).

    fp64x2: an element outside allclose passes where its error against fp64 is at most GRAD_FP64_FACTOR x the
    reference's own there (|new - ref64| <= 2 |ref32 - ref64|): where the reference in that dtype is itself that far
    from fp64, its rounding, not the solution, decides allclose. held says which rule passed ("allclose",
    "fp64x2"; None when neither); mismatches still counts allclose's.

    Returns a dict: ok, failures (list of str), max_abs_err_fp64, max_rel_err_fp64,
    max_abs_diff_fp32, mismatches, first_mismatches [(index, new, ref32, ref64)], allclose_fp64
    (information only: would it pass against the fp64 reference).
    `index_offset` maps indices of a row sample back to full-output indices (a list of rows).
    """
    r = dict(ok=False, failures=[], max_abs_err_fp64=None, max_rel_err_fp64=None,
             max_abs_diff_fp32=None, mismatches=None, first_mismatches=[], allclose_fp64=None, held=None)
    r["failures"] = _type_failures(out, ref32)
    if r["failures"]:
        return r
    ref_name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(ref32.dtype, "fp32")
    if ref_name != "fp32":  # judged on the exact fp32 upcast: no rounding in the check itself
        out, ref32 = out.float(), ref32.float()
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
    r["held"] = "allclose" if allclose else None
    if not allclose and fp64x2:
        own = (ref32.double() - ref64.double()).abs()
        excused = close | (d64 <= GRAD_FP64_FACTOR * own)
        if bool(excused.all()):
            r["held"] = "fp64x2"
        else:
            close = excused  # the mismatches reported are those neither rule passes
    if not allclose and r["held"] is None:
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
            + (f" (note: within atol/rtol of the fp64 reference; the {ref_name} reference's own rounding decides)"
               if r["allclose_fp64"] else "")
            + (f"; {int((~close).sum())} of them also beyond {GRAD_FP64_FACTOR:g} x the reference's own error vs "
               "fp64 (fp64x2)" if fp64x2 else ""))
    r["ok"] = not r["failures"]
    return r


def _type_failures(out, ref):
    """What is wrong with `out`'s type, shape, dtype or device against the reference output `ref`."""
    if not torch.is_tensor(out):
        return [f"returned {type(out).__name__}, expected a tensor"]
    bad = []
    if tuple(out.shape) != tuple(ref.shape):
        bad.append(f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        bad.append(f"dtype {out.dtype}, expected {ref.dtype}")
    if out.device != ref.device:
        bad.append(f"device {out.device}, expected {ref.device}")
    return bad


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
    return dict(ok=False, failures=[], dropin=None, variants={}, variants_not_run=[], ref_fp32_max_abs_err_fp64=None,
                ref_fp32_max_rel_err_fp64=None, ref_spread=None, weak_oracle=None, reference_oom=None,
                rows_checked=None, trials=[], backward=None)


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
    reference_oom, trials, backward). `args` holds trials, seed, rows, atol and rtol of the checked
    dtype, torch_dtype and backward (pass_settings()). Must run outside torch.inference_mode: the
    models are built in normal mode (parameters requiring grad, as after construction); the judged
    calls run under inference_mode, the grad-mode check (trial 0, every variant) and --backward under
    torch.enable_grad().
    """
    if torch.is_inference_mode_enabled():  # inference-tensor parameters would make the grad-mode call fail
        raise RuntimeError("check_shape must be called outside torch.inference_mode")
    res = new_correctness() if res is None else res
    models = _models_for_check(refmod, solmod, dims, device, args.torch_dtype, res)
    if models is None:
        return res
    ref, new = models
    default_variant = getattr(new, "variant", None)
    kept = variants_here(new, variants)
    res["variants_not_run"] = [v for v in variants if v not in kept]
    variants = kept
    if not variants:  # every asked-for variant is outside this model's own VARIANTS: nothing more to check
        res["ok"] = not res["failures"]
        return res
    for v in variants:
        res["variants"][v or "-"] = dict(ok=True, failures=[], last_variants=[], max_abs_err_fp64=None,
                                         max_rel_err_fp64=None, max_abs_diff_fp32=None, mismatches=0,
                                         grad_checked=False)
    if args.backward:
        res["backward"] = new_backward(variants, dims)
    judge = CallJudge(new, dims, args, device, fp64x2=_fp64x2_outputs(refmod, args.torch_dtype))
    spread = [math.inf, -math.inf]  # lowest and highest finite reference value over all trials
    for t in range(args.trials):
        tr = make_trial(refmod, ref, new, name, dims, shape_index, t, args, device, res, spread)
        for v in variants:
            for grad in ([False, True] if t == 0 else [False]):  # grad mode: trial 0, every variant
                _record_call(res["variants"][v or "-"], tr, v, grad, judge.call(tr, v, grad))
        if res["backward"] is not None and not res["backward"]["skipped"]:
            check_backward(refmod, ref, new, variants, tr, args, device, res["backward"])
        if default_variant is not None:
            new.variant = default_variant
        res["trials"].append(tr.record)
        tr = None  # free before the next trial (the judge keeps only the last output)
        _free(device)
    judge.prev = None
    _judge_oracle(res, spread, args.atol)
    for key, vr in res["variants"].items():
        res["failures"] += [f"variant {key}: {m}" for m in vr["failures"]]
    if res["backward"] is not None:
        res["failures"] += res["backward"]["failures"]
    res["ok"] = not res["failures"]
    return res


def variants_here(new, variants):
    """`variants` less those that the model's own VARIANTS leaves out (a solution may narrow VARIANTS on an
    instance to the variants that run for its dimensions); None (no variants declared) is kept."""
    here = getattr(new, "VARIANTS", None)
    if here is None:
        return list(variants)
    here = tuple(here)
    return [v for v in variants if v is None or v in here]


def _models_for_check(refmod, solmod, dims, device, dtype, res):
    """The drop-in check, then (ref, new) from build_pair(); None when ModelNew cannot be built or
    loaded (the failure recorded in `res` and printed)."""
    init = refmod.init_inputs_for(dims)
    try:
        ok, detail = dropin_check(refmod.Model, solmod.ModelNew, init)
    except SolutionError as e:
        return _fail_construction(res, str(e))
    res["dropin"] = dict(ok=ok, detail=detail)
    log(f"  drop-in (same seed -> same parameters): {'yes' if ok else 'NO'}: {detail}")
    if not ok:
        res["failures"].append(f"not a KernelBench drop-in: {detail}")
    try:
        return build_pair(refmod, solmod, dims, device, dtype)
    except SolutionError as e:
        return _fail_construction(res, str(e))


def _fail_construction(res, msg):
    res["failures"].append(msg)
    log(f"  FAIL: {msg}")
    return None


def make_trial(refmod, ref, new, name, dims, shape_index, t, args, device, res, spread):
    """Trial t of one shape: parameters re-drawn in both models, fresh inputs and their clones, the
    reference's outputs (`ref32` in the checked dtype, `ref64`) and its error, recorded in `res`
    (ref_fp32_*_err_fp64) and `spread`. Returns a namespace: t, seed, desc, inputs, clones, ref32,
    ref64, rows (sampled rows i or None), ref_err, record (the trial's JSON dict)."""
    seed = args.seed * 1_000_003 + shape_index * 1009 + t
    dist = DISTRIBUTIONS[t % len(DISTRIBUTIONS)]
    mask_kind = mask_kind_for(shape_index, t, args.trials)
    with torch.no_grad():
        redraw_parameters(ref, new, seed + 500_000)
        inputs = make_inputs(refmod, dims, dist, mask_kind, seed, device, args.torch_dtype)
        clones = [x.clone() for x in inputs]
    has_mask = "mask" in getattr(refmod, "INPUT_ROLES", ())
    record = dict(trial=t, seed=seed, distribution=dist, mask=mask_kind if has_mask else None, variants={})
    desc = f"trial {t} seed {seed} {dist}" + (f" mask={mask_kind}" if has_mask else "")
    ref32, ref64, rows = reference_outputs(refmod, ref, inputs, name, dims, t, seed, args, device, res)
    if not all(torch.equal(x, c) for x, c in zip(inputs, clones)):
        raise RuntimeError("the reference changed its inputs; the harness cannot judge this pair")
    d_ref = (ref32.double() - ref64).abs()
    ref_err = _fmax(d_ref)
    res["ref_fp32_max_abs_err_fp64"] = _max_none(res["ref_fp32_max_abs_err_fp64"], ref_err)
    res["ref_fp32_max_rel_err_fp64"] = _max_none(
        res["ref_fp32_max_rel_err_fp64"], _fmax(d_ref / (ref64.abs() + args.atol)))
    fin = ref32[torch.isfinite(ref32)]
    if fin.numel():
        spread[0], spread[1] = min(spread[0], float(fin.min())), max(spread[1], float(fin.max()))
    return types.SimpleNamespace(t=t, seed=seed, desc=desc, inputs=inputs, clones=clones, ref32=ref32,
                                 ref64=ref64, rows=rows, ref_err=ref_err, record=record, dtype=args.dtype)


def reference_outputs(refmod, ref, inputs, name, dims, t, seed, args, device, res):
    """(ref32, ref64, rows) under inference_mode: the reference's output in the checked dtype and in
    float64 (a deep copy upcast, inputs upcast). For shapes flagged reference_may_oom: on `rows`, the
    sampled rows i (0 and N-1 always), through refmod.forward_rows; the full reference is tried
    once (trial 0, CUDA) and an OOM recorded as expected. rows is None for other shapes."""
    with torch.inference_mode():
        if not dims.get("reference_may_oom"):
            ref32 = ref(*inputs)
            ref64m = copy.deepcopy(ref).double()
            return ref32, ref64m(*[_to64(x) for x in inputs]), None
        if t == 0 and device.type == "cuda":
            _probe_full_reference(ref, inputs, name, device, res, args.dtype)
        n_rows = int(dims["N"])
        g = torch.Generator().manual_seed(seed + 7)
        pick = torch.randperm(n_rows, generator=g)[: max(0, args.rows - 2)].tolist()
        rows_list = sorted(set(pick + [0, n_rows - 1]))
        rows = torch.tensor(rows_list, device=device)
        res["rows_checked"] = len(rows_list)
        ref32 = refmod.forward_rows(ref, *inputs, rows)
        ref64m = copy.deepcopy(ref).double()
        return ref32, refmod.forward_rows(ref64m, *[_to64(x) for x in inputs], rows), rows_list


def _probe_full_reference(ref, inputs, name, device, res, dtype_name):
    """Run the full reference once on a reference_may_oom shape: res["reference_oom"] True on OOM."""
    log(f"  {name}: trying the full {dtype_name} reference (flagged reference_may_oom) ...")
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


class CallJudge:
    """Judges ModelNew's calls at one shape: each call with every check (compare() against the
    trial's references, the forced variant, inputs and parameters unchanged), and output aliasing
    across calls: the previous output, still held with a clone of its judged part, must not change
    and must not share storage with the next one."""

    def __init__(self, new, dims, args, device, fp64x2=False):
        self.new, self.dims, self.args, self.device, self.fp64x2 = new, dims, args, device, fp64x2
        self.prev = None  # (last output, clone of its judged part, its rows, where it came from)

    def sample(self, out, rows):
        """The part of an output that is judged: all of it, or the sampled rows i."""
        if rows is not None and out.dim() > 1 and out.shape[1] == self.dims["N"]:
            return out[:, rows]
        return out

    def call(self, tr, v, grad):
        """One ModelNew call on trial `tr` (inference_mode, or enable_grad outside it) with every
        check; returns a compare() dict with last_variant (call_raised when the call raised)."""
        if v is not None:
            self.new.variant = v
        mode = "under torch.enable_grad(): " if grad else ""
        with torch.no_grad():
            before = {k: x.detach().clone() for k, x in self.new.state_dict().items()}
        try:
            out = self._invoke(tr.inputs, grad)
        except Exception as e:
            return dict(ok=False, failures=[f"{mode}ModelNew raised {_short_exc(e)}"], call_raised=True,
                        max_abs_err_fp64=None, max_rel_err_fp64=None, max_abs_diff_fp32=None,
                        mismatches=None, last_variant=None)
        with torch.no_grad():
            if torch.is_tensor(out):
                out = out.detach()
            last = getattr(self.new, "last_variant", None)
            c = compare(self.sample(out, tr.rows) if torch.is_tensor(out) else out, tr.ref32, tr.ref64,
                        self.args.atol, self.args.rtol, index_offset=tr.rows, fp64x2=self.fp64x2)
            c["failures"] = [mode + m for m in c["failures"]]
            if v is not None and v != "auto" and last is not None and last != v:
                c["failures"].append(f"{mode}asked for variant {v}, last_variant says {last}")
            c["failures"] += [mode + m for m in side_effects(self.new, tr.inputs, tr.clones, before)]
            c["failures"] += [mode + m for m in self._aliasing(out)]
            self.prev = None
            if torch.is_tensor(out):
                self.prev = (out, self.sample(out, tr.rows).clone(), tr.rows,
                             f"{tr.desc}, variant {v or '-'}{' with grad' if grad else ''}")
        c["ok"] = not c["failures"]
        c["last_variant"] = last
        return c

    def _invoke(self, inputs, grad):
        if grad:
            with torch.enable_grad():
                out = self.new(*inputs)
        else:
            with torch.inference_mode():
                out = self.new(*inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return out

    def _aliasing(self, out):
        """Failures when `out` aliases the previous output (shared storage, or the previous changed)."""
        if self.prev is None:
            return []
        p_out, p_snap, p_rows, p_desc = self.prev
        if torch.is_tensor(out) and out.numel() and _shares_storage(out, p_out):
            return [f"ModelNew returned the storage of its previous output ({p_desc}), which "
                    "the caller still holds: outputs must not alias a buffer reused across calls"]
        if not _same_values(self.sample(p_out, p_rows), p_snap):
            return [f"this call changed ModelNew's previous output ({p_desc}): outputs must not "
                    "alias a buffer that a later call overwrites"]
        return []


def side_effects(new, inputs, clones, before):
    """Failures for inputs changed in place (restored from their clones for the next call) and for
    ModelNew parameters/buffers that differ from `before` (a state_dict clone)."""
    bad = []
    changed = [i for i, (x, cl) in enumerate(zip(inputs, clones)) if not torch.equal(x.detach(), cl)]
    if changed:
        bad.append(f"ModelNew changed its input(s) {changed} in place")
        with torch.no_grad():
            for i in changed:
                inputs[i].copy_(clones[i])  # restore for the next call
    after = new.state_dict()
    moved = [k for k, x in before.items() if k not in after or not torch.equal(after[k], x)]
    if moved:
        bad.append(f"ModelNew changed its parameters/buffers {moved[:4]} during forward")
    return bad


def _record_call(vr, tr, v, grad, c):
    """Merge one judged call `c` into its variant's results `vr` and the trial record; print it."""
    key = v or "-"
    last = c.get("last_variant")
    if last is not None and last not in vr["last_variants"]:
        vr["last_variants"].append(last)
    if grad:
        vr["grad_checked"] = True
        tr.record.setdefault("grad_variants", {})[key] = c
    else:
        tr.record["variants"][key] = c
    for f in ("max_abs_err_fp64", "max_rel_err_fp64", "max_abs_diff_fp32"):
        vr[f] = _max_none(vr[f], c[f])
    vr["mismatches"] += c["mismatches"] or 0
    if not c["ok"]:
        vr["ok"] = False
        vr["failures"] += [f"{tr.desc}: {m}" for m in c["failures"]]
    tag = f"[{key}{'->' + last if last and last != key else ''}]" + (" grad" if grad else "")
    status = "ok  " if c["ok"] else "FAIL"
    err = (f"max|d| vs fp64 {_e(c['max_abs_err_fp64'])} ({tr.dtype} ref {_e(tr.ref_err)})"
           if c["max_abs_err_fp64"] is not None else "")
    if c.get("held") == "fp64x2":
        err += f"; held: fp64x2 ({c['mismatches']} elements outside allclose)"
    log(f"  {status} {tag} {tr.desc}: {err}")
    for m in c["failures"]:
        log(f"       {m}")


def _judge_oracle(res, spread, atol):
    """Record the reference's output spread over all trials; below 10 * atol it is a failure (a
    constant output could pass)."""
    lo, hi = spread
    res["ref_spread"] = hi - lo if hi >= lo else 0.0
    res["weak_oracle"] = res["ref_spread"] < 10 * atol
    if res["weak_oracle"]:
        res["failures"].append(
            f"oracle too weak to judge: reference output spread {res['ref_spread']:.3g} over all trials is below "
            f"10*atol = {10 * atol:g} (a constant output could pass)")
        log(f"  FAIL {res['failures'][-1]}")


# ---------------------------------------------------------------------------------------------
# Gradients (--backward)
# ---------------------------------------------------------------------------------------------
def new_backward(variants, dims):
    """The empty --backward dict of one shape (filled by check_backward; see the module docstring)."""
    skipped = ("flagged reference_may_oom: the full reference does not fit, gradients not checked"
               if dims.get("reference_may_oom") else None)
    return dict(ok=skipped is None, failures=[], skipped=skipped,
                variants={v or "-": dict(ok=True, failures=[], grads={}) for v in variants})


def forward_arg_names(refmod, n):
    """Names of the reference forward's n arguments (input0, ... where the signature does not say)."""
    try:
        names = list(inspect.signature(refmod.Model.forward).parameters)[1:]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else f"input{i}" for i in range(n)]


def grad_leaves(inputs, roles):
    """The inputs of a training step: leaf copies requiring grad of the floating inputs of role "x",
    the others (masks) as they are."""
    return [x.detach().clone().requires_grad_(True) if r != "mask" and x.is_floating_point() else x
            for x, r in zip(inputs, roles)]


def model_grads(model, xs, names, g):
    """Gradients of (model(*xs) * g).sum() by autograd, as (out, {name: grad or None}, failures), for
    the inputs xs that require grad (grad_leaves()) and every parameter.

    Failures (the solution's): a parameter not requiring grad, an output that is no tensor or does
    not require grad; an exception in forward or backward propagates."""
    wrt = {names[i]: x for i, x in enumerate(xs) if x.requires_grad}
    params = dict(model.named_parameters())
    frozen = [n for n, p in params.items() if not p.requires_grad]
    failures = [f"parameter(s) {frozen[:4]} do not require grad: no gradient"] if frozen else []
    wrt.update({n: p for n, p in params.items() if p.requires_grad})
    with torch.enable_grad():
        out = model(*xs)
        if not torch.is_tensor(out) or not out.requires_grad:
            what = "requires no grad" if torch.is_tensor(out) else f"is a {type(out).__name__}"
            return out, {}, failures + [f"the output {what}: no backward through ModelNew"]
        grads = torch.autograd.grad((out * g).sum(), list(wrt.values()), allow_unused=True)
    return out, dict(zip(wrt, grads)), failures


def compare_grad(got, ref, ref64, atol, rtol):
    """Judge one gradient against the reference's in the checked dtype and in fp64.

    ok when allclose(got, ref, atol, rtol) (evaluated in fp64) or max|got - ref64| <= 2 x
    max|ref - ref64|; held says which: "allclose", "fp64x2", "both" (None when neither)."""
    r = dict(ok=False, failures=[], held=None, max_abs_err_fp64=None,
             ref_max_abs_err_fp64=_fmax((ref.double() - ref64.double()).abs()), max_abs_diff_ref=None)
    if got is None:
        r["failures"].append("no gradient (None: not connected to the output)")
        return r
    r["failures"] = _type_failures(got, ref)
    if r["failures"]:
        return r
    a, b, e = got.double(), ref.double(), ref64.double()
    bad_nonfinite = int((~torch.isfinite(a) & torch.isfinite(b)).sum())
    if bad_nonfinite:
        r["failures"].append(f"{bad_nonfinite} NaN/Inf values where the reference's gradient is finite")
    d = (a - b).abs()
    r["max_abs_diff_ref"] = _fmax(d)
    r["max_abs_err_fp64"] = _fmax((a - e).abs())
    n_bad = int((~(d <= atol + rtol * b.abs())).sum())
    by_tol = n_bad == 0
    by_fp64 = r["max_abs_err_fp64"] <= GRAD_FP64_FACTOR * r["ref_max_abs_err_fp64"]
    r["held"] = "both" if by_tol and by_fp64 else "allclose" if by_tol else "fp64x2" if by_fp64 else None
    if r["held"] is None:
        r["failures"].append(
            f"not allclose(atol={atol:g}, rtol={rtol:g}) to the reference's gradient ({n_bad} of {a.numel()} "
            f"elements, max |d| {r['max_abs_diff_ref']:.3g}), and its max error vs fp64 "
            f"{r['max_abs_err_fp64']:.3g} > {GRAD_FP64_FACTOR:g} x the reference's {r['ref_max_abs_err_fp64']:.3g}")
    r["ok"] = not r["failures"]
    return r


def check_backward(refmod, ref, new, variants, tr, args, device, bw):
    """--backward on trial `tr`: every variant's gradients against the reference's (checked dtype and
    fp64), merged into `bw` (new_backward()) and tr.record["backward"]; printed."""
    roles = input_roles(refmod, len(tr.inputs))
    names = forward_arg_names(refmod, len(tr.inputs))
    gen = torch.Generator(device=device).manual_seed(tr.seed + 900_000)
    g = torch.randn(tuple(tr.ref32.shape), generator=gen, device=device).to(tr.ref32.dtype)
    _out, want, _f = model_grads(ref, grad_leaves(tr.inputs, roles), names, g)
    inputs64 = grad_leaves([_to64(x) for x in tr.inputs], roles)
    _out, want64, _f = model_grads(copy.deepcopy(ref).double(), inputs64, names, g.double())
    del _out, inputs64
    tr.record["backward"] = {}
    for v in variants:
        c = _solution_backward(new, v, tr, roles, names, g, want, want64, args, device)
        tr.record["backward"][v or "-"] = c
        _record_backward(bw, v, tr, c)


def _solution_backward(new, v, tr, roles, names, g, want, want64, args, device):
    """One variant's training step on trial `tr`, every gradient judged by compare_grad; returns
    {ok, failures, last_variant, grads {name: compare_grad dict}}."""
    if v is not None:
        new.variant = v
    with torch.no_grad():
        before = {k: x.detach().clone() for k, x in new.state_dict().items()}
    c = dict(ok=False, failures=[], last_variant=None, grads={})
    xs = grad_leaves(tr.inputs, roles)
    try:
        _out, got, c["failures"] = model_grads(new, xs, names, g)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        c["failures"].append(f"forward+backward raised {_short_exc(e)}")
        return c
    del _out
    c["last_variant"] = last = getattr(new, "last_variant", None)
    if v is not None and v != "auto" and last is not None and last != v:
        c["failures"].append(f"asked for variant {v}, last_variant says {last}")
    c["failures"] += [m.replace("during forward", "during forward+backward")
                      for m in side_effects(new, xs, tr.clones, before)]
    if got:
        for n, ref_grad in want.items():
            gr = compare_grad(got.get(n), ref_grad, want64[n], args.atol, args.rtol)
            c["grads"][n] = gr
            c["failures"] += [f"gradient of {n}: {m}" for m in gr["failures"]]
    c["ok"] = not c["failures"]
    return c


def _record_backward(bw, v, tr, c):
    """Merge one variant's backward result `c` into `bw` (worst errors and held counts per gradient)."""
    key = v or "-"
    vb = bw["variants"][key]
    for n, gr in c["grads"].items():
        agg = vb["grads"].setdefault(n, dict(held={}, max_abs_err_fp64=None, ref_max_abs_err_fp64=None,
                                             max_abs_diff_ref=None))
        label = gr["held"] or "neither"
        agg["held"][label] = agg["held"].get(label, 0) + 1
        for f in ("max_abs_err_fp64", "ref_max_abs_err_fp64", "max_abs_diff_ref"):
            agg[f] = _max_none(agg[f], gr[f])
    if not c["ok"]:
        vb["ok"] = bw["ok"] = False
        vb["failures"] += [f"{tr.desc}: {m}" for m in c["failures"]]
        bw["failures"] += [f"backward, variant {key}: {tr.desc}: {m}" for m in c["failures"]]
    held = {}
    for gr in c["grads"].values():
        held[gr["held"] or "neither"] = held.get(gr["held"] or "neither", 0) + 1
    worst = max(c["grads"].values(), key=lambda gr: gr["max_abs_err_fp64"] or 0.0, default=None)
    err = (f"{len(c['grads'])} gradients; worst vs fp64 {_e(worst['max_abs_err_fp64'])} "
           f"(ref {_e(worst['ref_max_abs_err_fp64'])}); held: "
           + ", ".join(f"{k} {n}" for k, n in sorted(held.items())) if worst else "")
    last = c.get("last_variant")
    tag = f"[{key}{'->' + last if last and last != key else ''}] backward"
    log(f"  {'ok  ' if c['ok'] else 'FAIL'} {tag} {tr.desc}: {err}")
    for m in c["failures"]:
        log(f"       {m}")


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
        """GPU-only time (ms per replay) of one call (a forward, or a training step) captured in a CUDA graph, or
        raises."""
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

    def kb_times(self, fn, args, n):
        """kb_time_cuda_event with n trials: on CUDA with KernelBench's events, synchronize, 256 MiB L2
        clear and empty_cache, under torch.cuda.device; on the CPU with WallEvent and this Timer's flush."""
        if not self.cuda:
            return kb_time_cuda_event(fn, args, n, event=WallEvent, sync=self.sync, clear_l2=self.flush,
                                      empty_cache=lambda: None)
        with torch.cuda.device(self.device):
            return kb_time_cuda_event(fn, args, n, event=lambda: torch.cuda.Event(enable_timing=True),
                                      sync=self.sync, clear_l2=lambda: kb_clear_l2_cache(self.device),
                                      empty_cache=torch.cuda.empty_cache)

    def host_times(self, fn, args, n):
        return host_times(fn, args, n, self.sync)


# KernelBench's timing, reproduced from ScalingIntelligence/KernelBench at commit 423217d (2026-03-05):
# src/kernelbench/timing.py time_execution_with_cuda_event (the default timing_method "cuda_event") and
# clear_l2_cache; src/kernelbench/eval.py eval_kernel_against_ref, which times ModelNew and, for its speedup
# check, the reference Model with that function outside torch.no_grad (grad mode on, parameters requiring
# grad), on one input set from get_inputs() cast with .to(dtype=precision).to(device). Its defaults: 3
# warm-up calls, the first trial discarded; its scripts (run_and_check.py, eval_from_generations.py) pass
# num_perf_trials=100; the runtime is the mean of the trials and the speedup the reference's mean over
# ModelNew's.
KB_WARMUP = 3
KB_DISCARD_FIRST = 1
KB_TRIALS = 100
KB_L2_CLEAR_SHAPE = (32, 1024, 1024)  # int64: 256 MiB, whatever the GPU's L2 size


def kb_clear_l2_cache(device):
    """KernelBench's clear_l2_cache: allocate a 256 MiB int64 tensor, fill it with 42, drop it."""
    dummy = torch.empty(KB_L2_CLEAR_SHAPE, dtype=torch.int64, device=device)
    dummy.fill_(42)
    del dummy


def kb_time_cuda_event(fn, args, num_trials, *, event, sync, clear_l2, empty_cache, num_warmup=KB_WARMUP,
                       discard_first=KB_DISCARD_FIRST):
    """KernelBench's time_execution_with_cuda_event loop: times (ms) of num_trials calls fn(*args).

    num_warmup calls, each followed by sync(); empty_cache(); then num_trials + discard_first trials,
    each: sync(), two fresh events from event(), clear_l2(), start.record(), fn(*args) (its output kept
    until the next trial's call returns, as KernelBench's `_ = kernel_fn(*args)`), end.record(), sync(),
    start.elapsed_time(end); the first discard_first trials are dropped. On CUDA: event is
    torch.cuda.Event(enable_timing=True), sync torch.cuda.synchronize, clear_l2 kb_clear_l2_cache,
    empty_cache torch.cuda.empty_cache (Timer.kb_times); tests pass stand-ins.
    """
    for _ in range(num_warmup):
        fn(*args)
        sync()
    empty_cache()
    elapsed = []
    out = None
    for trial in range(num_trials + discard_first):
        sync()
        start, end = event(), event()
        clear_l2()
        start.record()
        out = fn(*args)
        end.record()
        sync()
        ms = start.elapsed_time(end)
        if trial >= discard_first:
            elapsed.append(ms)
    del out
    return elapsed


def host_times(fn, args, n, sync):
    """Host time (ms) of n calls fn(*args): time.perf_counter just before the call and just after it
    returns, nothing synchronised in between (launch, Python and autograd overhead; on CUDA not the
    kernels' run time unless the call waits for them). sync() before each call starts it on an idle
    device; the previous output is released before the clock starts."""
    ms = []
    out = None
    for _ in range(n):
        out = None
        sync()
        t0 = time.perf_counter()
        out = fn(*args)
        ms.append((time.perf_counter() - t0) * 1e3)
    del out
    sync()
    return ms


class WallEvent:
    """A CPU stand-in for torch.cuda.Event(enable_timing=True): record() reads time.perf_counter();
    elapsed_time(end) is in ms. Used by --cpu-timing (numbers mean nothing there)."""

    def __init__(self):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def kb_stats(ms):
    """stats() plus the std and max KernelBench reports beside its mean (mean_ms is its runtime)."""
    a = np.asarray(ms, dtype=np.float64)
    return dict(stats(ms), std_ms=float(a.std()), max_ms=float(a.max()))


def time_candidate(timer, label, fn, input_sets, want_graph=True):
    """Per-call stats, CUDA-graph stats and peak memory of one callable; errors reported, not raised.
    Without want_graph (no CUDA), graph_error says so."""
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
    """Timing of ModelNew (each of time_variants), eager reference and torch.compile(reference) in the
    checked dtype, the forward under inference_mode; then ModelNew and the eager reference timed as
    KernelBench times them, in grad mode (_time_kb); with args.backward also a training step
    (res["train"]: time_training). Call outside inference_mode. Raises SolutionError when ModelNew
    cannot be built or loaded."""
    res = dict(new={}, eager=None, compile=None, compile_note=None, flops=None, min_bytes=None,
               floor_s=None, kb_note=KB_NOTE, failures=[])
    ref, new = build_pair(refmod, solmod, dims, device, args.torch_dtype)
    redraw_parameters(ref, new, args.seed + 99)
    sets = [make_inputs(refmod, dims, "normal", "random01", args.seed * 7919 + 31 * k + shape_index, device,
                        args.torch_dtype) for k in range(args.input_sets)]
    time_variants = _timed_variants(new, time_variants)
    with torch.inference_mode():
        _time_forward(res, ref, new, sets, name, args, timer, time_variants, do_compile, ref_oom)
    kb_set = kb_inputs(refmod, dims, args.seed * 7919 + 17 + shape_index, device, args.torch_dtype)
    _time_kb(res, ref, new, kb_set, timer, time_variants, ref_oom)
    del kb_set
    _roofline(res, refmod, dims, args)
    if args.backward:
        res["train"] = time_training(refmod, ref, new, sets, name, dims, args, timer, time_variants,
                                     do_compile, ref_oom)
        res["failures"] += res["train"]["failures"]
    del ref, new, sets
    _free(device)
    return res


def _timed_variants(new, time_variants):
    """time_variants, or by default what a fresh ModelNew selects, else VARIANTS[0], else none."""
    if time_variants is not None:
        return variants_here(new, time_variants)
    default_variant = getattr(new, "variant", None)
    declared = tuple(getattr(new, "VARIANTS", ()) or ())
    return [default_variant if default_variant is not None or not declared else declared[0]]


def _time_each_variant(res, new, variants, what, fn, sets, timer, **kw):
    """Time fn on `sets` with new.variant set to each of `variants` in turn (None: as constructed) into
    res["new"][name]; `what` (" forward+backward" or "") names the timed step in labels and failures.
    new.variant is restored afterwards."""
    default_variant = getattr(new, "variant", None)
    for v in variants:
        key = v or "-"
        if v is not None:
            new.variant = v
        r = time_candidate(timer, f"ModelNew [{key}]{what}", fn, sets, **kw)
        r["last_variant"] = getattr(new, "last_variant", None)
        res["new"][key] = r
        if r["error"]:
            res["failures"].append(f"ModelNew [{key}] failed while timing{what}: {r['error']}")
    if default_variant is not None:
        new.variant = default_variant


def _time_forward(res, ref, new, sets, name, args, timer, time_variants, do_compile, ref_oom):
    """Forward timing into `res`: ModelNew per variant, the eager reference, torch.compile(reference)."""
    cuda = timer.cuda
    _time_each_variant(res, new, time_variants, "", lambda *a: new(*a), sets, timer, want_graph=cuda)
    if ref_oom:
        res["eager"] = dict(per_call=None, graph=None, graph_error="reference OOM", peak_bytes=None,
                            error="out of memory (seen in correctness)", oom=True)
    else:
        res["eager"] = time_candidate(timer, "eager reference", ref, sets, want_graph=cuda)
    if do_compile and not ref_oom:
        res["compile"] = _time_compiled(ref, lambda m: m, sets, name, timer, "torch.compile(reference)")
    else:
        res["compile_note"] = _compile_note(args, ref_oom)


KB_NOTE = ("KernelBench-style: grad mode on, parameters requiring grad, one input set drawn like get_inputs() "
           "(normal, all-ones mask), time_execution_with_cuda_event of KernelBench 423217d (3 warm-up calls, "
           "first trial discarded, 256 MiB L2 clear per trial, runtime = mean); host = perf_counter around the "
           "call, median; torch.compile(reference) not timed this way (KernelBench's baseline times it under "
           "no_grad, and a grad-mode graph would be a second compile)")


def kb_inputs(refmod, dims, seed, device, dtype):
    """One input set as KernelBench's get_inputs() draws it (standard normal activations, all-ones
    masks), every tensor then cast with .to(dtype=dtype).to(device) as its _process_input_tensor does
    (masks included, in every dtype); no tensor requires grad."""
    return [x.to(dtype=dtype).to(device=device) for x in make_inputs(refmod, dims, "normal", "ones", seed, device)]


def kb_candidate(timer, label, fn, args, r, trials_from=None):
    """KernelBench-style time (kb: kb_stats of Timer.kb_times) and host time per call (host: stats of
    Timer.host_times) of fn(*args) into the T dict r, run in grad mode whatever the caller's mode;
    kb_error says why they are missing. The trial count is timer.n_samples() of the per-call median of
    `trials_from` (a T dict) when there is one, at most KB_TRIALS: --samples (100, KernelBench's
    scripts' count) for calls under 10 ms."""
    r.update(kb=None, host=None, kb_error=None, kb_oom=False)
    per_call = (trials_from or {}).get("per_call")
    n = min(KB_TRIALS, timer.n_samples(per_call["median_ms"] * 1e-3) if per_call else timer.samples)
    log(f"    timing {label} KernelBench-style (grad mode) ...")
    try:
        with torch.enable_grad():
            r["kb"] = kb_stats(timer.kb_times(fn, args, n))
            r["host"] = stats(timer.host_times(fn, args, n))
    except Exception as e:
        r["kb_error"] = _short_exc(e)
        r["kb_oom"] = _is_oom(e)
        log(f"    {label} KernelBench-style: {'out of memory' if r['kb_oom'] else 'error'}: {r['kb_error'][:200]}")
    _free(timer.device)  # after the except block, so a traceback no longer pins its tensors
    return r


def _time_kb(res, ref, new, kb_set, timer, time_variants, ref_oom):
    """KernelBench-style forward timing (kb_candidate) of ModelNew per timed variant and of the eager
    reference, outside inference_mode with autograd on; kb_speedup_vs_eager per ModelNew entry. A
    ModelNew error here is a failure; new.variant is restored afterwards."""
    assert not torch.is_inference_mode_enabled(), "KernelBench-style timing runs outside inference_mode"
    default_variant = getattr(new, "variant", None)
    for v in time_variants:
        key = v or "-"
        r = res["new"].get(key)
        if r is None:
            continue
        if r.get("error"):
            r.update(kb=None, host=None, kb_error="not timed: the per-call timing failed", kb_oom=False)
            continue
        if v is not None:
            new.variant = v
        kb_candidate(timer, f"ModelNew [{key}]", lambda *a: new(*a), kb_set, r, trials_from=r)
        r["kb_last_variant"] = getattr(new, "last_variant", None)
        if r["kb_error"]:
            res["failures"].append(f"ModelNew [{key}] failed while timing KernelBench-style (grad mode): "
                                   f"{r['kb_error']}")
    if default_variant is not None:
        new.variant = default_variant
    eager = res["eager"]
    if ref_oom or eager.get("error"):
        eager.update(kb=None, host=None, kb_oom=bool(ref_oom),
                     kb_error="reference OOM" if ref_oom else "not timed: the per-call timing failed")
    else:
        kb_candidate(timer, "eager reference", ref, kb_set, eager, trials_from=eager)
    for r in res["new"].values():
        b, k = (eager or {}).get("kb"), r.get("kb")
        r["kb_speedup_vs_eager"] = b["mean_ms"] / k["mean_ms"] if b and k else None


def _compile_note(args, ref_oom):
    return "reference OOM" if ref_oom else (
        "skipped (--no-compile)" if args.no_compile else "skipped for this shape (default: non-awkward shapes only; --compile-all)")


def _time_compiled(ref, step, sets, name, timer, label):
    """torch.compile(ref) compiled by a first call of step(compiled), then timed (a T dict with
    compile_s, CUDA graph timing on CUDA), or a dict with the error."""
    log(f"    compiling torch.compile(reference) for {name} (20-60 s per shape on the GPU machine) ...")
    try:
        torch._dynamo.reset()
        compiled = torch.compile(ref, dynamic=False)
        fn = step(compiled)
        t0 = time.perf_counter()
        fn(*sets[0])
        timer.sync()
        log(f"    compiled in {time.perf_counter() - t0:.1f} s")
        r = time_candidate(timer, label, fn, sets, want_graph=timer.cuda)
        r["compile_s"] = time.perf_counter() - t0
        del compiled, fn
    except Exception as e:
        r = dict(per_call=None, graph=None, error=_short_exc(e), oom=_is_oom(e))
        log(f"    torch.compile failed: {r['error'][:200]}")
    with contextlib.suppress(Exception):
        torch._dynamo.reset()
    return r


def _roofline(res, refmod, dims, args):
    """The roofline floor of one forward and, per timed ModelNew variant, its multiple of the floor,
    achieved TFLOP/s and TB/s (per call and CUDA graph) and speedups over eager and compile."""
    fl, by = refmod.flops(dims), refmod.min_bytes(dims)
    res["flops"], res["min_bytes"] = int(fl), int(by)
    res["floor_s"] = max(fl / (args.peak_tflops * 1e12), by / (args.peak_tbs * 1e12))
    for r in res["new"].values():
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
    _speedups(res)


def _speedups(res):
    """speedup_vs_eager / speedup_vs_compile of each ModelNew entry of res["new"] (median per call)."""
    for r in res["new"].values():
        for base in ("eager", "compile"):
            b = res[base]
            r[f"speedup_vs_{base}"] = (b["per_call"]["median_ms"] / r["per_call"]["median_ms"]
                                       if r.get("per_call") and b and b.get("per_call") else None)


def train_step(model, g):
    """One training step as a callable: the gradients of (model(*xs) * g).sum() for the xs that require
    grad (grad_leaves()) and every parameter that does, by torch.autograd.grad (nothing accumulates)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(*xs):
        out = model(*xs)
        return torch.autograd.grad((out * g).sum(), [x for x in xs if x.requires_grad] + params)

    return step


def time_training(refmod, ref, new, sets, name, dims, args, timer, time_variants, do_compile, ref_oom):
    """Forward + backward timing (train_step) of ModelNew per variant, the eager reference and
    torch.compile(reference), and the peak memory of one step. Not for reference_may_oom shapes."""
    res = dict(new={}, eager=None, compile=None, compile_note=None, failures=[])
    if ref_oom or dims.get("reference_may_oom"):
        res["compile_note"] = "not timed: flagged reference_may_oom"
        return res
    tsets = [grad_leaves(s, input_roles(refmod, len(s))) for s in sets]
    with torch.no_grad():
        shape = tuple(ref(*sets[0]).shape)
    gen = torch.Generator(device=timer.device).manual_seed(args.seed + 77)
    g = torch.randn(shape, generator=gen, device=timer.device).to(args.torch_dtype)
    cuda = timer.cuda
    _time_each_variant(res, new, time_variants, " forward+backward", train_step(new, g), tsets, timer,
                       want_graph=cuda)
    res["eager"] = time_candidate(timer, "eager reference forward+backward", train_step(ref, g), tsets,
                                  want_graph=cuda)
    if do_compile:
        res["compile"] = _time_compiled(ref, lambda m: train_step(m, g), tsets, name, timer,
                                        "torch.compile(reference) forward+backward")
    else:
        res["compile_note"] = _compile_note(args, False)
    _speedups(res)
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


def estimate_need(refmod, dims, timing, input_sets=3, backward=False):
    """Rough device bytes the harness needs for one shape (bytes; an over-estimate by design).

    Inputs `in_b` (sizes from input_shapes_for, 4 bytes each), output `out_b` = min_bytes - in_b.
    Correctness: inputs, clones and fp64 copies; fp32 reference, ModelNew and fp64 outputs, the
    previous ModelNew output and its clone (aliasing check); twice the reference's peak_bytes (fp64).
    Shapes flagged reference_may_oom: inputs and ModelNew outputs only (the current and the previous
    one; the reference runs on sampled rows). Timing adds the rotated input sets and two outputs.
    --backward (not for reference_may_oom shapes) adds four reference peaks (the saved tensors of
    the fp32, fp64 and ModelNew graphs) and six inputs (leaf copies and gradients, fp64 ones too).
    """
    in_b = 4 * sum(math.prod(s) for s in refmod.input_shapes_for(dims))
    out_b = max(int(refmod.min_bytes(dims)) - in_b, 0)
    if dims.get("reference_may_oom"):
        need = 4 * in_b + 3 * out_b
    else:
        peak = refmod.peak_bytes(dims) if hasattr(refmod, "peak_bytes") else 4 * (in_b + out_b)
        need = 4 * in_b + 7 * out_b + 2 * peak
        if backward:
            need += 4 * peak + 6 * in_b
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
                             input_sets=args.input_sets, backward=getattr(args, "backward", False))
        reason = None
        if need > 0.9 * avail:
            reason = f"needs about {need / 2**30:.1f} GiB, over 90% of the {avail / 2**30:.1f} GiB free"
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


def _kb_ms(r):
    """KernelBench's runtime (mean of its trials, ms) of a T dict, for the table."""
    if r and r.get("kb"):
        return f"{r['kb']['mean_ms']:.4g}"
    return "OOM" if (r or {}).get("kb_oom") else "n/a"


def _host_us(r):
    """The median host time per call of a T dict in microseconds, for the table."""
    return f"{r['host']['median_ms'] * 1e3:.1f}" if r and r.get("host") else "n/a"


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def _mb(b, none="-"):
    return none if b is None else f"{b / 2**20:.0f}"


def _show_dtype(report):
    """Whether the tables and labels name the dtype: any dtype but the default fp32 was checked."""
    return ((report.get("settings") or {}).get("dtypes") or ["fp32"]) != ["fp32"]


def shape_label(report, s):
    """A shape entry's name, with its dtype in brackets when the run checks another than fp32."""
    return f"{s['name']} [{s.get('dtype', 'fp32')}]" if _show_dtype(report) else s["name"]


def _variant_label(key, lasts):
    """The table's variant column: the key, and what last_variant said ran when that differs."""
    shown = [x for x in lasts if x != key]
    return key if not shown else ("/".join(shown) if key == "-" else f"{key}->{'/'.join(shown)}")


def table_rows(report):
    """Rows (list of str lists) of the final table, one per (shape, checked variant); header first.

    result and err64 are the variant's own; the timing columns are filled for timed variants. A
    dtype column follows the shape when the run checks another dtype than fp32.
    """
    show = _show_dtype(report)
    rows = [["shape"] + (["dtype"] if show else []) + [
        "variant", "result", "err64 new/ref", "new ms", "graph ms", "eager ms", "compile ms",
        "vs eager", "vs compile", "KB ms new/ref", "KB x", "host us new/ref", "x floor", "peak MB new/ref"]]
    for s in report["shapes"]:
        lead = [s["name"]] + ([s.get("dtype", "fp32")] if show else [])
        if s.get("skip_reason"):
            rows.append(lead + ["-", "skipped"] + [""] * 12)
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
            for ran in ((r or {}).get("last_variant"), (r or {}).get("kb_last_variant")):
                if ran and ran not in lasts:
                    lasts.append(ran)
            ok = s.get("ok") if len(keys) == 1 else (v.get("ok", False) and not shape_fail
                                                      and not (r or {}).get("error"))
            row = lead + [_variant_label(key, lasts), "PASS" if ok else "FAIL",
                          f"{_e(v.get('max_abs_err_fp64'))}/{ref_err}"]
            if r is None:
                rows.append(row + ["-"] * 11)
                continue
            comp_ms = _ms(comp) if comp else ("skip" if tm.get("compile_note") else "n/a")
            rows.append(row + [_ms(r), _ms(r, "graph"), _ms(eager), comp_ms,
                               _x(r.get("speedup_vs_eager")), _x(r.get("speedup_vs_compile")),
                               f"{_kb_ms(r)}/{_kb_ms(eager)}", _x(r.get("kb_speedup_vs_eager")),
                               f"{_host_us(r)}/{_host_us(eager)}",
                               "-" if r.get("floor_multiple") is None else f"{r['floor_multiple']:.1f}",
                               f"{_mb(r.get('peak_bytes'))}/{_mb((eager or {}).get('peak_bytes'))}"])
    return rows


def train_table_rows(report):
    """Rows of the --backward table, one per (shape, checked variant); header first (None when no
    shape has --backward results). grads: the variant's gradient verdict; grad err64: the worst max
    abs error against fp64 over its gradients and trials (ModelNew / reference); held: how often
    each criterion held; then forward + backward times and the peak memory of one training step."""
    show = _show_dtype(report)
    rows = [["shape"] + (["dtype"] if show else []) + [
        "variant", "grads", "grad err64 new/ref", "held", "f+b ms new", "eager ms", "compile ms",
        "vs eager", "vs compile", "graph ms new/eager/compile", "step peak MB new/ref"]]
    for s in report["shapes"]:
        bw = (s.get("correctness") or {}).get("backward")
        if s.get("skip_reason") or not bw:
            continue
        lead = [s["name"]] + ([s.get("dtype", "fp32")] if show else [])
        if bw.get("skipped"):
            rows.append(lead + ["-", "skipped"] + [""] * 9)
            continue
        train = (s.get("timing") or {}).get("train") or {}
        news, eager, comp = train.get("new") or {}, train.get("eager"), train.get("compile")
        for key, vb in bw["variants"].items():
            grads = list(vb["grads"].values())
            worst = [max((x[f] for x in grads if x[f] is not None), default=None)
                     for f in ("max_abs_err_fp64", "ref_max_abs_err_fp64")]
            held = {}
            for x in grads:
                for label, n in x["held"].items():
                    held[label] = held.get(label, 0) + n
            r = news.get(key)
            lasts = list(((s.get("correctness") or {}).get("variants") or {}).get(key, {}).get("last_variants") or [])
            ok = vb["ok"] and not (r or {}).get("error")
            row = lead + [_variant_label(key, lasts), "PASS" if ok else "FAIL", f"{_e(worst[0])}/{_e(worst[1])}",
                          " ".join(f"{k}:{n}" for k, n in sorted(held.items())) or "-"]
            if r is None:
                rows.append(row + ["-"] * 7)
                continue
            comp_ms = _ms(comp) if comp else ("skip" if train.get("compile_note") else "n/a")
            graphs = "/".join([_ms(r, "graph"), _ms(eager, "graph"), _ms(comp, "graph") if comp else comp_ms])
            peaks = (r.get("peak_bytes"), (eager or {}).get("peak_bytes"))
            rows.append(row + [_ms(r), _ms(eager), comp_ms, _x(r.get("speedup_vs_eager")),
                               _x(r.get("speedup_vs_compile")), graphs,
                               "n/a" if peaks == (None, None) else f"{_mb(peaks[0])}/{_mb(peaks[1])}"])
    return rows if len(rows) > 1 else None


def format_table(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _shape_failures(s):
    """Every failure of one shape entry: correctness (forward and --backward), then timing."""
    return (list((s.get("correctness") or {}).get("failures") or [])
            + list((s.get("timing") or {}).get("failures") or []))


def print_summary(report):
    """The failures (first four per shape), the table (and the --backward one), the legend, the notes."""
    failed_shapes = [s for s in report["shapes"] if not s.get("ok") and not s.get("skip_reason")]
    if failed_shapes:
        log("\nFailures:")
        for s in failed_shapes:
            fs = _shape_failures(s)
            for f in fs[:4]:
                log(f"  {shape_label(report, s)}: {f[:300]}")
            if len(fs) > 4:
                log(f"  {shape_label(report, s)}: ... {len(fs) - 4} more (see above / --json)")
    log("\n" + format_table(table_rows(report)))
    log("err64 = max abs error vs the reference in float64 (ModelNew / "
        + ("the reference in the row's dtype" if _show_dtype(report) else "fp32 reference")
        + "); times are medians; x floor = ModelNew time / roofline floor; peak = one forward, inputs excluded")
    if any((s.get("timing") or {}).get("kb_note") for s in report["shapes"]):
        log("KB = the forward timed as KernelBench times it (grad mode on, parameters requiring grad, its cuda_event "
            "method): mean ms, KB x = eager mean / ModelNew mean; host us = median wall time of the call returning "
            "(grad mode, not synchronised)")
    train = train_table_rows(report)
    if train:
        log("\n" + format_table(train))
        log("--backward: grad err64 = worst max abs gradient error vs float64 (ModelNew / reference); held = "
            "criterion met per gradient and trial (allclose to the reference, fp64x2: error <= 2x the "
            "reference's, both); f+b = forward + backward, per call; graph = one step captured in a CUDA graph, "
            "median per replay (GPU time alone; n/a without CUDA or where capture failed); step peak = one training "
            "step")
    for n in dict.fromkeys(report["notes"]):
        log(f"note: {n}")


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
                       "construction or call), 4 no CUDA device. The module docstring (harness.py) describes "
                       "every check, --dtype, --backward and the JSON layout.")
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
    p.add_argument("--dtype", choices=tuple(DTYPES) + ("all",), default="fp32",
                   help="precision of the models and inputs (cast with .to(device, dtype), as KernelBench); "
                        "all: fp32, fp16, bf16 in turn (default fp32)")
    p.add_argument("--backward", action="store_true",
                   help="also check the gradients of (out * g).sum() for the inputs and every parameter "
                        "against the reference's autograd (and fp64), and time forward + backward")
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
    p.add_argument("--atol", type=float, default=None,
                   help="absolute tolerance, >= 0, for every dtype checked (default 1e-4 in fp32, 1e-2 in fp16/bf16)")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance, >= 0, for every dtype checked (default 1e-4 in fp32, 1e-2 in fp16/bf16)")
    p.add_argument("--peak-tflops", type=float, default=50.0, help="fp32 ceiling for the floor (default 50)")
    p.add_argument("--peak-tbs", type=float, default=4.0, help="memory ceiling in TB/s (default 4.0)")
    p.add_argument("--cpu-timing", action="store_true",
                   help="with --device cpu: run the timing code with perf_counter (tests the harness only)")
    return p


def dtypes_of(args):
    """The dtype names a run checks, in order: --dtype, or all three for --dtype all."""
    return list(DTYPES) if args.dtype == "all" else [args.dtype]


def pass_settings(args, dtype_name):
    """The options of one dtype's pass: a copy of `args` with dtype, torch_dtype, and atol / rtol
    resolved (--atol / --rtol when given, else DEFAULT_TOL of the dtype)."""
    cfg = argparse.Namespace(**vars(args))
    cfg.dtype, cfg.torch_dtype = dtype_name, DTYPES[dtype_name]
    cfg.atol = DEFAULT_TOL[dtype_name] if args.atol is None else args.atol
    cfg.rtol = DEFAULT_TOL[dtype_name] if args.rtol is None else args.rtol
    return cfg


def _set_precision():
    """TF32 off everywhere (the fp32 pass criterion needs it; fp16/bf16 products are not affected)."""
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


class _Stop(Exception):
    """Ends a run before or between its steps with an exit code and the verdict line."""

    def __init__(self, code, verdict):
        super().__init__(verdict)
        self.code, self.verdict = code, verdict


def main(argv=None):
    """Run the harness; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    report = dict(harness_version=1, command=["harness.py"] + list(sys.argv[1:] if argv is None else argv),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  host=socket.gethostname(), python=platform.python_version(), torch=torch.__version__,
                  torch_cuda=torch.version.cuda, solution=None, reference=None, device=None,
                  settings=None, build=None, shapes=[], notes=[], exit_code=None, verdict=None)
    try:
        code, verdict = run(args, report)
    except _Stop as stop:
        code, verdict = stop.code, stop.verdict
    report["exit_code"], report["verdict"] = code, verdict
    log(verdict)
    _write_json(args.json, report)
    return code


def run(args, report):
    """The steps of a run in order: options, files, build, variants, device, then every dtype and
    shape, the summary. Returns (exit code, verdict); raises _Stop to end early."""
    check_options(args, report)
    sol_path, ref_path = locate_files(args, report)
    have_cuda = torch.cuda.is_available()
    default_build_env()  # without a GPU, load_inline still builds for sm_90
    _set_precision()
    refmod = load_module(ref_path)
    check_shape_options(args, refmod)  # before the (slow) build
    solmod, exts = build_solution(sol_path, report)
    solmod = judged_solution(refmod, solmod, report)
    variants = select_variants(solmod.ModelNew, args)  # before the device check: usage errors anywhere
    device, timing = select_device(args, have_cuda, exts, sol_path, report)
    report["settings"] = run_settings(args, variants, timing)
    try:
        shapes = select_shapes(refmod, args, device)
    except ValueError as e:
        raise _Stop(EXIT_USAGE, f"usage: {e}") from None
    timer = Timer(device, args.samples) if timing else None
    if timer is not None and timer.cuda:
        log(f"L2 {timer.l2_bytes / 2**20:.0f} MiB; flush buffer {timer.flush_bytes / 2**20:.0f} MiB")
    ctx = types.SimpleNamespace(refmod=refmod, solmod=solmod, device=device, variants=variants, timer=timer,
                                timing=timing, report=report, harness_errors=[])
    for dtype_name in dtypes_of(args):
        cfg = pass_settings(args, dtype_name)
        for si, (name, dims, skip) in enumerate(shapes):
            run_shape(ctx, cfg, si, name, dims, skip)
    if timing and not args.no_compile and not args.compile_all:
        report["notes"].append("torch.compile ran only for shapes not named awkward* nor flagged reference_may_oom; "
                               "--compile-all for all")
    print_summary(report)
    return verdict(report, ctx.harness_errors)


def check_options(args, report):
    """Usage errors in the options (before any file is read); notes on weak settings."""
    if args.json:
        bad = check_json_path(args.json)
        if bad:
            args.json = None  # nothing can be written there
            raise _Stop(EXIT_USAGE, f"usage: {bad}")
    if args.trials < 1 or args.samples < 1 or args.input_sets < 1 or args.rows < 2:
        raise _Stop(EXIT_USAGE, "usage: --trials, --samples, --input-sets must be >= 1 and --rows >= 2")
    atol = DEFAULT_TOL["fp32"] if args.atol is None else args.atol
    rtol = DEFAULT_TOL["fp32"] if args.rtol is None else args.rtol
    if not (atol >= 0 and rtol >= 0 and math.isfinite(atol) and math.isfinite(rtol)):
        raise _Stop(EXIT_USAGE, f"usage: --atol and --rtol must be finite and >= 0 (got {atol:g}, {rtol:g})")
    if not (args.peak_tflops > 0 and args.peak_tbs > 0):
        raise _Stop(EXIT_USAGE, "usage: --peak-tflops and --peak-tbs must be > 0")
    if args.trials < len(DISTRIBUTIONS):
        report["notes"].append(f"only {args.trials} trials: not every input distribution is tried "
                               f"(the default is {len(DISTRIBUTIONS)}, one per distribution)")


def locate_files(args, report):
    """(solution path, reference path), both existing files (usage error or exit 2 otherwise)."""
    try:
        sol_path, ref_path = resolve_target(args.target, args.ref)
    except ValueError as e:
        raise _Stop(EXIT_USAGE, f"usage: {e}") from None
    report["solution"], report["reference"] = sol_path, ref_path
    for p in (sol_path, ref_path):
        if not os.path.isfile(p):
            raise _Stop(EXIT_USAGE if p == ref_path else EXIT_BUILD, f"no such file: {p}")
    return sol_path, ref_path


def check_shape_options(args, refmod):
    """--shapes names and --shape texts against the reference: usage errors, said before the build."""
    try:
        names = [n.strip() for n in (args.shapes or "").split(",") if n.strip()]
        for n in names:
            if n not in refmod.SHAPES:
                raise ValueError(f"unknown shape {n!r}; the reference has {', '.join(refmod.SHAPES)}")
        for i, text in enumerate(args.shape or []):
            parse_custom_shape(text, i, refmod)
    except ValueError as e:
        raise _Stop(EXIT_USAGE, f"usage: {e}") from None


def build_solution(sol_path, report):
    """Import the solution (building its extensions); (module, names of the extensions built).
    Exit 2 when the import raises (SystemExit too) or the file defines no class ModelNew."""
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
        raise _Stop(EXIT_BUILD, f"BUILD FAILED: importing {sol_path} raised {_short_exc(e)}") from None
    exts = sorted(set(calls) | set(_extension_modules(solmod)))
    report["build"] = dict(ok=True, seconds=time.perf_counter() - t0, extensions=exts)
    log(f"built in {report['build']['seconds']:.1f} s" + (f" (extensions: {', '.join(exts)})" if exts else
                                                          " (pure PyTorch: no extension built)"))
    if not isinstance(getattr(solmod, "ModelNew", None), type):
        raise _Stop(EXIT_BUILD, f"BUILD FAILED: {sol_path} defines no class ModelNew")
    return solmod, exts


def judged_solution(refmod, solmod, report):
    """The solution as the checks see it: solmod itself, or, where the reference declares FAMILY (a str)
    and solmod's FAMILIES maps it to a class, a namespace whose ModelNew is that class (noted in the
    report). A FAMILY the file does not map leaves ModelNew judged."""
    fam, fams = getattr(refmod, "FAMILY", None), getattr(solmod, "FAMILIES", None)
    if not (isinstance(fam, str) and isinstance(fams, dict) and isinstance(fams.get(fam), type)):
        return solmod
    cls = fams[fam]
    note = f"the reference's FAMILY {fam!r}: judging the solution's FAMILIES[{fam!r}] = {cls.__name__} as ModelNew"
    log(note)
    report["notes"].append(note)
    return types.SimpleNamespace(ModelNew=cls, module=solmod)


def select_variants(NewModel, args):
    """The variants to check: ModelNew.VARIANTS for --variant all (the default), else the one named;
    [None] for a file that declares none. A name not in VARIANTS is a usage error."""
    declared = tuple(getattr(NewModel, "VARIANTS", ()) or ())
    if args.variant in (None, "all"):
        return list(declared) or [None]
    if not declared:
        raise _Stop(EXIT_USAGE, f"usage: --variant {args.variant}: ModelNew declares no VARIANTS")
    if args.variant not in declared:
        if args.variant in tuple(getattr(NewModel, "ALL_VARIANTS", ()) or ()):
            raise _Stop(EXIT_USAGE, f"usage: --variant {args.variant}: in ModelNew.ALL_VARIANTS but it does not run "
                                    f"on this machine (ModelNew.VARIANTS here: {declared})")
        raise _Stop(EXIT_USAGE, f"usage: --variant {args.variant}: not in ModelNew.VARIANTS {declared}")
    return [args.variant]


def select_device(args, have_cuda, exts, sol_path, report):
    """(device, timing): CUDA unless --device cpu, which pure-PyTorch files only may use (exit 4)."""
    want = args.device or "cuda"
    if want == "cuda" and not have_cuda:
        report["device"] = dict(type=None)
        raise _Stop(EXIT_NO_CUDA,
                    "NO CUDA DEVICE: the solution built/imported, but correctness on the GPU and timing need "
                    "a CUDA device. (Pure-PyTorch solutions can be checked with --device cpu --no-timing.)")
    if want == "cpu" and exts:
        report["device"] = dict(type="cpu")
        raise _Stop(EXIT_NO_CUDA,
                    f"NO CUDA DEVICE: {os.path.basename(sol_path)} builds a CUDA extension ({', '.join(exts)}); "
                    "its correctness and timing need a CUDA device (--device cpu is for pure-PyTorch files).")
    device = torch.device("cuda", torch.cuda.current_device()) if want == "cuda" else torch.device("cpu")
    report["device"] = _device_info(device)
    timing = not args.no_timing and (device.type == "cuda" or args.cpu_timing)
    if device.type == "cpu" and not args.no_timing and not args.cpu_timing:
        report["notes"].append("timing needs a CUDA device: skipped on the CPU")
    return device, timing


def run_settings(args, variants, timing):
    """The settings block of the JSON report (atol / rtol: those of the first dtype checked)."""
    passes = [pass_settings(args, d) for d in dtypes_of(args)]
    return dict(trials=args.trials, seed=args.seed, atol=passes[0].atol, rtol=passes[0].rtol, tf32=False,
                variants=[v or "-" for v in variants], samples=args.samples,
                input_sets=args.input_sets, timing=timing, compile=not args.no_compile,
                compile_all=args.compile_all, peak_tflops=args.peak_tflops, peak_tbs=args.peak_tbs,
                dtype=args.dtype, dtypes=[c.dtype for c in passes], backward=args.backward,
                tolerances={c.dtype: [c.atol, c.rtol] for c in passes})


def run_shape(ctx, cfg, si, name, dims, skip):
    """One shape in one dtype: correctness, then timing; appends its entry to the report."""
    report, device = ctx.report, ctx.device
    entry = dict(name=name, dtype=cfg.dtype, atol=cfg.atol, rtol=cfg.rtol, dims=dims, ok=False,
                 skip_reason=skip, correctness=None, timing=None)
    report["shapes"].append(entry)
    label = shape_label(report, entry)
    shown = ", ".join(f"{k}={v}" for k, v in dims.items() if k != "reference_may_oom")
    if skip:
        log(f"\n== {label} ({shown}): skipped: {skip}")
        report["notes"].append(f"{name} skipped: {skip}")
        return
    log(f"\n== {label} ({shown}) on {device}")
    c = entry["correctness"] = shape_correctness(ctx, cfg, si, name, dims, label)
    not_run = [v or "-" for v in c.get("variants_not_run") or ()]
    if not_run:
        report["notes"].append(f"{name}: variant{'s' if len(not_run) > 1 else ''} {', '.join(not_run)} not run "
                               "(outside ModelNew's VARIANTS for these dimensions)")
    if not c["variants"] and not_run and c["ok"]:
        entry["skip_reason"] = f"variant {', '.join(not_run)} does not run for these dimensions"
        log(f"== {label}: skipped: {entry['skip_reason']}")
        report["notes"].append(f"{name} skipped: {entry['skip_reason']}")
        return
    ok = c["ok"]
    if (c.get("backward") or {}).get("skipped"):
        report["notes"].append(f"--backward: {name} {c['backward']['skipped']}")
    if ctx.timing:
        tm = entry["timing"] = shape_timing(ctx, cfg, si, name, dims, label, bool(c.get("reference_oom")),
                                            c.get("variants_not_run") or ())
        if tm["failures"]:
            ok = False
            for f in tm["failures"]:
                log(f"  FAIL {f}")
        if device.type == "cpu":
            report["notes"].append("timing ran on the CPU (--cpu-timing): numbers mean nothing")
    entry["ok"] = ok
    log(f"== {label}: {'PASS' if ok else 'FAIL'}")
    _free(device)
    if ctx.timing and device.type == "cuda":
        with contextlib.suppress(Exception):
            torch._dynamo.reset()


def shape_correctness(ctx, cfg, si, name, dims, label):
    """check_shape for one shape; an exception in it is a harness error (recorded in ctx)."""
    c = new_correctness()
    try:  # outside inference_mode: check_shape runs the grad-mode check itself
        check_shape(ctx.refmod, ctx.solmod, name, dims, si, cfg, ctx.device, ctx.variants, res=c)
    except Exception as e:
        c["ok"] = False
        for key, vr in c["variants"].items():  # the solution's failures seen before the error
            c["failures"] += [f"variant {key}: {m}" for m in vr["failures"]]
        c["failures"] += (c.get("backward") or {}).get("failures") or []
        c["failures"].append(f"harness error: {_short_exc(e)}")
        ctx.harness_errors.append(f"{label}: {_short_exc(e)}")
        log(traceback.format_exc().rstrip())
    return c


def shape_timing(ctx, cfg, si, name, dims, label, ref_oom, not_run=()):
    """time_shape for one shape; the solution's failures and harness errors both become failures."""
    is_default = not name.startswith("awkward") and not dims.get("reference_may_oom")
    do_compile = not cfg.no_compile and (cfg.compile_all or is_default)
    tv = ctx.variants if (cfg.time_variants or cfg.variant not in (None, "all")) else None
    if tv is not None:
        tv = [v for v in tv if v not in not_run]  # the model's own VARIANTS (variants_here)
    log(f"  timing {name}: ModelNew ({'variants ' + ','.join(v or '-' for v in tv) if tv else 'default variant'}), "
        f"eager reference" + (", torch.compile(reference)" if do_compile else "")
        + ("; forward, then forward+backward" if cfg.backward else ""))
    try:
        return time_shape(ctx.refmod, ctx.solmod, name, dims, si, cfg, ctx.device, ctx.timer, tv, do_compile,
                          ref_oom)
    except SolutionError as e:
        return dict(failures=[str(e)], new={})
    except Exception as e:
        ctx.harness_errors.append(f"{label} (timing): {_short_exc(e)}")
        log(traceback.format_exc().rstrip())
        return dict(failures=[f"harness error (timing): {_short_exc(e)}"], new={})


def verdict(report, harness_errors):
    """(exit code, verdict line) from the shapes' results."""
    checked = [s for s in report["shapes"] if not s.get("skip_reason")]
    if not checked:
        return EXIT_USAGE, "NOTHING CHECKED: every selected shape was skipped"
    failed = [s for s in checked if not s.get("ok")]
    if not failed:
        return EXIT_OK, "PASS: every check passed"
    solution_failed = any(not f.startswith("harness error") for s in failed for f in _shape_failures(s))
    if harness_errors and not solution_failed:
        return EXIT_USAGE, (f"HARNESS ERROR (a bug in the harness or the reference, not a verdict on "
                            f"the solution): {'; '.join(harness_errors)[:600]}")
    return EXIT_WRONG, (f"FAIL: wrong results or failed checks at {', '.join(shape_label(report, s) for s in failed)}"
                        + (f" (and harness errors: {'; '.join(harness_errors)[:300]})" if harness_errors else ""))


if __name__ == "__main__":
    sys.exit(main())
