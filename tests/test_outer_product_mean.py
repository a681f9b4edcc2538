"""Tests of outer_product_mean.py's ModelNew against an fp64 evaluation of reference/outer_product_mean.py.

CPU tests (run in CI): the CUDA source builds with nvcc for sm_90, ModelNew on CPU tensors raises the
device error, and the boundary checks (dtype, rank, shapes, mask, limits) fire with their messages;
these checks run before any CUDA call, so CPU tensors reach them.
GPU tests (marker `gpu`, skipped without CUDA): both contraction orders against fp64 at
atol = rtol = 1e-4 on the named shapes (except "huge"), awkward sizes, hidden_dim 8/16/24/64/128,
pair_dim not a multiple of 4, float/bool/integer masks, fully masked positions, non-contiguous
inputs, empty sizes, a > 2^31-element output, state_dict loading, a grad-enabled forward with its
backward, outer_wg's 16-bit instances on float16 / bfloat16 inputs against fp64 and the reference
in that dtype, and fused_small (one kernel; outputs poisoned with NaN first; grad mode and backward).
"""

import ast
import copy
import os

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
TOL = dict(atol=1e-4, rtol=1e-4)


def _variant_table():
    """The kernel file's variant table (_ALL_VARIANTS), read from its source without building it, so
    that tests can be parametrised over it at collection; test_builds_for_sm90 checks that it is
    ModelNew.ALL_VARIANTS."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "outer_product_mean.py")
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_ALL_VARIANTS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("outer_product_mean.py defines no _ALL_VARIANTS")


ALL_VARIANTS = _variant_table()      # "auto" first, then every variant that can be forced
ORDERS = ALL_VARIANTS[1:]            # every forced variant


@pytest.fixture(scope="module")
def opm(kernel_module):
    return kernel_module("outer_product_mean.py", "outer_product_mean_under_test")


@pytest.fixture(scope="module")
def ref(load_module):
    return load_module("reference/outer_product_mean.py", "outer_product_mean_reference")


# ---------------------------------------------------------------------------------------------
# building blocks: models, inputs, the fp64 reference, variant selection
# ---------------------------------------------------------------------------------------------
def _randomise(model, gen):
    """Non-trivial values for every parameter (LayerNorm affine included, never zeros)."""
    with torch.no_grad():
        for p in model.parameters():
            scale = 1.0 / max(1.0, p.shape[-1] ** 0.5) if p.dim() == 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale + 0.05)


def _pair(opm, ref, cm, cz, c, seed):
    gen = torch.Generator().manual_seed(seed)
    m_ref = ref.Model(cm, cz, c)
    _randomise(m_ref, gen)
    new = opm.ModelNew(cm, cz, c)
    new.load_state_dict(m_ref.state_dict(), strict=True)
    return m_ref.cuda().eval(), new.cuda().eval()


def _msa(shape, dist, gen):
    if dist == "normal":
        x = torch.randn(shape, generator=gen)
    elif dist == "uniform":
        x = torch.rand(shape, generator=gen) * 2 - 1
    elif dist == "heavy":  # Student-t like: normal / sqrt(chi2 / 3)
        x = torch.randn(shape, generator=gen) / (torch.rand(shape, generator=gen) * 0.9 + 0.1)
    elif dist == "offset":
        x = torch.randn(shape, generator=gen) + 100.0
    else:
        raise ValueError(dist)
    return x


def _mask(B, S, N, kind, gen):
    if kind == "ones":
        return torch.ones(B, S, N)
    if kind == "binary":
        return (torch.rand(B, S, N, generator=gen) > 0.3).float()
    if kind == "fraction":
        return torch.rand(B, S, N, generator=gen) * 1.5 - 0.2  # any values, some negative
    if kind == "bool":
        return torch.rand(B, S, N, generator=gen) > 0.4
    if kind in ("uint8", "int32", "int64", "int8", "int16"):
        dt = getattr(torch, kind)
        return torch.randint(0, 3, (B, S, N), generator=gen).to(dt)
    raise ValueError(kind)


def _mask_full_positions(mask, gen):
    """Zero some positions i in every sequence (they must get the bias only)."""
    N = mask.shape[2]
    if N == 0:
        return mask
    cols = torch.randperm(N, generator=gen)[: max(1, N // 5)]
    mask = mask.clone()
    mask[:, :, cols] = 0
    return mask


def _ref64(m_ref, msa, mask):
    """The reference Model evaluated in float64 on the inputs' device (mask kept in its dtype unless
    float); the model is deep-copied, so m_ref may live on any device."""
    import copy
    m64 = copy.deepcopy(m_ref).double().to(msa.device)
    mask = mask.to(msa.device)
    msk = mask.double() if mask.is_floating_point() else mask
    with torch.no_grad():
        return m64(msa.double(), msk)


def _check(out, expect, what=""):
    assert out.dtype == torch.float32, what
    assert out.shape == expect.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(expect.shape)}"
    assert torch.isfinite(out).all(), f"{what}: NaN/Inf in the output (unwritten or wrong elements)"
    e = expect.float()
    bad = ~torch.isclose(out, e, **TOL)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        vals = [(i, out[tuple(i)].item(), e[tuple(i)].item()) for i in idx]
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches of {out.numel()}, "
                             f"max abs err {(out.double() - expect).abs().max().item():.3e}; first {vals}")


def _run(new, msa, mask, variant):
    new.variant = variant
    with torch.no_grad():
        out = new(msa, mask)
    if variant != "auto":
        assert new.last_variant == variant
    assert new.last_variant in ORDERS
    return out


def _caps(opm):
    """(tc_ok, wg_ok, ow_ok) of the current GPU; all False without CUDA."""
    return tuple(opm._ext.opm_device_caps(torch.cuda.current_device())) if HAS_CUDA else (False, False, False)


def _runs_here(opm, variant, c=None):
    """Whether `variant` runs on this GPU: in ModelNew.VARIANTS (the Hopper ones, w_first_wg2 and
    outer_wg, only on an H100 / H200 with the sm_90a build) and, given hidden_dim c, not outer_wg or
    fused_small for c > 32."""
    return variant in opm.ModelNew.VARIANTS and not (variant in ("outer_wg", "fused_small") and c is not None
                                                     and c > 32)


def _skip_unless_runs(opm, variant, c=None):
    """The one skip for variants this GPU (or hidden_dim c) cannot run; see _runs_here."""
    if not _runs_here(opm, variant, c):
        pytest.skip(f"{variant} does not run here (hidden_dim {c}; variants here: {opm.ModelNew.VARIANTS})")


def _orders(opm, c=None):
    """Every forced variant this GPU runs (for hidden_dim c when given)."""
    return tuple(v for v in ORDERS if _runs_here(opm, v, c))


def _case(opm, ref, B, S, N, cm, c, cz, mask_kind="binary", dist="normal", seed=0, variants=None,
          full_mask=True):
    if variants is None:
        variants = _orders(opm, c)
    gen = torch.Generator().manual_seed(seed)
    m_ref, new = _pair(opm, ref, cm, cz, c, seed)
    msa = _msa((B, S, N, cm), dist, gen)
    mask = _mask(B, S, N, mask_kind, gen)
    if full_mask:
        mask = _mask_full_positions(mask, gen)
    msa, mask = msa.cuda(), mask.cuda()
    expect = _ref64(m_ref, msa, mask)  # fp64 on the GPU (the CPU takes minutes at crop/long)
    msa0, mask0 = msa.clone(), mask.clone()
    outs = {}
    for v in variants:
        outs[v] = _run(new, msa, mask, v)
        _check(outs[v], expect, f"{v} B={B} S={S} N={N} cm={cm} c={c} cz={cz} mask={mask_kind} dist={dist}")
    assert torch.equal(msa, msa0) and torch.equal(mask, mask0), "inputs changed by the call"
    return outs


# ---------------------------------------------------------------------------------------------
# CPU tests (CI)
# ---------------------------------------------------------------------------------------------
def test_builds_for_sm90(opm):
    assert hasattr(opm, "ModelNew") and hasattr(opm._ext, "opm_forward")
    assert opm.ModelNew.ALL_VARIANTS == opm._ALL_VARIANTS == ALL_VARIANTS and ALL_VARIANTS[0] == "auto"
    caps = _caps(opm)  # the Hopper ones only where they run
    hopper = {"w_first_wg2": caps[1], "outer_wg": caps[2]}
    assert opm.ModelNew.VARIANTS == tuple(v for v in ALL_VARIANTS if hopper.get(v, True))
    # the CUDA enum carries the same table: id = index, and the range check reads its size
    assert f"kNumVariants = {len(ALL_VARIANTS)}" in opm._CUDA_SRC and "kOuterWg = " in opm._CUDA_SRC
    # sm_90a code, never sm_90 code (wgmma), and the host flag exactly with it
    gencode = opm._gencode_flags()
    has_90a = any("code=sm_90a" in f for f in gencode)
    assert not any("code=sm_90," in f + "," for f in gencode)
    assert ("-DOPM_SM90A" in opm._CUDA_FLAGS) == has_90a
    if os.environ.get("TORCH_CUDA_ARCH_LIST") in ("9.0", "9.0a"):  # CI and the H200 machine
        assert has_90a


G = "-gencode=arch=compute_{0},code={1}_{0}"


@pytest.mark.parametrize("given, flags", [
    ("9.0", [G.format("90a", "sm")]),
    ("8.0;9.0+PTX", [G.format("80", "sm"), G.format("90a", "sm"), G.format("90", "compute")]),  # portable PTX kept
    ("8.0 8.6", [G.format("80", "sm"), G.format("86", "sm")]),
    ("9.0a", [G.format("90a", "sm")]),
    ("10.0+PTX", [G.format("100", "sm"), G.format("100", "compute")]),
    ("Hopper", []),  # names: PyTorch's own flags, no sm_90a
])
def test_gencode_flags_build_sm90a(opm, monkeypatch, given, flags):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", given)
    assert opm._gencode_flags() == flags


def test_import_makes_no_cuda_call_and_keeps_the_environment(opm, repo_root):
    """With TORCH_CUDA_ARCH_LIST set, importing the file (the extension cached by the `opm` fixture)
    initialises no CUDA device (VARIANTS is evaluated on access) and leaves the variable as it was."""
    import subprocess
    import sys
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not archs:
        pytest.skip("TORCH_CUDA_ARCH_LIST unset: the build asks the GPUs for their capabilities")
    code = ("import os, torch, outer_product_mean as m\n"
            f"assert os.environ['TORCH_CUDA_ARCH_LIST'] == {archs!r}, os.environ['TORCH_CUDA_ARCH_LIST']\n"
            "assert not torch.cuda.is_initialized()\n"
            "print(m.ModelNew.VARIANTS)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'auto'" in r.stdout


def test_same_submodules_and_init(opm, ref):
    torch.manual_seed(3)
    a = ref.Model(40, 24, 16)
    torch.manual_seed(3)
    b = opm.ModelNew(40, 24, 16)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q)
    b.load_state_dict(a.state_dict(), strict=True)


def _cpu_args(B=1, S=2, N=3, cm=8, c=4, cz=5):
    return torch.randn(B, S, N, cm), torch.ones(B, S, N)


def test_cpu_tensors_raise_device_error(opm):
    model = opm.ModelNew(8, 5, 4)
    msa, mask = _cpu_args()
    with torch.no_grad(), pytest.raises(RuntimeError, match="must be a CUDA tensor.*cpu"):
        model(msa, mask)
    model.variant = "w_first_wg2"  # a name outside VARIANTS here is still accepted (the device decides)
    with torch.no_grad(), pytest.raises(RuntimeError, match="must be a CUDA tensor.*cpu"):
        model(msa, mask)
    model.variant = "auto"
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):  # grad path too
        model(msa, mask)
    for dtype in (torch.float16, torch.bfloat16):  # half precision (mask too) passes the dtype checks
        with torch.no_grad(), pytest.raises(RuntimeError, match="must be a CUDA tensor.*cpu"):
            model.to(dtype)(msa.to(dtype), mask.to(dtype))


@pytest.mark.parametrize("bad, pattern", [
    ("msa_dtype", r"msa_repr must be float32, float16 or bfloat16, got float64"),
    ("msa_rank", r"msa_repr must be 4-D .*got shape \[2, 3, 8\]"),
    ("msa_dim", r"msa_dim = 7 .*layer_norm weight/bias have shapes \[8\]"),
    ("mask_shape", r"msa_mask must have shape \(B, S, N\) = \(1, 2, 3\).*got \[1, 3, 2\]"),
    ("mask_rank", r"msa_mask must have shape .*got \[1, 2, 3, 1\]"),
    ("mask_dtype", r"unsupported msa_mask dtype Double"),
])
def test_boundary_checks(opm, bad, pattern):
    model = opm.ModelNew(8, 5, 4)
    msa, mask = _cpu_args()
    if bad == "msa_dtype":
        msa = msa.double()
    elif bad == "msa_rank":
        msa = torch.randn(2, 3, 8)
    elif bad == "msa_dim":
        msa = torch.randn(1, 2, 3, 7)
    elif bad == "mask_shape":
        mask = torch.ones(1, 3, 2)
    elif bad == "mask_rank":
        mask = torch.ones(1, 2, 3, 1)
    elif bad == "mask_dtype":
        mask = mask.double()
    with torch.no_grad(), pytest.raises(RuntimeError, match=pattern):
        model(msa, mask)


def test_limits(opm):
    msa, mask = _cpu_args(cm=8)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"hidden_dim must be in \[1, 128\], got 129"):
        opm.ModelNew(8, 5, 129)(msa, mask)
    msa = torch.randn(1, 2, 3, 800)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"msa_dim must be in \[1, 768\].*got 800"):
        opm.ModelNew(800, 5, 4)(msa, mask)
    with torch.no_grad(), pytest.raises(RuntimeError, match="layer_norm.weight must be float32 like msa_repr, got float64"):
        opm.ModelNew(8, 5, 4).double()(torch.randn(1, 2, 3, 8), mask)
    model = opm.ModelNew(8, 5, 4)
    model.variant = "fastest"
    with pytest.raises(ValueError, match="variant must be one of"):
        model(torch.randn(1, 2, 3, 8), mask)
    # the extension's range check reads the same table (kNumVariants); it comes before the device check
    params = [p.detach() for p in model.parameters()]
    n = len(ALL_VARIANTS)
    for code in (-1, n):
        with pytest.raises(RuntimeError, match=rf"variant code must be 0-{n - 1}, got {code}"):
            opm._ext.opm_forward(torch.randn(1, 2, 3, 8), mask, *params, 1e-5, code, False)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):  # the last valid code gets past it
        opm._ext.opm_forward(torch.randn(1, 2, 3, 8), mask, *params, 1e-5, n - 1, False)
    # fused_small's hidden_dim limit is a shape check: it fires before the device check
    big = opm.ModelNew(8, 5, 33)
    big.variant = "fused_small"
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"variant fused_small needs hidden_dim <= 32 \(this "
                                                           r"model: 33\); use outer_first or w_first_small"):
        big(torch.randn(1, 2, 3, 8), mask)
    big = opm.ModelNew(8, 5, 32)
    big.variant = "fused_small"
    with torch.no_grad(), pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        big(torch.randn(1, 2, 3, 8), mask)


# ---------------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------------
NAMED = ["seed", "crop", "shallow", "long", "awkward_33", "awkward_17"]


@gpu
@pytest.mark.parametrize("name", NAMED)
def test_named_shapes_both_orders(opm, ref, name):
    sh = ref.SHAPES[name]
    outs = _case(opm, ref, sh["B"], sh["S"], sh["N"], sh["msa_dim"], sh["hidden_dim"], sh["pair_dim"],
                 mask_kind="fraction", seed=11)
    # the orders agree with each other far inside the tolerance
    torch.testing.assert_close(outs["outer_first"], outs["w_first"], **TOL)
    torch.testing.assert_close(outs["w_first_small"], outs["w_first"], **TOL)
    torch.testing.assert_close(outs["w_first_tc"], outs["w_first"], **TOL)
    torch.testing.assert_close(outs["w_first_tc2"], outs["w_first"], **TOL)
    for v in ("w_first_wg2", "outer_wg", "fused_small"):
        if v in outs:
            torch.testing.assert_close(outs[v], outs["w_first"], **TOL)
    if "outer_wg" in outs:  # the tensor-core prep and wgmma against the FMA prep, same contraction order
        torch.testing.assert_close(outs["outer_wg"], outs["outer_first"], **TOL)


@gpu
@pytest.mark.parametrize("name, expected", [("seed", "w_first_small"), ("shallow", "w_first_tc2"), ("crop", "outer_first"),
                                            ("long", "outer_first")])
def test_auto_picks_by_estimated_time(opm, ref, name, expected):
    sh = ref.SHAPES[name]
    B, S, N, c, cz = sh["B"], sh["S"], sh["N"], sh["hidden_dim"], sh["pair_dim"]
    new = opm.ModelNew(sh["msa_dim"], cz, c).cuda()
    msa = torch.randn(B, S, N, sh["msa_dim"], device="cuda")
    if name == "seed" and torch.cuda.get_device_properties(0).multi_processor_count >= 128:
        expected = "fused_small"  # its 128 tasks and 128 groups of 4 msa rows in one wave of blocks
    elif _runs_here(opm, "outer_wg") and name in ("crop", "long"):  # the H100/H200: outer_first on wgmma
        expected = "outer_wg"
    elif _runs_here(opm, "w_first_wg2") and name == "shallow":  # and w_first on wgmma at S = 32
        expected = "w_first_wg2"
    elif expected == "w_first_tc2":  # else w_first_tc2 where its 136 KB (139264 bytes) fit
        optin = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 1 << 20)
        expected = "w_first_tc2" if optin >= 139264 else "w_first_tc"
    _run(new, msa, torch.ones(B, S, N, device="cuda"), "auto")
    assert new.last_variant == expected
    with torch.enable_grad():  # the autograd path (KernelBench times without no_grad) reports it too
        new.last_variant = None
        new(msa, torch.ones(B, S, N, device="cuda"))
    assert new.last_variant == expected
    if name in ("seed", "shallow"):
        outs = _case(opm, ref, B, S, N, sh["msa_dim"], c, cz, seed=5, variants=("auto",))
        assert outs["auto"].shape == (B, N, N, cz)


@gpu
@pytest.mark.parametrize("B,S,N,cm,c,cz", [
    (1, 1, 1, 8, 32, 8),        # S = 1, N = 1
    (2, 1, 17, 64, 32, 64),
    (1, 5, 1, 33, 16, 7),       # N = 1, odd c_m, odd c_z
    (1, 7, 37, 37, 32, 13),     # odd c_m, c_z not a multiple of 4, N not a multiple of 4
    (2, 9, 45, 40, 8, 30),      # hidden 8 -> padded to 16
    (1, 6, 70, 64, 16, 65),     # hidden 16, c_z = 65 (two z chunks, last partial)
    (1, 4, 29, 48, 24, 20),     # hidden 24 -> padded to 32
    (1, 3, 19, 64, 64, 66),     # hidden 64
    (1, 2, 9, 20, 100, 9),      # hidden 100 -> padded to 128
    (1, 2, 6, 16, 128, 4),      # hidden 128
    (1, 37, 131, 3, 32, 128),   # tiny c_m, S not a multiple of 16, N > one 128-row tile
    (3, 17, 64, 1, 16, 1),      # c_m = 1 (LayerNorm gives beta), c_z = 1
    (1, 1024, 40, 16, 32, 128), # j-chunks: w_first 20 (2 j of 16 MB), w_first_wg2 3 (16 j of 32 MB)
    (2, 5, 200, 24, 16, 33),    # hidden 16 with S odd (w_first_wg2: K padded to 32), odd c_z, N > 128
    (1, 4096, 12, 8, 32, 100),  # w_first_wg2: chunks of 5 j = 500 columns (4 blocks, the last 116 wide)
    (1, 3, 10, 768, 32, 8),     # c_m = 768 at hidden 32 (outer_wg's prep: CP = 32)
    (1, 3, 10, 768, 100, 8),    # c_m = 768 at hidden 128: the prep's largest shared memory (230 KB)
    (2, 21, 70, 40, 32, 200),   # outer_wg: two z chunks (c_z > 128), S past a 16-s stage, N % 16 != 0
    (1, 13, 23, 300, 32, 64),   # outer_wg's prep with 16-row tiles (c_m > 256), S % 4 and N % 4 != 0
    (2, 6, 9, 52, 24, 16),      # outer_wg's prep: c_m % 16 != 0 (zero columns of the last k group), B = 2
])
def test_awkward_sizes(opm, ref, B, S, N, cm, c, cz):
    _case(opm, ref, B, S, N, cm, c, cz, mask_kind="binary", seed=B * 1000 + S * 10 + N)


@gpu
def test_outer_wg_needs_hidden_dim_at_most_32(opm, ref):
    _skip_unless_runs(opm, "outer_wg")
    _, new = _pair(opm, ref, 16, 8, 64, 7)
    msa, mask = torch.randn(1, 3, 9, 16, device="cuda"), torch.ones(1, 3, 9, device="cuda")
    new.variant = "outer_wg"
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"outer_wg needs hidden_dim <= 32 \(this model: 64\)"):
        new(msa, mask)
    assert "outer_wg" not in _orders(opm, 64) and "outer_wg" in _orders(opm, 32)


@gpu
@pytest.mark.parametrize("S, N", [(2**19, 2**16), (1, 2**19)])
def test_outer_wg_tile_index_limit_names_a_kept_variant(opm, ref, S, N):
    """B * S * N / 16 >= 2^31 (the prep's warp tiles) or B * N^2 / 64 >= 2^31 (the fused kernel's tiles):
    forced outer_wg raises before any allocation and names variants that exist (stride-0 inputs: the
    check comes before the copy to contiguous; the second shape's output alone would be 8 TiB)."""
    _skip_unless_runs(opm, "outer_wg")
    _, new = _pair(opm, ref, 16, 8, 32, 8)
    msa = torch.randn(1, 1, 1, 16, device="cuda").expand(1, S, N, 16)
    mask = torch.ones(1, 1, 1, device="cuda").expand(1, S, N)
    new.variant = "outer_wg"
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"outer_wg needs B \* S \* N / 16 < 2\^31 .* and "
                                                           r"B \* N\^2 / 64 < 2\^31 .*got B = 1, "
                                                           rf"S = {S}, N = {N}; use outer_first or w_first_wg2"):
        new(msa, mask)
    for v in ("outer_first", "w_first_wg2"):
        assert v in opm.ModelNew.ALL_VARIANTS


