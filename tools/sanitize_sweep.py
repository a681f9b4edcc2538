"""compute-sanitizer sweep: every kernel family of contact_map.py and outer_product_mean.py under the four tools.

    python tools/sanitize_sweep.py --log-dir $OUT/sanitize             # memcheck, racecheck, synccheck, initcheck
    python tools/sanitize_sweep.py --quick --tools memcheck,racecheck --files outer_product_mean
    python tools/sanitize_sweep.py --per-case --tools memcheck --cases cm_fma   # one process per case
    python tools/sanitize_sweep.py --dry-run                            # the cases and the commands; no GPU, no torch

Needs an H100 / H200 (compute capability 9.0: the wgmma kernels run only there), compute-sanitizer (--sanitizer,
else PATH, else CUDA_HOME/bin), a demangler (c++filt on PATH, else CUDA's cu++filt: the sanitizer's directory,
CUDA_HOME/bin, PATH) and cuobjdump for the coverage list. The kernel files are imported as the tests import them,
so their extensions are built on the first import (minutes) and loaded from PyTorch's cache afterwards.

Runtime. Measured 2026-12-06 on an H100 with 16 CPU cores (compute-sanitizer 2025.3.1, torch 2.11, extensions
built) with one sanitized process per (tool, case): each took 80-190 s, most of it the sanitizer's start, PyTorch's
import and instrumenting, and the 76 of them, 12 at a time, did not finish within 10 minutes. Hence the default:
one sanitized process per (tool, kernel file) running all that file's selected cases, 4 tools x 2 files = 8
processes, all at once (--jobs 8). Their time has not been measured; the sweep is expected to take about as long
as its longest single (tool, file) run, after the census. --per-case gives the one process per (tool, case) runs
(to localise a failure: in a file's run, a fault that loses the CUDA context makes its later cases fail too);
--quick drops the calls that walk many tiles per block; --timeout bounds each run. Each run's time is printed; the
logs stay in --log-dir (per run TOOL-RUN.log, the sanitizer's report, and TOOL-RUN.out, the worker's output, where
RUN is the kernel file, e.g. racecheck-outer_product_mean.log, or with --per-case the case; summary.txt).

How it works:
  1. Cases. CASES below: each names one kernel file and a list of calls at small, awkward shapes (N from 1 to 45,
     mostly not a multiple of any tile, msa_dim 13 to 768, pair_dim 7 to 256, masks with about 20% zeros and a
     fully masked residue column and sequence row, fully masked inputs, every mask dtype), covering every forced
     variant of each file's variant table in float32, float16 and bfloat16, each template instantiation the H100
     reaches (contact map: the wgmma kernel's four builds in 32 and 16 bits, every mma and fma build chosen by
     shared memory; outer product mean: each hidden-dim tile size CP, each prep kernel, the pair-count modes'
     kernels through the OpenFold and Boltz modules, fused and unfused epilogues), the fused backwards with
     their options (split, block_tiles, a float32-parameter bf16 input, training steps through ModelNew) and calls
     with more tiles than resident blocks, so that the persistent kernels walk tiles, reuse ring slots and take
     tickets. Each call checks that the variant / backward parts it asks for are the ones that ran and copies
     every output to the host (under initcheck that copy reports any output byte no kernel wrote).
  2. Census. For each file one process without the sanitizer runs the cases under torch.profiler: the kernels
     each case launches, the extension library and its CUDA source, whether it was built with -lineinfo.
  3. Sanitized runs. One process per (tool, kernel file), --jobs at a time on the one GPU: compute-sanitizer --tool
     TOOL python tools/sanitize_sweep.py --worker CASE [CASE ...] with the file's cases (those the census ran
     without error; --per-case: one case per process), with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every tensor its own
     cudaMalloc: the caching allocator would hide out-of-bounds accesses into a neighbouring block and
     uninitialized reads of reused memory). The worker runs its cases one after another, prints a status line per
     case ("case NAME: ok in S s" or "case NAME: FAILED in S s: ERROR"), goes on after a failing case and exits 1
     if any failed. Options (dropped where the installed compute-sanitizer's --help does not list them):
     --error-exitcode, --print-limit, --demangle no (mangled names match the library's symbols exactly),
     --show-backtrace device, --target-processes application-only (not the build's ninja),
     --check-device-heap no (keeps CUDA's lazy module loading: PyTorch's unused kernels are never instrumented),
     a base --port per parallel run; memcheck --padding 4096 (an overrun into the next allocation is caught too),
     --report-api-errors no (every CUDA call in the two files raises through C10_CUDA_CHECK, so a failing call
     fails the run anyway; PyTorch's deliberate probes are noise), --check-tensor-ops yes (the TMA copies);
     racecheck --racecheck-report analysis and --check-tensor-ops yes. initcheck checks global memory (its
     default): its release notes list tensormap (TMA) instructions it does not support, and the wgmma kernels'
     shared-memory tiles arrive through them.
  4. Report. One line per (tool, kernel): "clean" and the number of cases that launched it (the census's kernels
     of the cases of each run: a file's run counts the union of its cases'), or the first report (its type, the
     kernel and the source location as compute-sanitizer prints it, with the kernel file's line where the line
     of the built cuda.cu is found there, and the run it came from), or "NOT CHECKED" where a case that launched
     the kernel failed, or its run failed or hit the print limit; each failed case and failed run gets a FAILED
     line by name; reports in kernels of neither file (PyTorch's) get lines too. Then the kernels of the built
     libraries (cuobjdump -symbols, ENTRY functions) that no case launched, and a summary line. Exit status 1
     when any report, failed run or failed case exists.

Limits: "clean" means that no report came from the launches the census saw for the cases of that run; under the
sanitizer a launcher's occupancy query could in principle pick another build (the mma kernel's one- or two-block
build), and reports from whatever ran are always shown under the kernel's own name. A file's run attributes a
report to its kernel, not to a case (--per-case does). racecheck sees shared memory only.
"""
import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
FILES = {"contact_map": "contact_map.py", "outer_product_mean": "outer_product_mean.py"}
F32, F16, BF16 = "float32", "float16", "bfloat16"
DTYPES = (F32, F16, BF16)
# every mask dtype the outer product mean's kernels read (mask_kind_of in its CUDA source)
MASK_DTYPES = (F32, F16, BF16, "bool", "uint8", "int8", "int16", "int32", "int64")
PREFIX = "========="
ERROR_EXIT = 86  # --error-exitcode: tells "the sanitizer found errors" from "the worker raised" (exit 1)


# =============================================================================================
# The cases
# =============================================================================================
class Case:
    """One worker process: a kernel file, a short description and its calls (dicts, see _call)."""

    def __init__(self, name, file, what, calls):
        self.name, self.file, self.what, self.calls = name, file, what, calls

    def selected_calls(self, quick):
        return [c for c in self.calls if not (quick and c.get("slow"))]


def _call(op, dtype, **kw):
    """A call: op names a worker function (_OPS), dtype the input's dtype; the rest are its arguments:
    shape fields (contact map B, N, C, H; outer product mean B, S, N, cm, c, cz), variant, expect (the
    last_variant or backward parts that must have run), walk (B chosen so that there are at least walk tiles per
    SM: persistent blocks take several tiles), slow (left out by --quick), mask, mask_dtype, offset, ..."""
    return dict(op=op, dtype=dtype, **kw)


def cm_call(op, dtype, B, N, C, H, **kw):
    return _call(op, dtype, B=B, N=N, C=C, H=H, **kw)


def opm_call(op, dtype, B, S, N, cm, c, cz, **kw):
    kw.setdefault("mask", "mixed")
    kw.setdefault("mask_dtype", F32)
    return _call(op, dtype, B=B, S=S, N=N, cm=cm, c=c, cz=cz, **kw)


def opm_parts(cm, cz):
    """The backward parts that run in kernels at hidden_dim 32 on Hopper (outer_product_mean_backward's rules): a, b
    and dWo always (pair_dim <= 128), da, db where pair_dim % 4 == 0, the LayerNorm kernel at msa_dim 128 / 256."""
    return ["a, b", "dWo"] + (["da, db"] if cz % 4 == 0 else []) + (["LayerNorm"] if cm in (128, 256) else [])


def _small_fits(C, H):
    """contact_map._small_fits: the dimensions the small kernel takes."""
    return 8 <= C <= 64 and C % 8 == 0 and 1 <= H <= 32


def _cm_wgmma_case(dtype):
    """"auto" on the wgmma kernel: its four builds (pair_dim <= 64 / <= 128: KC 64 / 128; hidden <= 32 / <= 64),
    zero-filled channel boxes (pair_dim 48, 80, 96), padded hidden units, edge tiles (N % 8), N = 8 (one box),
    N = 7 and a pair_dim below a 16-bit box row (other kernels), then many tiles per block. Where the small kernel
    takes the dimensions, "auto" may run it at a few tiles per SM: those calls walk 3 tiles per SM."""
    kernel = "wgmma" if dtype == F32 else "wgmma16"
    builds = [(64, 32), (48, 40), (96, 17), (128, 64)] if dtype == F32 else [(64, 32), (64, 64), (80, 24), (96, 33)]
    calls = [cm_call("cm_forward", dtype, None if _small_fits(C, H) else (i % 2) + 1, 19 - 2 * (i % 2), C, H,
                     variant="auto", expect=kernel, walk=3 if _small_fits(C, H) else None)
             for i, (C, H) in enumerate(builds)]
    calls += [cm_call("cm_forward", dtype, 1, 8, 64, 40, variant="auto", expect=kernel),
              cm_call("cm_forward", dtype, 1, 7, 64, 40, variant="auto", expect="mma")]
    if dtype != F32:  # 16-bit below 64 channels: the fp32 build on a converted copy
        calls.append(cm_call("cm_forward", dtype, None, 19, 48, 16, variant="auto", expect="wgmma", walk=3))
    # 6 tiles per SM: past the fixed first tiles (tickets in the KC = 128 build), ring slots reused
    calls += [cm_call("cm_forward", dtype, None, 17, C, H, variant="auto", expect=kernel, walk=6, slow=True)
              for C, H in builds]
    return Case(f"cm_wgmma_{dtype}", "contact_map", f'"auto" on the wgmma kernel ({kernel}), {dtype}', calls)


# The mma kernel's builds on an H100 / H200 (227 KB of shared memory per block), chosen by shared memory:
# (pair_dim, hidden_dim, walk). hidden 16 / 32: two blocks per SM where both fit (17, 33), else one block with the
# producer warps (160, 104: split weight fragments; 256, 237: weights from global memory, 237 with 4-byte copies);
# they copy only where a block has a next tile, hence walk 2. hidden 64 / 128: split fragments (96, 40) or global
# weights (200, 96); hidden 256: 256 threads, global weights.
MMA_BUILDS = [(17, 9, 0), (33, 17, 0), (160, 16, 2), (104, 20, 2), (256, 16, 2), (237, 24, 2), (96, 40, 0),
              (200, 40, 0), (40, 100, 0), (96, 100, 0), (96, 200, 0)]
# The fma kernel's builds there: weights in shared memory (W) or read through L1: (17, 9) 16 W, (33, 17) 32 W,
# (256, 32) 32, (96, 40) 64 W, (256, 64) 64, (40, 100) 128 W, (128, 128) 128, (96, 200) 256.
FMA_BUILDS = [(17, 9), (33, 17), (256, 32), (96, 40), (256, 64), (40, 100), (128, 128), (96, 200)]

