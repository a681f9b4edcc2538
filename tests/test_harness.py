"""The harness on the CPU: known-wrong pure-PyTorch files are rejected with exit code 3, the good ones
pass, build failures give 2, no CUDA gives 4, and the shared code paths (timing with perf_counter,
KernelBench's timing loop with stand-in events, table, JSON, variants, rows sampling, weak oracle,
--dtype, --backward) run. Small shapes only (CI: 2 cores, no GPU)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import harness

ROOT = harness.ROOT
SOL = os.path.join(ROOT, "tests", "solutions")
CM_REF = os.path.join(ROOT, "reference", "contact_map.py")
OPM_REF = os.path.join(ROOT, "reference", "outer_product_mean.py")
CM_SHAPES = "seed,awkward_37"
OPM_SHAPES = "seed,awkward_33,awkward_17"
CPU = ["--device", "cpu", "--no-timing"]

# file -> a phrase the harness must print for it
CM_WRONG = {
    "contact_map_zeros.py": "not allclose",
    "contact_map_no_ln_affine.py": "not allclose",
    "contact_map_fp16.py": "not allclose",
    "contact_map_mutates_input.py": "changed its input(s) [0] in place",
    "contact_map_param_order.py": "not a KernelBench drop-in",
    "contact_map_wrong_shape.py": "shape (4, 64, 64, 1), expected (4, 64, 64)",
    "contact_map_fp64_output.py": "dtype torch.float64, expected torch.float32",
    "contact_map_stale_weights.py": "not allclose",
    "contact_map_variants.py": "variant no_symmetrise",
    "contact_map_reuses_output.py": "outputs must not alias a buffer",
    "contact_map_init_raises.py": "ModelNew(64, 32) raised ValueError: pair_dim 64 not supported",
}
OPM_WRONG = {
    "outer_product_mean_zeros.py": "not allclose",
    "outer_product_mean_no_ln_affine.py": "not allclose",
    "outer_product_mean_fp16.py": "not allclose",
    "outer_product_mean_mutates_input.py": "changed its input(s) [0] in place",
    "outer_product_mean_param_order.py": "not a KernelBench drop-in",
    "outer_product_mean_af2_denominator.py": "not allclose",
    "outer_product_mean_no_clamp.py": "NaN/Inf values where the reference is finite",
    "outer_product_mean_binarised_mask.py": "mask=fractional",
    "outer_product_mean_wrong_when_grad.py": "under torch.enable_grad(): not allclose",
    "outer_product_mean_ignores_variant.py": "asked for variant outer_first, last_variant says w_first",
}


@pytest.mark.parametrize("name", sorted(CM_WRONG))
def test_rejects_wrong_contact_map(run_harness, name):
    code, out = run_harness(os.path.join(SOL, name), "--ref", CM_REF, *CPU, "--shapes", CM_SHAPES)
    assert code == harness.EXIT_WRONG, out[-3000:]
    assert CM_WRONG[name] in out, out[-3000:]
    assert "FAIL" in out.splitlines()[-1]
    assert "harness error" not in out and "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("name", sorted(OPM_WRONG))
def test_rejects_wrong_outer_product_mean(run_harness, name):
    code, out = run_harness(os.path.join(SOL, name), "--ref", OPM_REF, *CPU, "--shapes", OPM_SHAPES)
    assert code == harness.EXIT_WRONG, out[-3000:]
    assert OPM_WRONG[name] in out, out[-3000:]
    assert "harness error" not in out and "Traceback" not in out, out[-3000:]


def test_accepts_good_contact_map(run_harness):
    code, out = run_harness(os.path.join(SOL, "contact_map_good.py"), *CPU,  # reference found from the name
                            "--shapes", "seed,awkward_37,awkward_1,awkward_129")
    assert code == harness.EXIT_OK, out[-3000:]
    assert "drop-in (same seed -> same parameters): yes" in out
    assert out.splitlines()[-1].startswith("PASS")


def test_each_shape_checks_the_variants_its_model_lists(run_harness, tmp_path, monkeypatch):
    """A model's own VARIANTS may leave out variants that do not run for its dimensions: at each shape the harness
    checks and times only those its model lists and notes the rest; a shape where none of the asked-for variants
    runs is skipped, unless the model already failed (a drop-in failure still fails the shape)."""
    f = os.path.join(SOL, "contact_map_model_variants.py")
    js = tmp_path / "narrow.json"
    code, out = run_harness(f, "--device", "cpu", "--cpu-timing", "--samples", "2", "--input-sets", "1",
                            "--time-variants", "--backward", "--no-compile", "--shapes", "awkward_37,awkward_129",
                            "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    rep = json.loads(js.read_text())
    by = {s["name"]: s for s in rep["shapes"]}
    assert set(by["awkward_37"]["correctness"]["variants"]) == {"auto", "good", "narrow"}  # pair_dim 48
    assert set(by["awkward_129"]["correctness"]["variants"]) == {"auto", "good"}  # pair_dim 96
    assert by["awkward_129"]["correctness"]["variants_not_run"] == ["narrow"]
    assert set(by["awkward_129"]["correctness"]["backward"]["variants"]) == {"auto", "good"}
    assert set(by["awkward_129"]["timing"]["new"]) == {"auto", "good"}
    assert set(by["awkward_37"]["timing"]["train"]["new"]) == {"auto", "good", "narrow"}
    assert "awkward_129: variant narrow not run" in out and "ModelNew (variants auto,good)," in out
    code, out = run_harness(f, *CPU, "--shapes", "awkward_37,awkward_129", "--variant", "narrow")
    assert code == harness.EXIT_OK and "skipped: variant narrow does not run for these dimensions" in out, out[-3000:]
    code, out = run_harness(f, *CPU, "--shapes", "awkward_129", "--variant", "narrow")
    assert code == harness.EXIT_USAGE and "NOTHING CHECKED" in out, out[-3000:]
    sol, load = harness.load_module(f), harness.load_module
    monkeypatch.setattr(sol, "PARAM_ORDER_WRONG", True)
    monkeypatch.setattr(harness, "load_module",
                        lambda path, *a, **k: sol if os.path.abspath(path) == f else load(path, *a, **k))
    code, out = run_harness(f, *CPU, "--shapes", "awkward_129", "--variant", "narrow")
    assert code == harness.EXIT_WRONG and "not a KernelBench drop-in" in out, out[-3000:]


def test_accepts_good_outer_product_mean_every_variant(run_harness, tmp_path):
    js = tmp_path / "opm.json"
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_good.py"), *CPU, "--shapes", OPM_SHAPES,
                            "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    rep = json.loads(js.read_text())
    declared = set(harness.load_module(os.path.join(SOL, "outer_product_mean_good.py")).ModelNew.VARIANTS)
    assert len(declared) >= 2
    masks = set()
    for s in rep["shapes"]:
        v = s["correctness"]["variants"]
        assert set(v) == declared
        assert all(v[k]["last_variants"] == [k] for k in declared)
        assert all(x["grad_checked"] for x in v.values())  # the grad-enabled path, every variant
        trials = s["correctness"]["trials"]
        assert set(trials[0]["grad_variants"]) == declared
        assert all(g["ok"] for g in trials[0]["grad_variants"].values())
        masks |= {t["mask"] for t in trials}
    assert masks == set(harness.MASK_KINDS)  # integer masks included
    assert {"int32", "int64", "uint8"} <= masks


def test_variant_selection(run_harness):
    f = os.path.join(SOL, "contact_map_variants.py")
    code, out = run_harness(f, *CPU, "--shapes", "awkward_37", "--variant", "good")
    assert code == harness.EXIT_OK, out[-2000:]
    # "auto" names the kernel that ran in last_variant ("good"): not a forced-variant mismatch, shown
    code, out = run_harness(f, *CPU, "--shapes", "awkward_37", "--variant", "auto")
    assert code == harness.EXIT_OK and "auto->good" in out, out[-2000:]
    code, out = run_harness(f, *CPU, "--shapes", "awkward_37", "--variant", "no_symmetrise")
    assert code == harness.EXIT_WRONG
    code, out = run_harness(f, *CPU, "--shapes", "awkward_37", "--variant", "nope")
    assert code == harness.EXIT_USAGE
    # an undeclared variant is a usage error before the device is looked at (exit 1, not 4, without a GPU)
    code, out = run_harness(f, "--shapes", "awkward_37", "--variant", "nope", "--no-timing")
    assert code == harness.EXIT_USAGE and "not in ModelNew.VARIANTS" in out
    # one the file has (ALL_VARIANTS) but that does not run on this machine: said so
    code, out = run_harness(f, "--shapes", "awkward_37", "--variant", "other_gpu", "--no-timing")
    assert code == harness.EXIT_USAGE and "does not run on this machine" in out
    code, out = run_harness(os.path.join(SOL, "contact_map_good.py"), *CPU, "--shapes", "awkward_37",
                            "--variant", "x")
    assert code == harness.EXIT_USAGE and "declares no VARIANTS" in out


def test_build_failure_exit_code(run_harness, tmp_path):
    code, out = run_harness(os.path.join(SOL, "broken_build.py"), "--ref", CM_REF, *CPU, "--shapes", "seed")
    assert code == harness.EXIT_BUILD and "BUILD FAILED" in out
    empty = tmp_path / "no_model_new.py"
    empty.write_text("import torch\n")
    code, out = run_harness(empty, "--ref", CM_REF, *CPU, "--shapes", "seed")
    assert code == harness.EXIT_BUILD and "defines no class ModelNew" in out
    code, out = run_harness(tmp_path / "missing.py", "--ref", CM_REF, *CPU)
    assert code == harness.EXIT_BUILD


def test_usage_errors(run_harness, tmp_path):
    f = os.path.join(SOL, "contact_map_good.py")
    assert run_harness(f, *CPU, "--shapes", "nope")[0] == harness.EXIT_USAGE
    assert run_harness(f, *CPU, "--trials", "0")[0] == harness.EXIT_USAGE
    for opt in (["--atol", "-1"], ["--rtol=-1e-4"], ["--atol", "nan"]):
        code, out = run_harness(f, *CPU, *opt)
        assert code == harness.EXIT_USAGE and "must be finite and >= 0" in out, out[-2000:]
    code, out = run_harness(f, *CPU, "--json", tmp_path)  # a directory: refused before any work
    assert code == harness.EXIT_USAGE and "is a directory" in out and "building" not in out, out[-2000:]
    # a typo'd name is a usage error listing the valid names (not "no such file", exit 2)
    code, out = run_harness("contact_mpa", *CPU)
    assert code == harness.EXIT_USAGE and "valid names: contact_map, outer_product_mean" in out, out[-2000:]
    assert run_harness(os.path.join(SOL, "broken_build.py"), *CPU)[0] == harness.EXIT_USAGE  # no --ref
    # a missing solution file is exit 2 ("no such file") with or without --ref
    code, out = run_harness(os.path.join(SOL, "does_not_exist.py"), *CPU)
    assert code == harness.EXIT_BUILD and "no such file" in out, out[-2000:]
    with pytest.raises(SystemExit) as e:
        harness.main(["--bogus-option"])
    assert e.value.code == harness.EXIT_USAGE


def test_extension_file_refuses_cpu(run_harness):
    code, out = run_harness(os.path.join(SOL, "fake_extension.py"), "--ref", CM_REF, "--device", "cpu",
                            "--shapes", "seed")
    assert code == harness.EXIT_NO_CUDA and "need a CUDA device" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_no_cuda_message_and_exit_code_subprocess():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "harness.py"), os.path.join(SOL, "contact_map_good.py")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == harness.EXIT_NO_CUDA, r.stdout + r.stderr
    assert "building" in r.stdout and "NO CUDA DEVICE" in r.stdout and "need" in r.stdout


def test_wrong_file_exit_code_subprocess():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "harness.py"), os.path.join(SOL, "contact_map_zeros.py"),
                        "--ref", CM_REF, "--device", "cpu", "--no-timing", "--shapes", "awkward_37", "--trials", "5"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == harness.EXIT_WRONG, r.stdout + r.stderr


def test_cpu_timing_dry_run_and_json(run_harness, tmp_path):
    """--cpu-timing runs the timing/roofline/table/JSON code with perf_counter (numbers meaningless)."""
    js = tmp_path / "r.json"
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_good.py"), "--device", "cpu", "--cpu-timing",
                            "--no-compile", "--samples", "3", "--input-sets", "2", "--shapes", "awkward_33",
                            "--time-variants", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    rep = json.loads(js.read_text())
    assert rep["exit_code"] == 0 and rep["verdict"].startswith("PASS")
    assert rep["settings"]["tf32"] is False and rep["build"]["ok"] and rep["build"]["extensions"] == []
    s = rep["shapes"][0]
    assert s["name"] == "awkward_33" and s["ok"] and s["correctness"]["dropin"]["ok"]
    tm = s["timing"]
    assert set(tm["new"]) == {"outer_first", "w_first"}
    for r in tm["new"].values():
        assert r["per_call"]["n"] == 3 and r["per_call"]["p10_ms"] <= r["per_call"]["median_ms"] <= r["per_call"]["p90_ms"]
        assert r["floor_multiple"] > 0 and r["tflops"] > 0 and r["tbs"] > 0 and r["speedup_vs_eager"] > 0
        assert r["graph"] is None and r["graph_error"]
    assert tm["eager"]["per_call"]["median_ms"] > 0 and tm["compile_note"]
    assert tm["floor_s"] == max(tm["flops"] / 50e12, tm["min_bytes"] / 4.0e12)
    lines = out.splitlines()
    hdr = next(i for i, ln in enumerate(lines) if ln.startswith("shape "))
    assert "vs compile" in lines[hdr] and lines[hdr + 2].startswith("awkward_33")
    # the KernelBench-style forward: every timed variant and the eager reference, in the JSON and the table
    assert "KernelBench" in tm["kb_note"] and "grad mode" in tm["kb_note"]
    for r in list(tm["new"].values()) + [tm["eager"]]:
        assert r["kb_error"] is None and r["kb"]["n"] == 3 and r["host"]["n"] == 3
        assert r["kb"]["min_ms"] <= r["kb"]["mean_ms"] <= r["kb"]["max_ms"] and r["kb"]["std_ms"] >= 0
        assert r["host"]["median_ms"] > 0
    for k, r in tm["new"].items():
        assert r["kb_last_variant"] == k
        assert r["kb_speedup_vs_eager"] == pytest.approx(tm["eager"]["kb"]["mean_ms"] / r["kb"]["mean_ms"])
    cols = [c for c in lines[hdr].split("  ") if c.strip()]
    for col in ("KB ms new/ref", "KB x", "host us new/ref"):
        assert col in [c.strip() for c in cols], lines[hdr]


def test_rows_sampling_path_for_reference_may_oom(run_harness, tmp_path):
    """A custom OPM shape flagged reference_may_oom is checked through forward_rows (fp32 and fp64)."""
    shape = "B=2,S=3,N=23,msa_dim=16,hidden_dim=8,pair_dim=8,reference_may_oom=1"
    js = tmp_path / "r.json"
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_good.py"), *CPU, "--shape", shape, "--rows", "5",
                            "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    assert json.loads(js.read_text())["shapes"][0]["correctness"]["rows_checked"] == 5
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_af2_denominator.py"), *CPU, "--shape", shape)
    assert code == harness.EXIT_WRONG


def test_weak_oracle_is_a_failure(run_harness, tmp_path):
    flat = "return torch.sigmoid(1e-7 * self.lin(x)).squeeze(-1)  # ~0.5 everywhere"
    ref, sol = _write_pair(tmp_path, flat, forward_new=flat)
    code, out = run_harness(sol, "--ref", ref, *CPU)
    assert code == harness.EXIT_WRONG and "oracle too weak" in out


def test_custom_shape_and_skips(run_harness):
    f = os.path.join(SOL, "contact_map_good.py")
    code, out = run_harness(f, *CPU, "--shape", "B=1,N=3,pair_dim=8,hidden_dim=4")
    assert code == harness.EXIT_OK and "custom0" in out
    # keys checked against the reference's SHAPES before the build: usage errors naming the expected keys
    for bad, why in (("N=3", "missing key(s) B, pair_dim, hidden_dim"), ("foo=2", "unknown key(s) foo"),
                     ("B=1,N=3,pair_dim=8,hidden_dim=4,S=2", "unknown key(s) S"),
                     ("B=1,N=0,pair_dim=8,hidden_dim=4", "N must be >= 1"), ("B=1,N=x", "not an integer")):
        code, out = run_harness(f, *CPU, "--shape", bad)
        assert code == harness.EXIT_USAGE and why in out and "building" not in out, (bad, out[-2000:])
        if "key" in why:
            assert "expected keys B,N,pair_dim,hidden_dim" in out
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_good.py"), *CPU, "--shape", "N=3")
    assert code == harness.EXIT_USAGE and "optional flags: reference_may_oom=0|1" in out
    # default selection on the CPU skips the heavy shapes with a note, runs the rest
    names = [(n, r) for n, _d, r in harness.select_shapes(
        harness.load_module(OPM_REF), harness.build_parser().parse_args(["x", "--device", "cpu"]),
        torch.device("cpu"))]
    assert dict(names)["seed"] is None and dict(names)["huge"] is not None


def test_dropin_check_function():
    ref = harness.load_module(CM_REF)
    good = harness.load_module(os.path.join(SOL, "contact_map_good.py"))
    bad = harness.load_module(os.path.join(SOL, "contact_map_param_order.py"))
    assert harness.dropin_check(ref.Model, good.ModelNew, ref.get_init_inputs())[0]
    ok, detail = harness.dropin_check(ref.Model, bad.ModelNew, ref.get_init_inputs())
    assert not ok and "mlp." in detail


def test_good_files_are_kernelbench_drop_ins():
    """KernelBench's own flow: same seed, build both, no weight copy, compare outputs on get_inputs()."""
    for stem in ("contact_map", "outer_product_mean"):
        ref = harness.load_module(os.path.join(ROOT, "reference", stem + ".py"))
        sol = harness.load_module(os.path.join(SOL, stem + "_good.py"))
        torch.manual_seed(0)
        m = ref.Model(*ref.get_init_inputs())
        torch.manual_seed(0)
        n = sol.ModelNew(*ref.get_init_inputs())
        torch.manual_seed(1)
        inputs = ref.get_inputs()
        with torch.no_grad():
            torch.testing.assert_close(n(*inputs), m(*inputs), atol=1e-4, rtol=1e-4)


