"""CPU tests of tools/sanitize_sweep.py: its reading of compute-sanitizer's reports (samples written in the
tool's output format, with kernel names as --demangle no prints them), the verdict lines, the commands it builds,
and its case table against the kernel files' variant tables (read with ast: importing a kernel file builds it)."""
import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_sweep():
    spec = importlib.util.spec_from_file_location("sanitize_sweep", os.path.join(ROOT, "tools", "sanitize_sweep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sw = _load_sweep()

# Itanium-mangled names of kernels of both files and of a PyTorch kernel, as nvcc emits them
MMA = "_ZN11contact_map22contact_map_mma_kernelILi16ELNS_7WFormatE0ELi512ELi2ELb0EEEvPKfPfS3_S3_S3_S3_S3_S3_S3_S3_fiiiiib"
MMA_PROD = "_ZN11contact_map22contact_map_mma_kernelILi32ELNS_7WFormatE1ELi512ELi1ELb1EEEvPKfPfS3_S3_S3_S3_S3_S3_S3_S3_fiiiiib"
PREP = "_ZN3opm15opm_prep_kernelILi32EEEvPKfPKviS2_Pfxi"
OUTER_WG = "_ZN3opm19opm_outer_wg_kernelI6__halfEEvPKvS3_S3_PKfS5_PT_xxxxxii"
TORCH_COPY = "_ZN2at6native12_GLOBAL__N_129vectorized_elementwise_kernelILi4ENS1_11CopyFunctorEEEviT0_"

MEMCHECK_LOG = f"""========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at {PREP}+0x1a70 in cuda.cu:812
=========     by thread (37,0,0) in block (3,0,0)
=========     Address 0x7f3a1c0011f0 is out of bounds
=========     and is 1,008 bytes after the nearest allocation at 0x7f3a1c000e00 of size 16 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cudaLaunchKernel [0x75230] in libcudart.so.13
=========         Host Frame: void opm::launch_prep<32>(at::Tensor const&) [0x1b2c0] in outer_product_mean_0a1b2c3d4e5f.so
=========
========= Invalid __shared__ write of size 4 bytes
=========     at {MMA}+0x3f0 in cuda.cu:1101
=========     by thread (130,0,0) in block (0,0,0)
=========     Address 0x9c40 is out of bounds
=========
========= ERROR SUMMARY: 2 errors
"""

# an access inside a function the compiler did not inline: the device backtrace names the kernel last
MEMCHECK_CALLED_FUNCTION_LOG = f"""========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at _ZN11contact_map10write_tileILi4EEEvPfPKffiiii+0xb0 in cuda.cu:985
=========     by thread (3,0,0) in block (7,0,0)
=========     Address 0x7cc43aa00400 is out of bounds
=========     and is 0 bytes after the nearest allocation at 0x7cc43aa00000 of size 1,024 bytes
=========         Device Frame: {MMA_PROD}+0x2f30 in cuda.cu:1160
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cudaLaunchKernel [0x75230] in libcudart.so.13
=========
========= ERROR SUMMARY: 1 error
"""

RACECHECK_ANALYSIS_LOG = f"""========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at {OUTER_WG}+0x2c80 in cuda.cu:2801
=========     and Read access at {OUTER_WG}+0x3a10 in cuda.cu:2843 [512 hazards]
=========
========= Warning: Race reported between Read access at {MMA}+0x900 in cuda.cu:1075
=========     and Write access at {MMA}+0x1210 in cuda.cu:1130 [32 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""

RACECHECK_HAZARD_LOG = f"""========= COMPUTE-SANITIZER
========= ERROR: Potential WAR hazard detected at __shared__ 0x1a0 in block (5,0,0) :
=========     Read Thread (64,0,0) at {OUTER_WG}+0x3a10 in cuda.cu:2843
=========     Write Thread (288,0,0) at {OUTER_WG}+0x2c80 in cuda.cu:2801
=========     Current Value : 0, Incoming Value : 1065353216
=========
========= Warning: (Warp Level Programming) Potential RAW hazard detected at __shared__ 0x8c in block (0,0,0) :
=========     Write Thread (35,0,0) at {MMA}+0x90 in cuda.cu:1044
=========     Read Thread (32,0,0) at {MMA}+0x120 in cuda.cu:1056
=========     Current Value : 35
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""

SYNCCHECK_LOG = f"""========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in block
=========     at {MMA_PROD}+0x11f0 in cuda.cu:1098
=========     by thread (32,0,0) in block (0,0,0)
=========
========= Warpgroup MMA sequence error detected. Warps of the warpgroup executed different wgmma instructions
=========     at {OUTER_WG}+0x5e00 in cuda.cu:2790
=========     by thread (128,0,0) in block (2,0,0)
=========
========= ERROR SUMMARY: 2 errors
"""

# PyTorch's copy kernel reading an output element no kernel of ours wrote
INITCHECK_LOG = f"""========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at {TORCH_COPY}+0x70
=========     by thread (31,0,0) in block (1,0,0)
=========     Address 0x7f3c7ec000fc
=========
========= ERROR SUMMARY: 1 error
"""

CLEAN_LOG = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"


# ------------------------------------------------------------------------------------------------
# reading the reports
# ------------------------------------------------------------------------------------------------
def test_memcheck_reports_name_kernel_type_and_source_line():
    reports, summary = sw.parse_sanitizer_log(MEMCHECK_LOG)
    assert summary == {"errors": 2}
    assert [(r.kind, r.kernel, r.location) for r in reports] == [
        ("invalid __global__ read", PREP, "cuda.cu:812"),
        ("invalid __shared__ write", MMA, "cuda.cu:1101")]
    assert reports[0].location2 is None and reports[0].severity == ""
    # the host frames and the address lines stay with their report, none starts a report
    assert len(reports[0].lines) == 8 and reports[0].lines[-1].startswith("Host Frame")


def test_report_in_a_called_function_is_the_kernels():
    (r,), _ = sw.parse_sanitizer_log(MEMCHECK_CALLED_FUNCTION_LOG)
    assert r.kind == "invalid __global__ write"
    assert r.kernel == MMA_PROD            # the outermost device frame
    assert r.location == "cuda.cu:985"     # where the access was


def test_older_frame_format():
    text = ("========= Invalid __global__ write of size 4 bytes\n"
            "=========     at unaligned_kernel():0x160 in memcheck_demo.cu:6\n"
            "=========     by thread (0,0,0) in block (0,0,0)\n"
            "=========     Address 0x7f6510c00001 is misaligned\n"
            "=========\n========= ERROR SUMMARY: 1 error\n")
    (r,), _ = sw.parse_sanitizer_log(text)
    assert (r.kind, r.kernel, r.location) == ("invalid __global__ write", "unaligned_kernel()", "memcheck_demo.cu:6")


def test_racecheck_analysis_reports_both_accesses():
    reports, summary = sw.parse_sanitizer_log(RACECHECK_ANALYSIS_LOG)
    assert summary == {"hazards": 2, "race_errors": 1, "race_warnings": 1}
    a, b = reports
    assert (a.kind, a.severity, a.kernel, a.location, a.location2) == (
        "race Write/Read", "error", OUTER_WG, "cuda.cu:2801", "cuda.cu:2843")
    assert (b.kind, b.severity, b.kernel, b.location, b.location2) == (
        "race Read/Write", "warning", MMA, "cuda.cu:1075", "cuda.cu:1130")


def test_racecheck_hazard_reports():
    (a, b), _ = sw.parse_sanitizer_log(RACECHECK_HAZARD_LOG)
    assert (a.kind, a.severity, a.kernel, a.location) == ("WAR hazard", "error", OUTER_WG, "cuda.cu:2843")
    assert (b.kind, b.severity, b.kernel, b.location) == ("RAW hazard", "warning", MMA, "cuda.cu:1044")
    assert a.location2 is None  # a hazard's two threads are not a race analysis' two accesses


def test_synccheck_reports():
    (a, b), summary = sw.parse_sanitizer_log(SYNCCHECK_LOG)
    assert summary == {"errors": 2}
    assert (a.kind, a.kernel, a.location) == ("barrier error: Divergent thread(s) in block", MMA_PROD, "cuda.cu:1098")
    assert b.kind.startswith("wgmma sequence error: Warps of the warpgroup") and b.kernel == OUTER_WG


def test_initcheck_report_in_a_pytorch_kernel():
    (r,), _ = sw.parse_sanitizer_log(INITCHECK_LOG)
    assert (r.kind, r.kernel, r.location) == ("uninitialized __global__ read", TORCH_COPY, None)


def test_unknown_messages_are_reports_and_program_output_is_not():
    text = ("worker: case cm_fma_float32 ok in 3.1 s\n"
            "========= COMPUTE-SANITIZER\n"
            "========= Warning: Detected overflow of tracked cuda::barrier structures. Results might be incorrect.\n"
            "========= Internal Sanitizer Error: The Sanitizer encountered an error while launching "
            f"{PREP} and didn't track the launch.\n"
            "========= Target application returned an error\n"
            "=========     Host Frame: main [0xae61] in python3\n"
            "========= ERROR SUMMARY: 2 errors\n")
    (a, b), summary = sw.parse_sanitizer_log(text)
    assert a.severity == "warning" and a.kind.startswith("Detected overflow of tracked cuda::barrier")
    assert b.kind == "internal sanitizer error" and b.kernel is None
    assert summary == {"errors": 2}


def test_clean_run():
    r = sw.judge_run(0, CLEAN_LOG, "case cm_fma_float32: ok in 2.0 s\n", 1000)
    assert r.reports == [] and r.failure is None and not r.truncated


def test_failed_and_unfinished_runs_prove_nothing():
    tb = "Traceback (most recent call last):\n  ...\nRuntimeError: last_variant: expected 'wgmma', 'mma' ran\n"
    r = sw.judge_run(1, CLEAN_LOG, tb, 1000)
    assert r.failure.startswith("worker exit 1") and "expected 'wgmma'" in r.failure and r.reports == []
    r = sw.judge_run(0, "========= COMPUTE-SANITIZER\n", "", 1000)  # the tool stopped before its summary
    assert "did not finish" in r.failure
    assert "no compute-sanitizer output" in sw.judge_run(127, "", "compute-sanitizer: not found", 1000).failure
    assert sw.judge_run(-9, "", "", 1000, seconds=901, timed_out=True).failure == "timed out after 901 s"
    # a fault ends the worker too: the report stays, and the run counts as failed
    r = sw.judge_run(1, MEMCHECK_LOG, "RuntimeError: CUDA error: an illegal memory access was encountered", 1000)
    assert len(r.reports) == 2 and r.failure.startswith("worker exit 1")


def test_a_run_that_never_reached_cuda():
    """compute-sanitizer 2026.4's log for a target that died before its first CUDA call (the output of this very
    option list on a machine without a driver)."""
    text = ("========= COMPUTE-SANITIZER\n"
            "========= Error: process didn't terminate successfully\n"
            "=========     The application may have hit an error when dereferencing Unified Memory from the host. "
            "Please rerun the application under cuda-gdb or a host debugger to catch host side errors.\n"
            "========= Error: Target application terminated before first instrumented API call\n"
            "========= Tracking kernels launched by child processes requires the --target-processes all option.\n")
    r = sw.judge_run(255, text, "", 1000)
    assert r.reports == []
    assert r.failure == ("compute-sanitizer did not finish (no summary line; exit 255): "
                         "Error: Target application terminated before first instrumented API call")


def test_counted_errors_without_a_parsed_report_are_not_clean():
    r = sw.judge_run(sw.ERROR_EXIT, "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 3 errors\n", "", 1000)
    assert r.failure is None and len(r.reports) == 1 and r.reports[0].kind == "unparsed errors"
    r = sw.judge_run(0, "========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)\n", "", 1000)
    assert [x.kind for x in r.reports] == ["unparsed errors"]


def test_print_limit_marks_the_run_truncated():
    assert sw.judge_run(sw.ERROR_EXIT, MEMCHECK_LOG, "", 2).truncated
    assert not sw.judge_run(sw.ERROR_EXIT, MEMCHECK_LOG, "", 3).truncated
    assert not sw.judge_run(sw.ERROR_EXIT, MEMCHECK_LOG, "", 0).truncated  # 0: no limit


# a file's run of three cases: the second fails with a Python error, the others end
GROUP_OUTPUT = ("case cm_a: ok in 12.0 s\n"
                "Traceback (most recent call last):\n  ...\nRuntimeError: cm_b call 2: cm_forward ...: "
                "last_variant: expected 'fma', 'mma' ran\n\n"
                "case cm_b: FAILED in 3.5 s: RuntimeError: cm_b call 2: cm_forward ...: last_variant: expected "
                "'fma', 'mma' ran\n"
                "case cm_c: ok in 8.1 s\n")


def test_case_status_lines():
    assert sw.case_status(GROUP_OUTPUT) == {
        "cm_a": None, "cm_c": None,
        "cm_b": "RuntimeError: cm_b call 2: cm_forward ...: last_variant: expected 'fma', 'mma' ran"}
    assert sw.case_status("") == {}


def test_a_failing_case_in_a_files_run_is_named_and_the_others_stand():
    for rc in (1, sw.ERROR_EXIT):  # with reports, compute-sanitizer's error exit code hides the worker's 1
        r = sw.judge_run(rc, CLEAN_LOG if rc == 1 else MEMCHECK_LOG, GROUP_OUTPUT, 1000,
                         cases=["cm_a", "cm_b", "cm_c"])
        assert r.failure is None
        assert list(r.case_failures) == ["cm_b"] and "expected 'fma', 'mma' ran" in r.case_failures["cm_b"]
    r = sw.judge_run(0, CLEAN_LOG, "case cm_a: ok in 1.0 s\ncase cm_b: ok in 1.0 s\n", 1000, cases=["cm_a", "cm_b"])
    assert r.failure is None and r.case_failures == {}


def test_a_worker_that_dies_in_a_files_run():
    # a crash in cm_b: cm_b and cm_c have no status line, each is named
    out = "case cm_a: ok in 12.0 s\nFatal Python error: Segmentation fault\n"
    r = sw.judge_run(-11, CLEAN_LOG, out, 1000, cases=["cm_a", "cm_b", "cm_c"])
    assert r.failure is None and sorted(r.case_failures) == ["cm_b", "cm_c"]
    assert r.case_failures["cm_b"].startswith("did not finish (worker exit -11): ")
    # every case ended but the worker still failed: the run fails
    r = sw.judge_run(1, CLEAN_LOG, "case cm_a: ok in 1.0 s\nboom at exit\n", 1000, cases=["cm_a"])
    assert r.failure == "worker exit 1: case cm_a: ok in 1.0 s | boom at exit" and r.case_failures == {}
    # a timed-out run proves nothing; it says how far it got, and its failed cases are still named
    r = sw.judge_run(-9, "", GROUP_OUTPUT.split("case cm_c")[0], 1000, seconds=600, timed_out=True,
                     cases=["cm_a", "cm_b", "cm_c"])
    assert r.failure == "timed out after 600 s (2 of 3 cases finished)" and list(r.case_failures) == ["cm_b"]
    r = sw.judge_run(-9, "", "", 1000, seconds=600, timed_out=True, cases=["cm_a"])
    assert r.failure == "timed out after 600 s" and r.case_failures == {}


def test_the_worker_goes_on_after_a_failing_case(monkeypatch, capsys):
    """worker_main with stand-ins for torch and run_case: a status line per case, on after a failure, exit 1."""
    monkeypatch.setitem(sys.modules, "torch", type(sys)("torch"))
    monkeypatch.setattr(sw, "_check_device", lambda torch: None)
    ran = []

    def run_case(torch, case, quick):
        ran.append(case.name)
        if case.name == "cm_fma_float32":
            raise RuntimeError("cm_fma_float32 call 3: cm_forward ...: CUDA error: an illegal memory access\nmore")

    monkeypatch.setattr(sw, "run_case", run_case)
    names = ["cm_mma_float32", "cm_fma_float32", "cm_mma_fma_half"]
    assert sw.worker_main(names, quick=True) == 1
    out = capsys.readouterr().out
    assert ran == names
    assert "Traceback (most recent call last)" in out
    status = sw.case_status(out)
    assert status == {"cm_mma_float32": None, "cm_mma_fma_half": None,
                      "cm_fma_float32": "RuntimeError: cm_fma_float32 call 3: cm_forward ...: CUDA error: an "
                                        "illegal memory access"}
    monkeypatch.setattr(sw, "run_case", lambda torch, case, quick: None)
    assert sw.worker_main(names, quick=True) == 0


# ------------------------------------------------------------------------------------------------
# kernel names, libraries, source lines
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, want", [
    ("void ns::kern<32, (ns::WF)1, float>(float const*, float*, int)", "ns::kern<32, (ns::WF)1, float>"),
    ("plain(int*)", "plain"),
    ("void k<2>(void (*)(int), float const*)", "k<2>"),
    ("void at::native::(anonymous namespace)::f<4>(int)", "at::native::(anonymous namespace)::f<4>"),
    ("opm::opm_outer_wg_kernel<__half>", "opm::opm_outer_wg_kernel<__half>"),
])
def test_strip_params(name, want):
    assert sw.strip_params(name) == want