CM_CASES = [
    _cm_wgmma_case(F32),
    _cm_wgmma_case(F16),
    _cm_wgmma_case(BF16),
    Case("cm_mma_float32", "contact_map", "the mma kernel's builds, a 4-byte aligned input",
         [cm_call("cm_forward", F32, None if w else 2, 17 + 2 * (i % 2), C, H, variant="mma", expect="mma", walk=w)
          for i, (C, H, w) in enumerate(MMA_BUILDS)]
         + [cm_call("cm_forward", F32, 1, 19, 64, 40, variant="auto", expect="mma", offset=1),
            cm_call("cm_forward", F32, None, 17, 17, 9, variant="mma", expect="mma", walk=4, slow=True)]),
    Case("cm_fma_float32", "contact_map", "the fma kernel's builds",
         [cm_call("cm_forward", F32, 2, 17 + 2 * (i % 2), C, H, variant="fma", expect="fma")
          for i, (C, H) in enumerate(FMA_BUILDS)]
         + [cm_call("cm_forward", F32, None, 17, 17, 9, variant="fma", expect="fma", walk=16, slow=True),
            cm_call("cm_forward", F32, None, 17, 256, 32, variant="fma", expect="fma", walk=2, slow=True)]),
    Case("cm_small", "contact_map", '"small" in each dtype: edge tiles, N = 1, pair_dim 8 / 48 / 64, odd hidden',
         [cm_call("cm_forward", dt, B, N, C, H, variant="small", expect="small")
          for dt in DTYPES for B, N, C, H in ((4, 63, 64, 32), (2, 19, 48, 17), (1, 1, 64, 32), (1, 9, 8, 1))]
         + [cm_call("cm_train", BF16, 1, 17, 64, 32, variant="small", expect="small")]),
    Case("cm_mma_fma_half", "contact_map", '"mma" and "fma" on float16 / bfloat16 input (converted copies)',
         [cm_call("cm_forward", dt, B, N, C, H, variant=v, expect=v)
          for dt in (F16, BF16) for v in ("mma", "fma") for B, N, C, H in ((1, 19, 64, 32), (2, 17, 33, 17))]),
]
for _dt in DTYPES:
    _kernel = "wgmma" if _dt == F32 else "wgmma16"
    _tf32 = {"f16": False} if _dt == BF16 else {}  # bfloat16: the split-TF32 instance; cm_backward_f16 the other
    CM_CASES.append(Case(
        f"cm_backward_{_dt}", "contact_map", f"the fused backward, {_dt} (split TF32); training steps through ModelNew",
        [cm_call("cm_backward", _dt, 1, 19, 128, 64, **_tf32), cm_call("cm_backward", _dt, 2, 17, 64, 32, **_tf32),
         cm_call("cm_backward", _dt, 1, 17, 48, 16, **_tf32), cm_call("cm_backward", _dt, 1, 1, 64, 32, **_tf32)]
        + ([cm_call("cm_backward", _dt, 1, 17, 64, 32, params_dtype=F32, **_tf32)] if _dt == BF16 else [])
        + [cm_call("cm_train", _dt, 2, 17, 64, 32, variant="small", expect="small", **_tf32),
           cm_call("cm_train", _dt, 2, 17, 64, 48, variant="auto", expect=_kernel, **_tf32),
           cm_call("cm_train", _dt, 1, 19, 128, 64, variant="mma", expect="mma", **_tf32),
           cm_call("cm_backward", _dt, None, 17, 128, 64, walk=3, slow=True, **_tf32)]))
CM_CASES.append(Case(
    "cm_backward_f16", "contact_map", "the fused backward, bfloat16, with BACKWARD_FP16_PRODUCTS on (fp16 products)",
    [cm_call("cm_backward", BF16, 1, 19, 128, 64, f16=True), cm_call("cm_backward", BF16, 2, 17, 64, 32, f16=True),
     cm_call("cm_backward", BF16, 1, 17, 48, 16, f16=True), cm_call("cm_backward", BF16, 1, 1, 64, 32, f16=True),
     cm_call("cm_backward", BF16, 1, 19, 128, 48, f16=True),
     cm_call("cm_train", BF16, 2, 17, 64, 48, variant="auto", expect="wgmma16", f16=True),
     cm_call("cm_backward", BF16, None, 17, 128, 64, walk=3, slow=True, f16=True)]))
CM_CASES.append(Case(
    "cm_backward_one_conversion", "contact_map",
    "the fused backward with BACKWARD_ONE_CONVERSION on (non-fp32 grad_out / parameters in one fp32 buffer)",
    [cm_call("cm_backward", BF16, 1, 19, 128, 64, one_conversion=True),
     cm_call("cm_backward", F16, 2, 17, 64, 32, one_conversion=True),
     cm_call("cm_backward", F32, 1, 17, 48, 16, params_dtype=BF16, one_conversion=True),
     cm_call("cm_train", BF16, 2, 17, 64, 48, variant="auto", expect="wgmma16", one_conversion=True)]))

# The outer product mean's forced variants (its _ALL_VARIANTS less "auto"; the tests check this list against it).
OPM_ORDERS = ("outer_first", "w_first", "w_first_small", "w_first_tc", "w_first_tc2", "w_first_wg2", "outer_wg",
              "fused_small")


def _opm_outer_wg_case(dtype):
    """outer_wg's edges: two z chunks (pair_dim 200), S past an s block, the prep's tile kinds (msa_dim % 16 != 0,
    > 256, 768; for 16-bit input the warp-tile prep at msa_dim 64 and 256), hidden 16 / 24, S = N = 1, everything
    masked, then more tiles than SMs (the persistent kernel's ring across tiles)."""
    mdt = dtype if dtype != F32 else "bool"
    calls = [opm_call("opm_forward", dtype, 2, 21, 40, 40, 32, 200, variant="outer_wg"),
             opm_call("opm_forward", dtype, 1, 13, 23, 300, 32, 64, variant="outer_wg", mask_dtype=mdt),
             opm_call("opm_forward", dtype, 2, 6, 9, 52, 24, 16, variant="outer_wg"),
             opm_call("opm_forward", dtype, 1, 5, 19, 64, 16, 64, variant="outer_wg", mask_dtype=mdt),
             opm_call("opm_forward", dtype, 1, 1, 1, 8, 32, 8, variant="outer_wg"),
             opm_call("opm_forward", dtype, 1, 3, 17, 16, 32, 12, variant="outer_wg", mask="zeros"),
             opm_call("opm_forward", dtype, 1, 5, 19, 64, 32, 64, variant="auto")]
    if dtype == F32:
        calls.append(opm_call("opm_forward", dtype, 1, 3, 10, 768, 32, 8, variant="outer_wg"))
    else:
        calls += [opm_call("opm_forward", dtype, 1, 45, 19, 256, 32, 128, variant="outer_wg", mask_dtype=mdt),
                  opm_call("opm_forward", dtype, 2, 5, 21, 64, 32, 24, variant="outer_wg"),
                  opm_call("opm_forward", dtype, 1, 7, 17, 13, 32, 7, variant="outer_wg")]
    calls.append(opm_call("opm_forward", dtype, None, 37, 40, 64, 32, 200, variant="outer_wg", walk=3, slow=True))
    return Case(f"opm_outer_wg_{dtype}", "outer_product_mean", f"outer_wg's prep and fused kernels, {dtype}", calls)


def _opm_fused_small_case(dtype):
    """fused_small (one cooperative launch): the seed shape, S = N = 1, S = 0, odd msa_dim (one-element loads),
    hidden 16 / 31 (Wo element by element), odd pair_dim (one-element stores), msa_dim 768, everything masked,
    and more tasks than resident blocks (2700: blocks walk tasks, Wo staged after the first)."""
    mdt = dtype if dtype != F32 else "int8"
    calls = [opm_call("opm_forward", dtype, 2, 8, 32, 64, 32, 64, variant="fused_small"),
             opm_call("opm_forward", dtype, 1, 1, 1, 8, 32, 8, variant="fused_small"),
             opm_call("opm_forward", dtype, 2, 0, 7, 16, 32, 12, variant="fused_small"),
             opm_call("opm_forward", dtype, 1, 5, 19, 33, 16, 7, variant="fused_small", mask_dtype=mdt),
             opm_call("opm_forward", dtype, 1, 20, 33, 62, 31, 9, variant="fused_small"),
             opm_call("opm_forward", dtype, 1, 3, 10, 768, 32, 8, variant="fused_small", mask_dtype="bool"),
             opm_call("opm_forward", dtype, 1, 3, 17, 16, 32, 12, variant="fused_small", mask="zeros"),
             opm_call("opm_forward", dtype, 2, 21, 70, 40, 32, 200, variant="fused_small", slow=True)]
    return Case(f"opm_fused_small_{dtype}", "outer_product_mean", f"fused_small's kernel, {dtype}", calls)


def _opm_backward_case(dtype):
    """outer_product_mean_backward's kernels at hidden_dim 32: a, b (outer_wg's prep, rows out), dWo, da / db,
    the LayerNorm pass, dbo; pair_dim not a multiple of 4 / 8, S over 512 (two s chunks), the prep's tile kinds
    (block_tiles), training steps through ModelNew (a, b kept from outer_wg or fused_small, or recomputed)."""
    if dtype == F32:
        calls = [opm_call("opm_backward", dtype, 1, 5, 19, 64, 32, 64, expect=opm_parts(64, 64)),
                 opm_call("opm_backward", dtype, 1, 7, 37, 256, 32, 128, mask_dtype="bool", expect=opm_parts(256, 128)),
                 opm_call("opm_backward", dtype, 2, 9, 20, 128, 32, 100, mask_dtype="int8", expect=opm_parts(128, 100)),
                 opm_call("opm_backward", dtype, 1, 530, 9, 32, 32, 8, expect=opm_parts(32, 8)),
                 opm_call("opm_backward", dtype, 1, 3, 11, 256, 32, 13, mask_dtype="int64", expect=opm_parts(256, 13)),
                 opm_call("opm_rows", dtype, 1, 9, 20, 300, 32, 1, block_tiles=False),
                 opm_call("opm_rows", dtype, 2, 6, 9, 52, 32, 1, block_tiles=True)]
    else:
        calls = [opm_call("opm_backward", dtype, 1, 40, 37, 256, 32, 128, mask_dtype=dtype, expect=opm_parts(256, 128)),
                 opm_call("opm_backward", dtype, 2, 9, 20, 128, 32, 100, mask_dtype="bool", expect=opm_parts(128, 100)),
                 opm_call("opm_backward", dtype, 1, 3, 9, 128, 32, 8, mask_dtype="int8", expect=opm_parts(128, 8)),
                 opm_call("opm_backward", dtype, 1, 9, 20, 128, 32, 64, split=True, expect=opm_parts(128, 64)),
                 opm_call("opm_rows", dtype, 1, 9, 20, 48, 32, 1, block_tiles=False),
                 opm_call("opm_rows", dtype, 1, 9, 20, 48, 32, 1, block_tiles=True),
                 opm_call("opm_rows", dtype, 1, 9, 20, 300, 32, 1, block_tiles=False),
                 opm_call("opm_rows", dtype, 1, 4, 9, 256, 32, 1, block_tiles=False)]
    calls += [opm_call("opm_train", dtype, 1, 8, 32, 64, 32, 64, variant="outer_wg", expect=opm_parts(64, 64)),
              opm_call("opm_train", dtype, 2, 8, 32, 64, 32, 64, variant="fused_small", expect=opm_parts(64, 64)),
              opm_call("opm_train", dtype, 1, 5, 19, 128, 32, 64, variant="outer_first", expect=opm_parts(128, 64)),
              # 10000 msa rows: several 32-row tiles per block of the LayerNorm pass
              opm_call("opm_backward", dtype, 2, 50, 100, 256, 32, 64, expect=opm_parts(256, 64), slow=True)]
    return Case(f"opm_backward_{dtype}", "outer_product_mean", f"the backward's kernels, {dtype}", calls)