def test_input_generators():
    g = torch.Generator().manual_seed(0)
    shape = (2, 5, 40)
    assert harness.make_mask(shape, "bool", g, "cpu").dtype == torch.bool
    for kind in ("int32", "int64", "uint8"):
        m = harness.make_mask(shape, kind, g, "cpu")
        assert m.dtype == getattr(torch, kind) and set(m.unique().tolist()) == {0, 1}
    assert (harness.make_mask(shape, "int64", g, "cpu").sum(1) == 0).any(dim=-1).all()  # dead positions
    frac = harness.make_mask(shape, "fractional", g, "cpu")
    assert ((frac > 0) & (frac < 1)).any() and (frac == 0).any()
    dead = harness.make_mask(shape, "dead_positions", g, "cpu")
    assert (dead.sum(1) == 0).any(dim=-1).all()  # some position masked in every sequence, per batch
    assert (harness.make_mask(shape, "ones", g, "cpu") == 1).all()
    for dist in harness.DISTRIBUTIONS:
        x = harness.make_activation((64, 64), dist, g, "cpu")
        assert x.dtype == torch.float32 and torch.isfinite(x).all() and (x != 0).all() and x.std() > 0.1
    assert harness.make_activation((1000,), "offset100", g, "cpu").mean() > 90
    t = harness.make_activation((100000,), "student_t3", g, "cpu")
    assert t.abs().max() > 8  # heavy tail