@pytest.mark.skipif(sw.find_demangler() is None, reason="needs c++filt or cu++filt")
def test_profiler_names_match_the_libraries_kernels():
    """The profiler's kernel names (libstdc++'s demangler, with "void " and parameters) give the same key as c++filt
    (or cu++filt) of the library's mangled names; two builds of one kernel give two keys."""
    d_mma, d_prod, d_wg = sw.demangle([MMA, MMA_PROD, OUTER_WG], sw.find_demangler())
    profiler = ("void contact_map::contact_map_mma_kernel<16, (contact_map::WFormat)0, 512, 2, false>(float const*, "
                "float*, float const*, float const*, float const*, float const*, float const*, float const*, float "
                "const*, float const*, float, int, int, int, int, int, bool)")
    assert sw.kernel_key(profiler) == sw.kernel_key(d_mma) != sw.kernel_key(d_prod)
    assert sw.strip_params(d_wg) == "opm::opm_outer_wg_kernel<__half>"


def _fake_demangler(path, one_at_a_time=False):
    """An executable at path that demangles the test's names given as arguments, one line each (one_at_a_time:
    only its first argument), like c++filt and cu++filt; without arguments it fails."""
    table = {MMA: "void contact_map::mma<16>(float const*)", PREP: "void opm::prep<32>(float const*, int)"}
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\nimport sys\ntable = {table!r}\nargs = sys.argv[1:]\n"
                "if not args:\n    sys.exit('usage: cu++filt [options] <symbol(s)>')\n"
                f"for a in args[:{1 if one_at_a_time else None}]:\n    print(table.get(a, a))\n")
    os.chmod(path, 0o755)
    return str(path)