def _opm_pair_case():
    """The pair-count modes (OpenFold: (acc + bo) / (n + eps), Boltz: acc / max(n, 1) + bo): the pair scale and
    epilogue kernels after each forward order, outer_wg's and w_first_wg2's kPair instances (PAIR_EPILOGUE "fused")
    and the unfused pass after outer_wg, every mask kind through the pair count, training steps (PAIR_BACKWARD
    "chunks" and "kernels")."""
    calls = [opm_call("opm_pair", dt, 1, 5, 19, 64, 32, 64, family=fam, variant=v, epilogue=e, mask_dtype=md)
             for fam in ("openfold", "boltz")
             for dt, v, e, md in ((F32, "outer_wg", "fused", "bool"), (F16, "outer_wg", "fused", F16),
                                  (BF16, "outer_wg", "fused", "int8"), (F32, "outer_wg", "unfused", F32),
                                  (BF16, "outer_wg", "unfused", BF16), (F32, "outer_first", "fused", "int64"),
                                  (F32, "w_first_wg2", "fused", F32), (F32, "w_first_small", "fused", "uint8"),
                                  (BF16, "fused_small", "fused", BF16), (F32, "fused_small", "fused", "int16"))]
    calls += [opm_call("opm_pair", F32, 2, 6, 21, 64, 32, 24, family="openfold", variant="outer_wg", mask="zeros"),
              opm_call("opm_pair", BF16, 1, 4, 17, 64, 32, 64, family="boltz", variant="outer_wg", train=True),
              opm_call("opm_pair", F32, 1, 4, 17, 64, 32, 64, family="openfold", variant="outer_wg", train=True),
              # PAIR_BACKWARD "kernels": the row mode's dWo and da, db kernels on s1 g
              opm_call("opm_pair", F32, 1, 4, 17, 64, 32, 64, family="boltz", variant="outer_wg", train=True,
                       backward="kernels"),
              opm_call("opm_pair", BF16, 1, 4, 17, 64, 32, 64, family="openfold", variant="outer_wg", train=True,
                       backward="kernels"),
              # opm_backward_pair_g (PAIR_G_KERNEL): s1 g in fp16 (OpenFold), in fp32 from bf16 (pair_dim 12: split
              # TF32, Boltz)
              opm_call("opm_pair", F16, 1, 4, 17, 64, 32, 64, family="openfold", variant="outer_wg", train=True,
                       backward="kernels", pair_g=True),
              opm_call("opm_pair", BF16, 1, 4, 17, 64, 32, 12, family="boltz", variant="outer_wg", train=True,
                       backward="kernels", pair_g=True),
              # the pair counts on the fp64 tensor cores (PAIR_COUNTS_DMMA): partial chunks and tiles, each float mask
              opm_call("opm_pair_counts", F32, 2, 70, 45, 64, 32, 64, mask_dtype=F32),
              opm_call("opm_pair_counts", F32, 1, 130, 64, 64, 32, 64, mask_dtype=BF16),
              opm_call("opm_pair_counts", F32, 1, 3, 7, 64, 32, 64, mask_dtype=F16),
              # the same sums fed by the cp.async ring (PAIR_COUNTS_RING): partial stages and tiles; 576 tiles (more
              # than 4 per SM: a block's second tile refills the ring)
              opm_call("opm_pair_counts", F32, 2, 70, 48, 64, 32, 64, mask_dtype=F32, counts=2),
              opm_call("opm_pair_counts", F32, 1, 130, 64, 64, 32, 64, mask_dtype=BF16, counts=2),
              opm_call("opm_pair_counts", F32, 1, 3, 8, 64, 32, 64, mask_dtype=F16, counts=2),
              opm_call("opm_pair_counts", F32, 1, 5, 768, 64, 32, 64, mask_dtype=BF16, counts=2),
              # the ring's HMMA instance (PAIR_COUNTS_HMMA): partial stages and tiles, both 16-bit masks, 576 tiles
              opm_call("opm_pair_counts", F32, 1, 130, 64, 64, 32, 64, mask_dtype=BF16, counts=3),
              opm_call("opm_pair_counts", F32, 1, 3, 8, 64, 32, 64, mask_dtype=F16, counts=3),
              opm_call("opm_pair_counts", F32, 1, 37, 768, 64, 32, 64, mask_dtype=F16, counts=3),
              # w_first_wg2's kPair epilogue: pair_dim 7 (one element per store, columns of two j in one pair);
              # 130 residues: two 128-row tiles
              opm_call("opm_pair", F32, 1, 5, 130, 64, 32, 64, family="openfold", variant="w_first_wg2"),
              opm_call("opm_pair", F32, 1, 5, 19, 64, 32, 7, family="boltz", variant="w_first_wg2"),
              # pair_dim 7: the epilogue's one-element path (multiples of 4 / 8 take 16-byte vectors)
              opm_call("opm_pair", F32, 1, 5, 19, 64, 32, 7, family="openfold", variant="outer_first"),
              opm_call("opm_pair", F16, 1, 5, 19, 64, 32, 7, family="boltz", variant="outer_wg", epilogue="unfused")]
    return Case("opm_pair_modes", "outer_product_mean", "the pair-count normalisations' kernels", calls)


def _opm_pair_walk_case():
    """outer_wg's 16-bit kPair instances: one call walking two tiles per SM, one with a tile per block; N 19: partial
    tiles (the scale loads' bounds)."""
    calls = [opm_call("opm_pair", BF16, None, 5, 19, 64, 32, 64, family="openfold", variant="outer_wg",
                      mask_dtype=BF16, walk=2),
             opm_call("opm_pair", F16, 1, 5, 19, 64, 32, 64, family="boltz", variant="outer_wg", mask_dtype=F16)]
    return Case("opm_pair_walk", "outer_product_mean", "outer_wg's 16-bit pair instances: a walk, partial tiles", calls)


def _opm_low_memory_case():
    """Training steps with LOW_MEMORY_BACKWARD on and off: the da / db kernels writing fp16 / bf16 and the LayerNorm
    kernel reading it, or both in fp32 (R = 95: a partial last tile) in each dtype; N 300 at B 2: the dWo kernel's G
    planes in two chunks (bf16, on)."""
    parts = opm_parts(128, 64)
    calls = [opm_call("opm_train", dt, 1, 5, 19, 128, 32, 64, variant="outer_wg", expect=parts, low=low)
             for low in (True, False) for dt in (BF16, F16, F32)]
    calls.append(opm_call("opm_train", BF16, 2, 3, 300, 128, 32, 64, variant="outer_wg", expect=parts, low=True))
    return Case("opm_low_memory", "outer_product_mean", "the backward with and without LOW_MEMORY_BACKWARD", calls)


def _opm_keep_o_case():
    """KEEP_O's kernels: outer_wg's kKeepO instances (opm_forward with keep_o: O written beside out) in both 16-bit
    dtypes, row mode and the pair modes' kPair instances, edge tiles (N 19, 37), two z chunks (pair_dim 200: the second
    chunk's tiles write no O), more tiles than SMs (walk); the "kernel" dWo product alone. The training step's default
    dWo over the kept O is a library matrix product (its kernels draw racecheck and initcheck reports, NOTES.md): the
    GPU tests check that path."""
    shapes = ((BF16, 1, 5, 19, 128, 64, 0, F32), (F16, 2, 9, 37, 256, 128, 0, "bool"),
              (BF16, 1, 40, 17, 64, 200, 0, BF16), (BF16, 1, 4, 17, 64, 64, 1, "int8"), (F16, 1, 4, 17, 64, 64, 2, F16))
    calls = [opm_call("opm_keep_o", dt, B, S, N, cm, 32, cz, norm=norm, mask_dtype=md)
             for dt, B, S, N, cm, cz, norm, md in shapes]
    calls.append(opm_call("opm_keep_o", BF16, None, 37, 40, 64, 32, 128, norm=0, walk=3, slow=True))
    # opm_bw_wo_kept_kernel (KEEP_O_PRODUCT "kernel") alone: P = B N N pairs in partial 32-pair steps, one partial z
    # tile (24), two z tiles (136)
    calls += [opm_call("opm_wo_kept", dt, B, 1, N, 64, 32, cz)
              for dt, B, N, cz in ((BF16, 1, 7, 24), (F16, 2, 13, 136))]
    return Case("opm_keep_o", "outer_product_mean", "KEEP_O: the kKeepO forwards and opm_bw_wo_kept_kernel", calls)


def _opm_g_mem_case():
    """G_MEM's kernel alone (opm_bw_g_kernel: G in memory; its two products are the library's): a partial j tile and
    c_z not a multiple of 16 (N 37, c_z 24), two batches with two j tiles, the second partial (N 130, c_z 128)."""
    calls = [opm_call("opm_g_mem", dt, B, 1, N, 64, 32, cz) for dt, B, N, cz in ((BF16, 1, 37, 24), (F16, 2, 130, 128))]
    return Case("opm_g_mem", "outer_product_mean", "G_MEM: opm_bw_g_kernel", calls)


def _opm_ln_in_place_case():
    """The LayerNorm kernel alone (opm_backward_ln), its blocks' partials written over da, db's rows (consume): at
    msa_dim 128 a partial is 17 chunks of a 16-bit tile's da or db rows (9 tiles) or 9 fp32 ones (5 tiles), so N = R
    rows for 9 / 5 tiles per block on 132 SMs fit exactly, plus a partial last tile; consume off (133 tiles): a
    buffer. The worker checks that da, db changed exactly when the partials fit on the device's SM count."""
    calls = [opm_call("opm_ln", dt, 1, 1, 32 * 132 * tiles + 13, 128, 32, 64, dab=dab, consume=consume)
             for dt, dab, tiles, consume in ((BF16, BF16, 9, True), (F16, F32, 5, True), (F32, F32, 5, True),
                                             (F32, F32, 1, False))]
    return Case("opm_ln_in_place", "outer_product_mean", "the LayerNorm kernel's partials in da, db or a buffer",
                calls)


def _opm_wo_split_j_case():
    """The dWo part alone (opm_backward_wo) in chunks of one i tile's j blocks (split_j: B 2, N 100, 25 j blocks of
    256 KB of G planes in fp32, 64 KB in 16 bits, per batch element; chunks of 2 and a last one of 1), and the i-tile
    chunks beside it."""
    calls = [opm_call("opm_wo", dt, 2, 5, 100, 128, 32, 64, chunk=chunk, split_j=split_j)
             for dt, chunk, split_j in ((F32, 1 << 20, True), (BF16, 1 << 18, True), (F16, 1 << 18, True),
                                        (F32, 256 << 20, False))]
    return Case("opm_wo_split_j", "outer_product_mean", "the dWo kernels in chunks of j blocks (split_j)", calls)