def test_cpu_timing_with_torch_compile(run_harness, tmp_path):
    """The torch.compile(reference) branch (inductor on the CPU, ~20 s): compiled, timed, speedup filled."""
    js = tmp_path / "c.json"
    code, out = run_harness(os.path.join(SOL, "contact_map_good.py"), "--device", "cpu", "--cpu-timing",
                            "--shapes", "awkward_1", "--compile-all", "--samples", "3", "--trials", "5", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    assert "compiling torch.compile(reference) for awkward_1" in out
    tm = json.loads(js.read_text())["shapes"][0]["timing"]
    assert tm["compile"]["per_call"]["median_ms"] > 0 and tm["compile"]["compile_s"] > 0
    assert tm["new"]["-"]["speedup_vs_compile"] > 0
    assert "train" not in tm  # forward only without --backward
    # --backward: the training step of torch.compile(reference) too (forward + backward graph)
    code, out = run_harness(os.path.join(SOL, "contact_map_good.py"), "--device", "cpu", "--cpu-timing",
                            "--shapes", "awkward_1", "--compile-all", "--samples", "3", "--trials", "2",
                            "--backward", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    train = json.loads(js.read_text())["shapes"][0]["timing"]["train"]
    assert train["compile"]["per_call"]["median_ms"] > 0 and train["compile"]["compile_s"] > 0
    assert train["new"]["-"]["speedup_vs_compile"] > 0 and train["new"]["-"]["speedup_vs_eager"] > 0
    assert "timing torch.compile(reference) forward+backward" in out


def test_init_raising_is_the_solutions_failure(run_harness):
    """A constructor that raises: "ModelNew(...) raised", exit 3, everywhere it is built (drop-in check,
    correctness, timing), never a harness error with a traceback."""
    code, out = run_harness(os.path.join(SOL, "contact_map_init_raises.py"), "--device", "cpu", "--cpu-timing",
                            "--no-compile", "--samples", "2", "--shapes", "awkward_1")
    assert code == harness.EXIT_WRONG, out[-3000:]
    assert out.count("ModelNew(64, 32) raised ValueError") >= 2  # correctness and timing
    assert "harness error" not in out and "Traceback" not in out


def _write_pair(tmp_path, forward_ref, forward_new="return self.lin(x).squeeze(-1)", extra_new=""):
    ref = tmp_path / "tiny_ref.py"
    ref.write_text(textwrap.dedent('''
        import torch, torch.nn as nn
        class Model(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.lin = nn.Linear(d, 1)
            def forward(self, x):
                %s
        SHAPES = {"tiny": dict(B=6, d=4)}
        def init_inputs_for(s): return [s["d"]]
        def input_shapes_for(s): return [(s["B"], s["d"])]
        def flops(s): return 10
        def min_bytes(s): return 4 * (s["B"] * s["d"] + s["B"])
    ''') % forward_ref)
    sol = tmp_path / "tiny_sol.py"
    sol.write_text(textwrap.dedent('''
        import torch, torch.nn as nn
        class ModelNew(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.lin = nn.Linear(d, 1)
                self._last = None
            def forward(self, x):
                %s
                %s
    ''') % (extra_new, forward_new))
    return ref, sol


def test_output_changed_later_is_caught(run_harness, tmp_path):
    """Aliasing without sharing storage: each call returns a fresh tensor but zeroes the previous one."""
    ref, sol = _write_pair(tmp_path, "return self.lin(x).squeeze(-1)",
                           forward_new="self._last = self.lin(x).squeeze(-1).detach(); return self._last",
                           extra_new="self._last is not None and self._last.zero_()")
    code, out = run_harness(sol, "--ref", ref, *CPU)
    assert code == harness.EXIT_WRONG and "this call changed ModelNew's previous output" in out, out[-3000:]
    ok_sol = tmp_path / "ok_sol.py"
    ok_sol.write_text(sol.read_text().replace("self._last is not None and self._last.zero_()", "pass"))
    code, out = run_harness(ok_sol, "--ref", ref, *CPU)
    assert code == harness.EXIT_OK, out[-3000:]


def test_harness_error_is_exit_1(run_harness, tmp_path):
    """An exception in the reference (not the solution) is a harness error: exit 1, not a verdict."""
    ref, sol = _write_pair(tmp_path, "raise RuntimeError('reference bug')")
    code, out = run_harness(sol, "--ref", ref, *CPU)
    assert code == harness.EXIT_USAGE and "HARNESS ERROR" in out.splitlines()[-1], out[-3000:]


# --- precision (--dtype) ----------------------------------------------------------------------
def test_good_solutions_pass_in_every_dtype(run_harness, tmp_path):
    """--dtype all: fp32, fp16, bf16 in turn, each against the reference run in that dtype (KernelBench's
    1e-2 tolerance in fp16/bf16), with the reference's own fp64 error reported per dtype."""
    js = tmp_path / "cm.json"
    code, out = run_harness(os.path.join(SOL, "contact_map_good.py"), *CPU, "--shapes", "awkward_37,awkward_1",
                            "--dtype", "all", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    rep = json.loads(js.read_text())
    assert rep["settings"]["dtypes"] == ["fp32", "fp16", "bf16"]
    assert rep["settings"]["tolerances"] == {"fp32": [1e-4, 1e-4], "fp16": [1e-2, 1e-2], "bf16": [1e-2, 1e-2]}
    by = {(s["name"], s["dtype"]): s for s in rep["shapes"]}
    assert set(by) == {(n, d) for n in ("awkward_37", "awkward_1") for d in ("fp32", "fp16", "bf16")}
    assert all(s["ok"] for s in by.values())
    assert by["awkward_37", "bf16"]["atol"] == 1e-2 and by["awkward_37", "fp32"]["atol"] == 1e-4
    # the reference really ran in each dtype: its own error against fp64 grows fp32 < fp16 < bf16
    err = {d: by["awkward_37", d]["correctness"]["ref_fp32_max_abs_err_fp64"] for d in ("fp32", "fp16", "bf16")}
    assert err["fp32"] < 1e-5 < err["fp16"] < err["bf16"] < 1e-1, err
    lines = out.splitlines()
    hdr = next(i for i, ln in enumerate(lines) if ln.startswith("shape ") and "result" in ln)
    assert lines[hdr].split()[:2] == ["shape", "dtype"] and lines[hdr + 2].split()[:2] == ["awkward_37", "fp32"]
    # an OPM variant in the reference's order of operations passes in every dtype too, masks included
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_good.py"), *CPU, "--shapes", "awkward_33",
                            "--variant", "outer_first", "--dtype", "all")
    assert code == harness.EXIT_OK, out[-3000:]
    assert "== awkward_33 [fp16]" in out and "== awkward_33 [bf16]" in out


def test_low_precision_inputs_masks_included_are_cast(run_harness, tmp_path):
    """In fp16/bf16 every input tensor, the mask too, reaches ModelNew in that dtype (KernelBench's cast);
    in fp32 masks keep their kind (bool and integer masks are still checked)."""
    sol = tmp_path / "outer_product_mean_dtype_probe.py"
    sol.write_text(textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {SOL!r})
        from outer_product_mean_good import ModelNew as Good

        SEEN = set()

        class ModelNew(Good):
            def forward(self, msa_repr, msa_mask):
                SEEN.add((str(msa_repr.dtype), str(msa_mask.dtype)))
                for p in self.parameters():
                    assert p.dtype == msa_repr.dtype, (p.dtype, msa_repr.dtype)
                return super().forward(msa_repr, msa_mask)
    '''))
    code, out = run_harness(sol, "--ref", OPM_REF, *CPU, "--shapes", "awkward_17", "--variant", "outer_first",
                            "--dtype", "all")
    assert code == harness.EXIT_OK, out[-3000:]
    seen = next(m for k, m in sys.modules.items() if k.startswith("_loaded_outer_product_mean_dtype_probe")).SEEN
    low = {(x, m) for x, m in seen if x != "torch.float32"}
    assert low == {("torch.float16", "torch.float16"), ("torch.bfloat16", "torch.bfloat16")}, seen
    assert {m for x, m in seen if x == "torch.float32"} >= {"torch.float32", "torch.bool", "torch.int32"}, seen


def test_bf16_input_needs_bf16_output(run_harness):
    f = os.path.join(SOL, "contact_map_fp32_output.py")
    code, out = run_harness(f, *CPU, "--shapes", "awkward_37")
    assert code == harness.EXIT_OK, out[-3000:]  # right in fp32
    code, out = run_harness(f, *CPU, "--shapes", "awkward_37", "--dtype", "bf16")
    assert code == harness.EXIT_WRONG, out[-3000:]
    assert "dtype torch.float32, expected torch.bfloat16" in out
    assert out.splitlines()[-1] == "FAIL: wrong results or failed checks at awkward_37 [bf16]"


def test_dtype_all_fails_when_one_dtype_fails(run_harness, tmp_path):
    """A bug in the fp16 path only: --dtype all fails (exit 3) and names fp16; fp32 and bf16 pass."""
    f = os.path.join(SOL, "outer_product_mean_fp16_drops_mask.py")
    js = tmp_path / "m.json"
    code, out = run_harness(f, *CPU, "--shapes", "awkward_33", "--dtype", "all", "--json", js)
    assert code == harness.EXIT_WRONG, out[-3000:]
    rep = json.loads(js.read_text())
    assert {s["dtype"]: s["ok"] for s in rep["shapes"]} == {"fp32": True, "fp16": False, "bf16": True}
    assert "not allclose(atol=0.01, rtol=0.01)" in out
    assert rep["verdict"] == "FAIL: wrong results or failed checks at awkward_33 [fp16]"
    assert run_harness(f, *CPU, "--shapes", "awkward_33", "--dtype", "bf16")[0] == harness.EXIT_OK
    with pytest.raises(SystemExit) as e:
        harness.main([f, *CPU, "--dtype", "fp64"])
    assert e.value.code == harness.EXIT_USAGE


# --- training (--backward) --------------------------------------------------------------------
def _grads_of(rep):
    return {(s["name"], s["dtype"], k): vb for s in rep["shapes"]
            for k, vb in s["correctness"]["backward"]["variants"].items()}


def test_backward_good_solutions_pass(run_harness, tmp_path):
    """Plain-autograd solutions: every gradient (inputs of role x, every parameter; no mask) passes,
    in every trial and variant; without --backward no gradient is checked."""
    js = tmp_path / "b.json"
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_good.py"), *CPU, "--shapes", "awkward_33",
                            "--backward", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    rep = json.loads(js.read_text())
    assert rep["settings"]["backward"] is True
    params = [n for n, _ in harness.load_module(OPM_REF).Model(8, 4, 2).named_parameters()]
    grads = _grads_of(rep)
    declared = harness.load_module(os.path.join(SOL, "outer_product_mean_good.py")).ModelNew.VARIANTS
    assert {k[2] for k in grads} == set(declared)
    for vb in grads.values():
        assert vb["ok"] and set(vb["grads"]) == {"msa_repr", *params}  # no msa_mask gradient
        for g in vb["grads"].values():
            assert sum(g["held"].values()) == 6 and "neither" not in g["held"]
            assert g["max_abs_err_fp64"] <= 2 * g["ref_max_abs_err_fp64"] or g["max_abs_diff_ref"] < 1e-2
    t0 = rep["shapes"][0]["correctness"]["trials"][0]["backward"]
    assert all(c["ok"] and c["grads"]["proj_a.weight"]["held"] for c in t0.values())
    assert "grad err64 new/ref" in out
    code, out = run_harness(os.path.join(SOL, "contact_map_good.py"), *CPU, "--shapes", "awkward_37",
                            "--trials", "3", "--backward", "--dtype", "all", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    grads = _grads_of(json.loads(js.read_text()))
    assert len(grads) == 3 and all(set(vb["grads"]) >= {"pair_repr", "layer_norm.weight"} for vb in grads.values())
    code, out = run_harness(os.path.join(SOL, "contact_map_good.py"), *CPU, "--shapes", "awkward_1", "--json", js)
    assert code == harness.EXIT_OK and json.loads(js.read_text())["shapes"][0]["correctness"]["backward"] is None


# file, shapes, a phrase --backward must print; the forward is right (passes without --backward)
BACKWARD_WRONG = {
    "contact_map_ln_affine_no_grad.py": ("awkward_37", "gradient of layer_norm.weight: not allclose"),
    "contact_map_detached_symmetrise.py": ("awkward_37", "gradient of pair_repr: not allclose"),
    "outer_product_mean_no_denom_grad.py": ("awkward_33", "gradient of proj_a.weight: not allclose"),
}


@pytest.mark.parametrize("name", sorted(BACKWARD_WRONG))
def test_backward_rejects_wrong_gradients(run_harness, tmp_path, name):
    shapes, phrase = BACKWARD_WRONG[name]
    f = os.path.join(SOL, name)
    code, out = run_harness(f, *CPU, "--shapes", shapes, "--trials", "2")
    assert code == harness.EXIT_OK, out[-3000:]
    js = tmp_path / "w.json"
    code, out = run_harness(f, *CPU, "--shapes", shapes, "--trials", "2", "--backward", "--json", js)
    assert code == harness.EXIT_WRONG, out[-3000:]
    assert phrase in out and "harness error" not in out and "Traceback" not in out, out[-3000:]
    s = json.loads(js.read_text())["shapes"][0]
    assert s["correctness"]["variants"]["-"]["ok"]  # the forward passed
    grads = s["correctness"]["backward"]["variants"]["-"]["grads"]
    if name == "outer_product_mean_no_denom_grad.py":  # out_proj.bias does not see the denominator
        assert "neither" not in grads["out_proj.bias"]["held"] and "neither" in grads["proj_b.bias"]["held"]
    if name == "contact_map_ln_affine_no_grad.py":  # the input's gradient is still right
        assert "neither" not in grads["pair_repr"]["held"] and "neither" in grads["layer_norm.bias"]["held"]


def test_backward_in_bf16_rejects_wrong_gradients(run_harness):
    """--backward --dtype bf16: the 1e-2 tolerance still catches a gradient that misses a path."""
    f = os.path.join(SOL, "contact_map_detached_symmetrise.py")
    code, out = run_harness(f, *CPU, "--shapes", "awkward_37", "--trials", "2", "--backward", "--dtype", "bf16")
    assert code == harness.EXIT_WRONG and "gradient of pair_repr: not allclose(atol=0.01, rtol=0.01)" in out


def test_compare_grad():
    ref64 = torch.linspace(-1, 1, 50, dtype=torch.float64)
    ref = (ref64 + 1e-3).float()  # the reference's own error: 1e-3
    r = harness.compare_grad(None, ref, ref64, 1e-4, 1e-4)
    assert not r["ok"] and "no gradient" in r["failures"][0]
    assert harness.compare_grad(ref.clone(), ref, ref64, 1e-4, 1e-4)["held"] == "both"
    r = harness.compare_grad(ref64.float(), ref, ref64, 1e-4, 1e-4)  # exact, far from the reference
    assert r["ok"] and r["held"] == "fp64x2" and r["max_abs_err_fp64"] < 1e-6
    r = harness.compare_grad((ref64 - 1e-3).float(), ref, ref64, 1e-2, 1e-2)  # as far as the reference, other side
    assert r["ok"] and r["held"] == "both"
    r = harness.compare_grad((ref64 + 3e-3).float(), ref, ref64, 1e-4, 1e-4)  # 3x the reference's error
    assert not r["ok"] and r["held"] is None and "> 2 x the reference's" in r["failures"][0]
    r = harness.compare_grad(ref.double(), ref, ref64, 1e-4, 1e-4)
    assert not r["ok"] and "dtype torch.float64, expected torch.float32" in r["failures"][0]
    bad = ref.clone()
    bad[3] = float("nan")
    assert "NaN/Inf" in harness.compare_grad(bad, ref, ref64, 1e-4, 1e-4)["failures"][0]


def test_compare_fp64x2_outputs():
    """compare(..., fp64x2=True): an element outside allclose passes where its fp64 error is at most 2x the
    reference's own there (held "fp64x2"), fails beyond it (only those listed); without fp64x2 KernelBench's
    allclose alone decides. Only the family references ask for it, only in fp16 / bf16."""
    ref64 = torch.linspace(-1, 1, 64, dtype=torch.float64)
    ref = ref64.to(torch.bfloat16)
    ref[5] = ref64[5] + 0.02  # the reference 0.02 off at element 5
    new = ref64.to(torch.bfloat16)  # the solution rounds once
    new[5] = ref64[5] - 0.01  # 0.03 from the reference, 0.01 from fp64
    kb = harness.compare(new, ref, ref64, 1e-2, 1e-2)
    assert not kb["ok"] and kb["held"] is None and kb["mismatches"] == 1
    r = harness.compare(new, ref, ref64, 1e-2, 1e-2, fp64x2=True)
    assert r["ok"] and r["held"] == "fp64x2" and r["mismatches"] == 1
    assert harness.compare(ref.clone(), ref, ref64, 1e-2, 1e-2, fp64x2=True)["held"] == "allclose"
    new[9] = ref64[9] + 0.05  # 0.05 from fp64 where the reference rounds once: beyond 2x its own
    r = harness.compare(new, ref, ref64, 1e-2, 1e-2, fp64x2=True)
    assert not r["ok"] and r["held"] is None and r["mismatches"] == 2
    assert [m[0] for m in r["first_mismatches"]] == [(9,)] and "1 of them also beyond 2 x" in r["failures"][0]
    ro, rb, kb_ref = (harness.load_module(os.path.join(ROOT, "reference", f"outer_product_mean{s}.py"))
                      for s in ("_openfold", "_boltz", ""))
    for dt in (torch.float16, torch.bfloat16):
        assert harness._fp64x2_outputs(ro, dt) and harness._fp64x2_outputs(rb, dt)
        assert not harness._fp64x2_outputs(kb_ref, dt)
    assert not harness._fp64x2_outputs(ro, torch.float32)


def test_backward_cpu_timing_and_reference_may_oom(run_harness, tmp_path):
    """--backward --cpu-timing: forward + backward timed per variant, eager too; peak memory and the CUDA-graph
    step n/a on the CPU. A reference_may_oom shape is not checked for gradients (said so), and still passes."""
    js = tmp_path / "t.json"
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_good.py"), "--device", "cpu", "--cpu-timing",
                            "--no-compile", "--samples", "2", "--input-sets", "2", "--trials", "2", "--shapes",
                            "awkward_17", "--time-variants", "--backward", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    train = json.loads(js.read_text())["shapes"][0]["timing"]["train"]
    assert set(train["new"]) == {"outer_first", "w_first"}
    for r in list(train["new"].values()) + [train["eager"]]:
        assert r["per_call"]["n"] == 2 and r["per_call"]["median_ms"] > 0 and r["peak_bytes"] is None
        assert r["graph"] is None and r["graph_error"]
    assert train["new"]["w_first"]["last_variant"] == "w_first" and train["new"]["w_first"]["speedup_vs_eager"] > 0
    lines = out.splitlines()
    hdr = next(i for i, ln in enumerate(lines) if ln.startswith("shape ") and "f+b ms new" in ln)
    assert "graph ms new/eager/compile" in lines[hdr]
    row = lines[hdr + 2].split()
    assert row[:3] == ["awkward_17", "outer_first", "PASS"] and row[-2:] == ["n/a/n/a/skip", "n/a"], row
    shape = "B=2,S=3,N=23,msa_dim=16,hidden_dim=8,pair_dim=8,reference_may_oom=1"
    code, out = run_harness(os.path.join(SOL, "outer_product_mean_good.py"), *CPU, "--shape", shape, "--rows", "5",
                            "--trials", "2", "--backward", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    bw = json.loads(js.read_text())["shapes"][0]["correctness"]["backward"]
    assert bw["skipped"] and "reference_may_oom" in bw["skipped"] and "--backward: custom0 flagged" in out


@pytest.mark.gpu
def test_backward_timing_captures_the_step_in_a_cuda_graph(run_harness, tmp_path):
    """--backward on a CUDA device: ModelNew's and the eager reference's training steps are timed per call and
    as CUDA-graph replays (a replay, GPU time alone, within 5% of the per-call median or below it: at this small
    shape the host's launches dominate a call), and the table shows both graph times."""
    js = tmp_path / "g.json"
    code, out = run_harness(os.path.join(SOL, "contact_map_good.py"), "--no-compile", "--samples", "10",
                            "--input-sets", "1", "--trials", "1", "--shapes", "awkward_37", "--backward",
                            "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    train = json.loads(js.read_text())["shapes"][0]["timing"]["train"]
    for r in list(train["new"].values()) + [train["eager"]]:
        assert r["graph"] and r["graph_error"] is None, r
        assert 0 < r["graph"]["median_ms"] <= 1.05 * r["per_call"]["median_ms"], r
    hdr = next(ln for ln in out.splitlines() if "graph ms new/eager/compile" in ln)
    assert hdr.startswith("shape ")


# --- KernelBench-style timing -----------------------------------------------------------------
class _FakeClock:
    """A clock, events and callables that log what KernelBench's loop does, in order."""

    def __init__(self, durations):
        self.t, self.trace, self.durations, self.prev = 0.0, [], list(durations), None
        self.prev_alive = []

    def event(self):
        clock = self

        class Event:
            def record(self):
                clock.trace.append("record")
                self.t = clock.t

            def elapsed_time(self, end):
                return end.t - self.t

        self.trace.append("event")
        return Event()

    def fn(self, *args):
        import weakref
        self.trace.append("call")
        self.prev_alive.append(self.prev is not None and self.prev() is not None)
        self.t += self.durations.pop(0)
        out = torch.zeros(1)
        self.prev = weakref.ref(out)
        return out

    def sync(self):
        self.trace.append("sync")

    def clear_l2(self):
        self.trace.append("clear")
        self.t += 1000.0  # outside the timed window

    def empty_cache(self):
        self.trace.append("empty_cache")


def test_kb_timing_loop_is_kernelbench_cuda_event():
    """kb_time_cuda_event follows KernelBench's time_execution_with_cuda_event step by step: warm-up calls
    each synchronised, empty_cache, then per trial sync, two events, L2 clear, record, call, record, sync;
    the first trial dropped; the previous output alive while the next call runs (`_ = kernel_fn(*args)`)."""
    n = 5
    warm, drop = harness.KB_WARMUP, harness.KB_DISCARD_FIRST
    durations = [0.5] * warm + [float(i + 1) for i in range(n + drop)]
    c = _FakeClock(durations)
    ms = harness.kb_time_cuda_event(c.fn, [torch.ones(2)], n, event=c.event, sync=c.sync, clear_l2=c.clear_l2,
                                    empty_cache=c.empty_cache)
    assert ms == durations[warm + drop:]  # each trial's own call, the L2 clear excluded, the first dropped
    trial = ["sync", "event", "event", "clear", "record", "call", "record", "sync"]
    assert c.trace == ["call", "sync"] * warm + ["empty_cache"] + trial * (n + drop)
    assert c.prev_alive == [False] * (warm + 1) + [True] * (n + drop - 1)
    assert (warm, drop, harness.KB_TRIALS) == (3, 1, 100)  # KernelBench 423217d: defaults and its scripts' trials
    # on the CPU the Timer drives the same loop with perf_counter events
    timer = harness.Timer(torch.device("cpu"), samples=4)
    calls = []
    assert len(timer.kb_times(lambda *a: calls.append(torch.is_grad_enabled()), [], 4)) == 4
    assert len(calls) == warm + 4 + drop


def test_host_times_do_not_synchronise_inside_the_call(monkeypatch):
    """host_times: perf_counter just around the call, sync before each call (never between the clock reads)."""
    clock, trace = [0.0], []

    def perf_counter():
        trace.append("clock")
        return clock[0]

    def fn(x):
        trace.append("call")
        clock[0] += x
        return torch.zeros(1)

    monkeypatch.setattr(harness.time, "perf_counter", perf_counter)
    ms = harness.host_times(fn, [0.25], 3, lambda: trace.append("sync"))
    assert ms == [250.0] * 3
    assert trace == ["sync", "clock", "call", "clock"] * 3 + ["sync"]


def test_kb_timing_runs_the_grad_mode_forward(run_harness, tmp_path):
    """The KernelBench-style timing calls ModelNew and the eager reference outside inference_mode with autograd
    on and parameters requiring grad, on inputs that do not require grad: warm-up + trials + the dropped trial +
    the host-time calls, beside the inference-mode timing; its numbers are in the JSON and the table."""
    log_new, log_ref = tmp_path / "new.log", tmp_path / "ref.log"
    probe = ("open(%r, 'a').write('%%d %%d %%d %%d\\n' %% (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), "
             "all(p.requires_grad for p in self.parameters()), x.requires_grad)); ")
    ref, sol = _write_pair(tmp_path, probe % str(log_ref) + "return self.lin(x).squeeze(-1)",
                           forward_new=probe % str(log_new) + "return self.lin(x).squeeze(-1)")

    def states(path):
        lines = path.read_text().split("\n") if path.exists() else []
        return [tuple(int(v) for v in ln.split()) for ln in lines if ln]

    code, out = run_harness(sol, "--ref", ref, *CPU)
    assert code == harness.EXIT_OK, out[-3000:]
    before = {"new": states(log_new), "ref": states(log_ref)}
    for p in (log_new, log_ref):
        p.unlink(missing_ok=True)
    js = tmp_path / "kb.json"
    code, out = run_harness(sol, "--ref", ref, "--device", "cpu", "--cpu-timing", "--no-compile", "--samples", "3",
                            "--input-sets", "2", "--json", js)
    assert code == harness.EXIT_OK, out[-3000:]
    tm = json.loads(js.read_text())["shapes"][0]["timing"]
    for who, path, r in (("new", log_new, tm["new"]["-"]), ("ref", log_ref, tm["eager"])):
        after = states(path)
        grad = [s for s in after if s[0]]
        n_kb = harness.KB_WARMUP + r["kb"]["n"] + harness.KB_DISCARD_FIRST + r["host"]["n"]
        assert len(grad) - sum(1 for s in before[who] if s[0]) == n_kb, (who, after)
        assert all(s == (1, 0, 1, 0) for s in grad), (who, grad)  # no inference mode, params need grad
        # and the inference-mode timing is still there
        assert sum(1 for s in after if s[1]) > sum(1 for s in before[who] if s[1]), who
    row = next(ln for ln in out.splitlines() if ln.startswith("tiny "))
    assert f"{tm['new']['-']['kb']['mean_ms']:.4g}/{tm['eager']['kb']['mean_ms']:.4g}" in row, row
    assert f"{tm['new']['-']['host']['median_ms'] * 1e3:.1f}/{tm['eager']['host']['median_ms'] * 1e3:.1f}" in row


def test_kb_timing_error_is_the_solutions_failure(run_harness, tmp_path):
    """A ModelNew that raises only after a few grad-mode calls (past the correctness check's) fails the run
    in the KernelBench-style timing: exit 3, said so, no harness error."""
    ref, sol = _write_pair(tmp_path, "return self.lin(x).squeeze(-1)",
                           forward_new="return self.lin(x).squeeze(-1)",
                           extra_new="torch.is_grad_enabled() and self._count()")
    sol.write_text(sol.read_text() + textwrap.dedent('''
        def _count(self):
            self._grad_calls = getattr(self, "_grad_calls", 0) + 1
            if self._grad_calls > 2:
                raise RuntimeError("grad path broken after two calls")
        ModelNew._count = _count
    '''))
    assert run_harness(sol, "--ref", ref, *CPU)[0] == harness.EXIT_OK
    code, out = run_harness(sol, "--ref", ref, "--device", "cpu", "--cpu-timing", "--no-compile", "--samples", "2")
    assert code == harness.EXIT_WRONG, out[-3000:]
    assert "failed while timing KernelBench-style (grad mode): RuntimeError: grad path broken" in out, out[-3000:]
    assert "harness error" not in out and "Traceback" not in out