def test_demangler_c_plus_plus_filt_first(monkeypatch, tmp_path):
    cxxfilt = _fake_demangler(tmp_path / "c++filt")
    monkeypatch.setattr(sw.shutil, "which", lambda name: cxxfilt if name == "c++filt" else None)
    os.makedirs(tmp_path / "cuda" / "bin")
    _fake_demangler(tmp_path / "cuda" / "bin" / "cu++filt")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert sw.find_demangler() == cxxfilt


def test_demangler_falls_back_to_cuda_cu_plus_plus_filt(monkeypatch, tmp_path):
    """No c++filt on PATH: cu++filt beside compute-sanitizer, else in CUDA_HOME/bin, else on PATH."""
    monkeypatch.setattr(sw.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    for d in ("sanitizer/bin", "cuda/bin", "path"):
        os.makedirs(tmp_path / d)
    sanitizer = str(tmp_path / "sanitizer" / "bin" / "compute-sanitizer")
    candidates = sw.demangler_candidates(sanitizer)
    assert candidates[0] == os.path.join(os.path.dirname(sanitizer), "cu++filt")
    assert candidates.index(str(tmp_path / "cuda" / "bin" / "cu++filt")) > 0
    beside = _fake_demangler(tmp_path / "sanitizer" / "bin" / "cu++filt")
    in_home = _fake_demangler(tmp_path / "cuda" / "bin" / "cu++filt")
    assert sw.find_demangler(sanitizer) == beside
    assert sw.find_demangler() == in_home
    os.remove(in_home)
    on_path = _fake_demangler(tmp_path / "path" / "cu++filt")
    monkeypatch.setattr(sw.shutil, "which", lambda name: on_path if name == "cu++filt" else None)
    assert sw.demangler_candidates()[-1] == on_path and sw.find_demangler() in (on_path, "/usr/local/cuda/bin/cu++filt")
    # the names as arguments, one line each; a name it does not know stays as it is
    assert sw.demangle([MMA, PREP, "plain"], beside) == [
        "void contact_map::mma<16>(float const*)", "void opm::prep<32>(float const*, int)", "plain"]
    # a demangler printing fewer lines than names: one name at a time
    one = _fake_demangler(tmp_path / "one", one_at_a_time=True)
    assert sw.demangle([MMA, PREP], one) == ["void contact_map::mma<16>(float const*)",
                                             "void opm::prep<32>(float const*, int)"]
    many = [MMA] * 70 + [PREP]  # more names than one call takes
    assert sw.demangle(many, beside)[69:] == ["void contact_map::mma<16>(float const*)",
                                             "void opm::prep<32>(float const*, int)"]


def test_no_demangler(monkeypatch, tmp_path):
    monkeypatch.setattr(sw, "demangler_candidates", lambda sanitizer=None: [str(tmp_path / "c++filt"),
                                                                            str(tmp_path / "cu++filt")])
    assert sw.find_demangler("/x/compute-sanitizer") is None
    assert sw.demangle([MMA, PREP], None) == [MMA, PREP]  # the names stay mangled
    broken = tmp_path / "cu++filt"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    assert sw.find_demangler() == str(broken) and sw.demangle([MMA], str(broken)) == [MMA]


CUOBJDUMP_SYMBOLS = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]
host = linux
compile_size = 64bit
identifier = cuda.cu

symbols:
OBJECT        WEAK    DEFAULT    -                                 U  .nv.reservedSmem.offset0
NOTYPE        WEAK    DEFAULT    RESERVED_SHARED                      __nv_reservedSMEM_offset_0_alias
FUNC          LOCAL   DEFAULT    -                                    _ZN3opm8detail_fEv
FUNC          GLOBAL  DEFAULT    ENTRY                                {mma}
FUNC          GLOBAL  DEFAULT    ENTRY                                {prep}

Fatbin elf code:
================
arch = sm_80
code version = [1,8]

symbols:
FUNC          GLOBAL  DEFAULT    ENTRY                                {mma}
""".format(mma=MMA, prep=PREP)


def test_parse_symbols_lists_entry_functions_per_arch():
    assert sw.parse_symbols(CUOBJDUMP_SYMBOLS) == {"sm_90a": {MMA, PREP}, "sm_80": {MMA}}


# CUDA 13's cuobjdump (Triton's copy, 2026-12) spells the symbol table's columns with their ELF prefixes
CUOBJDUMP13_SYMBOLS = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]
host = linux
compile_size = 64bit
compressed
identifier = /tmp/ext/outer_product_mean_0123/cuda.cu

symbols:
STT_OBJECT       STB_WEAK   STV_DEFAULT  U .nv.reservedSmem.offset0
STT_?            STB_WEAK   STO_RESERVED_SHARED   __nv_reservedSMEM_offset_0_alias
STT_FUNC         STB_WEAK   STV_DEFAULT    $__internal_0_$__cuda_sm20_rcp_rn_f32_slowpath
STT_FUNC         STB_GLOBAL STO_ENTRY      {prep}
STT_FUNC         STB_GLOBAL STO_ENTRY      {outer_wg}
""".format(prep=PREP, outer_wg=OUTER_WG)


def test_parse_symbols_reads_cuda_13_spelling():
    assert sw.parse_symbols(CUOBJDUMP13_SYMBOLS) == {"sm_90a": {PREP, OUTER_WG}}


def test_py_location_finds_the_kernel_files_line():
    src = ["#include <cuda_fp16.h>", "namespace k {", "__global__ void a(float* x) {", "  x[0] = 1.f;", "}",
           "__global__ void b(float* x) {", "  x[1] = 2.f;", "}", "}  // namespace k"]
    cu = ["#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>"] + src  # load_inline's
    py = ['"""doc"""', "import torch", "", 'CUDA_SRC = r"""'] + src + ['"""', "", "_ext = build()"]
    assert sw.py_location("cuda.cu:7", cu, py, "k.py") == "k.py:8"        # x[0] = 1.f;
    assert sw.py_location("cuda.cu:10", cu, py, "k.py") == "k.py:11"      # x[1] = 2.f;
    assert sw.py_location("cuda.cu:8", cu, py, "k.py") == "k.py:9"        # "}" twice: the neighbours decide
    assert sw.py_location("cuda.cu:11:5", cu, py, "k.py") == "k.py:12"    # a column after the line
    assert sw.py_location("cuda.cu:1", cu, py, "k.py") is None            # not in the kernel file
    assert sw.py_location("cuda.cu:400", cu, py, "k.py") is None
    assert sw.py_location(None, cu, py, "k.py") is None