def _opm_ab16_case():
    """The 16-bit da, db part alone (opm_backward_ab; its ring of 11 slots of 16 KB): N 37 (ragged own and loop
    tiles), S 530 (two s chunks, a partial 64-row block), pair_dim 8 and 104 (a g box under a slot), out in T and in
    fp32."""
    calls = [opm_call("opm_ab", dt, B, S, N, 128, 32, cz, out_t=out_t)
             for dt, B, S, N, cz, out_t in ((BF16, 1, 530, 37, 104, True), (F16, 2, 17, 37, 8, False))]
    return Case("opm_ab16", "outer_product_mean", "the 16-bit da, db kernels alone", calls)


OPM_CASES = [
    Case("opm_orders_float32", "outer_product_mean", "every forced variant at msa_dim 64 / 256, pair_dim 64 / 128",
         [opm_call("opm_forward", F32, 2, 5, 19, 64, 32, 64, variant=v) for v in OPM_ORDERS]
         + [opm_call("opm_forward", F32, 1, 7, 36, 256, 32, 128, variant=v) for v in OPM_ORDERS]
         + [opm_call("opm_forward", F32, 1, 3, 17, 16, 16, 12, variant=v, mask="zeros") for v in OPM_ORDERS]
         + [opm_call("opm_forward", F32, 2, 5, 19, 64, 32, 64, variant="auto")]),
    Case("opm_cp_float32", "outer_product_mean", "each hidden-dim tile size (CP 16, 64, 128) of the other variants",
         [opm_call("opm_forward", F32, 1, 3, 17, 33, c, 13, variant=v)
          for c in (8, 40, 100) for v in ("outer_first", "w_first", "w_first_wg2")]
         + [opm_call("opm_forward", F32, 1, 4, 21, 33, 40, 13, variant=v)
            for v in ("w_first_small", "w_first_tc", "w_first_tc2")]
         + [opm_call("opm_forward", F32, 2, 9, 45, 40, 8, 30, variant="w_first_tc2"),
            opm_call("opm_forward", F32, 1, 2, 6, 16, 128, 4, variant="outer_first")]),
    _opm_outer_wg_case(F32),
    _opm_outer_wg_case(F16),
    _opm_outer_wg_case(BF16),
    Case("opm_orders_half", "outer_product_mean", "the other variants and auto on float16 / bfloat16 input",
         [opm_call("opm_forward", dt, 1, 5, 19, 64, 32, 64, variant=v, mask_dtype=dt)
          for dt in (F16, BF16) for v in OPM_ORDERS + ("auto",) if v != "outer_wg"]),
    Case("opm_masks", "outer_product_mean", "every mask dtype through each kernel that reads the mask",
         [opm_call(op, dt, 1, 4, 17, cm, 32, 64, variant=v, mask_dtype=md, expect=e)
          for md in MASK_DTYPES
          for op, dt, v, cm, e in (("opm_forward", F32, "outer_first", 64, None),
                                   ("opm_forward", F32, "outer_wg", 64, None),
                                   ("opm_forward", F16, "outer_wg", 64, None),
                                   ("opm_forward", F32, "fused_small", 64, None),
                                   ("opm_forward", BF16, "fused_small", 64, None),
                                   ("opm_backward", F32, None, 128, opm_parts(128, 64)))]),
    _opm_fused_small_case(F32),
    _opm_fused_small_case(F16),
    _opm_fused_small_case(BF16),
    _opm_backward_case(F32),
    _opm_backward_case(F16),
    _opm_backward_case(BF16),
    _opm_pair_case(),
    _opm_pair_walk_case(),
    _opm_low_memory_case(),
    _opm_keep_o_case(),
    _opm_g_mem_case(),
    _opm_ln_in_place_case(),
    _opm_wo_split_j_case(),
    _opm_ab16_case(),
]

CASES = CM_CASES + OPM_CASES
CASES_BY_NAME = {c.name: c for c in CASES}
assert len(CASES_BY_NAME) == len(CASES), "case names must be unique"