@gpu
@pytest.mark.parametrize("kind", ["ones", "binary", "fraction", "bool", "uint8", "int8", "int16", "int32", "int64"])
def test_mask_kinds(opm, ref, kind):
    _case(opm, ref, 2, 11, 41, 24, 32, 20, mask_kind=kind, seed=7)


@gpu
@pytest.mark.parametrize("dist", ["uniform", "heavy", "offset"])
def test_distributions(opm, ref, dist):
    _case(opm, ref, 1, 24, 50, 64, 32, 32, mask_kind="fraction", dist=dist, seed=13)


@gpu
@pytest.mark.parametrize("v", ORDERS)
def test_fully_masked_positions_get_bias(opm, ref, v):
    B, S, N, cm, c, cz = 1, 6, 20, 16, 16, 12
    _skip_unless_runs(opm, v, c)
    m_ref, new = _pair(opm, ref, cm, cz, c, 21)
    msa = torch.randn(B, S, N, cm, device="cuda")
    mask = torch.ones(B, S, N, device="cuda")
    mask[:, :, 3] = 0
    out = _run(new, msa, mask, v)
    bias = new.out_proj.bias.detach()
    torch.testing.assert_close(out[0, 3], bias.expand(N, cz), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[0, :, 3], bias.expand(N, cz), atol=1e-6, rtol=0)
    _check(out, _ref64(m_ref, msa.cpu(), mask.cpu()).cuda(), v)
    mask.zero_()  # everything masked: bias everywhere
    out = _run(new, msa, mask, v)
    torch.testing.assert_close(out, new.out_proj.bias.detach().expand(B, N, N, cz), atol=1e-6, rtol=0)


@gpu
@pytest.mark.parametrize("v", ORDERS)
def test_non_contiguous_inputs(opm, ref, v):
    B, S, N, cm, c, cz = 2, 5, 23, 24, 32, 20
    _skip_unless_runs(opm, v, c)
    m_ref, new = _pair(opm, ref, cm, cz, c, 31)
    gen = torch.Generator().manual_seed(31)
    big = torch.randn(B, N, S, cm + 3, generator=gen)
    msa = big[..., 1:cm + 1].transpose(1, 2)              # (B, S, N, cm), strided
    maskt = (torch.rand(N, B, S, generator=gen) > 0.3).float()
    mask = maskt.permute(1, 2, 0)                          # (B, S, N), strided
    assert not msa.is_contiguous() and not mask.is_contiguous()
    expect = _ref64(m_ref, msa, mask).cuda()
    _check(_run(new, msa.cuda(), mask.cuda(), v), expect, v)
    # non-contiguous parameters too (a transposed view of a weight)
    with torch.no_grad():
        w = new.proj_a.weight.detach().t().contiguous().t()
        new.proj_a.weight = torch.nn.Parameter(w)
    _check(_run(new, msa.cuda(), mask.cuda(), v), expect, v + " strided parameter")


@gpu
@pytest.mark.parametrize("v", ALL_VARIANTS)
@pytest.mark.parametrize("B,S,N", [(0, 3, 5), (2, 3, 0), (2, 0, 7), (0, 0, 0)])
def test_empty_sizes(opm, ref, B, S, N, v):
    """The reference itself cannot run B = 0 or N = 0 (reshape of 0 elements), so no reference here:
    shape and dtype, and for S = 0 the bias everywhere (what the reference gives: 0 / max(0, 1) = 0)."""
    cm, c, cz = 16, 32, 12
    _skip_unless_runs(opm, v, c)
    _, new = _pair(opm, ref, cm, cz, c, 41)
    msa = torch.randn(B, S, N, cm, device="cuda")
    mask = torch.ones(B, S, N, device="cuda")
    out = _run(new, msa, mask, v)
    assert out.shape == (B, N, N, cz) and out.dtype == torch.float32 and out.device == msa.device
    if out.numel():
        bias = new.out_proj.bias.detach().expand(B, N, N, cz)
        torch.testing.assert_close(out, bias, atol=0, rtol=0)
    torch.cuda.synchronize()


@gpu
def test_state_dict_after_construction(opm, ref):
    B, S, N, cm, c, cz = 1, 4, 12, 16, 16, 8
    m_ref, new = _pair(opm, ref, cm, cz, c, 51)
    msa = torch.randn(B, S, N, cm, device="cuda")
    mask = torch.ones(B, S, N, device="cuda")
    before = _run(new, msa, mask, "auto").clone()
    other = ref.Model(cm, cz, c)
    _randomise(other, torch.Generator().manual_seed(52))
    new.load_state_dict(other.state_dict(), strict=True)
    after = _run(new, msa, mask, "auto")
    assert not torch.allclose(before, after)
    _check(after, _ref64(other, msa.cpu(), mask.cpu()).cuda(), "after load_state_dict")
    with torch.no_grad():  # in-place parameter edits are seen (parameters read at each call)
        new.layer_norm.weight.mul_(2.0)
        other.layer_norm.weight.mul_(2.0)
    _check(_run(new, msa, mask, "auto"), _ref64(other, msa.cpu(), mask.cpu()).cuda(), "after in-place edit")


@gpu
@pytest.mark.parametrize("v", ALL_VARIANTS)
def test_layer_norm_eps_from_module(opm, ref, v):
    B, S, N, cm, c, cz = 1, 3, 9, 16, 16, 8
    _skip_unless_runs(opm, v, c)
    m_ref, new = _pair(opm, ref, cm, cz, c, 61)
    msa = torch.randn(B, S, N, cm) * 0.3
    mask = torch.ones(B, S, N)
    # eps = 0 is legal (non-constant rows stay finite); S and N are padded by every tile, and padding
    # rows must not turn into 1 / sqrt(0 + eps) (outer_wg's prep once gave NaN everywhere there)
    for eps in (0.5, 0.0):
        m_ref.layer_norm.eps = new.layer_norm.eps = eps
        expect = _ref64(m_ref, msa, mask).cuda()
        _check(_run(new, msa.cuda(), mask.cuda(), v), expect, f"{v}, eps = {eps}")


@gpu
@pytest.mark.parametrize("v", ORDERS)
def test_misaligned_contiguous_msa(opm, ref, v):
    """A contiguous msa_repr view at an odd storage offset (not 16-byte aligned; c_m % 4 == 0, so the
    prep kernels would take their 16-byte loads / bulk copies): copied first, correct for every variant."""
    B, S, N, cm, c, cz = 1, 5, 13, 32, 32, 16
    _skip_unless_runs(opm, v, c)
    m_ref, new = _pair(opm, ref, cm, cz, c, 67)
    gen = torch.Generator().manual_seed(67)
    big = torch.randn(B * S * N * cm + 1, generator=gen).cuda()
    msa = big[1:].view(B, S, N, cm)
    assert msa.is_contiguous() and msa.data_ptr() % 16 != 0
    mask = (torch.rand(B, S, N, generator=gen) > 0.3).float().cuda()
    expect = _ref64(m_ref, msa, mask)
    _check(_run(new, msa, mask, v), expect, v)