# ------------------------------------------------------------------------------------------------
# the verdict lines
# ------------------------------------------------------------------------------------------------
def test_summarise_one_line_per_tool_and_kernel():
    names = {MMA: "contact_map::mma<16>", MMA_PROD: "contact_map::mma<32, prod>", PREP: "opm::prep<32>",
             OUTER_WG: "opm::outer_wg<__half>", "?" + TORCH_COPY: "at::native::copy"}
    kernel_file = {MMA: "contact_map", MMA_PROD: "contact_map", PREP: "outer_product_mean",
                   OUTER_WG: "outer_product_mean"}
    case_files = {"cm_a": "contact_map", "opm_b": "outer_product_mean"}
    case_kernels = {"cm_a": {MMA, MMA_PROD}, "opm_b": {PREP, OUTER_WG}}
    results = {
        ("memcheck", "cm_a"): sw.judge_run(0, CLEAN_LOG, "", 1000),
        # a read in the prep kernel and a write in the mma kernel, which the census saw in cm_a only
        ("memcheck", "opm_b"): sw.judge_run(sw.ERROR_EXIT, MEMCHECK_LOG, "", 1000),
        ("racecheck", "cm_a"): sw.judge_run(1, CLEAN_LOG, "RuntimeError: boom", 1000),
        # two reports (outer_wg's, PyTorch's) at a print limit of 1: the prep kernel is not proven clean
        ("racecheck", "opm_b"): sw.judge_run(sw.ERROR_EXIT, RACECHECK_ANALYSIS_LOG.replace(MMA, TORCH_COPY), "", 1),
    }
    lines, failed, counts = sw.summarise(["memcheck", "racecheck"], ["cm_a", "opm_b"], case_files, case_kernels,
                                         results, names, kernel_file, where=lambda loc, file: f"{loc} ({file}.py)")

    def line(tool, name):
        """(label, line) of the one line of (tool, kernel name): columns tool, label, file, then name  detail."""
        found = [l for l in lines if l[:9].strip() == tool and l[44:].split("  ")[0] == name]
        assert len(found) == 1, (tool, name, lines)
        return found[0][11:22].strip(), found[0]

    assert line("memcheck", "contact_map::mma<32, prod>")[0] == "clean"
    assert line("memcheck", "contact_map::mma<32, prod>")[1].endswith("contact_map::mma<32, prod>  (1 cases)")
    state, text = line("memcheck", "opm::prep<32>")
    assert state == "REPORT" and "invalid __global__ read at cuda.cu:812 (outer_product_mean.py)" in text
    assert text.endswith("[case opm_b; 1 reports in 1 runs]")
    state, text = line("memcheck", "contact_map::mma<16>")  # a report is never hidden behind another case's clean
    assert state == "REPORT" and "invalid __shared__ write at cuda.cu:1101 (contact_map.py)" in text
    assert line("memcheck", "opm::outer_wg<__half>")[0] == "clean"
    assert line("racecheck", "contact_map::mma<16>")[0] == "NOT CHECKED"  # cm_a's worker failed
    assert "case cm_a failed" in line("racecheck", "contact_map::mma<16>")[1]
    assert "case opm_b hit the print limit" in line("racecheck", "opm::prep<32>")[1]
    state, text = line("racecheck", "opm::outer_wg<__half>")
    assert state == "REPORT" and "race Write/Read at cuda.cu:2801 (outer_product_mean.py) and cuda.cu:2843" in text
    state, text = line("racecheck", "at::native::copy")  # PyTorch's kernel: its own line, file "other"
    assert state == "REPORT" and text[24:42].strip() == "other" and "race Read/Write" in text
    assert [l for l in lines
            if l.startswith("racecheck") and "FAILED" in l and "worker exit 1: RuntimeError: boom" in l]
    assert failed and counts == {"clean": 2, "report": 4, "not checked": 3}


def test_summarise_all_clean_passes_and_census_failures_fail():
    kernel_file = {MMA: "contact_map"}
    results = {(t, "cm_a"): sw.judge_run(0, CLEAN_LOG, "", 1000) for t in sw.TOOLS}
    lines, failed, counts = sw.summarise(sw.TOOLS, ["cm_a"], {"cm_a": "contact_map"}, {"cm_a": {MMA}}, results,
                                         {MMA: "mma"}, kernel_file)
    assert not failed and counts == {"clean": 4, "report": 0, "not checked": 0} and len(lines) == 4
    _, failed, _ = sw.summarise(sw.TOOLS, ["cm_a"], {"cm_a": "contact_map"}, {"cm_a": {MMA}}, results, {MMA: "mma"},
                                kernel_file, census_errors={"cm_a": "RuntimeError: no CUDA device"})
    assert failed


def test_summarise_a_files_run():
    """A run of several cases: a kernel is clean from the union of the census kernels of its cases; a case that
    failed in it is named, and only the kernels it launched are not checked; a report names the run."""
    kernel_file = {MMA: "contact_map", MMA_PROD: "contact_map", PREP: "outer_product_mean"}
    names = {MMA: "mma<16>", MMA_PROD: "mma<32, prod>", PREP: "prep<32>"}
    case_files = {"cm_a": "contact_map", "cm_b": "contact_map", "cm_c": "contact_map", "opm_x": "outer_product_mean"}
    case_kernels = {"cm_a": {MMA}, "cm_b": {MMA, MMA_PROD}, "cm_c": {MMA}, "opm_x": {PREP}}
    runs = {"contact_map": ["cm_a", "cm_b", "cm_c"], "outer_product_mean": ["opm_x"]}
    failing = ("case cm_a: ok in 1.0 s\ncase cm_b: FAILED in 1.0 s: RuntimeError: boom\ncase cm_c: ok in 1.0 s\n")
    results = {("memcheck", "contact_map"): sw.judge_run(1, CLEAN_LOG, failing, 1000, cases=runs["contact_map"]),
               ("memcheck", "outer_product_mean"): sw.judge_run(sw.ERROR_EXIT, MEMCHECK_LOG, "case opm_x: ok in 1 s",
                                                                1000, cases=["opm_x"]),
               ("synccheck", "contact_map"): sw.judge_run(0, CLEAN_LOG, "".join(
                   f"case {c}: ok in 1.0 s\n" for c in runs["contact_map"]), 1000, cases=runs["contact_map"]),
               ("synccheck", "outer_product_mean"): sw.judge_run(-9, "", "", 1000, seconds=300, timed_out=True,
                                                                 cases=["opm_x"])}
    lines, failed, counts = sw.summarise(["memcheck", "synccheck"], list(case_files), case_files, case_kernels,
                                         results, names, kernel_file, runs=runs)
    text = "\n".join(lines)
    assert sw.verdict_line("memcheck", "FAILED", "contact_map", "case cm_b", "RuntimeError: boom") in lines
    assert "NOT CHECKED  contact_map         mma<32, prod>  case cm_b failed" in text
    # the mma kernel's one report comes from the outer product mean's run (MEMCHECK_LOG names it)
    assert "REPORT       contact_map         mma<16>  invalid __shared__ write at cuda.cu:1101  " \
           "[run outer_product_mean; 1 reports in 1 runs]" in text
    assert sw.verdict_line("synccheck", "clean", "contact_map", "mma<16>", "(3 cases)") in lines
    assert sw.verdict_line("synccheck", "clean", "contact_map", "mma<32, prod>", "(1 cases)") in lines
    # a file's run of one case is still named as the run (its logs are TOOL-FILE.*)
    assert sw.verdict_line("synccheck", "FAILED", "outer_product_mean", "run outer_product_mean",
                           "timed out after 300 s") in lines
    assert "synccheck  NOT CHECKED  outer_product_mean  prep<32>  run outer_product_mean failed" in text
    assert failed and counts == {"clean": 2, "report": 2, "not checked": 2}
    # a file's run that hit the print limit, or failed as a whole, is named as the run
    all_ok = "".join(f"case {c}: ok in 1.0 s\n" for c in runs["contact_map"])
    results[("synccheck", "contact_map")] = sw.judge_run(sw.ERROR_EXIT, SYNCCHECK_LOG, all_ok, 1,
                                                         cases=runs["contact_map"])
    lines, _, _ = sw.summarise(["synccheck"], list(case_files), case_files, case_kernels, results, names,
                               kernel_file, runs=runs)
    assert "synccheck  NOT CHECKED  contact_map         mma<16>  run contact_map hit the print limit" in lines
    results[("synccheck", "contact_map")] = sw.judge_run(0, "========= COMPUTE-SANITIZER\n", all_ok, 1000,
                                                         cases=runs["contact_map"])
    lines, _, _ = sw.summarise(["synccheck"], list(case_files), case_files, case_kernels, results, names,
                               kernel_file, runs=runs)
    assert "synccheck  NOT CHECKED  contact_map         mma<16>  run contact_map failed" in lines
    assert [l for l in lines if "FAILED" in l and "contact_map" in l] == [sw.verdict_line(
        "synccheck", "FAILED", "contact_map", "run contact_map",
        "compute-sanitizer did not finish (no summary line; exit 0): " + all_ok.strip().replace("\n", " | ")
        + " (3 of 3 cases finished)")]


# ------------------------------------------------------------------------------------------------
# the commands
# ------------------------------------------------------------------------------------------------
HELP_EXCERPT = """Usage: compute-sanitizer [options] [your-program] [your-program-options]

General options:
  -h [ --help ]                         Produce this help message.
  --check-device-heap arg (=yes)        Check allocation on the device heap.
  --demangle arg (=full)                Demangle function names.
  --error-exitcode arg                  When this is set, compute-sanitizer will return the given exitcode when any errors are detected.
  -c [ --launch-count ] arg (=0)        Limit the number of kernel launches to check.
  --launch-timeout arg                  Timeout in seconds to wait to connect to the target process.
  --log-file arg                        File where compute-sanitizer will write all of its text output.
  --port arg (=49152)                   Base port for connecting to target application
  --print-limit arg (=100)              When this is set, compute-sanitizer will stop printing errors after reaching the given number of errors.
  --target-processes arg (=all)         Select which processes are to be tracked by compute-sanitizer:
  --tool arg (=memcheck)                Set the tool to use.

Backtrace options:
  --show-backtrace arg (=yes)           Display a backtrace on error.

Memcheck-specific options:
  --padding arg (=0)                    Size in bytes for padding buffer to add after each allocation.
  --report-api-errors arg (=explicit)   Print errors if any API call fails.

Racecheck-specific options:
  --racecheck-report arg (=analysis)    The reporting mode that applies to racecheck.

Initcheck-specific options:
  --track-unused-memory                 Check for unused memory allocations.
"""