def tiles_per_batch(call):
    """Tiles of one batch element for the kernels that walk: the contact map's 8 x 8 position tiles (I <= J),
    outer_wg's 16 i x 4 j x 128 z tiles."""
    if call["op"].startswith("cm_"):
        nt = -(-call["N"] // 8)
        return nt * (nt + 1) // 2
    return -(-call["N"] // 16) * -(-call["N"] // 4) * -(-call["cz"] // 128)


def batch_of(call, sms):
    """B of a call: with walk the smallest B giving at least walk tiles per SM, else its own."""
    if not call.get("walk"):
        return call["B"]
    return max(1, -(-call["walk"] * sms // tiles_per_batch(call)))


def describe_call(call):
    keys = ("B", "N", "C", "H") if call["op"].startswith("cm_") else ("B", "S", "N", "cm", "c", "cz")
    shape = " ".join(f"{k}={call[k]}" if not (k == "B" and call[k] is None) else f"B=walk{call['walk']}" for k in keys)
    extra = [f"{k}={call[k]}" for k in ("variant", "f16", "one_conversion", "family", "epilogue", "backward", "train",
                                        "pair_g", "low", "mask", "mask_dtype", "offset", "params_dtype", "split",
                                        "block_tiles", "counts", "dab", "consume", "chunk", "split_j", "out_t",
                                        "norm")
             if k in call and (call[k] not in (None, False) or k in ("low", "consume", "split_j", "out_t", "f16"))
             and not (k == "mask" and call[k] == "mixed")]
    expect = f" -> {call['expect']}" if call.get("expect") else ""
    slow = "  (slow)" if call.get("slow") else ""
    return f"{call['op']:<12} {call['dtype']:<8} {shape} {' '.join(extra)}{expect}{slow}"


# =============================================================================================
# The worker: runs a case's calls in this process (under compute-sanitizer, or under the profiler for the census)
# =============================================================================================
_MODULES = {}


def load_kernel_file(file):
    """Import a kernel file by path (builds or loads its extension), once per process."""
    if file not in _MODULES:
        path = os.path.join(ROOT, FILES[file])
        spec = importlib.util.spec_from_file_location(file, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[file] = module
        spec.loader.exec_module(module)
        _MODULES[file] = module
    return _MODULES[file]


def _seed(call):
    return zlib.crc32(repr(sorted(call.items())).encode())


def _expect(what, got, want):
    if want is not None and got != want:
        raise RuntimeError(f"{what}: expected {want!r}, {got!r} ran (the case tests another path than it names)")


def _fetch(torch, *tensors):
    """Copy each tensor to the host: under initcheck the copy reports bytes that no kernel wrote; non-finite
    values mean unwritten or wrong outputs."""
    for t in tensors:
        if t is None:
            continue
        h = t.detach().cpu()
        if h.is_floating_point() and not torch.isfinite(h).all():
            raise RuntimeError(f"non-finite values in an output of shape {tuple(h.shape)}")


def _cm_setup(torch, mod, call, sms):
    """ModelNew (parameters scaled by 1/sqrt(fan_in), LayerNorm affine away from (1, 0): mixed ReLU signs) and an
    input (B, N, N, C), both in the call's dtype; offset: the input starts that many elements into its buffer."""
    gen = torch.Generator().manual_seed(_seed(call))
    dt = getattr(torch, call["dtype"])
    B, N, C, H = batch_of(call, sms), call["N"], call["C"], call["H"]
    model = mod.ModelNew(C, H)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "layer_norm.weight":
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / p.shape[1] ** 0.5)
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model = model.to(dt).cuda()
    off = call.get("offset", 0)
    flat = torch.randn(B * N * N * C + off, generator=gen).to(dt).cuda()
    x = flat[off:].view(B, N, N, C)
    g = torch.randn(B, N, N, generator=gen).to(dt).cuda()
    return model, x, g


def _cm_forward(torch, mod, call, sms):
    model, x, _ = _cm_setup(torch, mod, call, sms)
    model.variant = call["variant"]
    with torch.no_grad():
        out = model(x)
    _expect("last_variant", model.last_variant, call.get("expect"))
    _fetch(torch, out)


def _cm_backward(torch, mod, call, sms):
    model, x, g = _cm_setup(torch, mod, call, sms)
    params = [p.detach() for p in model.parameters()]
    if call.get("params_dtype"):
        params = [p.to(getattr(torch, call["params_dtype"])) for p in params]
    if not mod.fused_backward_runs(x, params[2]):
        raise RuntimeError("fused_backward_runs is False: the case would test the PyTorch-ops backward")
    with _module_setting(mod, "BACKWARD_FP16_PRODUCTS", call.get("f16")), \
            _module_setting(mod, "BACKWARD_ONE_CONVERSION", call.get("one_conversion")):
        _fetch(torch, *mod.contact_map_backward_fused(x, params[0], params[1], model.layer_norm.eps, *params[2:], g))


def _cm_train(torch, mod, call, sms):
    model, x, g = _cm_setup(torch, mod, call, sms)
    model.variant = call["variant"]
    x.requires_grad_(True)
    out = model(x)
    _expect("last_variant", model.last_variant, call.get("expect"))
    with _module_setting(mod, "BACKWARD_FP16_PRODUCTS", call.get("f16")), \
            _module_setting(mod, "BACKWARD_ONE_CONVERSION", call.get("one_conversion")):
        out.backward(g)
    _expect("last_backward", model.last_backward, "fused")
    _fetch(torch, x.grad, *(p.grad for p in model.parameters()))


def make_mask(torch, B, S, N, kind, dtype, gen):
    """The mask (B, S, N) on the CPU in dtype (a name). kind "mixed": about 20% zeros, residue N // 2 masked in every
    sequence (its denominator clamps to 1) and the last sequence masked whole; "zeros": everything masked (the bias
    everywhere); "ones". Integer masks take any value: some 2s."""
    keep = torch.rand(B, S, N, generator=gen) >= 0.2
    if kind == "zeros":
        keep.zero_()
    elif kind == "ones":
        keep.fill_(True)
    elif kind == "mixed":
        keep[:, :, N // 2] = False
        if S > 1:
            keep[:, S - 1] = False
    dt = getattr(torch, dtype)
    if dt == torch.bool:
        return keep
    if dt.is_floating_point:
        return keep.to(dt)
    return (keep.to(torch.int64) * torch.randint(1, 3, keep.shape, generator=gen)).to(dt)


def _opm_setup(torch, mod, call, sms, params_dtype=None):
    """ModelNew (hidden_dim c) in the call's dtype (or params_dtype), msa (B, S, N, cm), the mask (make_mask) and
    grad_out, on the GPU."""
    gen = torch.Generator().manual_seed(_seed(call))
    dt = getattr(torch, call["dtype"])
    B, S, N, cm, c, cz = batch_of(call, sms), call["S"], call["N"], call["cm"], call["c"], call["cz"]
    model = mod.ModelNew(cm, cz, c)
    with torch.no_grad():
        for p in model.parameters():
            scale = 1.0 / max(1.0, p.shape[-1] ** 0.5) if p.dim() == 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale + 0.05)
    model = model.to(getattr(torch, params_dtype) if params_dtype else dt).cuda()
    msa = torch.randn(B, S, N, cm, generator=gen).to(dt).cuda()
    mask = make_mask(torch, B, S, N, call["mask"], call["mask_dtype"], gen)
    g = torch.randn(B, N, N, cz, generator=gen).to(dt).cuda()
    return model, msa, mask.cuda(), g


@contextlib.contextmanager
def _module_setting(mod, name, value):
    """mod.name = value for the block (value None: left as it is), restored afterwards, also when the block raises (a
    worker goes on to its next case)."""
    saved = getattr(mod, name)
    if value is not None:
        setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, saved)


def _opm_forward(torch, mod, call, sms):
    """ModelNew's forward with the variant forced, under no_grad."""
    model, msa, mask, _ = _opm_setup(torch, mod, call, sms)
    model.variant = call["variant"]
    with torch.no_grad():
        out = model(msa, mask)
    _expect("last_variant", model.last_variant, call["variant"] if call["variant"] != "auto" else None)
    _fetch(torch, out)


def _opm_backward(torch, mod, call, sms):
    model, msa, mask, g = _opm_setup(torch, mod, call, sms)
    params = [p.detach() for p in model.parameters()]
    parts = []
    grads = mod.outer_product_mean_backward(msa, mask, params[0], params[1], model.layer_norm.eps, *params[2:], g,
                                            parts=parts, split=call.get("split", False))
    _expect("backward parts", parts, call.get("expect"))
    _fetch(torch, *grads)


def _opm_rows(torch, mod, call, sms):
    """_ext.opm_backward_rows (float32 parameters, hidden_dim 32; the msa in the call's dtype), block tiles or not."""
    model, msa, mask, _ = _opm_setup(torch, mod, call, sms, params_dtype=F32)
    params = [p.detach() for p in model.parameters()]
    _fetch(torch, *mod._ext.opm_backward_rows(msa, mask, *params[:6], model.layer_norm.eps, call["block_tiles"]))


def _opm_train(torch, mod, call, sms):
    """A ModelNew training step with the variant forced (and LOW_MEMORY_BACKWARD = call["low"] where given)."""
    model, msa, mask, g = _opm_setup(torch, mod, call, sms)
    model.variant = call["variant"]
    x = msa.detach().requires_grad_(True)
    with _module_setting(mod, "LOW_MEMORY_BACKWARD", call.get("low")):
        out = model(x, mask)
        _expect("last_variant", model.last_variant, call["variant"])
        out.backward(g)
    _expect("last_backward", list(model.last_backward or ()), call.get("expect"))
    _fetch(torch, x.grad, *(p.grad for p in model.parameters()))


def _opm_pair(torch, mod, call, sms):
    """OpenFoldOuterProductMean / BoltzOuterProductMean (call["family"]) with ModelNew's parameters, the variant
    forced, under pair_epilogue(call["epilogue"]) and pair_backward(call["backward"]) (and PAIR_G_KERNEL =
    call["pair_g"] where given); a forward under no_grad, or with train a training step."""
    _, msa, mask, g = _opm_setup(torch, mod, call, sms)
    gen = torch.Generator().manual_seed(_seed(call) + 1)
    fam = mod.FAMILIES[call["family"]](call["cm"], call["cz"], call["c"])
    with torch.no_grad():  # as _opm_setup draws ModelNew's
        for p in fam.parameters():
            scale = 1.0 / max(1.0, p.shape[-1] ** 0.5) if p.dim() == 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale + 0.05)
    fam = fam.to(msa.dtype).cuda()
    fam.variant = call["variant"]
    with _module_setting(mod, "PAIR_G_KERNEL", call.get("pair_g")), mod.pair_epilogue(call.get("epilogue", "fused")), \
            mod.pair_backward(call.get("backward", "chunks")):
        if call.get("train"):
            x = msa.detach().requires_grad_(True)
            fam(x, mask).backward(g)
            _fetch(torch, x.grad, *(p.grad for p in fam.parameters()))
        else:
            with torch.no_grad():
                _fetch(torch, fam(msa, mask))
    _expect("last_variant", fam.last_variant, call["variant"])


def _opm_keep_o(torch, mod, call, sms):
    """_ext.opm_forward on outer_wg with keep_o (the kKeepO instances; call["norm"]: row mode 0 or a pair mode with the
    fused epilogue) in the call's 16-bit dtype: out and the kept O fetched."""
    model, msa, mask, _ = _opm_setup(torch, mod, call, sms)
    params = [p.detach() for p in model.parameters()]
    res = mod._ext.opm_forward(msa, mask, *params, model.layer_norm.eps, mod.ModelNew.ALL_VARIANTS.index("outer_wg"),
                               True, call["norm"], 1e-3, True, 0, keep_o=True)
    _expect("kept O", res[5] is not None, True)
    _fetch(torch, res[0], res[5])


def _opm_wo_kept(torch, mod, call, sms):
    """_ext.opm_backward_wo_kept alone: g (B N N, cz) and o (B N N, 1024) in the call's 16-bit dtype."""
    gen = torch.Generator().manual_seed(_seed(call))
    P, dt = call["B"] * call["N"] * call["N"], getattr(torch, call["dtype"])
    g = torch.randn(P, call["cz"], generator=gen).to(dt).cuda()
    o = torch.randn(P, 1024, generator=gen).to(dt).cuda()
    _fetch(torch, mod._ext.opm_backward_wo_kept(g, o))


def _opm_g_mem(torch, mod, call, sms):
    """_ext.opm_backward_g alone: g (B, N, N, cz) and wo (cz, 1024) in the call's 16-bit dtype, inv_denom (B, N)."""
    gen = torch.Generator().manual_seed(_seed(call))
    B, N, cz, dt = call["B"], call["N"], call["cz"], getattr(torch, call["dtype"])
    g = torch.randn(B, N, N, cz, generator=gen).to(dt).cuda()
    wo = torch.randn(cz, 1024, generator=gen).to(dt).cuda()
    inv_d = torch.rand(B, N, generator=gen).cuda()
    _fetch(torch, mod._ext.opm_backward_g(g, wo, inv_d))


def _opm_ln(torch, mod, call, sms):
    """_ext.opm_backward_ln alone over R = B S N rows: x_in (R, cm) in the call's dtype, da, db (R, 32) in call["dab"],
    the call's mask (make_mask) as (R), float32 LayerNorm and projection weights; da, db consumed where
    call["consume"]."""
    gen = torch.Generator().manual_seed(_seed(call))
    R, cm = call["B"] * call["S"] * call["N"], call["cm"]
    xin = torch.randn(R, cm, generator=gen).to(getattr(torch, call["dtype"])).cuda()
    da, db = (torch.randn(R, 32, generator=gen).to(getattr(torch, call["dab"])).cuda() for _ in range(2))
    mask = make_mask(torch, call["B"], call["S"], call["N"], call["mask"], call["mask_dtype"], gen).reshape(R).cuda()
    ln_w, ln_b = (torch.randn(cm, generator=gen).cuda() for _ in range(2))
    wa, wb = ((torch.randn(32, cm, generator=gen) / cm**0.5).cuda() for _ in range(2))
    da0 = da.clone()
    _fetch(torch, *mod._ext.opm_backward_ln(xin, da, db, mask, ln_w, ln_b, wa, wb, 1e-5, call["consume"]))
    # the partials fit in da, db (ln_part_fits) where (chunks of a tile's rows + 1) / 2 tiles per block are full tiles
    chunks = -(-(66 * cm + 64) // (32 * 32 * da.element_size() // 4))
    fits = call["consume"] and (chunks + 1) // 2 * min(-(-R // 32), sms) <= R // 32
    _expect("partials in da, db", not bool(torch.equal(da, da0)), fits)


def _opm_wo(torch, mod, call, sms):
    """_ext.opm_backward_wo alone: a, b (B, S, N, 32) fp32, 1 / denom in [0.1, 1.1), g (B, N, N, cz) in the call's
    dtype (ops "split" for float32, else the dtype's name), call["chunk"] bytes of G planes, call["split_j"]."""
    gen = torch.Generator().manual_seed(_seed(call))
    B, S, N, cz = call["B"], call["S"], call["N"], call["cz"]
    a, b = (torch.randn(B, S, N, 32, generator=gen).cuda() for _ in range(2))
    inv_d = (torch.rand(B, N, generator=gen) + 0.1).cuda()
    g = torch.randn(B, N, N, cz, generator=gen).to(getattr(torch, call["dtype"])).cuda()
    ops = "split" if call["dtype"] == F32 else call["dtype"]
    _fetch(torch, mod._ext.opm_backward_wo(a, b, inv_d, g, ops, call["chunk"], call["split_j"]))


def _opm_ab(torch, mod, call, sms):
    """_ext.opm_backward_ab alone: a, b (B, S, N, 32) fp32, 1 / denom in [0.1, 1.1), g (B, N, N, cz) in the call's
    16-bit dtype (ops its name), wo (cz, 1024) fp32, call["out_t"]."""
    gen = torch.Generator().manual_seed(_seed(call))
    B, S, N, cz = call["B"], call["S"], call["N"], call["cz"]
    a, b = (torch.randn(B, S, N, 32, generator=gen).cuda() for _ in range(2))
    inv_d = (torch.rand(B, N, generator=gen) + 0.1).cuda()
    g = torch.randn(B, N, N, cz, generator=gen).to(getattr(torch, call["dtype"])).cuda()
    wo = (torch.randn(cz, 1024, generator=gen) / cz**0.5).cuda()
    _fetch(torch, *mod._ext.opm_backward_ab(a, b, inv_d, g, wo, call["dtype"], call["out_t"]))


def _opm_pair_counts(torch, mod, call, sms):
    """The pair counts of the call's mask on the fp64 tensor cores (opm_pair_scale with counts 1, DMMA, or the call's
    "counts": 2, DMMA fed by the ring; 3, 16-bit masks on HMMA fed by the ring), OpenFold's (s1, s2)."""
    _, _, mask, _ = _opm_setup(torch, mod, call, sms)
    _fetch(torch, mod._ext.opm_pair_scale(mask, 1, 1e-3, call.get("counts", 1)))


_OPS = {"cm_forward": _cm_forward, "cm_backward": _cm_backward, "cm_train": _cm_train, "opm_forward": _opm_forward,
        "opm_backward": _opm_backward, "opm_rows": _opm_rows, "opm_train": _opm_train, "opm_pair": _opm_pair,
        "opm_pair_counts": _opm_pair_counts, "opm_ln": _opm_ln, "opm_wo": _opm_wo, "opm_ab": _opm_ab,
        "opm_keep_o": _opm_keep_o, "opm_wo_kept": _opm_wo_kept,
        "opm_g_mem": _opm_g_mem}


def run_case(torch, case, quick):
    """Every selected call of a case, each synchronised (a fault is then attributed to its call)."""
    mod = load_kernel_file(case.file)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for i, call in enumerate(case.selected_calls(quick)):
        try:
            _OPS[call["op"]](torch, mod, call, sms)
            torch.cuda.synchronize()
        except Exception as e:
            raise RuntimeError(f"{case.name} call {i}: {describe_call(call)}: {e}") from e


def _check_device(torch):
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        raise RuntimeError(f"the cases need a compute capability 9.0 GPU (wgmma kernels); this one is {cap}")


def _one_line(e):
    """An exception as one line: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0].strip()}" if lines else type(e).__name__


def worker_main(names, quick):
    """Run cases in this process (compute-sanitizer watches it), one after another: a status line per case
    (STATUS_LINE: ok, or FAILED with the error, after its traceback), on to the next case after a failing one; exit 1
    if any case failed."""
    import torch
    _check_device(torch)
    failed = 0
    for name in names:
        t0 = time.time()
        try:
            run_case(torch, CASES_BY_NAME[name], quick)
        except Exception as e:
            failed += 1
            print(traceback.format_exc(), flush=True)
            print(f"case {name}: FAILED in {time.time() - t0:.1f} s: {_one_line(e)}", flush=True)
            continue
        print(f"case {name}: ok in {time.time() - t0:.1f} s", flush=True)
    return 1 if failed else 0


# the worker's status line of a case
STATUS_LINE = re.compile(r"^case (?P<case>\S+): (?P<state>ok|FAILED) in (?P<seconds>[\d.]+) s(?:: (?P<error>.*))?$",
                         re.M)


def case_status(worker_output):
    """{case: None (ok) or its error} from the worker's status lines."""
    return {m["case"]: None if m["state"] == "ok" else (m["error"] or "failed").strip()
            for m in STATUS_LINE.finditer(worker_output or "")}


def census_main(names, out_path, quick):
    """Run cases without the sanitizer under torch.profiler; write {cases: {name: {kernels, error, seconds}},
    files: {file: {library, cuda_source, lineinfo}}, device} as JSON."""
    import torch
    _check_device(torch)
    result = {"cases": {}, "files": {}, "device": {}}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    result["device"] = {"name": props.name, "sms": props.multi_processor_count, "torch": torch.__version__}
    for name in names:
        case = CASES_BY_NAME[name]
        error, t0 = None, time.time()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            try:
                run_case(torch, case, quick)
                torch.cuda.synchronize()
            except Exception:
                error = traceback.format_exc()
        kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and not e.name.startswith(("Memcpy", "Memset"))})
        result["cases"][name] = {"kernels": kernels, "error": error, "seconds": round(time.time() - t0, 2)}
        if case.file in _MODULES and case.file not in result["files"]:
            mod = _MODULES[case.file]
            so = mod._ext.__file__
            flags = getattr(mod, "_CUDA_FLAGS", None)
            if flags is None and hasattr(mod, "_nvcc_flags"):
                flags = mod._nvcc_flags()
            result["files"][case.file] = {"library": so, "cuda_source": os.path.join(os.path.dirname(so), "cuda.cu"),
                                          "lineinfo": None if flags is None else "-lineinfo" in flags}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


# =============================================================================================
# compute-sanitizer's report text
# =============================================================================================
class Report:
    """One compute-sanitizer message: kind (e.g. "invalid __global__ read", "race Write/Read", "WAW hazard"),
    severity ("error", "warning" or ""), kernel (the function as printed, mangled with --demangle no), location
    and location2 (file:line as printed; location2: a race's second access), header (the first line), lines."""

    def __init__(self, header):
        self.header, self.lines = header, [header]
        self.kind, self.severity, self.kernel, self.location, self.location2 = "", "", None, None, None

    def __repr__(self):
        return f"Report({self.kind!r}, kernel={self.kernel!r}, location={self.location!r})"


# A frame: "at FUNC+0xOFF in FILE:LINE" (older releases: "FUNC:0xOFF"), "Device Frame: FUNC+0xOFF in FILE:LINE".
_FRAME = re.compile(r"(?:\bat\s+|Device Frame:\s*)(?P<func>\S.*?)[+:](?P<off>0x[0-9a-fA-F]+)"
                    r"(?:\s+in\s+(?P<loc>[^\s\[]+))?")
_KINDS = [
    (re.compile(r"Invalid (__\w+__) (read|write|atomic)"), "invalid {0} {1}"),
    (re.compile(r"Uninitialized (__\w+__) memory read"), "uninitialized {0} read"),
    (re.compile(r"Race reported between (\w+) access.*?\band (\w+) access", re.S), "race {0}/{1}"),
    (re.compile(r"Potential (RAW|WAR|WAW) hazard"), "{0} hazard"),
    (re.compile(r"Barrier error detected\.?\s*([^\n]*)"), "barrier error: {0}"),
    (re.compile(r"Warpgroup MMA sequence error detected\.?\s*([^\n]*)"), "wgmma sequence error: {0}"),
    (re.compile(r"Program hit (\w+)"), "CUDA API error {0}"),
    (re.compile(r"Internal Sanitizer Error"), "internal sanitizer error"),
    (re.compile(r"Malloc/Free error"), "malloc/free error"),
]
_SUMMARY_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_SUMMARY_RACES = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
# top-level lines that are no report: the banner, the summaries, and the lines saying the worker failed (its exit
# code says the same, and its own output says why)
_NOT_REPORTS = re.compile(r"COMPUTE-SANITIZER$|LEAK SUMMARY|Target application returned an error"
                          r"|Error: process didn't terminate successfully|Tracking kernels launched by child processes")


def _classify(report):
    text = "\n".join(report.lines)
    m = re.match(r"(error|warning|info)\b\s*:?\s*", report.header, re.I)
    report.severity = m.group(1).lower() if m else ""
    for pattern, fmt in _KINDS:
        k = pattern.search(text)
        if k:
            report.kind = fmt.format(*(g.strip() for g in k.groups())).rstrip(": ")
            break
    else:  # an unknown message: its first line, addresses dropped
        report.kind = re.sub(r"0x[0-9a-fA-F]+", "0x..", report.header[m.end() if m else 0:])[:100]
    frames, device = [], []
    for line in report.lines:
        if line.startswith(("Host Frame", "Saved host backtrace")):
            continue
        f = _FRAME.search(line)
        if f:
            (device if line.startswith("Device Frame") else frames).append(f)
    if frames:
        report.kernel, report.location = frames[0].group("func"), frames[0].group("loc")
        if len(frames) > 1 and report.kind.startswith("race"):
            report.location2 = frames[1].group("loc")
    if device:  # the access was in a called function: the outermost frame is the kernel
        report.kernel = device[-1].group("func")
        report.location = report.location or device[0].group("loc")


def parse_sanitizer_log(text):
    """compute-sanitizer's log text -> (reports, summary). summary: {"errors": N} from ERROR SUMMARY, {"hazards",
    "race_errors", "race_warnings"} from RACECHECK SUMMARY; neither when the tool did not finish. Lines without the
    ========= prefix (program output) are skipped. A message starts at a line with one space after the prefix and
    takes the more indented lines after it; any such line that is not a banner or summary is a report (an unknown
    message is never taken for clean)."""
    reports, summary, current = [], {}, None
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(PREFIX):
            continue
        body = line[len(PREFIX):]
        if not body.strip():  # a bare prefix separates messages
            current = None
            continue
        if body.startswith("  "):  # a continuation line of the open message (none open: skipped)
            if current is not None:
                current.lines.append(body.strip())
            continue
        body = body.strip()
        m = _SUMMARY_ERRORS.match(body)
        if m:
            summary["errors"] = int(m.group(1))
            current = None
            continue
        m = _SUMMARY_RACES.match(body)
        if m:
            summary.update(hazards=int(m.group(1)), race_errors=int(m.group(2)), race_warnings=int(m.group(3)))
            current = None
            continue
        if _NOT_REPORTS.match(body):
            current = None
            continue
        current = Report(body)
        reports.append(current)
    for r in reports:
        _classify(r)
    return reports, summary


class RunResult:
    """A sanitized run (a tool and one or more cases): its reports, failure (why the whole run proves nothing, or
    None), case_failures ({case: why}: the cases whose status line says FAILED and, in a run that did not fail as a
    whole, those without a status line), truncated (print limit reached: kernels without a report of their own are
    not proven clean), seconds."""

    def __init__(self, reports=(), failure=None, truncated=False, seconds=0.0, case_failures=None):
        self.reports, self.failure, self.truncated, self.seconds = list(reports), failure, truncated, seconds
        self.case_failures = dict(case_failures or {})


def judge_run(rc, log_text, worker_output, print_limit, seconds=0.0, timed_out=False, cases=None):
    """A RunResult from compute-sanitizer's exit code rc, its log text and the worker's output. cases: the cases
    the worker ran, each judged by its status line (none: the worker stopped before the case ended); a worker exit
    that failed cases explain is no failure of the run. Without cases a failing worker fails the run."""
    reports, summary = parse_sanitizer_log(log_text or "")
    failure = None
    tail = " | ".join(l for l in (worker_output or "").strip().splitlines()[-3:])
    if timed_out:
        failure = f"timed out after {seconds:.0f} s"
    elif not log_text:
        failure = f"no compute-sanitizer output (exit {rc}): {tail}"
    elif not summary:  # the tool stopped early: its own messages (no kernel named) say why
        said = [r.header for r in reports if not r.kernel]
        reports = [r for r in reports if r.kernel]
        failure = f"compute-sanitizer did not finish (no summary line; exit {rc}): {' | '.join(said[:2]) or tail}"
    elif rc not in (0, ERROR_EXIT):
        failure = f"worker exit {rc}: {tail}"
    case_failures = {}
    if cases is not None:
        status = case_status(worker_output)
        if failure is None or failure.startswith("worker exit"):
            case_failures = {c: status[c] if c in status else f"did not finish (worker exit {rc}): {tail}"
                             for c in cases if status.get(c, "") is not None}
            if case_failures:  # the failed cases say why the worker failed: the others' results stand
                failure = None
        else:  # the run proves nothing: its own failed cases are named all the same
            case_failures = {c: e for c, e in status.items() if c in cases and e is not None}
            if len(cases) > 1:
                done = sum(c in status for c in cases)
                failure += f" ({done} of {len(cases)} cases finished)"
    counted = summary.get("errors", 0) or summary.get("race_errors", 0) + summary.get("race_warnings", 0)
    if (counted or rc == ERROR_EXIT) and not reports:
        r = Report(f"{counted} errors counted in the summary but no report parsed (exit {rc})")
        r.kind = "unparsed errors"
        reports.append(r)
    truncated = print_limit > 0 and len(reports) >= print_limit
    return RunResult(reports, failure, truncated, seconds, case_failures)


# =============================================================================================
# Kernel names, the libraries' kernels, source lines
# =============================================================================================
def strip_params(name):
    """A demangled function name without its return type ("void ") and parameter list."""
    name = name.strip()
    if name.startswith("void "):
        name = name[5:]
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                return name[:i].strip()
    return name


def kernel_key(demangled):
    """The key that matches a profiler kernel name (libstdc++'s demangler) with c++filt's or cu++filt's: no return
    type, no parameters, no spaces."""
    return re.sub(r"\s+", "", strip_params(demangled))


def demangler_candidates(sanitizer=None):
    """Where a demangler is looked for, in order: c++filt on PATH (binutils), else CUDA's cu++filt (the same
    Itanium demangling) beside compute-sanitizer (its directory and the toolkit's bin above a
    compute-sanitizer/ directory), in CUDA_HOME/bin, in /usr/local/cuda/bin, on PATH."""
    found = [shutil.which("c++filt")]
    dirs = []
    if sanitizer:
        for d in (os.path.dirname(os.path.abspath(sanitizer)), os.path.dirname(os.path.realpath(sanitizer))):
            dirs += [d, os.path.join(os.path.dirname(d), "bin")]
    dirs += [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin"), "/usr/local/cuda/bin"]
    found += [os.path.join(d, "cu++filt") for d in dirs] + [shutil.which("cu++filt")]
    return list(dict.fromkeys(c for c in found if c))


def find_demangler(sanitizer=None):
    """The first demangler of demangler_candidates that exists and can be run, or None."""
    for c in demangler_candidates(sanitizer):
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _demangler_output(tool, names):
    try:
        out = subprocess.run([tool] + names, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines() if out.returncode == 0 else None


def demangle(names, tool=None):
    """Each name demangled by tool (find_demangler's path; the name itself where tool is None or fails), the names
    given as arguments (c++filt and cu++filt both print one line per argument), 64 at a time, one at a time where
    a batch's output has another number of lines."""
    names = list(names)
    if not names or not tool:
        return names
    out = []
    for i in range(0, len(names), 64):
        batch = names[i:i + 64]
        got = _demangler_output(tool, batch)
        if got is None or len(got) != len(batch):
            got = []
            for n in batch:
                one = _demangler_output(tool, [n])
                got.append(one[0].strip() if one and len(one) == 1 and one[0].strip() else n)
        out += got
    return out


def parse_symbols(text):
    """The kernels (ENTRY functions) in `cuobjdump -symbols` output: {arch: set of mangled names}. Two spellings:
    "FUNC GLOBAL DEFAULT ENTRY name" and (CUDA 13's cuobjdump) "STT_FUNC STB_GLOBAL STO_ENTRY name"."""
    kernels, arch = {}, None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("arch = "):
            arch = s.split("=", 1)[1].strip()
            continue
        f = s.split()
        if len(f) >= 3 and f[0] in ("FUNC", "STT_FUNC") and ({"ENTRY", "STO_ENTRY"} & set(f[1:-1])):
            kernels.setdefault(arch, set()).add(f[-1])
    return kernels


def library_kernels(so):
    """Mangled names of every kernel in a built extension library (cuobjdump from tools/sass_digest.py's search:
    CUDA_HOME/bin, PATH, Triton's copy); None without cuobjdump."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import sass_digest
        tool = sass_digest._tool("cuobjdump")
    except SystemExit:
        return None
    finally:
        sys.path.pop(0)
    text = subprocess.run([tool, "-symbols", so], capture_output=True, text=True).stdout
    return set().union(*parse_symbols(text).values()) if text else set()


def py_location(location, cu_lines, py_lines, py_name):
    """"cuda.cu:812" -> "contact_map.py:925": the line of the built CUDA source found in the kernel file (the
    source string is the file's text, with placeholders replaced and three #include lines before it); where it
    occurs more than once, the occurrence whose neighbouring lines match best. None if not found or ambiguous."""
    m = re.search(r":(\d+)(?::\d+)?$", location or "")
    if not m or not cu_lines:
        return None
    n = int(m.group(1)) - 1
    if not 0 <= n < len(cu_lines) or not cu_lines[n].strip():
        return None
    want = cu_lines[n].strip()
    found = [i for i, l in enumerate(py_lines) if l.strip() == want]
    if len(found) > 1:
        def score(i):
            return sum(0 <= n + d < len(cu_lines) and 0 <= i + d < len(py_lines)
                       and cu_lines[n + d].strip() == py_lines[i + d].strip() for d in range(-6, 7))
        scores = sorted(((score(i), i) for i in found), reverse=True)
        found = [scores[0][1]] if scores[0][0] > scores[1][0] else []
    return f"{py_name}:{found[0] + 1}" if len(found) == 1 else None


# =============================================================================================
# The verdict: one line per (tool, kernel)
# =============================================================================================
def describe_report(report, where=lambda loc: loc):
    """kind, location (and a race's second location) as printed, each followed by where() of it."""
    text = report.kind or report.header
    if report.location:
        text += f" at {where(report.location)}"
    if report.location2:
        text += f" and {where(report.location2)}"
    return text


def verdict_line(tool, label, file, name, detail=""):
    return f"{tool:<9}  {label:<11}  {file:<18}  {name}" + (f"  {detail}" if detail else "")


def run_label(run, cases):
    """How a run is named in the verdict: "case NAME" for a run of one case of that name, else "run NAME"."""
    return f"case {run}" if list(cases) == [run] else f"run {run}"


def summarise(tools, cases, case_files, case_kernels, results, names, kernel_file, census_errors=None, where=None,
              runs=None):
    """The verdict's lines, whether it fails, and the counts of clean / reported / not-checked (tool, kernel) pairs.

    tools, cases: the order of the lines; case_files: {case: kernel file}; case_kernels: {case: set of the
    libraries' kernels (mangled names) that the census saw it launch}; runs: {run: its cases} (default: a run per
    case, named as the case); results: {(tool, run): RunResult}; names: {kernel: display name}; kernel_file:
    {kernel: file} for every kernel of the libraries; census_errors: {case: why it fails without the sanitizer};
    where(location, file): the location with the kernel file's line. A kernel is clean for a tool when no report
    names it and every case that launched it ran to its end in a run that finished below the print limit."""
    lines, failed = [], False
    counts = {"clean": 0, "report": 0, "not checked": 0}
    census_errors = census_errors or {}
    where = where or (lambda loc, file: loc)
    runs = runs if runs is not None else {c: [c] for c in cases}
    order = {c: i for i, c in enumerate(cases)}
    for case in cases:
        if case in census_errors:
            failed = True
            lines.append(verdict_line("all", "FAILED", case_files[case], f"case {case}",
                                      f"fails without the sanitizer: {census_errors[case]}"))
    for tool in tools:
        reported, launched, unchecked = {}, {}, {}
        for run, run_cases in sorted(runs.items(), key=lambda rc: min(order.get(c, 0) for c in rc[1])):
            result = results.get((tool, run))
            if result is None:
                continue
            label = run_label(run, run_cases)
            file = case_files[run_cases[0]]
            for r in result.reports:
                # a kernel of neither library (PyTorch's), or none named: keyed by what the report printed
                k = r.kernel if r.kernel in kernel_file else "?" + (r.kernel or "(no kernel named)")
                reported.setdefault(k, []).append((run, file, r))
            if result.failure:
                failed = True
                lines.append(verdict_line(tool, "FAILED", file, label, result.failure))
            for case in run_cases:
                if case in result.case_failures:
                    failed = True
                    lines.append(verdict_line(tool, "FAILED", case_files[case], f"case {case}",
                                              result.case_failures[case]))
                for k in case_kernels.get(case, ()):
                    launched.setdefault(k, []).append(case)
                    why = (f"case {case} failed" if case in result.case_failures else
                           f"{label} failed" if result.failure else
                           f"{label} hit the print limit" if result.truncated else None)
                    if why:
                        unchecked.setdefault(k, why)
        order_k = sorted(set(launched) | set(reported), key=lambda k: (kernel_file.get(k, "~"), names.get(k, k)))
        for k in order_k:
            name = names.get(k, k[1:] if k.startswith("?") else k)
            if k in reported:
                run, file, r = reported[k][0]
                file = kernel_file.get(k, file)
                n_runs = len({x for x, _, _ in reported[k]})
                detail = (f"{describe_report(r, lambda loc: where(loc, file))}  "
                          f"[{run_label(run, runs[run])}; {len(reported[k])} reports in {n_runs} runs]")
                lines.append(verdict_line(tool, "REPORT", kernel_file.get(k, "other"), name, detail))
                counts["report"] += 1
                failed = True
            elif k in unchecked:
                lines.append(verdict_line(tool, "NOT CHECKED", kernel_file[k], name, unchecked[k]))
                counts["not checked"] += 1
                failed = True
            else:
                lines.append(verdict_line(tool, "clean", kernel_file[k], name, f"({len(launched[k])} cases)"))
                counts["clean"] += 1
    return lines, failed, counts


# =============================================================================================
# Running compute-sanitizer
# =============================================================================================
def find_sanitizer(explicit=None):
    candidates = [explicit, shutil.which("compute-sanitizer"),
                  os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer"),
                  "/usr/local/cuda/bin/compute-sanitizer"]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    return None


def help_options(help_text):
    """The long options a compute-sanitizer --help text lists (None for no text: keep every option)."""
    if not help_text:
        return None
    return set(re.findall(r"^\s+(?:-\w \[ )?(--[\w-]+)", help_text, re.M))


# (option, value) per tool: see the module docstring for the reasons. {port}, {workers}, {print_limit} are filled
# per run.
COMMON_OPTIONS = [("--error-exitcode", str(ERROR_EXIT)), ("--print-limit", "{print_limit}"), ("--demangle", "no"),
                  ("--show-backtrace", "device"), ("--target-processes", "application-only"),
                  # no kernel here allocates on the device heap; with the check on, memcheck and initcheck turn CUDA's
                  # lazy module loading off, and every worker would load and instrument all of PyTorch's kernels
                  ("--check-device-heap", "no"),
                  # a worker under load may take long to reach CUDA; the sweep's own timeout bounds the run
                  ("--launch-timeout", "300"),
                  # a base port per parallel slot: runs at once would otherwise all start at 49152
                  ("--port", "{port}")]
TOOL_OPTIONS = {
    "memcheck": [("--padding", "4096"), ("--report-api-errors", "no"), ("--check-tensor-ops", "yes")],
    "racecheck": [("--racecheck-report", "analysis"), ("--racecheck-num-workers", "{workers}"),
                  ("--check-tensor-ops", "yes")],
    "synccheck": [],
    "initcheck": [],
}


def sanitizer_command(sanitizer, tool, log_file, worker_args, supported=None, print_limit=1000, port=49152,
                      workers=2, extra=()):
    """The command of one sanitized run; options the installed tool does not list (supported) are dropped, and so
    are those that extra (--sanitizer-args) gives again: an option given twice is an error to compute-sanitizer."""
    cmd = [sanitizer, "--tool", tool, "--log-file", log_file]
    given = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
    for opt, value in COMMON_OPTIONS + TOOL_OPTIONS[tool]:
        if (supported is None or opt in supported) and opt not in given:
            cmd += [opt, value.format(port=port, workers=workers, print_limit=print_limit)]
    return cmd + list(extra) + [sys.executable, os.path.relpath(os.path.abspath(__file__), ROOT)] + worker_args


def worker_env():
    env = dict(os.environ)
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # many workers share the CPU cores
    env.setdefault("CUDA_MODULE_LOADING", "LAZY")  # only the kernels a worker launches are loaded and instrumented
    return env


def _run(cmd, out_path, timeout):
    """Run cmd in its own process group (a timeout ends the sanitizer and its target together); its output goes
    to out_path. Returns (exit code, seconds, timed out)."""
    t0 = time.time()
    with open(out_path, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(), stdout=out, stderr=subprocess.STDOUT,
                             preexec_fn=os.setsid)
        try:
            rc = p.wait(timeout=timeout)
            return rc, time.time() - t0, False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            return p.returncode, time.time() - t0, True


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _case_weight(case, quick):
    """A rough cost for ordering the runs (longest first packs the parallel slots better)."""
    return len(case.selected_calls(quick)) + 4 * sum(bool(c.get("walk")) for c in case.selected_calls(quick))


def plan_runs(cases, per_case=False, skip=()):
    """{run name: its case names}: by default one run per kernel file with all its cases (named as the file), with
    per_case one run per case (named as the case); the cases named in skip left out."""
    runs = {}
    for case in cases:
        if case.name not in skip:
            runs.setdefault(case.name if per_case else case.file, []).append(case.name)
    return runs


def plan_line(n_cases, runs, per_case, n_tools, jobs):
    """The plan in one line: cases, runs per tool, runs at a time."""
    n = len(runs) * n_tools

    def count(k, noun):
        return f"{k} {noun}{'' if k == 1 else 's'}"
    return (f"{count(n_cases, 'case')} in {count(len(runs), 'run')} per tool (one per "
            f"{'case' if per_case else 'kernel file'}) x {count(n_tools, 'tool')} = {count(n, 'sanitized run')}, "
            f"{min(jobs, n)} at a time")


def run_command(sanitizer, tool, run, run_cases, log_dir, quick, supported, print_limit, port=49152, workers=2,
                extra=()):
    """(log file, worker output file, command) of the sanitized run of run_cases as run, logs TOOL-RUN.*."""
    log = os.path.join(log_dir, f"{tool}-{run}.log")
    out = os.path.join(log_dir, f"{tool}-{run}.out")
    cmd = sanitizer_command(sanitizer, tool, log, ["--worker"] + list(run_cases) + (["--quick"] if quick else []),
                            supported, print_limit, port=port, workers=workers, extra=extra)
    return log, out, cmd


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated tools (default: all four)")
    p.add_argument("--files", default=",".join(FILES), help="comma-separated kernel files (default: both)")
    p.add_argument("--cases", default="", help="only cases whose name contains one of these comma-separated words")
    p.add_argument("--quick", action="store_true", help="leave out the calls that walk many tiles per block")
    p.add_argument("--log-dir", help="where the logs go (default: a new temporary directory)")
    p.add_argument("--per-case", action="store_true",
                   help="one sanitized process per (tool, case) instead of one per (tool, kernel file)")
    p.add_argument("--jobs", type=int, default=8, help="sanitized runs at a time (default 8)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run, the census's too (default 900)")
    p.add_argument("--print-limit", type=int, default=1000, help="compute-sanitizer's --print-limit (default 1000)")
    p.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, then CUDA_HOME/bin)")
    p.add_argument("--sanitizer-args", default="", help="more compute-sanitizer options, as one shell-quoted string")
    p.add_argument("--dry-run", action="store_true", help="list the cases and the commands; run nothing")
    p.add_argument("--worker", nargs="+", metavar="CASE", help=argparse.SUPPRESS)
    p.add_argument("--census", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in args.tools if t not in TOOLS]
    if bad:
        p.error(f"unknown tools {bad}; choose from {TOOLS}")
    args.files = [f.strip().removesuffix(".py") for f in args.files.split(",") if f.strip()]
    bad = [f for f in args.files if f not in FILES]
    if bad:
        p.error(f"unknown files {bad}; choose from {tuple(FILES)}")
    words = [w.strip() for w in args.cases.split(",") if w.strip()]
    args.selected = [c for c in CASES if c.file in args.files and (not words or any(w in c.name for w in words))
                     and c.selected_calls(args.quick)]
    if not args.selected and not args.worker:
        p.error("no case selected")
    return args


def dry_run(args, sanitizer, supported):
    quick = ["--quick"] if args.quick else []
    log_dir = args.log_dir or "LOG_DIR"
    runs = plan_runs(args.selected, args.per_case)
    print(f"{plan_line(len(args.selected), runs, args.per_case, len(args.tools), args.jobs)}; walk: B = the "
          f"smallest batch with that many tiles per SM\n")
    for case in args.selected:
        calls = case.selected_calls(args.quick)
        print(f"{case.name}  ({FILES[case.file]}: {case.what}; {len(calls)} calls)")
        for c in calls:
            print(f"    {describe_call(c)}")
    print("\ncensus (no sanitizer, one process per file):")
    for file in args.files:
        names = [c.name for c in args.selected if c.file == file]
        if names:
            cmd = [sys.executable, "tools/sanitize_sweep.py", "--census", f"{log_dir}/census-{file}.json",
                   "--worker"] + names + quick
            print("    " + shlex.join(cmd))
    env = " ".join(f"{k}={v}" for k, v in worker_env().items() if os.environ.get(k) != v)
    print(f"\nsanitized runs (environment: {env}):")
    if supported is None:
        print("    (compute-sanitizer not found here: every option shown; at run time those its --help does not list"
              " are dropped)")
    for tool in args.tools:
        for run, run_cases in runs.items():
            _, _, cmd = run_command(sanitizer or "compute-sanitizer", tool, run, run_cases, log_dir, args.quick,
                                    supported, args.print_limit, extra=shlex.split(args.sanitizer_args))
            print("    " + shlex.join(cmd))
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        if args.census:
            return census_main(args.worker, args.census, args.quick)
        return worker_main(args.worker, args.quick)

    sanitizer = find_sanitizer(args.sanitizer)
    help_text = version = ""
    if sanitizer:
        help_text = subprocess.run([sanitizer, "--help"], capture_output=True, text=True).stdout
        version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        version = version[-1] if version else "unknown version"
    supported = help_options(help_text)
    if args.dry_run:
        return dry_run(args, sanitizer, supported)
    if not sanitizer:
        print("sanitize_sweep: compute-sanitizer not found (--sanitizer, PATH, CUDA_HOME/bin)", file=sys.stderr)
        return 2
    dropped = [] if supported is None else sorted({o for o, _ in COMMON_OPTIONS + sum(TOOL_OPTIONS.values(), [])}
                                                  - supported)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="sanitize_sweep_")
    os.makedirs(log_dir, exist_ok=True)
    quick = ["--quick"] if args.quick else []
    t_start = time.time()

    # 1. census: without the sanitizer, one process per file, both at once
    files = sorted({c.file for c in args.selected})
    census = {"cases": {}, "files": {}, "device": {}}
    with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
        futures = {}
        for file in files:
            path = os.path.join(log_dir, f"census-{file}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--census", path, "--worker"] + \
                  [c.name for c in args.selected if c.file == file] + quick
            futures[pool.submit(_run, cmd, os.path.join(log_dir, f"census-{file}.out"), args.timeout)] = (file, path)
        for fut in concurrent.futures.as_completed(futures):
            file, path = futures[fut]
            rc, seconds, timed_out = fut.result()
            part = json.loads(_read(path) or "{}")
            if not part:
                print(f"sanitize_sweep: the census of {file} failed (exit {rc}{', timed out' if timed_out else ''}); "
                      f"see {os.path.join(log_dir, f'census-{file}.out')}", file=sys.stderr)
                return 1
            for key in census:
                census[key].update(part.get(key, {}))
    dev = census["device"]
    census_errors = {}
    for case in args.selected:
        entry = census["cases"].get(case.name, {"kernels": [], "error": "not run"})
        if entry.get("error"):
            census_errors[case.name] = entry["error"].strip().splitlines()[-1]
    runs = plan_runs(args.selected, args.per_case, skip=census_errors)
    print(f"sanitize_sweep: {dev.get('name')} ({dev.get('sms')} SMs), torch {dev.get('torch')}, {version}; "
          f"{plan_line(len(args.selected) - len(census_errors), runs, args.per_case, len(args.tools), args.jobs)}; "
          f"logs in {log_dir}")
    if dropped:
        print(f"  options this compute-sanitizer does not list, left out: {' '.join(dropped)}")
    demangler = find_demangler(sanitizer)
    if demangler is None:
        print("  no c++filt on PATH and no cu++filt (beside compute-sanitizer, CUDA_HOME/bin, PATH): kernel names "
              "stay mangled and are not matched to the census's")
    for file, info in census["files"].items():
        if info.get("lineinfo") is False:
            print(f"  {FILES[file]} was built without -lineinfo: reports name SASS offsets, not source lines")

    # the libraries' kernels: mangled names, display names, and the key that matches the profiler's names
    kernel_file, names, key_to_kernel = {}, {}, {}
    for file, info in census["files"].items():
        ks = library_kernels(info["library"])
        if ks is None:
            print("  no cuobjdump: the kernels no case launched are not listed")
            ks = set()
        ks = sorted(ks)
        for k, d in zip(ks, demangle(ks, demangler)):
            kernel_file[k], names[k] = file, strip_params(d)
            key_to_kernel[kernel_key(d)] = k
    case_kernels = {}
    for case in args.selected:
        entry = census["cases"].get(case.name, {"kernels": []})
        case_kernels[case.name] = {key_to_kernel[kernel_key(n)] for n in entry["kernels"]
                                   if kernel_key(n) in key_to_kernel}

    # 2. the sanitized runs, longest first, each on a free slot (its own base port)
    weight = {run: sum(_case_weight(CASES_BY_NAME[c], args.quick) for c in cs) for run, cs in runs.items()}
    jobs = sorted(((t, run) for t in args.tools for run in runs),
                  key=lambda tr: -(weight[tr[1]] * (3 if tr[0] == "racecheck" else 2)))
    slots = list(range(args.jobs))
    workers = max(2, (os.cpu_count() or 4) // args.jobs)  # racecheck's host threads per run
    extra = shlex.split(args.sanitizer_args)
    results = {}

    def run_one(tool, run):
        slot = slots.pop()
        try:
            log, out, cmd = run_command(sanitizer, tool, run, runs[run], log_dir, args.quick, supported,
                                        args.print_limit, port=49152 + 20 * slot, workers=workers, extra=extra)
            rc, seconds, timed_out = _run(cmd, out, args.timeout)
            return judge_run(rc, _read(log), _read(out), args.print_limit, seconds, timed_out, cases=runs[run])
        finally:
            slots.append(slot)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_one, t, run): (t, run) for t, run in jobs}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            tool, run = futures[fut]
            r = results[(tool, run)] = fut.result()
            state = ("FAILED" if r.failure else f"{len(r.reports)} reports" if r.reports else
                     "no reports" if r.case_failures else "clean")
            if r.case_failures:
                state += f", {len(r.case_failures)} of {len(runs[run])} cases failed"
            print(f"  [{i:3d}/{len(jobs)}] {tool:<9} {run:<22} {r.seconds:6.1f} s  {state}", flush=True)

    # 3. the verdict
    sources = {file: (_read(info["cuda_source"]).splitlines(), _read(os.path.join(ROOT, FILES[file])).splitlines())
               for file, info in census["files"].items()}

    def where(loc, file):
        cu, py = sources.get(file, ([], []))
        mapped = py_location(loc, cu, py, FILES[file]) if os.path.basename(loc).startswith("cuda.cu") else None
        return f"{loc} ({mapped})" if mapped else loc

    # reports in kernels of neither library: their names demangled too
    foreign = sorted({r.kernel for run in results.values() for r in run.reports
                      if r.kernel and r.kernel not in kernel_file})
    names.update({"?" + k: strip_params(d) for k, d in zip(foreign, demangle(foreign, demangler))})
    lines, failed, counts = summarise(args.tools, [c.name for c in args.selected],
                                      {c.name: c.file for c in args.selected}, case_kernels, results, names,
                                      kernel_file, census_errors, where, runs=runs)
    launched = set().union(*case_kernels.values()) if case_kernels else set()
    if not launched:  # nothing to call clean: the names did not match (no demangler?) or no case ran
        failed = True
        lines.append("no kernel the cases launched was matched to the libraries' kernels (demangler: "
                     f"{demangler or 'none found'})")
    never = sorted((k for k in kernel_file if k not in launched), key=lambda k: (kernel_file[k], names[k]))
    lines += [verdict_line("-", "never run", kernel_file[k], names[k]) for k in never]
    lines.append(f"summary: {len(launched)} kernels launched x {len(args.tools)} tools: {counts['clean']} clean, "
                 f"{counts['report']} with reports, {counts['not checked']} not checked; {len(never)} library kernels "
                 f"no case launched; {len(jobs)} runs in {time.time() - t_start:.0f} s -> "
                 f"{'FAIL' if failed else 'PASS'}")
    print("\n".join(lines))
    with open(os.path.join(log_dir, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