@gpu
def test_grad_enabled_forward_matches_no_grad_and_backward_runs(opm, ref):
    """With grad enabled (parameters require grad, as KernelBench times it) the forward is the same kernel
    call bit for bit, and a backward gives every parameter and the input the reference's gradient."""
    m_ref, new = _pair(opm, ref, 16, 8, 16, 71)
    gen = torch.Generator().manual_seed(71)
    msa = torch.randn(1, 3, 9, 16, generator=gen).cuda()
    mask = (torch.rand(1, 3, 9, generator=gen) > 0.3).float().cuda()
    x_new, x_ref = msa.clone().requires_grad_(), msa.clone().requires_grad_()
    out = new(x_new, mask)
    assert out.requires_grad and torch.isfinite(out).all()
    with torch.no_grad():
        torch.testing.assert_close(out, new(msa, mask), atol=0, rtol=0)
    g = torch.randn(out.shape, generator=gen).cuda()
    (out * g).sum().backward()
    (m_ref(x_ref, mask) * g).sum().backward()
    torch.testing.assert_close(x_new.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    for (name, p), q in zip(new.named_parameters(), m_ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


@gpu
def test_current_stream_and_device(opm, ref):
    m_ref, new = _pair(opm, ref, 16, 8, 16, 81)
    msa = torch.randn(1, 5, 40, 16)
    mask = torch.ones(1, 5, 40)
    expect = _ref64(m_ref, msa, mask).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = _run(new, msa.cuda(), mask.cuda(), "outer_first")
    s.synchronize()
    _check(out, expect, "side stream")


@gpu
def test_output_over_2_31_elements(opm, ref):
    """Output of 4100^2 * 128 > 2^31 elements (8.6 GB): 64-bit offsets in every epilogue."""
    B, S, N, cm, c, cz = 1, 2, 4100, 16, 32, 128
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip("needs about 24 GB of free device memory")
    m_ref, new = _pair(opm, ref, cm, cz, c, 91)
    gen = torch.Generator().manual_seed(91)
    msa = torch.randn(B, S, N, cm, generator=gen)
    mask = (torch.rand(B, S, N, generator=gen) > 0.2).float()
    rows = [0, 1, 2047, 2048, N // 2, N - 2, N - 1]
    import copy
    m64 = copy.deepcopy(m_ref).double().cpu()
    with torch.no_grad():
        expect = ref.forward_rows(m64, msa.double(), mask.double(), rows).cuda()
    for v in (v for v in _orders(opm, c) if v != "w_first_small"):  # (the small kernel: small N only)
        out = _run(new, msa.cuda(), mask.cuda(), v)
        assert out.numel() > 2**31
        _check(out[:, rows], expect, f"{v} sampled rows")
        assert torch.isfinite(out[:, -3:]).all()
        del out
        torch.cuda.empty_cache()


# half an ulp of the largest output, relative: bfloat16 2^-9, float16 2^-12
_HALF_ULP = {torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -12}


def _outer_wg_against_fp64(m_ref, new, msa, mask):
    """outer_wg forced on a 16-bit module pair and inputs: (got, want, want64, err, e_ref, top): ModelNew's
    output, the reference's in that dtype, the fp64 evaluation, the max errors of both against it and its
    largest magnitude."""
    want64 = _ref64(m_ref, msa, mask)
    with torch.no_grad():
        want = m_ref(msa, mask)
    got = _run(new, msa, mask, "outer_wg")
    err, e_ref = (got.double() - want64).abs().max().item(), (want.double() - want64).abs().max().item()
    return got, want, want64, err, e_ref, want64.abs().max().item()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S, N, cm, cz, dist", [(64, 48, 64, 128, "normal"), (300, 40, 128, 128, "heavy"),
                                               (3, 33, 32, 128, "offset"), (5, 21, 20, 24, "normal"),
                                               (7, 17, 13, 7, "uniform"), (45, 19, 256, 128, "normal")])
def test_outer_wg_half_inputs_against_fp64(opm, ref, S, N, cm, cz, dist, dtype):
    """float16 / bfloat16 module and inputs with outer_wg forced (its 16-bit instance: a and b rounded to
    the dtype as the reference's are, O / denom to fp16, both phases on the 16-bit tensor cores): its
    max error against fp64 on the same values at most the reference's own in that dtype or 1.5 ulps of
    the output's largest value, and at most as many elements as the reference's outside 1e-2
    (KernelBench's tolerances) of fp64. (Neither is allclose to the other: at S = 3 the bfloat16
    reference is up to 5e-2 from fp64 at outputs near 12. At few sequences the roundings of a and b
    that both make put either up to about 1.5 ulps from fp64, and which of the two is closer varies
    with the inputs: over 40 seeds per case the old bound, half an ulp, failed up to 6 of them for
    both the 16-bit prep's TF32 products and its float16 ones.) c_m 20 and 13 take the prep's one-value
    loads (16-byte loads need c_m % 8 == 0), pair_dim 7 the fused kernel's single-element stores,
    S = 45 a partial promotion period and a 32-s block half past S."""
    _skip_unless_runs(opm, "outer_wg", 32)
    B, c = 1, 32
    gen = torch.Generator().manual_seed(S + N + cm)
    m_ref, new = _pair(opm, ref, cm, cz, c, seed=S)
    m_ref, new = m_ref.to(dtype), new.to(dtype)
    msa = _msa((B, S, N, cm), dist, gen).to(dtype).cuda()
    mask = _mask(B, S, N, "binary", gen).to(dtype).cuda()
    got, want, want64, err, e_ref, top = _outer_wg_against_fp64(m_ref, new, msa, mask)
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
    assert err <= max(e_ref, 3 * _HALF_ULP[dtype] * top), f"err {err:.2e} vs the reference's {e_ref:.2e} (top {top:.2e})"
    miss = lambda t: int(((t.double() - want64).abs() > 1e-2 + 1e-2 * want64.abs()).sum())
    assert miss(got) <= miss(want), (miss(got), miss(want))


@gpu
@pytest.mark.parametrize("wa_scale, wb_scale", [(2.0 ** 9, 2.0 ** -33), (2.0 ** -40, 1.0)])
def test_outer_wg_bf16_prep_scales_each_weight_row(opm, ref, wa_scale, wb_scale):
    """bfloat16 module and input on outer_wg with one projection's weights far below float16's smallest
    subnormal (2^-24) and the other's large, the biases and the LayerNorm's beta zero (a and b are the
    products alone): the prep's float16 products hold only through its power-of-two scale per weight
    row; max error against fp64 at most the reference's or half an ulp of the output's largest value,
    and the output nonzero (unscaled, the small weights would round to 0)."""
    _skip_unless_runs(opm, "outer_wg", 32)
    B, S, N, cm, c, cz = 1, 40, 24, 64, 32, 64
    gen = torch.Generator().manual_seed(11)
    m_ref, new = _pair(opm, ref, cm, cz, c, seed=11)
    with torch.no_grad():
        for m in (m_ref, new):
            m.proj_a.weight.mul_(wa_scale)
            m.proj_b.weight.mul_(wb_scale)
            for p in (m.layer_norm.bias, m.proj_a.bias, m.proj_b.bias, m.out_proj.bias):
                p.zero_()
    m_ref, new = m_ref.to(torch.bfloat16), new.to(torch.bfloat16)
    msa = _msa((B, S, N, cm), "normal", gen).to(torch.bfloat16).cuda()
    mask = _mask(B, S, N, "binary", gen).to(torch.bfloat16).cuda()
    got, _, _, err, e_ref, top = _outer_wg_against_fp64(m_ref, new, msa, mask)
    assert top > 0 and torch.isfinite(got).all() and got.abs().max().item() > 0.5 * top
    assert err <= max(e_ref, _HALF_ULP[torch.bfloat16] * top), f"err {err:.2e} vs the reference's {e_ref:.2e} (top {top:.2e})"


@gpu
@pytest.mark.parametrize("dtype, ctype", [(torch.bfloat16, "__nv_bfloat16"), (torch.float16, "__half")])
def test_outer_wg_half_reads_and_writes_its_dtype(opm, ref, dtype, ctype):
    """float16 / bfloat16 module and input on outer_wg: the kernels read the msa and write the output in
    that dtype themselves (the profiler lists the prep and the fused kernel of that type, and no PyTorch
    copy of a tensor of the msa's or the output's shape), and the result is within 1e-2 of fp64."""
    _skip_unless_runs(opm, "outer_wg", 32)
    B, S, N, cm, c, cz = 1, 48, 64, 64, 32, 128
    gen = torch.Generator().manual_seed(77)
    m_ref, new = _pair(opm, ref, cm, cz, c, seed=77)
    m_ref, new = m_ref.to(dtype), new.to(dtype)
    msa = _msa((B, S, N, cm), "normal", gen).to(dtype).cuda()
    mask = (torch.rand(B, S, N, generator=gen) > 0.2).cuda()  # bool: no mask conversion either
    _run(new, msa, mask, "outer_wg")
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        got = _run(new, msa, mask, "outer_wg")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any(f"opm_prep16_kernel<{ctype}" in n for n in kernels), kernels  # c_m % 16 == 0: the warp-tile prep
    assert any(f"opm_outer_wg_kernel<{ctype}, false>" in n for n in kernels), kernels
    big = ([B, S, N, cm], [B, N, N, cz])
    copies = [(e.name, e.input_shapes) for e in prof.events()
              if e.name in ("aten::copy_", "aten::_to_copy") and any(sh in big for sh in e.input_shapes)]
    assert not copies, copies
    assert got.dtype == dtype
    want64 = _ref64(m_ref, msa, mask)
    assert torch.allclose(got.double(), want64, atol=1e-2, rtol=1e-2), (got.double() - want64).abs().max()


def _backward_against_fp64_and_ops(opm, ref, B, S, N, cm, cz, dist, salt, fused_kw, ops_kw, mask_kind="binary"):
    """outer_product_mean_backward with the keyword arguments fused_kw and with ops_kw on the same inputs,
    both against fp64 autograd of the reference: every gradient's max error relative to its largest
    value at most max(2x the ops_kw call's, 1e-5), and a repeat fused_kw call bit-equal."""
    gen = torch.Generator().manual_seed(B + S + N + cz + salt)
    m_ref, new = _pair(opm, ref, cm, cz, 32, seed=S + salt)
    msa = _msa((B, S, N, cm), dist, gen).cuda()
    mask = _mask(B, S, N, mask_kind, gen).cuda()
    g = torch.randn(B, N, N, cz, generator=gen).cuda()
    params = [p.detach() for p in new.parameters()]
    args = (msa, mask, params[0], params[1], new.layer_norm.eps, *params[2:], g)
    fused = opm.outer_product_mean_backward(*args, **fused_kw)
    again = opm.outer_product_mean_backward(*args, **fused_kw)
    ops = opm.outer_product_mean_backward(*args, **ops_kw)
    m64 = copy.deepcopy(m_ref).double()
    x64 = msa.double().requires_grad_(True)
    (m64(x64, mask.double()) * g.double()).sum().backward()
    want = (x64.grad,) + tuple(p.grad for p in m64.parameters())
    names = ("msa",) + tuple(n for n, _ in m64.named_parameters())
    rel = lambda t, w: (t.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
    for name, f, r, o, w in zip(names, fused, again, ops, want):
        assert f.shape == w.shape and f.dtype == torch.float32 and torch.isfinite(f).all(), name
        assert torch.equal(f, r), f"{name}: a repeat call differs"
        e_f, e_o = rel(f, w), rel(o, w)
        assert e_f <= max(2 * e_o, 1e-5), f"{name}: kernel {e_f:.2e} vs ops {e_o:.2e}"


@gpu
@pytest.mark.parametrize("B, S, N, cm, cz, dist", [(1, 40, 37, 64, 128, "normal"), (2, 300, 20, 32, 64, "heavy"),
                                                   (1, 3, 9, 16, 8, "offset"), (1, 17, 130, 48, 100, "uniform")])
def test_backward_wo_kernel_against_fp64_and_the_ops_path(opm, ref, B, S, N, cm, cz, dist):
    """_backward_against_fp64_and_ops with out_proj's weight gradient in opm_bw_wo_kernel (wo_kernel=True)
    against the PyTorch-ops chunks (False), da and db in the chunks both times. Odd N (ragged 64 x 4
    tiles), S not a multiple of 16, pair_dim 8, 100 and 128, B = 2."""
    if not _caps(opm)[2]:
        pytest.skip("the dWo kernel needs a Hopper GPU and an sm_90a build")
    _backward_against_fp64_and_ops(opm, ref, B, S, N, cm, cz, dist, 0, dict(wo_kernel=True, ab_kernel=False),
                                   dict(wo_kernel=False, ab_kernel=False))


@gpu
@pytest.mark.parametrize("B, S, N, cm, cz, dist", [(1, 40, 37, 64, 128, "normal"), (2, 530, 20, 32, 64, "heavy"),
                                                   (1, 3, 9, 16, 8, "offset"), (1, 17, 130, 48, 100, "uniform")])
def test_backward_ab_kernel_against_fp64_and_the_ops_path(opm, ref, B, S, N, cm, cz, dist):
    """_backward_against_fp64_and_ops with da and db in opm_bw_ab_kernel (ab_kernel=True, dWo in its
    kernel) against the PyTorch-ops chunks (both False). N not a multiple of 32 or 4 (ragged own and loop
    tiles), S over 512 (two s chunks) and not a multiple of 64, pair_dim 8, 64, 100 and 128, B = 2;
    _ab_kernel_runs for pair_dim % 4 == 0 only."""
    if not _caps(opm)[2]:
        pytest.skip("the da / db kernel needs a Hopper GPU and an sm_90a build")
    msa = torch.empty(1, 1, 1, cm, device="cuda")
    assert opm._ab_kernel_runs(msa, 32, cz, torch.float32) and not opm._ab_kernel_runs(msa, 32, cz + 2, torch.float32)
    _backward_against_fp64_and_ops(opm, ref, B, S, N, cm, cz, dist, 1, dict(wo_kernel=True, ab_kernel=True),
                                   dict(wo_kernel=False, ab_kernel=False))


class _EinsumKernels:
    """A stand-in for the extension's backward kernels with their signatures (the same products by einsum,
    LayerNorm by ATen), so that the host-side plumbing of outer_product_mean_backward runs on a CPU."""

    split_j_seen = []  # opm_backward_wo's split_j per call

    @staticmethod
    def opm_backward_wo(a, b, inv_denom, g, ops, chunk_bytes, split_j):
        assert ops in ("split", "float16", "bfloat16") and chunk_bytes in (32 << 20, 256 << 20)
        assert isinstance(split_j, bool) and not (split_j and chunk_bytes != 32 << 20)  # only with low_memory
        _EinsumKernels.split_j_seen.append(split_j)
        return torch.einsum("bsih,bsjk,bijz->zhk", a, b, g * inv_denom[:, :, None, None]).reshape(g.shape[-1], -1)

    @staticmethod
    def opm_backward_ab(a, b, inv_denom, g, wo, ops, out_t):
        assert ops in ("split", "float16", "bfloat16") and out_t in (False, ops != "split")
        G = torch.einsum("bijz,zhk->bijhk", g * inv_denom[:, :, None, None], wo.reshape(-1, 32, 32))
        return torch.einsum("bijhk,bsjk->bsih", G, b), torch.einsum("bijhk,bsih->bsjk", G, a)

    @staticmethod
    def opm_backward_dbo(g):
        return g.sum(tuple(range(g.dim() - 1)))

    @staticmethod
    def opm_backward_rows(msa, mask, ln_w, ln_b, wa, ba, wb, bb, eps, block_tiles):
        x = F.layer_norm(msa, msa.shape[-1:], ln_w, ln_b, eps)
        m = mask.to(x.dtype)[..., None]
        return (x @ wa.t() + ba) * m, (x @ wb.t() + bb) * m, 1 / mask.to(x.dtype).sum(1).clamp(min=1)

    @staticmethod
    def opm_backward_ln(xin, da, db, mask, ln_w, ln_b, wa, wb, eps, consume):
        xin, ln_w, ln_b = (t.detach().requires_grad_(True) for t in (xin, ln_w, ln_b))
        with torch.enable_grad():
            x = F.layer_norm(xin, xin.shape[-1:], ln_w, ln_b, eps)
        dpa, dpb = da * mask[:, None], db * mask[:, None]
        d_x, d_lw, d_lb = torch.autograd.grad(x, (xin, ln_w, ln_b), dpa @ wa + dpb @ wb)
        x = x.detach()
        return d_x, d_lw, d_lb, dpa.t() @ x, dpa.sum(0), dpb.t() @ x, dpb.sum(0)


def test_step_memory_tool_says_it_needs_a_gpu(repo_root):
    """tools/opm_step_memory.py: --help shows its docstring and the defaults; without a CUDA device it exits 1 with
    one line naming the requirement, before loading the kernel file (no build, no driver traceback)."""
    import subprocess
    import sys
    tool = os.path.join(repo_root, "tools", "opm_step_memory.py")
    r = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "LOW_MEMORY_BACKWARD off and on" in r.stdout and "default long" in r.stdout, r.stdout
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the tool would run")
    r = subprocess.run([sys.executable, tool, "--dtypes", "bf16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip() == ("opm_step_memory: needs a CUDA device "
                                                      "(torch.cuda.is_available() is False)"), r.stderr[-2000:]


def test_backward_chunks_form_what_no_kernel_computes(opm, ref, monkeypatch):
    """Each mix of the backward's kernels (stood in by einsum and ATen's LayerNorm, float64 on the CPU)
    gives the all-ops gradients: the chunks form O where dWo has no kernel and G where da, db have
    none, and the a / b and LayerNorm kernels' inputs and outputs are wired as the ops path's; `parts`
    names the kernels of each mix."""
    B, S, N, cm, cz = 2, 5, 7, 16, 8
    gen = torch.Generator().manual_seed(11)
    m_ref = ref.Model(cm, cz, 32).double()
    _randomise(m_ref, gen)
    msa = torch.randn(B, S, N, cm, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, S, N, generator=gen) > 0.3).double()
    g = torch.randn(B, N, N, cz, generator=gen, dtype=torch.float64)
    params = [p.detach() for p in m_ref.parameters()]
    args = (msa, mask, params[0], params[1], m_ref.layer_norm.eps, *params[2:], g)
    parts = []
    want = opm.outer_product_mean_backward(*args, wo_kernel=False, ab_kernel=False, rows_kernel=False, ln_kernel=False,
                                           parts=parts)
    assert parts == []
    monkeypatch.setattr(opm, "_ext", _EinsumKernels)
    all4 = ["a, b", "dWo", "da, db", "LayerNorm"]
    for ks, names in (((False, True, False, False), ["da, db"]), ((True, False, False, False), ["dWo"]),
                      ((True, True, False, False), ["dWo", "da, db"]), ((True, True, True, False), all4[:3]),
                      ((True, True, False, True), all4[1:]), ((False, False, True, True), ["a, b", "LayerNorm"]),
                      ((True, True, True, True), all4)):
        kw = dict(zip(("wo_kernel", "ab_kernel", "rows_kernel", "ln_kernel"), ks))
        for low, split_j in ((False, False), (True, False), (False, True), (True, True)):
            # low_memory: the dWo kernel's chunk bytes (float64 here: da, db stay in it); LOW_MEMORY_SPLIT_J goes to
            # the dWo kernel only with it
            monkeypatch.setattr(opm, "LOW_MEMORY_SPLIT_J", split_j)
            _EinsumKernels.split_j_seen.clear()
            parts = []
            got = opm.outer_product_mean_backward(*args, **kw, parts=parts, low_memory=low)
            assert parts == names, kw
            assert _EinsumKernels.split_j_seen == ([low and split_j] if ks[0] else [])
            for w, t in zip(want, got):
                assert t.shape == w.shape and (t - w).abs().max() <= 1e-12 * max(w.abs().max(), 1.0), (kw, low)
    # with release_ab (the autograd Function's low-memory backward): the given a, b's storage freed after use, 1 /
    # denom's kept, the same gradients
    ab = _EinsumKernels.opm_backward_rows(msa, mask, params[0], params[1], *params[2:6], m_ref.layer_norm.eps, False)
    got = opm.outer_product_mean_backward(*args, ab=ab, rows_kernel=False, low_memory=True, release_ab=True)
    assert ab[0].untyped_storage().nbytes() == 0 and ab[1].untyped_storage().nbytes() == 0
    assert ab[2].untyped_storage().nbytes() > 0
    for w, t in zip(want, got):
        assert t.shape == w.shape and (t - w).abs().max() <= 1e-12 * max(w.abs().max(), 1.0)


@gpu
@pytest.mark.parametrize("B, S, N, cm, cz, dist, mask_kind", [(1, 40, 37, 256, 128, "normal", "binary"),
                                                              (2, 9, 20, 128, 64, "heavy", "bool"),
                                                              (1, 3, 11, 256, 8, "offset", "fraction"),
                                                              (2, 50, 100, 256, 64, "uniform", "int8")])
def test_backward_ln_kernel_against_fp64_and_the_ops_path(opm, ref, B, S, N, cm, cz, dist, mask_kind):
    """_backward_against_fp64_and_ops with the LayerNorm part in opm_bw_ln_kernel (ln_kernel=True)
    against the PyTorch-ops chunks (False), a and b from the ops both times. msa_dim 128 and 256, B * S
    * N not a multiple of the kernel's 32-row tiles (a partial last tile), 313 tiles at 10000 rows (two
    or three per block on 132 SMs: the double buffer, a partial tile after full ones); float, bool and
    integer masks; _ln_kernel_runs for msa_dim 128 and 256 only."""
    if not _caps(opm)[2]:
        pytest.skip("the LayerNorm kernel needs a Hopper GPU and an sm_90a build")
    msa = torch.empty(1, 1, 1, cm, device="cuda")
    assert opm._ln_kernel_runs(msa, 32, cm) and not opm._ln_kernel_runs(msa, 32, 64)
    _backward_against_fp64_and_ops(opm, ref, B, S, N, cm, cz, dist, 2, dict(ln_kernel=True, rows_kernel=False),
                                   dict(ln_kernel=False, rows_kernel=False), mask_kind)


@gpu
@pytest.mark.parametrize("dtype, R, cm, fits", [(torch.float32, 131072, 256, True), (torch.bfloat16, 131072, 256, True),
                                                (torch.float32, 40000, 128, True), (torch.bfloat16, 2000, 256, False)])
def test_backward_ln_kernel_partials_in_place_bit_equal(opm, dtype, R, cm, fits):
    """opm_backward_ln with consume (the blocks' partials written over da, db's rows once read, where they fit: at
    131072 rows 31 tiles per block on 132 SMs, 9 of them (fp32) or 17 (bf16) hold a partial; at 2000 rows 63 blocks of
    one tile, a buffer) returns the same bits as without, every output, and leaves x_in, mask and the weights alone;
    da, db change in the tiles that hold partials (each block's first (chunks + 1) / 2) and nowhere else; da and db
    that overlap are refused."""
    if not _caps(opm)[2]:
        pytest.skip("the LayerNorm kernel needs a Hopper GPU and an sm_90a build")
    gen = torch.Generator().manual_seed(R + cm)
    xin = (torch.randn(R, cm, generator=gen) * 2 + 0.5).to(dtype).cuda()
    da, db = (torch.randn(R, 32, generator=gen).to(dtype).cuda() for _ in range(2))
    mask = (torch.rand(R, generator=gen) > 0.2).float().cuda()
    ln_w, ln_b = (torch.randn(cm, generator=gen).cuda() for _ in range(2))
    wa, wb = (torch.randn(32, cm, generator=gen).cuda() / cm**0.5 for _ in range(2))
    ins = (xin, mask, ln_w, ln_b, wa, wb)
    keep = [t.clone() for t in ins]
    want = opm._ext.opm_backward_ln(xin, da.clone(), db.clone(), mask, ln_w, ln_b, wa, wb, 1e-5, False)
    da2, db2 = da.clone(), db.clone()
    got = opm._ext.opm_backward_ln(xin, da2, db2, mask, ln_w, ln_b, wa, wb, 1e-5, True)
    torch.cuda.synchronize()
    for w, t in zip(want, got):
        assert w.dtype == t.dtype and torch.equal(w, t)
        assert torch.isfinite(t).all()
    assert all(torch.equal(a, b) for a, b in zip(ins, keep))
    # where the partials go (ln_part_fits, ln_part_at): chunks of one tile's da or db rows, tiles blk + k blocks
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    blocks = min(-(-R // 32), sms)
    chunks = -(-(66 * cm + 64) // (32 * 32 * da.element_size() // 4))
    rows = (chunks + 1) // 2 * blocks * 32  # the tiles that hold partials: the first (chunks + 1) / 2 of each block
    assert (rows <= R // 32 * 32) == fits or sms != 132
    if rows <= R // 32 * 32:
        assert not torch.equal(da2[:32], da[:32]) and not torch.equal(db2[:32], db[:32])
        assert torch.equal(da2[rows:], da[rows:]) and torch.equal(db2[rows:], db[rows:])
    else:
        assert torch.equal(da2, da) and torch.equal(db2, db)
    with pytest.raises(RuntimeError, match="do not overlap"):
        opm._ext.opm_backward_ln(xin, da2, da2, mask, ln_w, ln_b, wa, wb, 1e-5, True)


@gpu
@pytest.mark.parametrize("B, S, N, cm, cz, dist, mask_kind", [(1, 40, 37, 256, 128, "normal", "binary"),
                                                              (2, 9, 20, 64, 64, "heavy", "bool"),
                                                              (1, 3, 11, 100, 8, "offset", "int64"),
                                                              (1, 17, 130, 768, 100, "uniform", "fraction")])
def test_backward_rows_kernel_against_fp64_and_the_ops_path(opm, ref, B, S, N, cm, cz, dist, mask_kind):
    """_backward_against_fp64_and_ops with a, b and 1 / denom from outer_wg's prep kernel (rows_kernel=True)
    against ATen's LayerNorm and addmm (False), the LayerNorm part by the ops both times. S and N not
    multiples of the prep's 4 s x 8 n tiles, msa_dim 64 to 768 (100: not a multiple of 4, plain loads
    instead of bulk copies), float, bool and integer masks; _rows_kernel_runs for hidden_dim 32 only."""
    if not _caps(opm)[2]:
        pytest.skip("the a / b kernel needs a Hopper GPU and an sm_90a build")
    msa = torch.empty(1, 1, 1, cm, device="cuda")
    assert opm._rows_kernel_runs(msa, 32, cm) and not opm._rows_kernel_runs(msa, 16, cm)
    _backward_against_fp64_and_ops(opm, ref, B, S, N, cm, cz, dist, 3, dict(rows_kernel=True, ln_kernel=False),
                                   dict(rows_kernel=False, ln_kernel=False), mask_kind)


def _backward_case_in(opm, ref, B, S, N, cm, cz, dist, mask_kind, dtype, salt):
    """A backward case in dtype (CUDA): outer_product_mean_backward's args (msa, mask in the msa's dtype where it is
    floating, parameters, grad_out), and the gradient names, fp64 autograd's gradients of the reference on those
    inputs upcast, and the reference's own run in dtype, each (msa, then the parameters in order)."""
    gen = torch.Generator().manual_seed(B + S + N + cz + salt)
    m_ref, new = _pair(opm, ref, cm, cz, 32, seed=S + salt)
    msa = _msa((B, S, N, cm), dist, gen).to(dtype).cuda()
    mask = _mask(B, S, N, mask_kind, gen)
    mask = (mask.to(dtype) if mask.is_floating_point() else mask).cuda()
    g = torch.randn(B, N, N, cz, generator=gen).to(dtype).cuda()
    params = [p.detach().to(dtype) for p in new.parameters()]
    args = (msa, mask, params[0], params[1], new.layer_norm.eps, *params[2:], g)
    m_t = copy.deepcopy(m_ref).to(dtype)
    m64 = copy.deepcopy(m_ref).double()
    with torch.no_grad():
        for p_t, p64, p in zip(m_t.parameters(), m64.parameters(), params):
            p_t.copy_(p)
            p64.copy_(p.double())
    x_t = msa.clone().requires_grad_(True)
    m_t(x_t, mask).backward(g)
    x64 = msa.double().requires_grad_(True)
    (m64(x64, mask.double()) * g.double()).sum().backward()
    want = (x64.grad,) + tuple(p.grad for p in m64.parameters())
    refd = (x_t.grad,) + tuple(p.grad for p in m_t.parameters())
    names = ("msa",) + tuple(n for n, _ in m64.named_parameters())
    return args, names, want, refd


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, S, N, cm, cz, dist, mask_kind", [(1, 40, 37, 256, 128, "normal", "binary"),
                                                              (2, 9, 20, 128, 100, "heavy", "bool"),
                                                              (1, 3, 9, 128, 8, "uniform", "int8"),
                                                              (2, 50, 100, 256, 64, "offset", "fraction")])
def test_backward_half_msa_kernels_against_fp64_and_the_ops_path(opm, ref, B, S, N, cm, cz, dist, mask_kind, dtype):
    """A float16 / bfloat16 msa and parameters through every backward kernel as ModelNew's backward runs
    them (a, b from the prep reading the msa in its dtype, dWo and da, db on that dtype's tensor cores
    where pair_dim % 8 == 0, else split TF32 on an fp32 copy of grad_out, the LayerNorm kernel reading
    the msa and writing its gradient in that dtype) against the PyTorch-ops chunks (fp32 math) on the
    same inputs and the reference module run in that dtype, all against fp64 autograd of the reference
    on those inputs upcast: each gradient in the input's dtype, finite, equal in a second call
    (deterministic), out_proj.weight's not bit-equal to split=True's where pair_dim % 8 == 0 (the 16-bit
    products ran), its max error relative to its largest value at most max(2x the ops path's, 2x the
    reference's in that dtype, 2^-9), and the ops path's own at most 2^-8; split=True (split TF32 with
    16-bit input) at most max(2x the ops path's, 2^-9). R = 1480 and 360 end in a partial 32-row tile of
    the LayerNorm kernel, R = 27 has no full tile, R = 10000 gives several tiles per block; pair_dim 8
    (past c_z in the last 16-z step of da / db's G step), 64, 128 and 100 (split); S = 3, 9 (one partial
    32-s block of dWo's phase A), 40, 50; float, bool, integer and fractional masks (the mask in the
    msa's dtype where it is floating)."""
    if not _caps(opm)[2]:
        pytest.skip("the backward kernels need a Hopper GPU and an sm_90a build")
    args, names, want, refd = _backward_case_in(opm, ref, B, S, N, cm, cz, dist, mask_kind, dtype, 4)
    assert opm._ln_kernel_runs(args[0], 32, cm) and opm._rows_kernel_runs(args[0], 32, cm)
    parts = []
    fused = opm.outer_product_mean_backward(*args, parts=parts)
    assert parts == ["a, b", "dWo", "da, db", "LayerNorm"]
    again = opm.outer_product_mean_backward(*args)
    split = opm.outer_product_mean_backward(*args, split=True)
    ops = opm.outer_product_mean_backward(*args, wo_kernel=False, ab_kernel=False, rows_kernel=False, ln_kernel=False)
    rel = lambda t, w: (t.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
    assert len(fused) == len(again) == len(split) == len(ops) == len(refd) == len(want) == 9
    for name, f, f2, sp, o, r, w in zip(names, fused, again, split, ops, refd, want):
        assert f.shape == w.shape and f.dtype == dtype and torch.isfinite(f).all(), name
        assert torch.equal(f, f2), f"{name}: two calls differ"
        if name == "out_proj.weight" and cz % 8 == 0:
            assert not torch.equal(f, sp), "out_proj.weight: the default equals split=True"
        e_f, e_s, e_o, e_r = rel(f, w), rel(sp, w), rel(o, w), rel(r, w)
        assert e_o <= 2.0**-8, f"{name}: ops {e_o:.2e}"
        assert e_f <= max(2 * e_o, 2 * e_r, 2.0**-9), f"{name}: kernels {e_f:.2e} vs ops {e_o:.2e}, reference {e_r:.2e}"
        assert e_s <= max(2 * e_o, 2.0**-9), f"{name}: split kernels {e_s:.2e} vs ops {e_o:.2e}"


@gpu
@pytest.mark.parametrize("ops, chunk", [("split", 1 << 20), ("bfloat16", 1 << 18), ("split", 300 << 10)])
def test_backward_wo_split_j_against_i_tile_chunks_and_fp64(opm, ops, chunk):
    """opm_backward_wo with split_j, where one i tile's G planes (B = 2, N = 100: 25 j blocks of 256 KB each in fp32,
    64 KB in 16 bits, per batch element) exceed chunk_bytes: chunks of 2 j blocks (the last one of 1), or of 1
    (300 KB), give dWo within 1e-5 of the i-tile chunks' (the same products summed in another order) and, in split
    TF32, within 1e-5 of fp64's sum_{b,i,j} gd O."""
    if not _caps(opm)[2]:
        pytest.skip("the dWo kernel needs a Hopper GPU and an sm_90a build")
    B, S, N, cz = 2, 5, 100, 64
    gen = torch.Generator().manual_seed(17 + chunk)
    a, b = (torch.randn(B, S, N, 32, generator=gen).cuda() for _ in range(2))
    inv_d = (torch.rand(B, N, generator=gen) + 0.1).cuda()
    g = torch.randn(B, N, N, cz, generator=gen).to(torch.float32 if ops == "split" else torch.bfloat16).cuda()
    whole = opm._ext.opm_backward_wo(a, b, inv_d, g, ops, 256 << 20, False)
    split = opm._ext.opm_backward_wo(a, b, inv_d, g, ops, chunk, True)
    torch.cuda.synchronize()
    assert split.shape == whole.shape == (cz, 1024) and torch.isfinite(split).all()
    scale = whole.abs().max().item()
    assert (split - whole).abs().max().item() <= 1e-5 * scale
    if ops == "split":
        o = torch.einsum("bsih,bsjk->bijhk", a.double(), b.double()).reshape(B, N, N, 1024)
        want = torch.einsum("bijz,bijn->zn", g.double() * inv_d.double()[:, :, None, None], o)
        assert (split.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, S, N, cz, out_t", [(1, 40, 37, 128, False), (2, 530, 20, 64, True),
                                                (1, 3, 9, 8, True), (1, 17, 130, 104, False)])
def test_backward_ab_16_bit_against_fp64(opm, dtype, B, S, N, cz, out_t):
    """opm_backward_ab on fp16 / bf16 products (its 16-bit instances, which the profiler sees, on their ring of 11
    slots of 16 KB): da, db each within 2^-7 of fp64's sums (relative to the largest value; g, wo, a, b rounded to T
    as the kernel's operands, G not, which the kernel rounds) and bit-equal in a second call, at ragged own / loop
    tiles, two s chunks (S = 530: a loop tile's 10 slots), pair_dim 8 to 128, B = 2, out in float32 and in T."""
    if not _caps(opm)[2]:
        pytest.skip("the da / db kernel needs a Hopper GPU and an sm_90a build")
    ops, ctype = ("float16", "__half") if dtype == torch.float16 else ("bfloat16", "__nv_bfloat16")
    gen = torch.Generator().manual_seed(B + S + N + cz)
    a, b = (torch.randn(B, S, N, 32, generator=gen).cuda() for _ in range(2))
    inv_d = (torch.rand(B, N, generator=gen) + 0.1).cuda()
    g = torch.randn(B, N, N, cz, generator=gen).to(dtype).cuda()
    wo = (torch.randn(cz, 1024, generator=gen) / cz**0.5).cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = opm._ext.opm_backward_ab(a, b, inv_d, g, wo, ops, out_t)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for f in (0, 1):
        kernel = f"opm_bw_ab_kernel<{f}, {ctype}, {ctype if out_t else 'float'}>"
        assert any(kernel in n for n in names), (kernel, sorted(set(names)))
    again = opm._ext.opm_backward_ab(a, b, inv_d, g, wo, ops, out_t)
    G = torch.einsum("bijz,zq->bijq", g.double() * inv_d.double()[:, :, None, None], wo.to(dtype).double())
    G = G.reshape(B, N, N, 32, 32)
    want = (torch.einsum("bijhk,bsjk->bsih", G, b.to(dtype).double()),
            torch.einsum("bijhk,bsih->bsjk", G, a.to(dtype).double()))
    for name, t, r, w in zip(("da", "db"), got, again, want):
        assert t.dtype == (dtype if out_t else torch.float32) and t.shape == (B, S, N, 32), name
        assert torch.equal(t, r), f"{name}: a second call differs"
        err = (t.double() - w).abs().max().item() / w.abs().max().item()
        assert err <= 2.0**-7, f"{name}: {err:.2e}"


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("B, S, N, cm, cz, dist, mask_kind", [(1, 40, 37, 256, 128, "normal", "binary"),
                                                              (1, 6, 1024, 128, 64, "heavy", "bool"),
                                                              (2, 9, 300, 128, 64, "offset", "fraction")])
def test_low_memory_backward_against_fp64(opm, ref, B, S, N, cm, cz, dist, mask_kind, dtype):
    """outer_product_mean_backward with low_memory=True (dWo's G planes in 32 MB chunks; da, db in the msa's
    16-bit type, read so by the LayerNorm kernel) against fp64 autograd of the reference, as
    test_backward_half_msa_kernels_against_fp64_and_the_ops_path judges the default: each gradient in the
    input's dtype, finite, equal in a second call, its max error relative to its largest value at most
    max(2x the PyTorch-ops path's, 2x the reference's in that dtype, 2^-9) in 16 bits, max(2x the ops
    path's, 1e-5) in fp32. N = 1024 (8 chunks of two 16-MB i tiles in 16 bits, 16 in fp32), 300 at B = 2 (two
    chunks of 3 and 2 i tiles in 16 bits, 5 of one in fp32), 37 (one); in 16 bits the msa's gradient differs from
    the default's (da, db were rounded to the 16-bit type)."""
    if not _caps(opm)[2]:
        pytest.skip("the backward kernels need a Hopper GPU and an sm_90a build")
    args, names, want, refd = _backward_case_in(opm, ref, B, S, N, cm, cz, dist, mask_kind, dtype, 6)
    parts = []
    low = opm.outer_product_mean_backward(*args, parts=parts, low_memory=True)
    assert parts == ["a, b", "dWo", "da, db", "LayerNorm"]
    again = opm.outer_product_mean_backward(*args, low_memory=True)
    default = opm.outer_product_mean_backward(*args)
    ops = opm.outer_product_mean_backward(*args, wo_kernel=False, ab_kernel=False, rows_kernel=False, ln_kernel=False)
    rel = lambda t, w: (t.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
    half = dtype != torch.float32
    if half:
        assert not torch.equal(low[0], default[0]), "msa: da, db in the 16-bit type changed nothing"
    assert len(low) == len(again) == len(default) == len(ops) == len(refd) == len(want) == 9
    for name, f, f2, o, r, w in zip(names, low, again, ops, refd, want):
        assert f.shape == w.shape and f.dtype == dtype and torch.isfinite(f).all(), name
        assert torch.equal(f, f2), f"{name}: two calls differ"
        e_f, e_o, e_r = rel(f, w), rel(o, w), rel(r, w)
        bound = max(2 * e_o, 2 * e_r, 2.0**-9) if half else max(2 * e_o, 1e-5)
        assert e_f <= bound, f"{name}: low-memory kernels {e_f:.2e} vs ops {e_o:.2e}, reference {e_r:.2e}"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_low_memory_training_step_frees_and_recomputes(opm, ref, monkeypatch, dtype):
    """ModelNew (outer_wg) with LOW_MEMORY_BACKWARD in a training step: the backward frees the forward's a, b (their
    saved storage is empty after it, 1 / denom's is not), a second backward through the retained graph recomputes
    them and gives the first's gradients bit for bit, as do a step under non-reentrant activation checkpointing and
    one with the saved tensors offloaded to the CPU (saved-tensor hooks), and one step's peak device memory (out,
    (out g).sum(), its backward) is below the default's by at least half of what the G planes save (N = 1024: 16 i
    tiles of 16 MB in 16 bits, 256 MB -> 32; 16 of 64 MB in fp32, 256 -> 64); gradients within 1e-2 (16-bit) / 1e-4
    of the default's."""
    if not _caps(opm)[2]:
        pytest.skip("the backward kernels need a Hopper GPU and an sm_90a build")
    B, S, N, cm, cz = 1, 8, 1024, 128, 128
    gen = torch.Generator().manual_seed(41)
    m_ref, new = _pair(opm, ref, cm, cz, 32, seed=41)
    new = new.to(dtype)
    new.variant = "outer_wg"  # (at S = 8 "auto" may take a variant with larger temporaries, and no a, b to hand over)
    msa = _msa((B, S, N, cm), "normal", gen).to(dtype).cuda()
    mask = (torch.rand(B, S, N, generator=gen) > 0.2).to(dtype).cuda()
    g = torch.randn(B, N, N, cz, generator=gen).to(dtype).cuda()

    def step(retain=False):
        x = msa.clone().requires_grad_(True)
        out = new(x, mask)
        leaves = [x] + list(new.parameters())
        first = torch.autograd.grad((out * g).sum(), leaves, retain_graph=retain)
        return out, first, leaves

    def peak():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = step()[1]
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, grads

    monkeypatch.setattr(opm, "LOW_MEMORY_BACKWARD", False)
    peak_off, want = peak()
    monkeypatch.setattr(opm, "LOW_MEMORY_BACKWARD", True)
    peak_on, got = peak()
    assert new.last_backward == ("a, b", "dWo", "da, db", "LayerNorm")
    saved = (256 - (64 if dtype == torch.float32 else 32)) << 20  # G planes: at least one 64-residue i tile
    assert peak_on <= peak_off - saved // 2, (peak_on, peak_off, saved)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for w, t in zip(want, got):
        assert (t.double() - w.double()).abs().max() <= tol * max(w.double().abs().max().item(), 1.0)
    out, first, leaves = step(retain=True)
    a_saved, b_saved, inv_d = out.grad_fn.saved_tensors[10:13]  # (msa, mask, 8 parameters, a, b, 1 / denom)
    assert a_saved.untyped_storage().nbytes() == 0 and b_saved.untyped_storage().nbytes() == 0
    assert inv_d.untyped_storage().nbytes() > 0
    second = torch.autograd.grad((out * g).sum(), leaves)
    for f, s2 in zip(first, second):
        assert torch.equal(f, s2)
    x = msa.clone().requires_grad_(True)
    out = torch.utils.checkpoint.checkpoint(new, x, mask, use_reentrant=False)
    ckpt = torch.autograd.grad((out * g).sum(), [x] + list(new.parameters()))
    with torch.autograd.graph.save_on_cpu():
        x = msa.clone().requires_grad_(True)
        out = new(x, mask)
    cpu = torch.autograd.grad((out * g).sum(), [x] + list(new.parameters()))
    for f, c1, c2 in zip(first, ckpt, cpu):
        assert torch.equal(f, c1) and torch.equal(f, c2)


@gpu
def test_low_memory_split_j_training_step(opm, ref, monkeypatch):
    """LOW_MEMORY_SPLIT_J in an fp32 training step with LOW_MEMORY_BACKWARD at N = 1024 (one i tile's G planes 64 MB,
    over the 32 MB chunk: two chunks of its j blocks): gradients within 1e-5 of the i-tile chunks' and the step's
    peak device memory at least 16 MB lower."""
    if not _caps(opm)[2]:
        pytest.skip("the backward kernels need a Hopper GPU and an sm_90a build")
    B, S, N, cm, cz = 1, 8, 1024, 128, 128
    gen = torch.Generator().manual_seed(43)
    _, new = _pair(opm, ref, cm, cz, 32, seed=43)
    new = new.cuda()
    new.variant = "outer_wg"
    msa = _msa((B, S, N, cm), "normal", gen).cuda()
    mask = (torch.rand(B, S, N, generator=gen) > 0.2).float().cuda()
    g = torch.randn(B, N, N, cz, generator=gen).cuda()
    monkeypatch.setattr(opm, "LOW_MEMORY_BACKWARD", True)

    def peak(split_j):
        monkeypatch.setattr(opm, "LOW_MEMORY_SPLIT_J", split_j)
        x = msa.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = new(x, mask)
        grads = torch.autograd.grad((out * g).sum(), [x] + list(new.parameters()))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, grads

    peak_off, want = peak(False)
    peak_on, got = peak(True)
    assert new.last_backward == ("a, b", "dWo", "da, db", "LayerNorm")
    assert peak_on <= peak_off - (16 << 20), (peak_on, peak_off)
    for w, t in zip(want, got):
        assert (t.double() - w.double()).abs().max() <= 1e-5 * max(w.double().abs().max().item(), 1.0)


@gpu
@pytest.mark.parametrize("B, S, N, cm, dist, mask_kind", [(1, 40, 37, 256, "normal", "binary"),
                                                          (2, 9, 20, 100, "offset", "bool")])
def test_forward_keeps_a_b_equal_to_the_backward_rows_kernel(opm, ref, B, S, N, cm, dist, mask_kind):
    """opm_forward with keep_ab, where outer_wg runs (hidden_dim 32), returns a, b and 1 / denom bit-equal
    to opm_backward_rows' on the same inputs (one prep kernel, two outputs), within 1e-5 of fp64; other
    variants return None for them."""
    if not _caps(opm)[2]:
        pytest.skip("outer_wg needs a Hopper GPU and an sm_90a build")
    gen = torch.Generator().manual_seed(B + S + N + cm)
    m_ref, new = _pair(opm, ref, cm, 64, 32, seed=S)
    msa = _msa((B, S, N, cm), dist, gen).cuda()
    mask = _mask(B, S, N, mask_kind, gen).cuda()
    params = [p.detach() for p in new.parameters()]
    eps = new.layer_norm.eps
    out, ran, a, b, inv_d, o = opm._ext.opm_forward(msa, mask, *params, eps, ALL_VARIANTS.index("outer_wg"), True)
    assert ALL_VARIANTS[ran] == "outer_wg" and a is not None and o is None
    a2, b2, inv_d2 = opm._ext.opm_backward_rows(msa, mask, *params[:6], eps, False)
    assert torch.equal(a, a2) and torch.equal(b, b2) and torch.equal(inv_d, inv_d2)
    p64 = [p.double() for p in params]
    x = F.layer_norm(msa.double(), (cm,), p64[0], p64[1], eps)
    m = mask.double()[..., None]
    for got, w, bias in ((a, p64[2], p64[3]), (b, p64[4], p64[5])):
        want = (x @ w.t() + bias) * m
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert (inv_d.double() - 1 / mask.double().sum(1).clamp(min=1)).abs().max() <= 1e-7
    _, ran, *rest = opm._ext.opm_forward(msa, mask, *params, eps, ALL_VARIANTS.index("outer_first"), True)
    assert ALL_VARIANTS[ran] == "outer_first" and rest == [None, None, None, None]


def _ldmatrix_x4_trans(smem, rows, cols):
    """ldmatrix.sync.aligned.m8n8.x4.trans.b16 on a 2-D smem array: lane l addresses row rows[l] from column cols[l]
    (row l % 8 of matrix l / 8); returns regs[lane][i] = (two 16-bit values) of matrix i transposed: lane T holds
    (M_i[2 (T % 4)][T / 4], M_i[2 (T % 4) + 1][T / 4]), M_i[j][c] = smem[rows[8 i + j], cols[8 i + j] + c]."""
    regs = [[None] * 4 for _ in range(32)]
    for i in range(4):
        M = torch.stack([smem[rows[8 * i + j], cols[8 * i + j]:cols[8 * i + j] + 8] for j in range(8)])
        for T in range(32):
            regs[T][i] = (M[2 * (T % 4), T // 4], M[2 * (T % 4) + 1, T // 4])
    return regs


def _ldmatrix_x4(smem, rows, cols):
    """ldmatrix.sync.aligned.m8n8.x4.b16 (not transposed), addressed as _ldmatrix_x4_trans: lane T holds
    (M_i[T / 4][2 (T % 4)], M_i[T / 4][2 (T % 4) + 1])."""
    regs = [[None] * 4 for _ in range(32)]
    for i in range(4):
        M = torch.stack([smem[rows[8 * i + j], cols[8 * i + j]:cols[8 * i + j] + 8] for j in range(8)])
        for T in range(32):
            regs[T][i] = (M[T // 4, 2 * (T % 4)], M[T // 4, 2 * (T % 4) + 1])
    return regs


def _mma_m16n8k16(acc, a, b):
    """mma.sync m16n8k16 row.col, fp32 accumulate: a[lane][0..3], b[lane][0..1] (pairs), acc[lane][0..3] per PTX's
    fragment layouts (g = lane / 4, t = lane % 4: a0 A[g][2t..], a1 A[g+8][2t..], a2 A[g][2t+8..], a3 A[g+8][2t+8..];
    b0 B[2t..][g], b1 B[2t+8..][g]; c0, c1 C[g][2t..], c2, c3 C[g+8][2t..])."""
    A, Bm = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for T in range(32):
        g, t = T // 4, T % 4
        for e in range(2):
            A[g, 2 * t + e], A[g + 8, 2 * t + e] = a[T][0][e], a[T][1][e]
            A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a[T][2][e], a[T][3][e]
            Bm[2 * t + e, g], Bm[2 * t + 8 + e, g] = b[T][0][e], b[T][1][e]
    C = A @ Bm
    for T in range(32):
        g, t = T // 4, T % 4
        acc[T][0] += C[g, 2 * t]; acc[T][1] += C[g, 2 * t + 1]
        acc[T][2] += C[g + 8, 2 * t]; acc[T][3] += C[g + 8, 2 * t + 1]


@pytest.mark.parametrize("P, cz, nt, zt, split", [(45, 24, 3, 0, (0, 64)), (200, 136, 7, 1, (64, 160))])
def test_wo_kept_kernel_fragments_emulated(P, cz, nt, zt, split):
    """opm_bw_wo_kept_kernel's index arithmetic, emulated on the CPU from its source's formulas with PTX's ldmatrix
    .trans and m16n8k16 fragment layouts: a block's 128 z x 128 hk tile over its split of the pairs (partial steps,
    rows past the split and z past c_z zero-filled) is g^T o there, in every warp's and lane's output places."""
    gen = torch.Generator().manual_seed(P + cz)
    g = torch.randn(P, cz, generator=gen, dtype=torch.float64)
    o = torch.randn(P, 1024, generator=gen, dtype=torch.float64)
    LD, z0, n0 = 136, 128 * zt, 128 * nt
    p0, p1 = split[0], min(P, split[1])
    part = torch.full((cz, 1024), float("nan"), dtype=torch.float64)
    accs = [[[[0.0] * 4 for _ in range(4)] for _ in range(4)] for _ in range(256)]  # [tid][mz][nn][4]
    for it in range(-(-(p1 - p0) // 32)):
        gs, os_ = torch.zeros(32, LD, dtype=torch.float64), torch.zeros(32, LD, dtype=torch.float64)
        for tid in range(256):  # the load lambda
            for q in range(2):
                e = tid + 256 * q
                r, c = e // 16, e % 16
                p, z = p0 + 32 * it + r, z0 + 8 * c
                if p < p1 and z < cz:
                    gs[r, 8 * c:8 * c + 8] = g[p, z:z + 8]
                if p < p1:
                    os_[r, 8 * c:8 * c + 8] = o[p, n0 + 8 * c:n0 + 8 * c + 8]
        for w in range(8):
            wz, wn = w // 4, w % 4
            for kk in range(2):
                lanes = range(32)
                a = [_ldmatrix_x4_trans(gs, [16 * kk + 8 * ((l // 8) >> 1) + l % 8 for l in lanes],
                                        [64 * wz + 16 * mz + 8 * ((l // 8) & 1) for l in lanes]) for mz in range(4)]
                bt = [_ldmatrix_x4_trans(os_, [16 * kk + 8 * ((l // 8) & 1) + l % 8 for l in lanes],
                                         [32 * wn + 16 * np_ + 8 * ((l // 8) >> 1) for l in lanes]) for np_ in range(2)]
                b = [[(bt[nn // 2][T][2 * (nn % 2)], bt[nn // 2][T][2 * (nn % 2) + 1]) for T in range(32)]
                     for nn in range(4)]
                for mz in range(4):
                    for nn in range(4):
                        acc = [accs[32 * w + T][mz][nn] for T in range(32)]
                        _mma_m16n8k16(acc, [a[mz][T] for T in range(32)], b[nn])
    for tid in range(256):  # the stores
        lane, w = tid % 32, tid // 32
        wz, wn = w // 4, w % 4
        for mz in range(4):
            for hh in range(2):
                z = z0 + 64 * wz + 16 * mz + lane // 4 + 8 * hh
                if z >= cz:
                    continue
                for nn in range(4):
                    hk = n0 + 32 * wn + 2 * (lane % 4) + 8 * nn
                    part[z, hk], part[z, hk + 1] = accs[tid][mz][nn][2 * hh], accs[tid][mz][nn][2 * hh + 1]
    want = g[p0:p1].t() @ o[p0:p1]
    zs, hs = slice(z0, min(cz, z0 + 128)), slice(n0, n0 + 128)
    assert torch.allclose(part[zs, hs], want[zs, hs], rtol=1e-12, atol=1e-12)
    assert torch.isnan(part[:, :n0]).all() and torch.isnan(part[:z0]).all()  # nothing outside the tile


@pytest.mark.parametrize("N, cz, i, jt", [(37, 24, 5, 0), (200, 128, 199, 1)])
def test_g_kernel_fragments_emulated(N, cz, i, jt):
    """opm_bw_g_kernel's index arithmetic, emulated on the CPU from its source's formulas with PTX's ldmatrix, ldmatrix
    .trans and m16n8k16 fragment layouts: one block (row i, 128 residues j from 128 jt) writes G[32 i + h, 32 j + k] =
    inv_denom[i] sum_z g[i, j, z] wo[z, 32 h + k] for every h, k and j < N there and nothing else (partial j tile, c_z
    not a multiple of 16: rows and z past the ends copied as zeros)."""
    gen = torch.Generator().manual_seed(N + cz)
    g = torch.randn(N, N, cz, generator=gen, dtype=torch.float64)
    wo = torch.randn(cz, 1024, generator=gen, dtype=torch.float64)
    scale = 0.37
    kc = -(-cz // 16) * 16
    ld, j0 = kc + 8, 128 * jt
    G = torch.full((32 * N, 32 * N), float("nan"), dtype=torch.float64)
    gs = torch.zeros(128, ld, dtype=torch.float64)
    for e in range(128 * (kc // 8)):  # g's rows (every thread's items together)
        r, c = e // (kc // 8), e % (kc // 8)
        if j0 + r < N and 8 * c < cz:
            gs[r, 8 * c:8 * c + 8] = g[i, j0 + r, 8 * c:8 * c + 8]
    lanes = range(32)
    for hc in range(16):
        ws = torch.zeros(kc, 72, dtype=torch.float64)
        for e in range(kc * 8):  # load_wo
            z, c = e // 8, e % 8
            if z < cz:
                ws[z, 8 * c:8 * c + 8] = wo[z, 64 * hc + 8 * c:64 * hc + 8 * c + 8]
        for w in range(8):
            wm, wn = w % 4, w // 4
            acc = [[[[0.0] * 4 for _ in range(32)] for _ in range(4)] for _ in range(2)]  # [mi][nn][lane][4]
            for ks in range(kc // 16):
                a = [_ldmatrix_x4(gs, [32 * wm + 16 * mi + 8 * ((l // 8) & 1) + l % 8 for l in lanes],
                                  [16 * ks + 8 * ((l // 8) >> 1) for l in lanes]) for mi in range(2)]
                bt = [_ldmatrix_x4_trans(ws, [16 * ks + 8 * ((l // 8) & 1) + l % 8 for l in lanes],
                                         [32 * wn + 16 * np_ + 8 * ((l // 8) >> 1) for l in lanes]) for np_ in range(2)]
                b = [[(bt[nn // 2][T][2 * (nn % 2)], bt[nn // 2][T][2 * (nn % 2) + 1]) for T in range(32)]
                     for nn in range(4)]
                for mi in range(2):
                    for nn in range(4):
                        _mma_m16n8k16(acc[mi][nn], [a[mi][T] for T in range(32)], b[nn])
            for lane in lanes:  # the stores
                for mi in range(2):
                    for hh in range(2):
                        j = j0 + 32 * wm + 16 * mi + lane // 4 + 8 * hh
                        if j >= N:
                            continue
                        for nn in range(4):
                            h, k = 2 * hc + wn, 8 * nn + 2 * (lane % 4)
                            G[32 * i + h, 32 * j + k] = acc[mi][nn][lane][2 * hh] * scale
                            G[32 * i + h, 32 * j + k + 1] = acc[mi][nn][lane][2 * hh + 1] * scale
    js = slice(j0, min(N, j0 + 128))
    want = (g[i, js] @ wo).reshape(-1, 32, 32).permute(1, 0, 2).reshape(32, -1) * scale  # rows h, columns (j, k)
    got = G[32 * i:32 * i + 32, 32 * j0:32 * min(N, j0 + 128)]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.isnan(G[:32 * i]).all() and torch.isnan(G[:, :32 * j0]).all()  # nothing outside the block's part


def _kept_o_fp64(a, b, scale, dtype):
    """O times the row's factor in fp64 from the forward's a, b rounded to dtype (as its planes), and the bound of the
    kernel's error: one rounding to dtype of the value (half a subnormal step at least) plus 2^-20 of the sum of
    |a b| (fp32 sums over S)."""
    a, b = (t.to(dtype).double() for t in (a, b))
    B, S, N, c = a.shape
    o = torch.einsum("bsih,bsjk->bijhk", a, b).reshape(B, N, N, c * c) * scale
    mag = torch.einsum("bsih,bsjk->bijhk", a.abs(), b.abs()).reshape(B, N, N, c * c) * scale.abs()
    unit, sub = (2.0**-8, 2.0**-134) if dtype == torch.bfloat16 else (2.0**-11, 2.0**-25)  # (sub: subnormals)
    return o, unit * o.abs() + 2.0**-20 * mag + sub


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, S, N, cm, cz, mask_kind, norm", [(1, 40, 37, 256, 128, "binary", 0),
                                                              (2, 9, 20, 64, 24, "bool", 0),
                                                              (1, 33, 19, 128, 64, "binary", 1),
                                                              (2, 7, 21, 64, 64, "int8", 2)])
def test_forward_keeps_o(opm, ref, B, S, N, cm, cz, mask_kind, norm, dtype):
    """opm_forward with keep_o where outer_wg runs on a 16-bit msa (hidden_dim 32): the output is bit-equal to the
    run without it, and the kept O (B, N, N, 1024) is O / denom (the pair modes, fused epilogue: s1 O) within one
    rounding to the dtype of fp64 from the forward's own a, b; every element written (the block it lands in was
    filled with NaN first). keep_o is ignored in float32 and where the pair modes' epilogue runs unfused."""
    if not _caps(opm)[2]:
        pytest.skip("outer_wg needs a Hopper GPU and an sm_90a build")
    gen = torch.Generator().manual_seed(B + S + N + cm + norm)
    _, new = _pair(opm, ref, cm, cz, 32, seed=S)
    msa = _msa((B, S, N, cm), "normal", gen).to(dtype).cuda()
    mask = _mask(B, S, N, mask_kind, gen).cuda()
    params = [p.detach().to(dtype) for p in new.parameters()]
    eps, code = new.layer_norm.eps, ALL_VARIANTS.index("outer_wg")
    extra = (norm, 1e-3, True, 0)

    def run(keep_o, x=msa):
        return opm._ext.opm_forward(x, mask, *params, eps, code, True, *extra, keep_o=keep_o)

    out0, _, a0, b0, *_ = run(True)
    out0.fill_(float("nan"))
    poison = run(True)[5]
    poison.fill_(float("nan"))
    del poison  # the next call's O of the same size takes this block from the caching allocator
    out1, ran, a, b, inv_d, o = run(True)
    out2, _, a2, b2, _, none = run(False)
    assert ALL_VARIANTS[ran] == "outer_wg" and none is None and o.dtype == dtype and o.shape == (B, N, N, 1024)
    assert torch.equal(out1, out2) and torch.equal(a, a2) and torch.equal(b, b2)
    if norm == 0:
        scale = inv_d.double()[:, :, None, None]
    else:
        s1, _ = opm.pair_scales(mask, norm, 1e-3)
        scale = s1.double()[..., None]
    want, bound = _kept_o_fp64(a, b, scale, dtype)
    err = (o.double() - want).abs()
    assert torch.isfinite(o).all() and (err <= bound).all(), (err / bound).max().item()
    if norm:  # the unfused epilogue (a row-mode run, then a pass over out): not kept
        assert opm._ext.opm_forward(msa, mask, *params, eps, code, True, norm, 1e-3, False, 0, keep_o=True)[5] is None
    p32 = [p.float() for p in params]
    assert opm._ext.opm_forward(msa.float(), mask, *p32, eps, code, True, *extra, keep_o=True)[5] is None


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("P, cz", [(45, 8), (1369, 24), (70000, 128), (300, 136)])
def test_wo_kept_kernel_against_fp64(opm, P, cz, dtype):
    """opm_backward_wo_kept (KEEP_O_PRODUCT "kernel"): g^T o in float32 within fp32 summation error of fp64 from the
    same 16-bit inputs (products exact), every element written (NaN-filled block reused), bit-equal on a second call;
    partial 32-pair steps and splits, a partial z tile and two z tiles."""
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs an sm_80+ GPU")
    gen = torch.Generator().manual_seed(P + cz)
    g = torch.randn(P, cz, generator=gen).to(dtype).cuda()
    o = torch.randn(P, 1024, generator=gen).to(dtype).cuda()
    got = opm._ext.opm_backward_wo_kept(g, o)
    got.fill_(float("nan"))
    del got
    got = opm._ext.opm_backward_wo_kept(g, o)
    assert got.dtype == torch.float32 and got.shape == (cz, 1024)
    g64, o64 = g.double(), o.double()
    want, mag = g64.t() @ o64, g64.abs().t() @ o64.abs()
    err = (got.double() - want).abs()
    assert torch.isfinite(got).all() and (err <= 2.0**-20 * mag + 1e-30).all(), (err / (mag + 1e-30)).max().item()
    assert torch.equal(got, opm._ext.opm_backward_wo_kept(g, o))


def _step_setup(opm, ref, family, dtype, shape, seed):
    """(module on outer_wg, msa, mask, grad_out) on the GPU in dtype for a training step: ModelNew (family None) or
    the family's module with random parameters, a normal msa, a binary mask in dtype, a normal grad_out."""
    B, S, N, cm, cz = shape
    gen = torch.Generator().manual_seed(70 + seed)
    if family:
        new = opm.FAMILIES[family](cm, cz, 32)
        _randomise(new, torch.Generator().manual_seed(seed))
    else:
        new = _pair(opm, ref, cm, cz, 32, seed=seed)[1]
    new = new.to(dtype).cuda()
    new.variant = "outer_wg"  # ("auto" may take fused_small in float16 here)
    msa = _msa((B, S, N, cm), "normal", gen).to(dtype).cuda()
    mask = _mask(B, S, N, "binary", gen).cuda().to(dtype)
    return new, msa, mask, torch.randn(B, N, N, cz, generator=gen).to(dtype).cuda()


def _steps_off_on(opm, monkeypatch, flag, new, msa, mask, g):
    """Two training steps of new with the module attribute flag False, then True: ((last_backward, gradients of msa
    and every parameter) off, the same on, the names of the CUDA kernels the second step ran)."""
    def step(on):
        monkeypatch.setattr(opm, flag, on)
        x = msa.clone().requires_grad_(True)
        out = new(x, mask)
        return new.last_backward, torch.autograd.grad((out * g).sum(), [x] + list(new.parameters()))

    off = step(False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        on = step(True)
        torch.cuda.synchronize()
    return off, on, [e.name for e in prof.events()]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", [None, "openfold"])
@pytest.mark.parametrize("product", ["library", "kernel"])
def test_training_step_with_kept_o(opm, ref, monkeypatch, family, dtype, product):
    """KEEP_O on: the step's dWo is one product over the forward's O ("dWo from O" in last_backward; the library's or
    opm_bw_wo_kept_kernel, KEEP_O_PRODUCT); every other gradient is bit-equal to the step with KEEP_O off, and dWo is
    within two roundings to the dtype of fp64's from the forward's own a, b (and so is the dWo kernel's)."""
    if not _caps(opm)[2]:
        pytest.skip("outer_wg needs a Hopper GPU and an sm_90a build")
    B, S, N, cm, cz = 1, 40, 37, 256, 128
    new, msa, mask, g = _step_setup(opm, ref, family, dtype, (B, S, N, cm, cz), 7)

    monkeypatch.setattr(opm, "KEEP_O_PRODUCT", product)

    (parts_off, off), (parts_on, on), kernels = _steps_off_on(opm, monkeypatch, "KEEP_O", new, msa, mask, g)
    assert "dWo" in parts_off and "dWo from O" in parts_on and "dWo" not in parts_on
    assert any("opm_bw_wo_kept_kernel" in k for k in kernels) == (product == "kernel"), kernels
    names = ["msa"] + [n for n, _ in new.named_parameters()]
    iwo = names.index("out_proj.weight") if "out_proj.weight" in names else names.index("linear_out.weight")
    for i, (w, t) in enumerate(zip(off, on)):
        if i != iwo:
            assert torch.equal(w, t), names[i]
    # fp64 dWo from the forward's a, b (opm_forward's own, row or pair scale)
    lins = (new.linear_1, new.linear_2, new.linear_out) if family else (new.proj_a, new.proj_b, new.out_proj)
    params = [new.layer_norm.weight, new.layer_norm.bias] + [t for lin in lins for t in (lin.weight, opm._proj_bias(lin))]
    extra = (opm.NORM_OPENFOLD, new.eps, True, 0) if family else ()
    *_, a, b, inv_d, _ = opm._ext.opm_forward(msa, mask, *[p.detach() for p in params], new.layer_norm.eps,
                                              ALL_VARIANTS.index("outer_wg"), True, *extra)
    scale = (inv_d.double()[:, :, None, None] if not family
             else opm.pair_scales(mask, opm.NORM_OPENFOLD, new.eps)[0].double()[..., None])
    o64, _ = _kept_o_fp64(a, b, scale, dtype)
    g64 = g.double().reshape(-1, cz)
    want = g64.t() @ o64.reshape(-1, 1024)
    sub = 2.0**-25 if dtype == torch.float16 else 0.0  # (O's subnormals in float16)
    bound = 2 * 2.0**-8 * (g64.abs().t() @ (o64.abs().reshape(-1, 1024) + sub)) + 1e-30
    for got in (on[iwo], off[iwo]):
        assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max().item()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, N, cz", [(1, 37, 24), (2, 130, 128), (1, 129, 120)])
def test_g_kernel_against_fp64(opm, B, N, cz, dtype):
    """opm_backward_g (G_MEM): G[b, 32 i + h, 32 j + k] = inv_denom[b, i] sum_z g[b, i, j, z] wo[z, 32 h + k] within one
    rounding to the dtype (and fp32 summation error) of fp64 from the same 16-bit inputs, every element written
    (NaN-filled block reused), bit-equal on a second call; partial j tiles, c_z not a multiple of 16, two batches."""
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs an sm_80+ GPU")
    gen = torch.Generator().manual_seed(B * 1000 + N + cz)
    g = torch.randn(B, N, N, cz, generator=gen).to(dtype).cuda()
    wo = (torch.randn(cz, 1024, generator=gen) * 0.1).to(dtype).cuda()
    inv_d = (1.0 / torch.randint(1, 50, (B, N), generator=gen).float()).cuda()
    got = opm._ext.opm_backward_g(g, wo, inv_d)
    got.fill_(float("nan"))
    del got
    got = opm._ext.opm_backward_g(g, wo, inv_d)
    assert got.dtype == dtype and got.shape == (B, 32 * N, 32 * N)

    def as_g(t):  # (B, N i, N j, 32 h, 32 k) -> rows (i, h), columns (j, k)
        return (t.reshape(B, N, N, 32, 32) * inv_d.double()[:, :, None, None, None]).permute(0, 1, 3, 2, 4).reshape(
            B, 32 * N, 32 * N)

    g64, w64 = g.double().reshape(B, N * N, cz), wo.double()
    want, mag = as_g(g64 @ w64), as_g(g64.abs() @ w64.abs())
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    bound = unit * want.abs() + 2.0**-20 * mag + 2.0**-24
    err = (got.double() - want).abs()
    assert torch.isfinite(got).all() and (err <= bound).all(), (err / bound).max().item()
    assert torch.equal(got, opm._ext.opm_backward_g(g, wo, inv_d))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", [None, "openfold"])
@pytest.mark.parametrize("low_memory", [False, True])
def test_training_step_with_g_mem(opm, ref, monkeypatch, family, dtype, low_memory):
    """G_MEM on: da, db come from G in memory and two library products ("da, db from G" in last_backward, the G kernel
    in the profile); dWo and dbo are bit-equal to the step with G_MEM off (opm_bw_ab_kernel), and every other gradient
    is within the relative error of da, db's rounding to the dtype of it (a transposed or misplaced G would be off by
    the gradient's size)."""
    if not _caps(opm)[2]:
        pytest.skip("outer_wg needs a Hopper GPU and an sm_90a build")
    B, S, N, cm, cz = 2, 40, 37, 256, 128
    new, msa, mask, g = _step_setup(opm, ref, family, dtype, (B, S, N, cm, cz), 8)
    monkeypatch.setattr(opm, "G_MEM_MIN_S", 1)
    monkeypatch.setattr(opm, "LOW_MEMORY_BACKWARD", low_memory)

    (parts_off, off), (parts_on, on), kernels = _steps_off_on(opm, monkeypatch, "G_MEM", new, msa, mask, g)
    assert "da, db" in parts_off and "da, db from G" in parts_on and "da, db" not in parts_on
    assert any("opm_bw_g_kernel" in k for k in kernels) and not any("opm_bw_ab_kernel" in k for k in kernels)
    names = ["msa"] + [n for n, _ in new.named_parameters()]
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name, w, t in zip(names, off, on):
        if "out_proj" in name or "linear_out" in name:
            assert torch.equal(w, t), name
        else:
            rel = ((t.double() - w.double()).norm() / w.double().norm()).item()
            assert torch.isfinite(t).all() and rel <= tol, (name, rel)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, S, N, cm, dist, mask_kind", [(1, 40, 37, 256, "offset", "binary"),
                                                          (2, 37, 45, 48, "normal", "bool"),
                                                          (1, 9, 20, 16, "heavy", "fraction")])
def test_prep_warp_tiles_equal_block_tiles(opm, ref, B, S, N, cm, dist, mask_kind, dtype):
    """A 16-bit msa with msa_dim % 16 == 0 (up to 256) takes outer_wg's warp-tile prep
    (opm_prep16_kernel): its a, b rows and 1 / denom are bit-equal to the block-tile prep's
    (opm_prep_ow_kernel, block_tiles=True) on the same inputs (S % 8 or N % 2 nonzero in each case), the
    profiler shows which kernel each call ran, and the forward runs the warp-tile prep."""
    if not _caps(opm)[2]:
        pytest.skip("outer_wg needs a Hopper GPU and an sm_90a build")
    ctype = "__nv_bfloat16" if dtype == torch.bfloat16 else "__half"
    gen = torch.Generator().manual_seed(B + S + N + cm)
    _, new = _pair(opm, ref, cm, 64, 32, seed=S)
    msa = _msa((B, S, N, cm), dist, gen).to(dtype).cuda()
    mask = _mask(B, S, N, mask_kind, gen).cuda()
    params = [p.detach() for p in new.parameters()]
    eps = new.layer_norm.eps
    acts = [torch.profiler.ProfilerActivity.CUDA]
    rows = {}
    for block_tiles in (False, True):
        with torch.profiler.profile(activities=acts) as prof:
            rows[block_tiles] = opm._ext.opm_backward_rows(msa, mask, *params[:6], eps, block_tiles)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        assert any(f"opm_prep16_kernel<{ctype}" in n for n in names) == (not block_tiles), names
        assert any("opm_prep_ow_kernel<" in n and ctype in n for n in names) == block_tiles, names
    assert all(torch.isfinite(t).all() for t in rows[False])
    assert all(torch.equal(w, b) for w, b in zip(rows[False], rows[True]))
    with torch.profiler.profile(activities=acts) as prof:
        opm._ext.opm_forward(msa, mask, *[p.to(dtype) for p in params], eps, ALL_VARIANTS.index("outer_wg"), False)
        torch.cuda.synchronize()
    assert any(f"opm_prep16_kernel<{ctype}" in e.name for e in prof.events()), [e.name for e in prof.events()]


# ---------------------------------------------------------------------------------------------
# fused_small: the whole forward in one cooperative launch
# ---------------------------------------------------------------------------------------------
def _poisoned(call, nbytes):
    """call() right after a block of nbytes from PyTorch's caching allocator was filled with 0xff bytes (NaN
    in float32, float16 and bfloat16) and freed: returns (out, whether out is that block). The forward's
    first allocation is its output, and the allocator hands the same free block to the same request, so
    an element the kernel does not write reads NaN."""
    blk = torch.full((max(nbytes, 1),), 255, dtype=torch.uint8, device="cuda")
    ptr = blk.data_ptr()
    del blk
    out = call()
    return out, out.data_ptr() == ptr


def _fs_inputs(opm, ref, B, S, N, cm, c, cz, mask_kind, seed, dtype=torch.float32, dist="normal"):
    """A module pair in dtype, msa (dist) and a mask of mask_kind ("same": 0/1 in dtype) with fully masked
    positions, on the GPU, all drawn from seed."""
    gen = torch.Generator().manual_seed(seed)
    m_ref, new = _pair(opm, ref, cm, cz, c, seed)
    m_ref, new = m_ref.to(dtype), new.to(dtype)
    msa = _msa((B, S, N, cm), dist, gen).to(dtype).cuda()
    mask = _mask_full_positions(_mask(B, S, N, "binary" if mask_kind == "same" else mask_kind, gen), gen)
    mask = (mask.to(dtype) if mask_kind == "same" else mask).cuda()
    new.variant = "fused_small"
    return m_ref, new, msa, mask


@gpu
@pytest.mark.parametrize("B,S,N,cm,c,cz,mask_kind", [
    (2, 8, 32, 64, 32, 64, "ones"),        # KernelBench's seed shape
    (2, 8, 32, 64, 32, 64, "fraction"),
    (1, 1, 1, 8, 32, 8, "binary"),         # S = N = 1
    (2, 1, 17, 64, 32, 64, "bool"),        # S = 1, N % 4 != 0
    (1, 5, 1, 33, 16, 7, "int64"),         # odd msa_dim (one-element loads), hidden 16 (Wo element-wise)
    (1, 7, 37, 37, 32, 13, "uint8"),       # pair_dim odd: one-element stores
    (2, 9, 45, 40, 8, 30, "int8"),         # hidden 8, N past an i block
    (1, 20, 33, 62, 31, 9, "int16"),       # msa_dim % 4 != 0, hidden 31 (odd), S past two s chunks
    (1, 13, 40, 68, 24, 65, "int32"),      # msa_dim % 8 != 0 (4-element loads), pair_dim 65
    (2, 0, 7, 16, 32, 12, "binary"),       # S = 0: the bias everywhere
    (1, 3, 10, 768, 32, 8, "fraction"),    # msa_dim 768
    (2, 21, 70, 40, 32, 200, "binary"),    # 2700 tasks: blocks walk tasks (Wo staged after the first)
    (1, 37, 131, 3, 32, 128, "bool"),      # 5 s chunks, 5 i blocks
    (3, 17, 64, 1, 16, 1, "binary"),       # msa_dim 1, pair_dim 1
])
def test_fused_small_against_fp64(opm, ref, B, S, N, cm, c, cz, mask_kind):
    """fused_small against an fp64 evaluation of the reference at atol = rtol = 1e-4, three trials of fresh
    random inputs (fully masked positions in each), the output block poisoned with NaN before each call;
    the inputs unchanged and a repeat call bit-equal (deterministic)."""
    for trial in range(3):
        m_ref, new, msa, mask = _fs_inputs(opm, ref, B, S, N, cm, c, cz, mask_kind, seed=1000 * trial + N + cm,
                                           dist=("normal", "heavy", "offset")[trial])
        expect = _ref64(m_ref, msa, mask)
        msa0, mask0 = msa.clone(), mask.clone()
        with torch.no_grad():
            out, poisoned = _poisoned(lambda: new(msa, mask), B * N * N * cz * 4)
            again = new(msa, mask)
        assert poisoned, "the output did not land in the poisoned block"
        assert new.last_variant == "fused_small"
        _check(out, expect, f"fused_small trial {trial} B={B} S={S} N={N} cm={cm} c={c} cz={cz} mask={mask_kind}")
        assert torch.equal(out, again), "a repeat call differs"
        assert torch.equal(msa, msa0) and torch.equal(mask, mask0), "inputs changed by the call"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,S,N,cm,c,cz,mask_kind", [(2, 8, 32, 64, 32, 64, "same"), (1, 5, 19, 20, 32, 24, "bool"),
                                                    (1, 7, 17, 13, 16, 7, "int64"), (2, 1, 33, 62, 31, 9, "same"),
                                                    (1, 40, 45, 64, 32, 200, "int8"), (1, 3, 33, 40, 32, 128, "same")])
def test_fused_small_half_against_fp64_and_the_reference(opm, ref, B, S, N, cm, c, cz, mask_kind, dtype):
    """float16 / bfloat16 module, msa and mask (or a bool / integer mask) on fused_small: the output in
    that dtype, poisoned before the call, finite; its max error against fp64 at most the reference's own in
    that dtype or 1.5 ulps of the largest output (fp32 inside, a and b rounded where the reference rounds
    them, one rounding at the end), and at most as many elements as the reference's outside 1e-2
    (KernelBench's tolerances) of fp64. Three trials of fresh inputs."""
    for trial in range(3):
        m_ref, new, msa, mask = _fs_inputs(opm, ref, B, S, N, cm, c, cz, mask_kind, seed=77 * trial + S + N,
                                           dtype=dtype, dist=("normal", "uniform", "offset")[trial])
        want64 = _ref64(m_ref, msa, mask)
        with torch.no_grad():
            want = m_ref(msa, mask)
            got, poisoned = _poisoned(lambda: new(msa, mask), B * N * N * cz * 2)
        assert poisoned and new.last_variant == "fused_small"
        assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
        err, e_ref = (got.double() - want64).abs().max().item(), (want.double() - want64).abs().max().item()
        top = want64.abs().max().item()
        assert err <= max(e_ref, 3 * _HALF_ULP[dtype] * top), f"err {err:.2e} vs the reference's {e_ref:.2e} (top {top:.2e})"
        miss = lambda t: int(((t.double() - want64).abs() > 1e-2 + 1e-2 * want64.abs()).sum())
        assert miss(got) <= miss(want), (miss(got), miss(want))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_small_at_kernelbench_inputs(opm, ref, dtype):
    """KernelBench's own check at its seed shape: the module as constructed (its init), get_inputs' msa and
    mask cast to dtype, five trials, allclose to the reference run in that dtype at KernelBench's
    tolerances (fp32 1e-4; fp16 / bf16 1e-2)."""
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for trial in range(5):
        torch.manual_seed(trial)
        m_ref = ref.Model(*ref.get_init_inputs())
        new = opm.ModelNew(*ref.get_init_inputs())
        new.load_state_dict(m_ref.state_dict())
        m_ref, new = m_ref.to(dtype).cuda(), new.to(dtype).cuda()
        new.variant = "fused_small"
        msa, mask = (t.to(dtype).cuda() for t in ref.get_inputs())
        want = m_ref(msa, mask)  # grad mode, as KernelBench calls it
        got = new(msa, mask)
        assert new.last_variant == "fused_small" and got.dtype == dtype
        torch.testing.assert_close(got.detach(), want.detach(), atol=tol, rtol=tol)


@gpu
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("dtype, ctype", [(torch.float32, "float"), (torch.bfloat16, "__nv_bfloat16"),
                                          (torch.float16, "__half")])
def test_fused_small_is_one_kernel_in_its_dtype(opm, ref, dtype, ctype, grad):
    """fused_small at the seed shape, with grad mode off or on (parameters requiring grad, as KernelBench
    times it): the forward launches exactly one CUDA kernel, opm_fused_small_kernel<T> of the inputs' type,
    and makes no PyTorch copy or conversion of any tensor."""
    B, S, N, cm, c, cz = 2, 8, 32, 64, 32, 64
    _, new, msa, mask = _fs_inputs(opm, ref, B, S, N, cm, c, cz, "same", seed=5, dtype=dtype)
    ctx = torch.enable_grad if grad else torch.no_grad
    with ctx():
        new(msa, mask)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof, ctx():
        out = new(msa, mask)
        torch.cuda.synchronize()
    assert out.dtype == dtype and out.requires_grad == grad
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and f"opm_fused_small_kernel<{ctype}>" in kernels[0], kernels
    copies = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::_to_copy", "aten::clone",
                                                           "aten::contiguous", "aten::fill_", "aten::zero_")]
    assert not copies, copies


@gpu
@pytest.mark.parametrize("c", [32, 16])
def test_fused_small_grad_mode_forward_then_backward(opm, ref, c):
    """Grad mode (msa and parameters requiring grad) on fused_small: the forward is the no-grad kernel call
    bit for bit; at hidden_dim 32 it keeps its a, b rows for the backward ("a, b" in last_backward), at 16
    the backward recomputes them (on any GPU); every gradient within 1e-4 of the fp32 reference's autograd, and equal
    within 1e-5 relative to the gradients after an outer_first forward (which keeps nothing)."""
    B, S, N, cm, cz = 2, 8, 32, 64, 64
    m_ref, new, msa, mask = _fs_inputs(opm, ref, B, S, N, cm, c, cz, "binary", seed=c)
    gen = torch.Generator().manual_seed(c + 1)
    g = torch.randn(B, N, N, cz, generator=gen).cuda()
    grads = {}
    for v in ("fused_small", "outer_first"):
        new.zero_grad(set_to_none=True)
        new.variant = v
        x_new = msa.clone().requires_grad_()
        out = new(x_new, mask)
        assert out.requires_grad and new.last_variant == v
        if v == "fused_small":
            with torch.no_grad():
                torch.testing.assert_close(out, new(msa, mask), atol=0, rtol=0)
        (out * g).sum().backward()
        if v == "fused_small":  # kept a, b: the backward takes them as the rows kernel's
            assert ("a, b" in new.last_backward) == (c == 32), new.last_backward
        grads[v] = [x_new.grad] + [p.grad for p in new.parameters()]
        assert all(t is not None and torch.isfinite(t).all() for t in grads[v]), v
    x_ref = msa.clone().requires_grad_()
    (m_ref(x_ref, mask) * g).sum().backward()
    want = [x_ref.grad] + [p.grad for p in m_ref.parameters()]
    names = ["msa"] + [n for n, _ in new.named_parameters()]
    for name, f, o, w in zip(names, grads["fused_small"], grads["outer_first"], want):
        torch.testing.assert_close(f, w, atol=1e-4, rtol=1e-4, msg=name)
        assert (f - o).abs().max() <= 1e-5 * max(o.abs().max().item(), 1e-30), name


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_small_half_grad_mode_keeps_a_b(opm, ref, dtype):
    """A 16-bit module and msa in grad mode on fused_small (hidden_dim 32): the forward returns its dtype and
    keeps its a, b rows; the backward's gradients (in the parameters' dtype, finite) within 2% of their
    largest value of those after an outer_first forward (a, b recomputed by the backward in fp32)."""
    B, S, N, cm, c, cz = 2, 8, 32, 64, 32, 64
    _, new, msa, mask = _fs_inputs(opm, ref, B, S, N, cm, c, cz, "same", seed=9, dtype=dtype)
    g = torch.randn(B, N, N, cz, generator=torch.Generator().manual_seed(10)).to(dtype).cuda()
    grads = {}
    for v in ("fused_small", "outer_first"):
        new.zero_grad(set_to_none=True)
        new.variant = v
        x = msa.clone().requires_grad_()
        out = new(x, mask)
        assert new.last_variant == v and out.dtype == dtype
        out.backward(g)
        if v == "fused_small":
            assert "a, b" in new.last_backward, new.last_backward
        grads[v] = [x.grad] + [p.grad for p in new.parameters()]
    names = ["msa"] + [n for n, _ in new.named_parameters()]
    for name, f, o in zip(names, grads["fused_small"], grads["outer_first"]):
        assert f.dtype == dtype and torch.isfinite(f).all(), name
        assert (f.double() - o.double()).abs().max() <= 2e-2 * o.double().abs().max(), name


@gpu
def test_fused_small_keeps_a_b_and_inv_denom(opm, ref):
    """opm_forward with keep_ab on fused_small at hidden_dim 32 returns its a, b rows and 1 / denom: within
    1e-5 of fp64 (relative to the largest) and the exact clamped reciprocal; at hidden_dim 16 None."""
    B, S, N, cm = 2, 11, 37, 40
    for c in (32, 16):
        _, new, msa, mask = _fs_inputs(opm, ref, B, S, N, cm, c, 24, "int32", seed=3 + c)
        params = [p.detach() for p in new.parameters()]
        eps = new.layer_norm.eps
        out, ran, a, b, inv_d, _ = opm._ext.opm_forward(msa, mask, *params, eps, ALL_VARIANTS.index("fused_small"),
                                                        True)
        assert ALL_VARIANTS[ran] == "fused_small"
        if c != 32:
            assert a is None and b is None and inv_d is None
            continue
        p64 = [p.double() for p in params]
        x = F.layer_norm(msa.double(), (cm,), p64[0], p64[1], eps)
        m = mask.double()[..., None]
        for got, w, bias in ((a, p64[2], p64[3]), (b, p64[4], p64[5])):
            want = (x @ w.t() + bias) * m
            assert got.shape == (B, S, N, 32) and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert (inv_d.double() - 1 / mask.double().sum(1).clamp(min=1)).abs().max() <= 1e-7
