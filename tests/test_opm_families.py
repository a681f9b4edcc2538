"""The OpenFold-family and Boltz references against the released modules they restate, on the CPU.

reference/outer_product_mean_openfold.py is checked against OpenFold3 0.5.0's OuterProductMean
(openfold3/core/model/layers/outer_product_mean.py), reference/outer_product_mean_boltz.py against
boltz 2.2.1's (boltz/model/layers/outer_product_mean.py). The released module gets random non-trivial
parameters and the reference loads its state_dict (strict; the reference uses the released names),
then both run on the same inputs with masks all ones, with a sequence and a position masked
everywhere (zero pair counts along a row and a column of the output), and fractional (pair counts
below 1, where Boltz's clamp(count, 1) and AlphaFold's count + 1e-3 part):
  * fp32: bitwise equal on the released unchunked path (the same operations in the same order);
    OpenFold3's chunk_size / inplace_safe and Boltz's chunked path within 1e-5.
  * bf16 (module, parameters and inputs cast, as KernelBench does): the unchunked outputs bitwise
    equal, and both within BF16_TOL of the reference evaluated in fp64 on the same bf16 parameters and
    inputs (the harness's fp64 oracle). Boltz's chunked path rounds its outer product to bf16 before
    the division: within BF16_TOL of fp64 too, but not equal to the reference. Under bf16 autocast
    (fp32 weights) the outputs are bitwise equal too.
  * OpenFold3 with biased projections (AlphaFold 2 / OpenFold, through its linear_init_params), another
    eps, and no mask; Boltz in fp64, where its outer product stays fp32 (close, not equal).
Then the harness on pure-PyTorch solutions for both references (good ones pass, wrong ones fail), and
KernelBench's strict static rules on the two reference files.

The packages are pinned in .ci/run and installed there without their dependencies; a test skips only
when its package is not installed. They are imported through the packages, nothing stubbed:
boltz.model.layers.outer_product_mean needs scipy (boltz/model/layers/initialize.py); openfold3's needs
gemmi and packaging (openfold3/__init__.py), ml-collections with absl-py and PyYAML
(core/config/default_linear_init_config.py), scipy (core/model/primitives/initialization.py) and
biotite (core/utils/tensor_utils.py imports AtomArray for type hints). None of their heavy
dependencies (rdkit, pytorch-lightning, wandb, pandas, ...) is imported.
"""
import copy
import importlib
import importlib.metadata
import importlib.util
import math
import os
import re

import pytest
import torch

import harness

RO = harness.load_module("reference/outer_product_mean_openfold.py")
RB = harness.load_module("reference/outer_product_mean_boltz.py")
SOL = os.path.join(harness.ROOT, "tests", "solutions")
CPU = ["--device", "cpu", "--no-timing"]

PINS = {"boltz": "2.2.1", "openfold3": "0.5.0"}  # the versions .ci/run installs

# bf16 against fp64: |out - out64| <= atol + rtol * |out64| with atol = rtol = BF16_TOL. bf16 keeps 8
# significant bits (a spacing of 2^-8 = 3.9e-3 relative); the largest error in these cases is 1.4e-2,
# and 2.4e-2 (Boltz's chunked path) over 4 seeds x 3 shapes up to S = 64, N = 33, c = 32 (outputs of
# order 1, and up to |bias| / eps ~ 1e3 where OpenFold's pair count is 0).
BF16_TOL = 3e-2

DIMS = [dict(B=2, S=5, N=7, msa_dim=16, hidden_dim=8, pair_dim=12),
        dict(B=1, S=64, N=33, msa_dim=64, hidden_dim=32, pair_dim=128)]
DIM_IDS = ["tiny", "s64_n33"]
MASKS = ["ones", "dead", "fractional"]


def released(dist):
    """The released OuterProductMean class of `dist` ("boltz" or "openfold3"); skips when not installed."""
    if importlib.util.find_spec(dist) is None:
        pytest.skip(f"{dist} is not installed (.ci/run installs {dist}=={PINS[dist]} without dependencies)")
    assert importlib.metadata.version(dist) == PINS[dist], f"{dist} {importlib.metadata.version(dist)} installed"
    module = {"boltz": "boltz.model.layers.outer_product_mean",
              "openfold3": "openfold3.core.model.layers.outer_product_mean"}[dist]
    return importlib.import_module(module).OuterProductMean


def randomise(model, seed):
    """Non-trivial parameters, deterministic per seed: matrices N(0, 1/fan_in), biases N(0, 0.5^2),
    LayerNorm weights 1 + N(0, 0.5^2). (The released modules zero their output Linear.)"""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_(base + 0.5 * torch.randn(p.shape, generator=g))
    return model.eval()