def test_help_options():
    opts = sw.help_options(HELP_EXCERPT)
    assert {"--help", "--launch-count", "--padding", "--racecheck-report", "--track-unused-memory", "--port"} <= opts
    assert "--check-tensor-ops" not in opts and sw.help_options("") is None


def test_sanitizer_command_per_tool():
    supported = sw.help_options(HELP_EXCERPT)  # an older tool: no --check-tensor-ops, no --racecheck-num-workers
    worker = ["--worker", "opm_masks"]
    mem = sw.sanitizer_command("/cs", "memcheck", "/l/m.log", worker, supported, print_limit=500, port=49192)
    assert mem[:5] == ["/cs", "--tool", "memcheck", "--log-file", "/l/m.log"]
    assert mem[-4:-2] == [sys.executable, "tools/sanitize_sweep.py"] and mem[-2:] == worker
    opts = dict(zip(mem[5:-4:2], mem[6:-4:2]))
    assert opts == {"--error-exitcode": str(sw.ERROR_EXIT), "--print-limit": "500", "--demangle": "no",
                    "--show-backtrace": "device", "--target-processes": "application-only", "--launch-timeout": "300",
                    "--check-device-heap": "no",
                    "--port": "49192", "--padding": "4096", "--report-api-errors": "no"}
    race = sw.sanitizer_command("/cs", "racecheck", "/l/r.log", worker, supported)
    assert "--racecheck-report" in race and "--padding" not in race and "--racecheck-num-workers" not in race
    init = sw.sanitizer_command("/cs", "initcheck", "/l/i.log", worker, supported)
    assert not any(o.startswith(("--racecheck", "--padding", "--check-tensor")) for o in init)
    # without help text (no sanitizer here) every option stays
    full = sw.sanitizer_command("cs", "racecheck", "r.log", worker, None, workers=3,
                                extra=["--racecheck-detect-level", "info"])
    assert full[full.index("--racecheck-num-workers") + 1] == "3" and "--check-tensor-ops" in full
    assert full[-6:-4] == ["--racecheck-detect-level", "info"]
    # --sanitizer-args replaces the sweep's own value of an option (given twice, the tool would refuse it)
    off = sw.sanitizer_command("cs", "memcheck", "m.log", worker, None, extra=["--check-tensor-ops", "no"])
    assert off.count("--check-tensor-ops") == 1 and off[off.index("--check-tensor-ops") + 1] == "no"
    eq = sw.sanitizer_command("cs", "memcheck", "m.log", worker, None, extra=["--padding=64"])
    assert "--padding" not in eq and "--padding=64" in eq


def test_default_runs_are_one_per_tool_and_kernel_file():
    args = sw.parse_args([])
    assert args.jobs == 8 and not args.per_case and len(args.selected) == len(sw.CASES)
    runs = sw.plan_runs(args.selected, args.per_case)
    assert runs == {f: [c.name for c in sw.CASES if c.file == f] for f in sw.FILES}
    cmds = [sw.run_command("cs", t, run, cases, "/logs", False, None, 1000) for t in args.tools
            for run, cases in runs.items()]
    assert len(cmds) == len(sw.TOOLS) * len(sw.FILES) == 8
    logs = [log for log, _, _ in cmds]
    assert len(set(logs)) == 8 and "/logs/racecheck-outer_product_mean.log" in logs
    assert len({out for _, out, _ in cmds}) == 8 and "/logs/racecheck-outer_product_mean.out" in [o for _, o, _ in cmds]
    for log, _, cmd in cmds:
        file = "contact_map" if log.endswith("-contact_map.log") else "outer_product_mean"
        assert cmd[cmd.index("--worker") + 1:] == [c.name for c in sw.CASES if c.file == file]
    # the cases the census failed are left out, --quick is passed on
    runs = sw.plan_runs(args.selected, skip={"cm_mma_float32"})
    assert "cm_mma_float32" not in runs["contact_map"] and len(runs["contact_map"]) == len(sw.CM_CASES) - 1
    _, _, cmd = sw.run_command("cs", "memcheck", "outer_product_mean", runs["outer_product_mean"], "/l", True, None,
                               1000)
    assert cmd[-1] == "--quick"


def test_per_case_runs_are_one_per_tool_and_case():
    args = sw.parse_args(["--per-case"])
    runs = sw.plan_runs(args.selected, args.per_case)
    assert runs == {c.name: [c.name] for c in sw.CASES}
    assert len(runs) * len(args.tools) == len(sw.CASES) * len(sw.TOOLS)
    log, out, cmd = sw.run_command("cs", "initcheck", "opm_masks", runs["opm_masks"], "/l", False, None, 1000)
    assert (log, out) == ("/l/initcheck-opm_masks.log", "/l/initcheck-opm_masks.out")
    assert cmd[-2:] == ["--worker", "opm_masks"]
    # kernel file names and case names never clash: a file's logs and a case's are different files
    assert not set(sw.FILES) & set(sw.CASES_BY_NAME)


def _fake_sweep(monkeypatch, tmp_path, demangler=True, fail=("memcheck", "cm_fma_float32")):
    """main() with stand-ins for its processes: the census writes each case's kernels (the mma kernel for the
    contact map's cases, the prep kernel for the outer product mean's), every sanitized run is clean and prints
    the status lines of its cases, the case fail names fails under its tool. Returns (exit code, the sanitized
    commands)."""
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text("#!/bin/sh\nexit 0\n")
    sanitizer.chmod(0o755)
    fake = _fake_demangler(tmp_path / "cu++filt") if demangler else None
    monkeypatch.setattr(sw, "find_demangler", lambda s=None: fake)
    monkeypatch.setattr(sw, "library_kernels", lambda so: {MMA} if "contact_map" in so else {PREP})
    kernels = {"contact_map": ["void contact_map::mma<16>(float const*)"],
               "outer_product_mean": ["void opm::prep<32>(float const*, int)"]}
    commands = []

    def run(cmd, out_path, timeout):
        cases = cmd[cmd.index("--worker") + 1:]
        if "--census" in cmd:
            file = sw.CASES_BY_NAME[cases[0]].file
            census = {"cases": {c: {"kernels": kernels[file], "error": None} for c in cases},
                      "files": {file: {"library": f"/x/{file}.so", "cuda_source": "/x/cuda.cu", "lineinfo": True}},
                      "device": {"name": "H100", "sms": 132, "torch": "2"}}
            with open(cmd[cmd.index("--census") + 1], "w") as f:
                json.dump(census, f)
            return 0, 1.0, False
        commands.append(cmd)
        tool = cmd[cmd.index("--tool") + 1]
        with open(cmd[cmd.index("--log-file") + 1], "w") as f:
            f.write(CLEAN_LOG)
        with open(out_path, "w") as f:
            for c in cases:
                f.write(f"case {c}: FAILED in 1.0 s: RuntimeError: boom\n" if (tool, c) == fail else
                        f"case {c}: ok in 1.0 s\n")
        return (1 if any((tool, c) == fail for c in cases) else 0), 2.0, False

    monkeypatch.setattr(sw, "_run", run)
    rc = sw.main(["--sanitizer", str(sanitizer), "--log-dir", str(tmp_path / "logs")])
    return rc, commands