def inputs(dims, kind, seed):
    """msa (B, S, N, c_m) and a float mask (B, S, N) of `kind`: ones, dead (sequence 1 and position 2
    masked everywhere, the rest 0/1), fractional (uniform weights, position 2 masked everywhere)."""
    B, S, N = dims["B"], dims["S"], dims["N"]
    g = torch.Generator().manual_seed(seed)
    msa = 2 * torch.randn(B, S, N, dims["msa_dim"], generator=g) + 0.5
    if kind == "ones":
        return msa, torch.ones(B, S, N)
    if kind == "dead":
        mask = (torch.rand(B, S, N, generator=g) < 0.7).float()
        mask[:, min(1, S - 1)] = 0
    else:
        mask = torch.rand(B, S, N, generator=g)
    mask[:, :, 2] = 0
    return msa, mask


def pair_ref(real, refmod, dims, **kwargs):
    """(released module with random parameters, reference Model loaded with its state_dict, strict)."""
    ref = refmod.Model(dims["msa_dim"], dims["pair_dim"], dims["hidden_dim"], **kwargs).eval()
    ref.load_state_dict(real.state_dict(), strict=True)
    return ref


def openfold3_module(dims, seed, proj_bias=False, eps=1e-3):
    """OpenFold3's OuterProductMean; proj_bias=True gives linear_1 / linear_2 a bias (AlphaFold 2 /
    OpenFold), through its own linear_init_params."""
    OPM = released("openfold3")
    from openfold3.core.config import default_linear_init_config as lin_init

    params = copy.deepcopy(lin_init.opm_init)
    assert params.linear_1.bias is False and params.linear_2.bias is False  # the reference's default
    params.linear_1.bias = params.linear_2.bias = proj_bias
    real = OPM(dims["msa_dim"], dims["pair_dim"], dims["hidden_dim"], eps=eps, linear_init_params=params)
    return randomise(real, seed)


def boltz_module(dims, seed):
    OPM = released("boltz")
    return randomise(OPM(dims["msa_dim"], dims["hidden_dim"], dims["pair_dim"]), seed)


def bf16_check(real, ref, msa, mask, tol, **call):
    """real and ref cast to bf16 on bf16 inputs: (real's output, ref's output); real's within `tol` of
    the fp64 reference on the same bf16 parameters and inputs."""
    real, ref = copy.deepcopy(real).bfloat16(), copy.deepcopy(ref).bfloat16()
    ref.load_state_dict(real.state_dict(), strict=True)
    m16, k16 = msa.bfloat16(), mask.bfloat16()
    with torch.no_grad():
        got, want = real(m16, k16, **call), ref(m16, k16)
        want64 = copy.deepcopy(ref).double()(m16.double(), k16.double())
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want64, atol=tol, rtol=tol)
    torch.testing.assert_close(want.double(), want64, atol=tol, rtol=tol)
    return got, want


# --- OpenFold3 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("proj_bias", [False, True], ids=["af3", "af2_bias"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_openfold3_matches_reference(dims, kind, proj_bias):
    real = openfold3_module(dims, 11, proj_bias=proj_bias)
    ref = pair_ref(real, RO, dims, proj_bias=proj_bias)
    assert ("linear_1.bias" in ref.state_dict()) == proj_bias
    msa, mask = inputs(dims, kind, 12)
    with torch.no_grad():
        got, want = real(msa, mask), ref(msa, mask)
    assert got.shape == want.shape == (dims["B"], dims["N"], dims["N"], dims["pair_dim"])
    torch.testing.assert_close(want, got, atol=0, rtol=0)  # same operations, same order
    got16, want16 = bf16_check(real, ref, msa, mask, BF16_TOL)
    assert torch.equal(got16, want16)


@pytest.mark.parametrize("kind", ["dead", "fractional"])
def test_openfold3_chunked_and_in_place_match(kind):
    dims = DIMS[1]
    real = openfold3_module(dims, 13)
    ref = pair_ref(real, RO, dims)
    msa, mask = inputs(dims, kind, 14)
    with torch.no_grad():
        want = ref(msa, mask)
        for call in (dict(chunk_size=4), dict(inplace_safe=True), dict(chunk_size=5, inplace_safe=True)):
            torch.testing.assert_close(real(msa, mask, **call), want, atol=1e-5, rtol=1e-5)
    bf16_check(real, ref, msa, mask, BF16_TOL, chunk_size=4, inplace_safe=True)


def test_openfold3_eps_argument_and_no_mask():
    dims = DIMS[0]
    real = openfold3_module(dims, 15, eps=0.25)
    ref = pair_ref(real, RO, dims, eps=0.25)
    msa, mask = inputs(dims, "fractional", 16)
    with torch.no_grad():
        torch.testing.assert_close(ref(msa, mask), real(msa, mask), atol=0, rtol=0)
        # no mask = all ones: S + eps per pair
        torch.testing.assert_close(ref(msa), real(msa), atol=0, rtol=0)
        torch.testing.assert_close(ref(msa), ref(msa, torch.ones(msa.shape[:-1])), atol=0, rtol=0)


# --- Boltz -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_boltz_matches_reference(dims, kind):
    real = boltz_module(dims, 21)
    ref = pair_ref(real, RB, dims)
    msa, mask = inputs(dims, kind, 22)
    with torch.no_grad():
        got, want = real(msa, mask), ref(msa, mask)
    assert got.shape == want.shape == (dims["B"], dims["N"], dims["N"], dims["pair_dim"])
    torch.testing.assert_close(want, got, atol=0, rtol=0)  # same operations, same order
    got16, want16 = bf16_check(real, ref, msa, mask, BF16_TOL)
    assert torch.equal(got16, want16)


@pytest.mark.parametrize("kind", ["dead", "fractional"])
def test_boltz_chunked_path(kind):
    """Boltz's chunked path (chunk_size in eval mode): the reference's values in fp32; in bf16 it forms
    the outer product in bf16, so it differs from the reference (the unchunked path) by bf16 rounding."""
    dims = DIMS[1]
    real = boltz_module(dims, 23)
    ref = pair_ref(real, RB, dims)
    msa, mask = inputs(dims, kind, 24)
    with torch.no_grad():
        want = ref(msa, mask)
        for chunk in (1, 4, 7):
            torch.testing.assert_close(real(msa, mask, chunk_size=chunk), want, atol=1e-5, rtol=1e-5)
    got16, want16 = bf16_check(real, ref, msa, mask, BF16_TOL, chunk_size=4)
    assert not torch.equal(got16, want16)


def test_boltz_fp64_differs_only_by_its_fp32_outer_product():
    """In fp64 Boltz still forms the outer product in fp32 (a.float()); the reference keeps fp64 there."""
    dims = DIMS[1]
    real = boltz_module(dims, 25).double()
    ref = pair_ref(real, RB, dims).double()
    msa, mask = inputs(dims, "fractional", 26)
    msa, mask = msa.double(), mask.double()
    with torch.no_grad():
        got, want = real(msa, mask), ref(msa, mask)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("fam", ["boltz", "openfold3"])
def test_same_under_bf16_autocast(fam):
    """fp32 weights under bf16 autocast, as Boltz-2 predicts ("bf16-mixed"): still the same operations."""
    dims = DIMS[1]
    real = boltz_module(dims, 27) if fam == "boltz" else openfold3_module(dims, 27)
    ref = pair_ref(real, RB if fam == "boltz" else RO, dims)
    msa, mask = inputs(dims, "fractional", 28)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = real(msa, mask), ref(msa, mask)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


# --- the harness on pure-PyTorch solutions ------------------------------------------------------
def test_harness_accepts_good_solutions(run_harness):
    for fam in ("boltz", "openfold"):
        sol = os.path.join(SOL, f"outer_product_mean_{fam}_good.py")
        code, out = run_harness(sol, "--ref", f"reference/outer_product_mean_{fam}.py", *CPU, "--shapes", "seed")
        assert code == harness.EXIT_OK, out[-3000:]
        assert "drop-in (same seed -> same parameters): yes" in out
        # the reference is found from the file's name too
        assert harness.resolve_target(sol, None)[1] == os.path.join(harness.ROOT, "reference",
                                                                     f"outer_product_mean_{fam}.py")
        code, out = run_harness(sol, *CPU, "--shapes", "awkward_33,awkward_17")
        assert code == harness.EXIT_OK, out[-3000:]


@pytest.mark.parametrize("name", ["outer_product_mean_boltz_eps.py", "outer_product_mean_openfold_divides_first.py"])
def test_harness_rejects_other_family_normalisations(run_harness, name):
    code, out = run_harness(os.path.join(SOL, name), *CPU, "--shapes", "seed,awkward_33")
    assert code == harness.EXIT_WRONG, out[-3000:]
    assert "not allclose" in out and "Traceback" not in out, out[-3000:]


def test_references_follow_kernelbench_static_rules():
    """KernelBench execs reference files too: no try/except, no `pass` outside comments."""
    kb = harness.load_module("tests/test_kernelbench.py")
    for path in ("reference/outer_product_mean_openfold.py", "reference/outer_product_mean_boltz.py"):
        with open(os.path.join(harness.ROOT, path)) as f:
            code = kb.strip_comments(f.read())
        broken = [name for name, pats in kb._STRICT.items() if any(re.search(p, code) for p in pats)]
        assert broken == [], f"{path}: {broken}"