def test_main_runs_one_process_per_tool_and_file(monkeypatch, tmp_path, capsys):
    rc, commands = _fake_sweep(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert rc == 1 and len(commands) == 8
    assert f"{len(sw.CASES)} cases in 2 runs per tool (one per kernel file) x 4 tools = 8 sanitized runs, 8 at a " \
           "time" in out
    for file in sw.FILES:
        names = [c.name for c in sw.CASES if c.file == file]
        assert sum(cmd[cmd.index("--worker") + 1:] == names for cmd in commands) == 4
    n_cm, n_opm = (sum(c.file == f for c in sw.CASES) for f in sw.FILES)
    assert sw.verdict_line("memcheck", "FAILED", "contact_map", "case cm_fma_float32", "RuntimeError: boom") in out
    assert sw.verdict_line("memcheck", "NOT CHECKED", "contact_map", "contact_map::mma<16>",
                           "case cm_mma_float32 failed") not in out
    assert sw.verdict_line("memcheck", "NOT CHECKED", "contact_map", "contact_map::mma<16>",
                           "case cm_fma_float32 failed") in out
    assert sw.verdict_line("memcheck", "clean", "outer_product_mean", "opm::prep<32>", f"({n_opm} cases)") in out
    assert sw.verdict_line("racecheck", "clean", "contact_map", "contact_map::mma<16>", f"({n_cm} cases)") in out
    assert f"memcheck  contact_map               2.0 s  no reports, 1 of {n_cm} cases failed" in out
    assert out.rstrip().endswith("-> FAIL") and "7 clean, 0 with reports, 1 not checked" in out
    with open(tmp_path / "logs" / "summary.txt") as f:
        assert f.read().splitlines()[-1].startswith("summary: 2 kernels launched x 4 tools")


def test_main_all_clean_passes_and_per_case_runs(monkeypatch, tmp_path, capsys):
    rc, commands = _fake_sweep(monkeypatch, tmp_path, fail=())
    assert rc == 0 and capsys.readouterr().out.rstrip().endswith("-> PASS")
    monkeypatch.setattr(sys, "argv", ["sanitize_sweep.py"])
    monkeypatch.setattr(sw, "parse_args", lambda argv, parse=sw.parse_args: parse(argv + ["--per-case"]))
    rc, commands = _fake_sweep(monkeypatch, tmp_path, fail=())
    assert rc == 0 and len(commands) == len(sw.CASES) * len(sw.TOOLS)
    assert os.path.exists(tmp_path / "logs" / "racecheck-opm_masks.log")


def test_main_without_a_demangler_says_so_once(monkeypatch, tmp_path, capsys):
    rc, _ = _fake_sweep(monkeypatch, tmp_path, demangler=False, fail=())
    out = capsys.readouterr().out
    assert rc == 1 and out.count("no c++filt on PATH and no cu++filt") == 1
    assert "no kernel the cases launched was matched to the libraries' kernels (demangler: none found)" in out


def test_worker_environment_disables_the_caching_allocator():
    assert sw.worker_env()["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"


# ------------------------------------------------------------------------------------------------
# the case table
# ------------------------------------------------------------------------------------------------
def _file_constant(file, name):
    """A constant of a kernel file, read with ast (importing the file would build its CUDA extension)."""
    for node in ast.parse(open(os.path.join(ROOT, file)).read()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{file} defines no {name}")


def _calls(file=None, op=None):
    return [c for case in sw.CASES if file in (None, case.file) for c in case.calls if op in (None, c["op"])]


def test_every_variant_in_every_dtype():
    cm_variants = list(_file_constant("contact_map.py", "_VARIANT_IDS"))
    opm_variants = list(_file_constant("outer_product_mean.py", "_ALL_VARIANTS"))
    assert list(sw.OPM_ORDERS) == opm_variants[1:]
    for file, op, variants in (("contact_map", "cm_forward", cm_variants),
                               ("outer_product_mean", "opm_forward", opm_variants)):
        have = {(c["variant"], c["dtype"]) for c in _calls(file, op)}
        missing = [(v, d) for v in variants for d in sw.DTYPES if (v, d) not in have]
        assert not missing, f"{file}: no forward call for {missing}"
    # every kernel the contact map's forward reports, in each dtype it runs in
    kernels = list(_file_constant("contact_map.py", "_KERNELS"))
    have = {(c["expect"], c["dtype"]) for c in _calls("contact_map", "cm_forward")}
    for k in kernels:
        dtypes = (sw.F16, sw.BF16) if k == "wgmma16" else sw.DTYPES
        assert all((k, d) in have for d in dtypes), (k, dtypes)
    # every forced variant checks that it ran: expect is the variant (outer product mean: the worker compares)
    assert all(c["expect"] == c["variant"] for c in _calls("contact_map", "cm_forward") if c["variant"] != "auto")


def test_every_backward_path_in_every_dtype():
    for d in sw.DTYPES:
        assert [c for c in _calls("contact_map", "cm_backward") if c["dtype"] == d]
        assert [c for c in _calls("contact_map", "cm_train") if c["dtype"] == d]
        bw = [c for c in _calls("outer_product_mean", "opm_backward") if c["dtype"] == d]
        assert set().union(*(c["expect"] for c in bw)) == {"a, b", "dWo", "da, db", "LayerNorm"}
        trained = {c["variant"] for c in _calls("outer_product_mean", "opm_train") if c["dtype"] == d}
        assert trained == {"outer_wg", "fused_small", "outer_first"}  # a, b from the forward, or recomputed
        rows = [c for c in _calls("outer_product_mean", "opm_rows") if c["dtype"] == d]
        assert {c["block_tiles"] for c in rows} == {False, True} or d == sw.F32  # float32 always takes block tiles
        assert {c["cm"] > 256 for c in rows} == {True, False}                     # the prep's 1- and 2-tile builds
    assert [c for c in _calls("contact_map", "cm_backward")
            if c.get("params_dtype") == sw.F32 and c["dtype"] == sw.BF16]
    for d in (sw.F16, sw.BF16):  # split TF32 with 16-bit input, and 16-bit products on pair_dim % 8 != 0 (split too)
        bw = [c for c in _calls("outer_product_mean", "opm_backward") if c["dtype"] == d]
        assert any(c.get("split") for c in bw) and any(c["cz"] % 8 for c in bw)
    assert any(c["S"] > 512 for c in _calls("outer_product_mean", "opm_backward"))  # da, db's two s chunks
    assert any(c["cz"] % 4 for c in _calls("outer_product_mean", "opm_backward"))   # da, db in PyTorch ops


def test_masks_and_awkward_shapes():
    opm = _calls("outer_product_mean")
    assert {c["mask_dtype"] for c in opm} == set(sw.MASK_DTYPES)
    for d in sw.DTYPES:  # masks with about 20% zeros and a fully masked column and row, and all-masked inputs
        assert {"mixed", "zeros"} <= {c["mask"] for c in opm if c["dtype"] == d}
    for v in sw.OPM_ORDERS:  # every variant with everything masked
        assert [c for c in opm if c.get("variant") == v and c["mask"] == "zeros"]
    fwd = _calls("outer_product_mean", "opm_forward")
    assert {64, 256} <= {c["cm"] for c in fwd} and {64, 128} <= {c["cz"] for c in fwd}
    assert {17, 19, 36, 40} <= {c["N"] for c in opm}
    tile = lambda c: 16 if c <= 16 else 32 if c <= 32 else 64 if c <= 64 else 128  # the kernels' CP
    assert {tile(c["c"]) for c in fwd} == {16, 32, 64, 128}
    cm = _calls("contact_map", "cm_forward")
    # the wgmma kernel's two channel builds (pair_dim <= 64 and 65-128) in every dtype
    for d in sw.DTYPES:
        cs = {c["C"] for c in cm if c["dtype"] == d and c["expect"] in ("wgmma", "wgmma16") and c["variant"] == "auto"}
        assert any(c <= 64 for c in cs) and any(64 < c <= 128 for c in cs), (d, cs)
    assert all(c["N"] % 8 for c in cm if c["N"] not in (1, 8))  # edge tiles everywhere but the one-box case


def test_calls_stay_small():
    """Every call, its walk batch taken on 132 SMs (an H100 SXM), stays under 8 M input elements: the slow tools
    must finish in minutes."""
    for case in sw.CASES:
        for c in case.calls:
            B = sw.batch_of(c, 132)
            n = B * c["N"] * c["N"] * c["C"] if c["op"].startswith("cm_") else B * c["S"] * c["N"] * c["cm"]
            assert n < 8e6, (case.name, sw.describe_call(c), n)


def test_walk_batches():
    c = sw.cm_call("cm_forward", sw.F32, None, 17, 128, 64, walk=6)
    assert sw.tiles_per_batch(c) == 6 and sw.batch_of(c, 132) == 132
    o = sw.opm_call("opm_forward", sw.F32, None, 37, 40, 64, 32, 200, walk=3)
    assert sw.tiles_per_batch(o) == 3 * 10 * 2 and sw.batch_of(o, 132) == 7
    assert sw.batch_of(sw.cm_call("cm_forward", sw.F32, 2, 17, 17, 9), 132) == 2
    # a walk decides B: the table leaves B out there
    assert all(c["B"] is None for case in sw.CASES for c in case.calls if c.get("walk"))
    # the mma kernel's producer-warp builds (one block per SM) walk at least 2 tiles per block
    prod = [c for c in _calls("contact_map", "cm_forward") if c["variant"] == "mma" and (c["C"], c["H"]) in
            {(160, 16), (104, 20), (256, 16), (237, 24)}]
    assert len(prod) == 4 and all(sw.batch_of(c, 132) * sw.tiles_per_batch(c) >= 2 * 132 for c in prod)


def test_quick_drops_only_slow_calls():
    for case in sw.CASES:
        quick = case.selected_calls(True)
        assert quick and all(not c.get("slow") for c in quick)
        assert len(case.selected_calls(False)) == len(case.calls)
    assert any(c.get("slow") for case in sw.CASES for c in case.calls)


def test_case_names_are_unique_and_ops_exist():
    assert len({c.name for c in sw.CASES}) == len(sw.CASES)
    assert {c["op"] for c in _calls()} <= set(sw._OPS)
    assert all(case.file in sw.FILES for case in sw.CASES)


def test_dry_run_imports_no_kernel_file_and_no_torch():
    code = ("import importlib.util, os, sys\n"
            f"path = {os.path.join(ROOT, 'tools', 'sanitize_sweep.py')!r}\n"
            "spec = importlib.util.spec_from_file_location('sw', path)\n"
            "sw = importlib.util.module_from_spec(spec); spec.loader.exec_module(sw)\n"
            "assert sw.main(['--dry-run', '--jobs', '4']) == 0\n"
            "loaded = [m for m in sys.modules.values() if os.path.basename(getattr(m, '__file__', '') or '')"
            " in ('contact_map.py', 'outer_product_mean.py')]\n"
            "assert not loaded, loaded\n"
            "assert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for case in sw.CASES:
        assert case.name in out
    for tool in sw.TOOLS:
        assert f"--tool {tool}" in out
    # one sanitized run per (tool, kernel file), with all the file's cases, + the two census commands
    assert out.count("--worker") == len(sw.FILES) * len(sw.TOOLS) + 2
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in out
    for tool in sw.TOOLS:
        for file in sw.FILES:
            names = " ".join(c.name for c in sw.CASES if c.file == file)
            assert f"--log-file LOG_DIR/{tool}-{file}.log" in out
            assert f"tools/sanitize_sweep.py --worker {names}\n" in out


def test_dry_run_per_case(capsys):
    assert sw.main(["--dry-run", "--per-case", "--tools", "memcheck,initcheck"]) == 0
    out = capsys.readouterr().out
    assert out.count("--worker") == len(sw.CASES) * 2 + 2
    assert f"--log-file LOG_DIR/initcheck-{sw.CASES[0].name}.log" in out
    assert f"--worker {sw.CASES[0].name}\n" in out


def test_options_select_tools_files_and_quick():
    args = sw.parse_args(["--tools", "racecheck", "--files", "outer_product_mean.py", "--quick", "--cases", "masks,cp"])
    assert args.tools == ["racecheck"] and [c.name for c in args.selected] == ["opm_cp_float32", "opm_masks"]
    with pytest.raises(SystemExit):
        sw.parse_args(["--tools", "leakcheck"])
    with pytest.raises(SystemExit):
        sw.parse_args(["--files", "nope"])


@pytest.mark.parametrize("dtype", sw.MASK_DTYPES)
def test_masks_have_a_fifth_zeros_and_fully_masked_rows_and_columns(dtype):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    B, S, N = 2, 9, 40
    m = sw.make_mask(torch, B, S, N, "mixed", dtype, gen)
    assert m.shape == (B, S, N) and m.dtype == getattr(torch, dtype)
    z = m == 0
    assert z[:, :, N // 2].all() and z[:, S - 1].all()            # a residue column and a sequence row, whole
    rest = z[:, :S - 1][:, :, [n for n in range(N) if n != N // 2]].float().mean().item()
    assert 0.1 < rest < 0.3                                         # and about 20% elsewhere
    assert not z.all() and set(m.double().unique().tolist()) <= ({0.0, 1.0, 2.0} if dtype.startswith(("int", "uint"))
                                                                 else {0.0, 1.0})
    assert (sw.make_mask(torch, B, S, N, "zeros", dtype, gen) == 0).all()
    assert (sw.make_mask(torch, B, S, N, "ones", dtype, gen) != 0).all()


def test_worker_runs_every_call_against_stand_ins(monkeypatch):
    """Every call of every case through the worker's code on the CPU, the kernel files replaced by stand-ins with
    their functions' signatures (a wrong argument raises TypeError) that report the path each call expects;
    .cuda() is the identity. A stand-in reporting another path than a call expects makes the worker raise."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"multi_processor_count": 132}))
    now = {}

    def ran(call):  # the variant the stand-ins report: the one the call expects
        if call["op"].startswith("cm_"):
            return call["expect"]
        return call["variant"] if call["variant"] != "auto" else "outer_wg"

    def zero_like_sum(*ts):  # a differentiable zero from every tensor
        return sum(t.float().sum() * 0 for t in ts)

    class CMModel(nn.Module):
        def __init__(self, pair_dim, hidden_dim):
            super().__init__()
            self.layer_norm = nn.LayerNorm(pair_dim)
            self.mlp = nn.Sequential(nn.Linear(pair_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim),
                                     nn.ReLU(), nn.Linear(hidden_dim, 1))
            self.variant, self.last_variant, self.last_backward = "auto", None, None

        def forward(self, pair_repr):
            self.last_variant, self.last_backward = ran(now["call"]), "fused"
            return CMFused.apply(pair_repr, *self.parameters())

    class CMFused(torch.autograd.Function):  # a training step's backward through cm_backward_fused, as ModelNew's
        @staticmethod
        def forward(ctx, pair, *params):
            ctx.save_for_backward(pair, *params)
            return pair.float().mean(-1).to(pair.dtype)

        @staticmethod
        def backward(ctx, grad_out):
            pair, *params = ctx.saved_tensors
            return cm.contact_map_backward_fused(pair, params[0], params[1], 1e-5, *params[2:], grad_out)

    def cm_backward_fused(pair, ln_w, ln_b, eps, w1, b1, w2, b2, w3, b3, grad_out):
        assert grad_out.shape == pair.shape[:3]
        assert cm.BACKWARD_FP16_PRODUCTS is bool(now["call"].get("f16"))  # the call's setting, else the default
        assert cm.BACKWARD_ONE_CONVERSION is bool(now["call"].get("one_conversion"))
        return (torch.zeros_like(pair),) + tuple(torch.zeros_like(p) for p in (ln_w, ln_b, w1, b1, w2, b2, w3, b3))

    cm = type("CM", (), {"ModelNew": CMModel, "contact_map_backward_fused": staticmethod(cm_backward_fused),
                         "fused_backward_runs": staticmethod(lambda pair, w1: w1.shape[0] % 16 == 0),
                         "BACKWARD_FP16_PRODUCTS": False, "BACKWARD_ONE_CONVERSION": False})

    class OPMModel(nn.Module):
        def __init__(self, msa_dim, pair_dim, hidden_dim=32):
            super().__init__()
            self.layer_norm = nn.LayerNorm(msa_dim)
            self.proj_a = nn.Linear(msa_dim, hidden_dim)
            self.proj_b = nn.Linear(msa_dim, hidden_dim)
            self.out_proj = nn.Linear(hidden_dim * hidden_dim, pair_dim)
            self.variant, self.last_variant, self.last_backward = "auto", None, None

        ALL_VARIANTS = ("auto", "outer_wg")

        def forward(self, msa_repr, msa_mask):
            assert msa_mask.shape == msa_repr.shape[:3]
            B, S, N, _ = msa_repr.shape
            self.last_variant, self.last_backward = ran(now["call"]), tuple(now["call"].get("expect") or ())
            assert opm.LOW_MEMORY_BACKWARD is bool(now["call"].get("low"))  # the call's setting, else the default
            z = msa_repr.float().sum() + zero_like_sum(*self.parameters())  # (sum: finite where S = 0)
            return (torch.zeros(B, N, N, self.out_proj.out_features) + z).to(msa_repr.dtype)

    def opm_backward(msa, mask, ln_w, ln_b, eps, wa, ba, wb, bb, wo, bo, grad_out, chunk_bytes=256 << 20,
                     wo_kernel=None, ab_kernel=None, ln_kernel=None, rows_kernel=None, ab=None, parts=None,
                     split=False):
        assert grad_out.shape[:3] == (msa.shape[0], msa.shape[2], msa.shape[2]) and wa.shape[0] == 32
        parts += now["call"]["expect"]
        return (torch.zeros_like(msa),) + tuple(torch.zeros_like(p) for p in (ln_w, ln_b, wa, ba, wb, bb, wo, bo))

    def opm_backward_rows(msa, mask, ln_w, ln_b, wa, ba, wb, bb, eps, block_tiles):
        assert all(p.dtype == torch.float32 for p in (ln_w, ln_b, wa, ba, wb, bb)) and isinstance(block_tiles, bool)
        B, S, N, _ = msa.shape
        return torch.zeros(B, S, N, 32), torch.zeros(B, S, N, 32), torch.ones(B, N)

    class OpenFoldModel(OPMModel):  # the family modules: their names and forward signatures
        def __init__(self, msa_dim, pair_dim, hidden_dim=32, eps=1e-3, proj_bias=False):
            nn.Module.__init__(self)
            self.layer_norm = nn.LayerNorm(msa_dim)
            self.linear_1 = nn.Linear(msa_dim, hidden_dim, bias=proj_bias)
            self.linear_2 = nn.Linear(msa_dim, hidden_dim, bias=proj_bias)
            self.out_proj = self.linear_out = nn.Linear(hidden_dim * hidden_dim, pair_dim)
            self.variant, self.last_variant, self.last_backward = "auto", None, None

        def forward(self, m, mask=None, chunk_size=None, inplace_safe=False):
            assert now["epilogue"] in ("fused", "unfused") and now["backward"] in ("chunks", "kernels")
            return OPMModel.forward(self, m, mask)

    class BoltzModel(OPMModel):
        def __init__(self, msa_dim, pair_dim, hidden_dim=32):
            nn.Module.__init__(self)
            self.norm = nn.LayerNorm(msa_dim)
            self.proj_a = nn.Linear(msa_dim, hidden_dim, bias=False)
            self.proj_b = nn.Linear(msa_dim, hidden_dim, bias=False)
            self.out_proj = self.proj_o = nn.Linear(hidden_dim * hidden_dim, pair_dim)
            self.variant, self.last_variant, self.last_backward = "auto", None, None

        def forward(self, m, mask, chunk_size=None):
            assert now["epilogue"] in ("fused", "unfused") and now["backward"] in ("chunks", "kernels")
            return OPMModel.forward(self, m, mask)

    def setting(key, modes):
        class Setting:
            def __init__(self, mode):
                assert mode in modes
                self.mode = mode

            def __enter__(self):
                now[key] = self.mode

            def __exit__(self, *exc):
                now[key] = None
        return Setting

    now["epilogue"] = now["backward"] = None
    def opm_pair_scale(mask, norm, eps, counts):
        assert mask.dim() == 3 and norm in (1, 2) and counts in (1, 2, 3)
        B, _, N = mask.shape
        return torch.ones(B, N, N, 2)

    def opm_backward_ln(xin, da, db, mask, ln_w, ln_b, wa, wb, eps, consume):
        R, cm = xin.shape
        assert da.shape == db.shape == (R, 32) and mask.shape == (R,) and wa.shape == wb.shape == (32, cm)
        assert all(p.dtype == torch.float32 for p in (mask, ln_w, ln_b, wa, wb)) and isinstance(consume, bool)
        if consume:  # the case's consume calls fit on 132 SMs: their partials go over da, db
            da[:32] += 1
            db[:32] += 1
        return (torch.zeros_like(xin), torch.zeros(cm), torch.zeros(cm), torch.zeros(32, cm), torch.zeros(32),
                torch.zeros(32, cm), torch.zeros(32))

    def opm_backward_wo(a, b, inv_denom, g, ops, chunk_bytes, split_j):
        B, S, N, c = a.shape
        assert b.shape == a.shape and c == 32 and inv_denom.shape == (B, N) and g.shape[:3] == (B, N, N)
        assert ops in ("split", "float16", "bfloat16") and isinstance(chunk_bytes, int) and isinstance(split_j, bool)
        return torch.zeros(g.shape[3], 1024)

    def opm_backward_ab(a, b, inv_denom, g, wo, ops, out_t):
        B, S, N, c = a.shape
        assert b.shape == a.shape and c == 32 and inv_denom.shape == (B, N) and g.shape[:3] == (B, N, N)
        assert wo.shape == (g.shape[3], 1024) and ops in ("float16", "bfloat16") and g.dtype == getattr(torch, ops)
        assert isinstance(out_t, bool)
        return (torch.zeros_like(a),) * 2

    def opm_forward(msa, mask, ln_w, ln_b, wa, ba, wb, bb, wo, bo, eps, variant, keep_ab, norm=0, norm_eps=1e-3,
                    pair_fused=False, pair_counts=0, keep_o=False):  # (the opm_keep_o calls alone)
        assert keep_ab and keep_o and pair_fused and norm in (0, 1, 2) and OPMModel.ALL_VARIANTS[variant] == "outer_wg"
        assert msa.dtype in (torch.float16, torch.bfloat16) and all(p.dtype == msa.dtype for p in (ln_w, wa, wo, bo))
        B, S, N, _ = msa.shape
        return (torch.zeros(B, N, N, wo.shape[0], dtype=msa.dtype), variant, None, None, None,
                torch.zeros(B, N, N, 1024, dtype=msa.dtype))

    def opm_backward_wo_kept(g, o):
        assert g.dtype == o.dtype and g.dtype in (torch.float16, torch.bfloat16) and g.shape[-1] % 8 == 0
        assert o.shape == (g.shape[0], 1024)
        return torch.zeros(g.shape[-1], 1024)

    def opm_backward_g(g, wo, inv_denom):
        B, N, _, cz = g.shape
        assert g.dtype == wo.dtype and g.dtype in (torch.float16, torch.bfloat16) and wo.shape == (cz, 1024)
        assert g.shape == (B, N, N, cz) and inv_denom.shape == (B, N) and inv_denom.dtype == torch.float32
        return torch.zeros(B, 32 * N, 32 * N, dtype=g.dtype)

    ext = type("Ext", (), {"opm_backward_rows": staticmethod(opm_backward_rows),
                           "opm_backward_g": staticmethod(opm_backward_g),
                           "opm_backward_wo_kept": staticmethod(opm_backward_wo_kept),
                           "opm_forward": staticmethod(opm_forward),
                           "opm_pair_scale": staticmethod(opm_pair_scale),
                           "opm_backward_ln": staticmethod(opm_backward_ln),
                           "opm_backward_wo": staticmethod(opm_backward_wo),
                           "opm_backward_ab": staticmethod(opm_backward_ab)})
    opm = type("OPM", (), {"ModelNew": OPMModel, "outer_product_mean_backward": staticmethod(opm_backward),
                           "_ext": ext, "FAMILIES": {"openfold": OpenFoldModel, "boltz": BoltzModel},
                           "pair_epilogue": setting("epilogue", ("fused", "unfused")),
                           "pair_backward": setting("backward", ("chunks", "kernels")),
                           "PAIR_G_KERNEL": False, "LOW_MEMORY_BACKWARD": False})
    monkeypatch.setattr(sw, "_MODULES", {"contact_map": cm, "outer_product_mean": opm})
    for name, fn in list(sw._OPS.items()):
        def wrapped(torch_, mod, call, sms, fn=fn):
            now["call"] = call
            return fn(torch_, mod, call, sms)
        monkeypatch.setitem(sw._OPS, name, wrapped)
    for case in sw.CASES:
        sw.run_case(torch, case, quick=False)
    assert opm.PAIR_G_KERNEL is False and opm.LOW_MEMORY_BACKWARD is False  # the calls' settings were restored
    # a path other than the expected one raises, naming the case and the call
    monkeypatch.setattr(cm, "fused_backward_runs", staticmethod(lambda pair, w1: False))
    with pytest.raises(RuntimeError, match=r"cm_backward_float32 call 0: cm_backward .*fused_backward_runs is False"):
        sw.run_case(torch, sw.CASES_BY_NAME["cm_backward_float32"], quick=True)
    monkeypatch.setattr(CMModel, "forward", lambda self, x: (setattr(self, "last_variant", "mma"), x.mean(-1))[1])
    with pytest.raises(RuntimeError, match=r"cm_wgmma_float32 call 0: .*last_variant: expected 'wgmma', 'mma' ran"):
        sw.run_case(torch, sw.CASES_BY_NAME["cm_wgmma_float32"], quick=True)


@pytest.mark.gpu
@pytest.mark.sanitizer
def test_racecheck_clean_on_the_ordered_hand_overs(tmp_path):
    """racecheck on the calls where it found three shared-memory hand-overs unordered (NOTES.md, Sanitizer record):
    the contact map's tile coordinates (tinfo, read by one lane now, the warp served by shuffles), the OPM
    backward's ring slots (every consumer thread arrives on the slot's empty barrier) and outer_wg's row scales
    (Osc, stored after the barrier that ends phase B's reads). The fp32 walk calls give each block several tiles,
    so slots come round."""
    if sw.find_sanitizer() is None:
        pytest.skip("compute-sanitizer not found")
    cases = "cm_wgmma_float32,opm_outer_wg_float16,opm_outer_wg_bfloat16,opm_backward_float32"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sanitize_sweep.py"), "--tools", "racecheck",
                        "--cases", cases, "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "racecheck" in r.stdout and "-> PASS" in r.stdout


@pytest.mark.gpu
@pytest.mark.sanitizer
def test_memcheck_clean_on_fused_small_16bit(tmp_path):
    """memcheck on fused_small's float16 / bfloat16 calls, where the kernel read ln_w past its end at msa_dim 64:
    the compiler had hoisted the 16-bit __ldg (inline asm) above its bounds check; its loads are plain loads now
    (NOTES.md, Sanitizer record)."""
    if sw.find_sanitizer() is None:
        pytest.skip("compute-sanitizer not found")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sanitize_sweep.py"), "--tools", "memcheck",
                        "--cases", "opm_fused_small_float16,opm_fused_small_bfloat16", "--per-case",
                        "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "opm_fused_small_kernel<__nv_bfloat16>" in r.stdout and "-> PASS" in r.stdout


def test_module_setting_restores_the_attribute_when_the_block_raises():
    """_module_setting sets a kernel module's attribute for one call (None: leaves it) and restores it afterwards,
    also when the call raises: a worker goes on to its next case, which must see the default."""
    import types
    mod = types.SimpleNamespace(PAIR_G_KERNEL=False)
    with sw._module_setting(mod, "PAIR_G_KERNEL", True):
        assert mod.PAIR_G_KERNEL is True
    assert mod.PAIR_G_KERNEL is False
    with pytest.raises(RuntimeError):
        with sw._module_setting(mod, "PAIR_G_KERNEL", True):
            raise RuntimeError("a failing case")
    assert mod.PAIR_G_KERNEL is False
    with sw._module_setting(mod, "PAIR_G_KERNEL", None):
        assert mod.PAIR_G_KERNEL is False
