"""The pair-count normalisations of outer_product_mean.py: OpenFoldOuterProductMean (AlphaFold / OpenFold,
(acc + bo) / (sum_s m_si m_sj + eps)) and BoltzOuterProductMean (acc / max(sum_s m_si m_sj, 1) + bo)
against reference/outer_product_mean_openfold.py and reference/outer_product_mean_boltz.py, and as
drop-ins converted from the released OpenFold3 / Boltz modules (from_openfold, from_boltz).

CPU (CI): the family modules are KernelBench drop-ins of their references (same seed, same parameters,
the reference's constructor arguments) and hold the released modules' parameter names; conversions copy
weights, eps, dtype and training mode and state dicts load both ways; pair_scales and the backward's
PyTorch path (outer_product_mean_backward with norm=...) against fp64 autograd of the references with
fully masked rows and columns and fractional masks (pair counts below 1 tell clamp(1) from + eps); the
harness's FAMILY mechanism on pure-PyTorch files; CPU tensors raise the device error.
GPU (marker gpu): every forced variant and "auto", fused and unfused pair epilogue, in fp32 / fp16 /
bf16 against fp64 (outputs poisoned with NaN through the caching allocator before each call); the
backward of both modes against fp64; the fp16 overflow of a fully masked pair (OpenFold: bias / eps);
bf16 rows below 2^-121 with pair scales near 1 / eps; the drop-ins converted from real modules inside a
small stack of layers (outputs and gradients).
"""
import copy
import os

import pytest
import torch

import harness

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
# tests/test_opm_families.py's references, parameter randomisation and released modules (pinned versions)
FAM = harness.load_module("tests/test_opm_families.py")
RO, RB, SOL, CPU, randomise = FAM.RO, FAM.RB, FAM.SOL, FAM.CPU, FAM.randomise
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp16 / bf16: a kernel's max error against fp64 may be this many times the reference's own in that
# dtype (the unfused pair epilogue rounds its output twice), or 4 half-ulps of the largest output
HALF_FACTOR = 2.0
HALF_ULP = {torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -12}


@pytest.fixture(scope="module")
def opm(kernel_module):
    return kernel_module("outer_product_mean.py", "outer_product_mean_pair_modes")


def inputs(B, S, N, cm, kind, seed):
    """msa (B, S, N, c_m) and a float mask of `kind`: ones; dead (0/1, sequence 1 and position 2 masked
    everywhere: a zero row and column of pair counts); fractional (uniform weights, position 2 masked:
    pair counts below 1); bool."""
    g = torch.Generator().manual_seed(seed)
    msa = 2 * torch.randn(B, S, N, cm, generator=g) + 0.5
    if kind == "ones":
        return msa, torch.ones(B, S, N)
    if kind == "bool":
        mask = torch.rand(B, S, N, generator=g) < 0.7
        mask[:, :, min(2, N - 1)] = False
        return msa, mask
    mask = (torch.rand(B, S, N, generator=g) < 0.7).float() if kind == "dead" else torch.rand(B, S, N, generator=g)
    if kind == "dead":
        mask[:, min(1, S - 1)] = 0
    mask[:, :, min(2, N - 1)] = 0
    return msa, mask


FAMILY = {"openfold": (RO, "OpenFoldOuterProductMean", dict(proj_bias=True, eps=1e-3)),
          "boltz": (RB, "BoltzOuterProductMean", {})}


def models(opm, family, cm, cz, c, seed, **kw):
    """(reference Model, the family module loaded with its state_dict), CPU, fp32."""
    refmod, cls, extra = FAMILY[family]
    extra = dict(extra, **kw)
    ref = randomise(refmod.Model(cm, cz, c, **extra), seed).eval()
    new = getattr(opm, cls)(cm, cz, c, **extra).eval()
    new.load_state_dict(ref.state_dict(), strict=True)
    return ref, new


# ---------------------------------------------------------------------------------------------
# CPU tests (CI)
# ---------------------------------------------------------------------------------------------
def test_family_modules_are_dropins_of_their_references(opm):
    for family, (refmod, cls, _) in FAMILY.items():
        New = getattr(opm, cls)
        assert opm.FAMILIES[family] is New and New.FAMILY == family == refmod.FAMILY
        for init in ([64, 128, 32], refmod.get_init_inputs()):
            ok, detail = harness.dropin_check(refmod.Model, New, init)
            assert ok, (family, detail)
    of = opm.OpenFoldOuterProductMean(16, 12, 8, eps=0.25, proj_bias=True)
    ok, detail = harness.dropin_check(lambda *a: RO.Model(*a, eps=0.25, proj_bias=True),
                                      lambda *a: opm.OpenFoldOuterProductMean(*a, eps=0.25, proj_bias=True), [16, 12, 8])
    assert ok, detail
    assert of.eps == 0.25 and of.linear_1.bias is not None
    # ModelNew keeps the KernelBench reference's submodules and constructor
    assert list(opm.ModelNew(8, 6, 4).state_dict()) == list(harness.load_module("reference/outer_product_mean.py")
                                                            .Model(8, 6, 4).state_dict())


def test_family_modules_raise_the_device_error_on_cpu(opm):
    ref, new = models(opm, "openfold", 8, 6, 4, 1)
    msa, mask = inputs(1, 3, 5, 8, "dead", 2)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        new(msa, mask)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        new(msa)  # mask None
    ref, new = models(opm, "boltz", 8, 6, 4, 1)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        new(msa, mask, chunk_size=4)


def openfold3_module(cm, cz, c, seed, proj_bias=False, eps=1e-3):
    return FAM.openfold3_module(dict(msa_dim=cm, pair_dim=cz, hidden_dim=c), seed, proj_bias=proj_bias, eps=eps)


def boltz_module(cm, cz, c, seed):
    return FAM.boltz_module(dict(msa_dim=cm, pair_dim=cz, hidden_dim=c), seed)


@pytest.mark.parametrize("proj_bias", [False, True])
def test_from_openfold_copies_weights_eps_dtype_and_mode(opm, proj_bias):
    real = openfold3_module(16, 12, 8, 3, proj_bias=proj_bias, eps=0.125).bfloat16().train()
    new = opm.from_openfold(real)
    assert isinstance(new, opm.OpenFoldOuterProductMean) and new.training and new.eps == 0.125
    assert (new.linear_1.bias is not None) == proj_bias and new.layer_norm.eps == real.layer_norm.eps
    assert list(new.state_dict()) == list(real.state_dict())
    for k, v in real.state_dict().items():
        assert torch.equal(new.state_dict()[k], v) and new.state_dict()[k].dtype == torch.bfloat16, k
    # both ways: the released module loads the drop-in's state dict
    other = openfold3_module(16, 12, 8, 4, proj_bias=proj_bias).bfloat16()
    other.load_state_dict(new.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), new.state_dict().values()))
    assert (new.c_m, new.c_z, new.c_hidden) == (16, 12, 8)


def test_from_boltz_copies_weights_and_mode(opm):
    real = boltz_module(16, 12, 8, 5).eval()
    new = opm.from_boltz(real)
    assert isinstance(new, opm.BoltzOuterProductMean) and not new.training and new.c_hidden == 8
    assert list(new.state_dict()) == list(real.state_dict())
    assert all(torch.equal(new.state_dict()[k], v) for k, v in real.state_dict().items())
    other = boltz_module(16, 12, 8, 6)
    other.load_state_dict(new.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), new.state_dict().values()))


@pytest.mark.parametrize("family", ["openfold", "boltz"])
@pytest.mark.parametrize("kind", ["dead", "fractional", "bool"])
def test_pair_scales_against_the_references(opm, family, kind):
    """pair_scales' s1, s2 reproduce the references' normalisation: out64 = s1 * (linear(o)) + s2 * bo
    with o the unnormalised outer product, on masks with zero and fractional pair counts."""
    ref, _ = models(opm, family, 12, 10, 6, 7)
    ref = ref.double()
    msa, mask = inputs(2, 5, 9, 12, kind, 8)
    msa = msa.double()
    norm = opm.NORM_OPENFOLD if family == "openfold" else opm.NORM_BOLTZ
    s1, s2 = opm.pair_scales(mask, norm, 1e-3)
    with torch.no_grad():
        want = ref(msa, mask.double())
        names = ("layer_norm", "linear_1", "linear_2", "linear_out") if family == "openfold" else \
                ("norm", "proj_a", "proj_b", "proj_o")
        ln, pa, pb, po = (getattr(ref, n) for n in names)
        m = mask.double()[..., None]
        x = torch.nn.functional.layer_norm(msa, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        a, b = pa(x) * m, pb(x) * m
        o = torch.einsum("bsih,bsjk->bijhk", a, b).reshape(2, 9, 9, -1)
        got = s1[..., None] * (o @ po.weight.t()) + s2[..., None] * po.bias
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    n = torch.einsum("bsi,bsj->bij", mask.double(), mask.double())
    assert (n == 0).any() and (kind == "bool" or ((n > 0) & (n < 1)).any() or kind == "dead")


def _grads_of(model, names, msa, mask, g):
    """fp64 autograd of model: (d msa, {name: grad}) for loss = sum(out * g)."""
    msa = msa.clone().requires_grad_(True)
    out = model(msa, mask)
    (out * g).sum().backward()
    return msa.grad, {n: p.grad for n, p in model.named_parameters() if n in names}


def _fp64_backward_case(opm, family, kind, seed):
    """An fp64 case of outer_product_mean_backward in a pair mode (ct = float64 on the CPU): its positional
    arguments, its norm keywords, the parameter names in its gradients' order, and fp64 autograd through the
    reference (d msa, {name: gradient}). Seeds seed, seed + 1, seed + 2."""
    B, S, N, cm, cz, c = 2, 5, 9, 12, 10, 6
    ref, _ = models(opm, family, cm, cz, c, seed)
    ref = ref.double()
    msa, mask = inputs(B, S, N, cm, kind, seed + 1)
    msa, mask = msa.double(), mask.double()
    g = torch.randn(B, N, N, cz, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    names = dict(openfold=("layer_norm", "linear_1", "linear_2", "linear_out"),
                 boltz=("norm", "proj_a", "proj_b", "proj_o"))[family]
    pnames = [f"{n}.{w}" for n in names for w in ("weight", "bias")]
    d_msa, want = _grads_of(ref, pnames, msa, mask, g)
    ln, pa, pb, po = (getattr(ref, n) for n in names)
    zero = torch.zeros(c, dtype=torch.float64)
    args = (msa, mask, ln.weight, ln.bias, ln.eps, pa.weight, zero if pa.bias is None else pa.bias, pb.weight,
            zero if pb.bias is None else pb.bias, po.weight, po.bias, g)
    norm = dict(norm=opm.NORM_OPENFOLD, norm_eps=ref.eps) if family == "openfold" else dict(norm=opm.NORM_BOLTZ)
    return args, norm, pnames, d_msa, want


def _assert_fp64_grads(got, pnames, d_msa, want):
    torch.testing.assert_close(got[0], d_msa, atol=1e-9, rtol=1e-9)
    for name, gr in zip(pnames, got[1:]):
        if want.get(name) is not None:  # (Boltz: no projection biases)
            torch.testing.assert_close(gr, want[name], atol=1e-9, rtol=1e-9, msg=name)


@pytest.mark.parametrize("family", ["openfold", "boltz"])
@pytest.mark.parametrize("kind", ["dead", "fractional", "ones"])
def test_backward_pair_modes_against_fp64_autograd(opm, family, kind):
    """outer_product_mean_backward's PyTorch path with norm=... in fp64 (ct = float64 on the CPU) equals
    autograd through the reference in fp64, the bias's gradient through the division included, in chunks
    of rows (chunk_bytes small: several chunks)."""
    args, norm, pnames, d_msa, want = _fp64_backward_case(opm, family, kind, 9)
    with torch.no_grad():
        got = opm.outer_product_mean_backward(*args, chunk_bytes=4096, **norm)
    _assert_fp64_grads(got, pnames, d_msa, want)
    # the row mode (norm 0): another dWo, except for Boltz with all-ones masks (pair count = row count)
    with torch.no_grad():
        rows = opm.outer_product_mean_backward(*args)
    assert torch.allclose(rows[-2], got[-2]) == (kind == "ones" and family == "boltz")


class _FakeRowKernels:
    """The row mode's dWo, da / db and d_bo kernels (opm_backward_wo, _ab, _dbo) as their math in PyTorch
    ops in the inputs' dtype, g / d per row i from inv_d; `calls` records which ran."""

    def __init__(self):
        self.calls = []

    def opm_backward_wo(self, a, b, inv_d, g, ops, chunk_bytes, split_j):
        self.calls.append("dWo")
        B, S, N, c = a.shape
        o = torch.einsum("bsih,bsjk->bijhk", a, b).reshape(B, N, N, c * c)
        return torch.einsum("bijz,bijq->zq", g * inv_d.to(g.dtype)[:, :, None, None], o)

    def opm_backward_ab(self, a, b, inv_d, g, wo, ops, out_t):
        self.calls.append("da, db")
        B, S, N, c = a.shape
        G = ((g * inv_d.to(g.dtype)[:, :, None, None]) @ wo).reshape(B, N, N, c, c)
        return torch.einsum("bijhk,bsjk->bsih", G, b), torch.einsum("bijhk,bsih->bsjk", G, a)

    def opm_backward_dbo(self, g):
        self.calls.append("dbo")
        return g.sum((0, 1, 2))


@pytest.mark.parametrize("kernels", [("dWo", "da, db"), ("dWo",), ("da, db",)], ids=["both", "wo", "ab"])
@pytest.mark.parametrize("family", ["openfold", "boltz"])
def test_pair_backward_on_the_row_kernels(opm, monkeypatch, family, kernels):
    """PAIR_BACKWARD "kernels", the default: the row mode's dWo and da, db kernels, faked by their math (g / d
    per row), handed s1 g and a row scale of 1, alone or together (the rest in chunks; dbo by ATen), give fp64
    autograd's gradients through the reference for both pair modes (fractional mask, a dead row and column); the
    fakes ran as asked, and "chunks" calls none of them."""
    fake = _FakeRowKernels()
    monkeypatch.setattr(opm, "_ext", fake)
    args, norm, pnames, d_msa, want = _fp64_backward_case(opm, family, "fractional", 12)
    kw = dict(chunk_bytes=4096, rows_kernel=False, ln_kernel=False, wo_kernel="dWo" in kernels,
              ab_kernel="da, db" in kernels, **norm)
    assert opm.PAIR_BACKWARD == "kernels"
    with torch.no_grad():
        with opm.pair_backward("chunks"):
            opm.outer_product_mean_backward(*args, **kw)
        assert fake.calls == [], "chunks ran a row-mode kernel"
        parts = []
        got = opm.outer_product_mean_backward(*args, parts=parts, **kw)
    assert fake.calls == list(kernels) and parts == list(kernels)
    assert opm.PAIR_BACKWARD == "kernels"
    _assert_fp64_grads(got, pnames, d_msa, want)
    with pytest.raises(ValueError, match="'chunks' or 'kernels'"):
        opm.pair_backward("fused")
    monkeypatch.setattr(opm, "PAIR_BACKWARD", "kernel")  # assigned directly: checked where it is read
    with pytest.raises(ValueError, match="PAIR_BACKWARD must be 'chunks' or 'kernels', got 'kernel'"):
        opm.outer_product_mean_backward(*args, **kw)


@pytest.fixture
def opm_fake(opm, monkeypatch):
    """opm with its CUDA extension replaced by tests/test_training.py's _FakeOpmExtension (the kernels'
    math in float32 PyTorch ops on the CPU, the pair modes included): the modules' wiring, dtypes and
    autograd on the CPU."""
    fake = harness.load_module("tests/test_training.py")._FakeOpmExtension(opm._ext)
    monkeypatch.setattr(opm, "_ext", fake)
    return opm, fake


@pytest.mark.parametrize("family, kw", [("openfold", dict(proj_bias=True)), ("openfold", dict(proj_bias=False, eps=0.25)),
                                        ("boltz", {})], ids=["af2_bias", "af3_eps", "boltz"])
@pytest.mark.parametrize("c", [5, 32])
def test_family_modules_wiring_on_the_cpu(opm_fake, family, kw, c):
    """Forward and gradients of the family modules (extension faked) equal autograd through the reference
    in fp32: the norm and eps handed to the extension, absent projection biases, hidden_dim 32 taking a, b
    from the forward ("a, b" in last_backward); OpenFold's mask None (all ones) and leading dims."""
    opm, fake = opm_fake
    cm, cz = 12, 10
    ref, new = models(opm, family, cm, cz, c, 60, **kw)
    new.train()
    msa, mask = inputs(2, 4, 7, cm, "fractional", 61)
    g = torch.randn(2, 7, 7, cz, generator=torch.Generator().manual_seed(62))
    names = [n for n, _ in ref.named_parameters()]
    calls = [(msa, mask)] + ([(msa, None)] if family == "openfold" else [])
    for x, k in calls:
        d_want, w_want = _grads_of(ref, names, x, k, g)
        d_got, w_got = _grads_of(new, names, x, k, g)
        ref.zero_grad()
        new.zero_grad()
        torch.testing.assert_close(d_got, d_want, atol=1e-5, rtol=1e-4)
        for n in names:
            torch.testing.assert_close(w_got[n], w_want[n], atol=1e-5, rtol=1e-4, msg=n)
        assert new.last_backward == (("a, b",) if c == 32 else ())
    norm = (1, float(kw.get("eps", 1e-3))) if family == "openfold" else (2, 1.0)
    assert all(r[:2] == norm for r in fake.norms) and fake.norms
    if family == "openfold":  # leading dims: none, and two
        with torch.no_grad():
            want = ref(msa, mask)
            torch.testing.assert_close(new(msa[0], mask[0]), want[0], atol=1e-5, rtol=1e-4)
            got = new(msa[None].expand(3, *msa.shape), mask[None].expand(3, *mask.shape))
            assert got.shape == (3,) + want.shape
            torch.testing.assert_close(got[2], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["openfold", "boltz"])
def test_family_modules_output_dtype(opm_fake, family, dtype):
    """A 16-bit module and input go to the extension in that dtype and come back in it, as the released
    modules return it; a module of another dtype than the input raises with the family's names."""
    opm, fake = opm_fake
    ref, new = models(opm, family, 12, 10, 5, 63)
    msa, mask = inputs(1, 3, 6, 12, "dead", 64)
    with torch.no_grad():
        out = new.to(dtype)(msa.to(dtype), mask)
    assert out.dtype == dtype and fake.dtypes[-1] == {dtype}
    with torch.no_grad(), pytest.raises(RuntimeError, match="norm.weight must be float32"):
        new(msa, mask)


@pytest.mark.parametrize("family", ["openfold3", "boltz"])
def test_converted_real_module_on_the_cpu(opm_fake, family):
    """from_openfold / from_boltz of a released module (extension faked): its outputs and gradients in fp32,
    the released forward's extra arguments accepted."""
    opm, _ = opm_fake
    cm, cz, c = 16, 12, 8
    real = openfold3_module(cm, cz, c, 65) if family == "openfold3" else boltz_module(cm, cz, c, 65)
    new = opm.from_openfold(real) if family == "openfold3" else opm.from_boltz(real)
    msa, mask = inputs(2, 5, 9, cm, "dead", 66)
    g = torch.randn(2, 9, 9, cz, generator=torch.Generator().manual_seed(67))
    names = [n for n, _ in real.named_parameters()]
    call = dict(chunk_size=4, inplace_safe=False) if family == "openfold3" else dict(chunk_size=4)
    outs = []
    for model in (real, new):
        x = msa.clone().requires_grad_(True)
        out = model(x, mask, **call)
        (out * g).sum().backward()
        outs.append((out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}))
    (o1, d1, w1), (o2, d2, w2) = outs
    torch.testing.assert_close(o2, o1, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(d2, d1, atol=1e-5, rtol=1e-4)
    for n in names:
        torch.testing.assert_close(w2[n], w1[n], atol=1e-4, rtol=1e-4, msg=n)


def test_harness_judges_the_family_class_of_the_reference(run_harness):
    """A file with ModelNew and FAMILIES: each reference judges its own class (pure PyTorch on the CPU),
    the default reference ModelNew; a wrong FAMILIES entry fails against its reference only."""
    good = os.path.join(SOL, "outer_product_mean_families.py")
    for ref in ("reference/outer_product_mean_openfold.py", "reference/outer_product_mean_boltz.py",
                "reference/outer_product_mean.py"):
        code, out = run_harness(good, "--ref", ref, *CPU, "--shapes", "seed,awkward_33")
        assert code == harness.EXIT_OK, out[-3000:]
        assert ("judging the solution's FAMILIES" in out) == ("_" in os.path.basename(ref)[len("outer_product_mean"):])
    wrong = os.path.join(SOL, "outer_product_mean_families_wrong.py")
    code, out = run_harness(wrong, "--ref", "reference/outer_product_mean_boltz.py", *CPU, "--shapes", "seed,awkward_33")
    assert code == harness.EXIT_WRONG and "not allclose" in out, out[-3000:]
    code, out = run_harness(wrong, "--ref", "reference/outer_product_mean_openfold.py", *CPU, "--shapes", "seed")
    assert code == harness.EXIT_OK, out[-3000:]


def _row_scale_exponent(mx, inv, clamp):
    """fs of opm_outer_wg_kernel's 16-bit kPair staging, in numpy (float32 products, uint32 bit fields): with clamp,
    the kernel's, the row max mx clamped to 2^-112 as an integer max; without, the cap it stands for, min(253,
    380 - e(inv)), computed per row."""
    import numpy as np
    mx, inv = np.asarray(mx, np.float32), np.asarray(inv, np.float32)
    if clamp:
        mx = np.maximum(mx.view(np.uint32), np.uint32(15 << 23)).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        e = ((mx * inv).view(np.uint32) >> 23 & 0xFF).astype(np.int64)
    fmax = 253 if clamp else np.minimum(253, 380 - (inv.view(np.uint32) >> 23 & 0xFF).astype(np.int64))
    return np.minimum(fmax, np.maximum(1, 268 - e))


def test_pair_row_scale_clamp_equals_the_cap():
    """The 16-bit kPair staging's clamp gives every row the capped fs: rows of at least 2^-112 keep their exponent,
    a row below 2^-112 (zero, subnormal or normal) takes the cap either way. Row maxima drawn over the whole float32
    range, scales over 2^-41..2^40 (s1 = 1 / (n + eps) up to 1 / eps, 0 for pairs past N, negative for negative mask
    weights, inf for eps 0), and the edges: 0, the smallest subnormal, 2^-112 and its neighbours, 2^-126, 1, the
    largest float, inf, NaN."""
    import numpy as np
    rng = np.random.default_rng(7)
    n = 400_000
    mx = np.ldexp(rng.random(n, dtype=np.float32) + np.float32(0.5), rng.integers(-160, 128, n)).astype(np.float32)
    inv = np.ldexp(rng.random(n, dtype=np.float32) + np.float32(0.5), rng.integers(-40, 40, n)).astype(np.float32)
    inv[rng.random(n) < 0.1] *= -1
    edges = np.array([0.0, np.float32(2.0 ** -149), np.float32(2.0 ** -112), np.nextafter(np.float32(2.0 ** -112), 0),
                      np.nextafter(np.float32(2.0 ** -112), 1), np.float32(2.0 ** -126), 1.0, np.finfo(np.float32).max,
                      np.inf, np.nan], np.float32)
    scales = np.array([0.0, 2.0 ** -20, 2.0 ** -14, 1e-3, 0.5, 1.0, 1000.0, 1e8, 2.0 ** 100, np.inf, -1000.0],
                      np.float32)
    mx = np.concatenate([mx, np.repeat(edges, scales.size)])
    inv = np.concatenate([inv, np.tile(scales, edges.size)])
    old, new = _row_scale_exponent(mx, inv, False), _row_scale_exponent(mx, inv, True)
    assert np.array_equal(old, new), (mx[old != new][:5], inv[old != new][:5])
    # the property the cap exists for: inv times the row's scale 2^(fs - 127) stays finite wherever inv is
    fin = np.isfinite(inv)
    with np.errstate(over="ignore"):
        scale = np.ldexp(np.float32(1), new[fin] - 127).astype(np.float32)
        assert np.isfinite(inv[fin] * scale).all()


def test_pair_settings_read_0_or_1_from_the_environment(opm, monkeypatch):
    """_env_flag (OPM_PAIR_G_KERNEL, OPM_PAIR_COUNTS_DMMA, OPM_PAIR_COUNTS_RING, OPM_PAIR_COUNTS_HMMA,
    OPM_LOW_MEMORY_BACKWARD, OPM_LOW_MEMORY_SPLIT_J): unset -> the default, "1" / "0" -> on / off, any other value
    raises naming the variable; all six default to on; _pair_counts maps the counts' three to
    the kernel code (0 FMA, 1 DMMA, 2 the ring, 3 the ring on HMMA); an attribute set to anything but True / False
    raises."""
    name = "OPM_TEST_FLAG"
    monkeypatch.delenv(name, raising=False)
    assert opm._env_flag(name, True) is True and opm._env_flag(name, False) is False
    monkeypatch.setenv(name, "0")
    assert opm._env_flag(name, True) is False
    monkeypatch.setenv(name, "1")
    assert opm._env_flag(name, False) is True
    for bad in ("true", "", "on", "2"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            opm._env_flag(name, True)
    if not {"OPM_PAIR_G_KERNEL", "OPM_PAIR_COUNTS_DMMA", "OPM_PAIR_COUNTS_RING", "OPM_PAIR_COUNTS_HMMA",
            "OPM_LOW_MEMORY_BACKWARD"} & set(os.environ):
        assert opm.PAIR_G_KERNEL is True and opm.PAIR_COUNTS_DMMA is True and opm.PAIR_COUNTS_RING is True
        assert opm.PAIR_COUNTS_HMMA is True and opm.LOW_MEMORY_BACKWARD is True
    if "OPM_LOW_MEMORY_SPLIT_J" not in os.environ:
        assert opm.LOW_MEMORY_SPLIT_J is True
    for dmma, ring, hmma, code in ((False, False, True, 0), (False, True, True, 0), (True, False, True, 1),
                                   (True, True, False, 2), (True, True, True, 3)):
        monkeypatch.setattr(opm, "PAIR_COUNTS_DMMA", dmma)
        monkeypatch.setattr(opm, "PAIR_COUNTS_RING", ring)
        monkeypatch.setattr(opm, "PAIR_COUNTS_HMMA", hmma)
        assert opm._pair_counts() == code
    for attr in ("PAIR_COUNTS_DMMA", "PAIR_COUNTS_RING", "PAIR_COUNTS_HMMA", "PAIR_G_KERNEL", "LOW_MEMORY_BACKWARD",
                 "LOW_MEMORY_SPLIT_J"):
        monkeypatch.setattr(opm, attr, "0")  # a string, not a bool: raises rather than reading as on
        with pytest.raises(ValueError, match=attr):
            opm._flag(attr)
        monkeypatch.setattr(opm, attr, True)
    monkeypatch.setattr(opm, "PAIR_COUNTS_RING", 1)
    with pytest.raises(ValueError, match="PAIR_COUNTS_RING"):
        opm._pair_counts()


def test_kernel_file_maps_the_reference_families(opm):
    """The harness judges outer_product_mean.py's FAMILIES[ref.FAMILY] for the two family references."""
    for refmod in (RO, RB):
        sol = harness.judged_solution(refmod, opm, dict(notes=[]))
        assert sol.ModelNew is opm.FAMILIES[refmod.FAMILY] and sol.module is opm
    assert harness.judged_solution(harness.load_module("reference/outer_product_mean.py"), opm, dict(notes=[])) is opm


# ---------------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------------
def _poison(nbytes):
    """Fill nbytes of the caching allocator's free memory with NaN (the next allocations of that size
    reuse it): an element a kernel leaves unwritten reads NaN."""
    t = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del t


def _ref64(ref, msa, mask):
    m64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        return m64(msa.double(), mask.double() if mask.is_floating_point() else mask)


def _variants(opm):
    return [v for v in opm.ModelNew.VARIANTS]  # "auto" and every forced variant that runs here


def _judge(got, want, want64, dtype, what):
    assert got.dtype == dtype and got.shape == want64.shape, what
    assert not torch.isnan(got).any(), f"{what}: NaN (an unwritten or wrong element)"
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want64, atol=1e-4, rtol=1e-4, msg=what)
        return
    fin = torch.isfinite(want64)
    err = (got.double() - want64)[fin].abs().max().item()
    e_ref = (want.double() - want64)[fin].abs().max().item()
    top = want64[fin].abs().max().item()
    assert err <= max(HALF_FACTOR * e_ref, 4 * HALF_ULP[dtype] * top), \
        f"{what}: err {err:.3e} vs the reference's {e_ref:.3e} (top {top:.3e})"


CASES = [(1, 40, 37, 64, 128, 32), (2, 7, 21, 20, 24, 32), (1, 3, 33, 40, 7, 16), (1, 64, 48, 128, 128, 32)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kind", ["dead", "fractional", "bool"])
@pytest.mark.parametrize("family", ["openfold", "boltz"])
@pytest.mark.parametrize("case", CASES, ids=[f"S{c[1]}_N{c[2]}_cz{c[4]}_c{c[5]}" for c in CASES])
def test_every_variant_against_fp64(opm, family, kind, dtype, case):
    """Every variant that runs here ("auto" included), with the fused and the unfused pair epilogue
    (PAIR_EPILOGUE), against the reference evaluated in fp64 on the same (dtype-rounded) parameters
    and inputs: fp32 within 1e-4; fp16 / bf16 within HALF_FACTOR x the reference's own error in that
    dtype (or 4 half-ulps of the largest output). pair_dim 7 takes the epilogue's one-element path (24: vectors),
    hidden_dim 16 the padded one; the inputs are checked unchanged."""
    B, S, N, cm, cz, c = case
    ref, new = models(opm, family, cm, cz, c, 20 + S)
    ref, new = ref.to("cuda", dtype), new.to("cuda", dtype)
    msa, mask = inputs(B, S, N, cm, kind, 21 + N)
    msa, mask = msa.to("cuda", dtype), mask.cuda() if kind == "bool" else mask.to("cuda", dtype)
    want64 = _ref64(ref, msa, mask)
    with torch.no_grad():
        want = ref(msa, mask)
    msa0, mask0 = msa.clone(), mask.clone()
    for fused in (False, True):
        for v in _variants(opm):
            if v == "outer_wg" and c > 32:
                continue
            new.variant = v
            _poison(2 * want64.numel() * 8)
            with torch.no_grad(), opm.pair_epilogue("fused" if fused else "unfused"):
                got = new(msa, mask)
            torch.cuda.synchronize()
            assert v == "auto" or new.last_variant == v
            _judge(got, want, want64, dtype, f"{family} {kind} {v} fused={fused} {case}")
    assert torch.equal(msa, msa0) and torch.equal(mask, mask0), "inputs changed"


@gpu
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("family, norm", [("openfold", 1), ("boltz", 2)])
def test_pair_counts_on_dmma_against_fp64(opm, family, norm, mask_dtype):
    """opm_pair_scale(..., dmma=True), the pair counts of float masks on the fp64 tensor cores (bool masks: the int64
    kernel either way), against pair_scales in fp64 and the fp64 FMA kernel: s1 within one float32 ulp, s2 as well
    (exactly 1 for Boltz); all-ones masks (integer counts) bit-equal to the FMA kernel. Fractional masks with zero rows,
    B = 2, S = 70 and N = 45 (partial chunks and tiles), S = 0, and N = 1."""
    gen = torch.Generator().manual_seed(norm)
    for B, S, N in ((2, 70, 45), (1, 0, 9), (1, 5, 1), (1, 130, 64)):
        m = torch.rand(B, S, N, generator=gen)
        m[:, :, :1] = 0.0
        m = (m > 0.3) if mask_dtype == torch.bool else m.to(mask_dtype)
        got = opm._ext.opm_pair_scale(m.cuda(), norm, 1e-3, True)
        fma = opm._ext.opm_pair_scale(m.cuda(), norm, 1e-3, False)
        s1, s2 = opm.pair_scales(m.cuda(), norm, 1e-3)
        want = torch.stack([s1, s2], -1)
        assert got.shape == (B, N, N, 2) and got.dtype == torch.float32
        for name, ref in (("fp64", want), ("fma", fma.double())):
            err = ((got.double() - ref).abs() / ref.abs().clamp(min=1e-30)).max().item() if got.numel() else 0.0
            assert err <= 2.0 ** -23, (name, B, S, N, err)
        ones = torch.ones(B, S, N, dtype=mask_dtype, device="cuda")
        assert torch.equal(opm._ext.opm_pair_scale(ones, norm, 1e-3, True),
                           opm._ext.opm_pair_scale(ones, norm, 1e-3, False))


def _kernels_of(fn):
    """The names of the CUDA kernels fn() launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@gpu
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pair_counts_ring_equal_to_dmma(opm, mask_dtype):
    """opm_pair_scale(..., 2): the DMMA kernel's sums fed by the cp.async ring, bit-equal to opm_pair_scale(..., 1) for
    fractional masks with zero columns; the ring kernel runs where N times the element size is a multiple of 16
    bytes (partial stages, partial tiles, S = 0, several tiles per block at N = 768), the DMMA kernel elsewhere (N =
    45, and a mask at an odd element offset)."""
    gen = torch.Generator().manual_seed(7)
    ve = 16 // torch.empty((), dtype=mask_dtype).element_size()
    for B, S, N in ((2, 70, 48), (1, 130, 64), (1, 3, 8), (1, 0, 16), (1, 5, 768), (2, 70, 45)):
        m = torch.rand(B, S, N, generator=gen)
        m[:, :, :1] = 0.0
        m = m.to("cuda", mask_dtype)
        want = opm._ext.opm_pair_scale(m, 1, 1e-3, 1)
        names = _kernels_of(lambda: opm._ext.opm_pair_scale(m, 1, 1e-3, 2))
        got = opm._ext.opm_pair_scale(m, 1, 1e-3, 2)
        assert torch.equal(got, want), (B, S, N)
        ring = any("opm_pair_scale_ring_kernel" in n for n in names)
        assert ring == (N % ve == 0), (B, S, N, names)
    store = torch.rand(1 + 2 * 40 * 64, generator=gen).to("cuda", mask_dtype)
    m = store[1:].view(2, 40, 64)  # one element off the storage's 16-byte alignment
    names = _kernels_of(lambda: opm._ext.opm_pair_scale(m, 2, 1e-3, 2))
    assert not any("ring" in n for n in names) and any("opm_pair_scale_dmma_kernel" in n for n in names), names
    assert torch.equal(opm._ext.opm_pair_scale(m, 2, 1e-3, 2), opm._ext.opm_pair_scale(m, 2, 1e-3, 1))


@gpu
@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.bfloat16])
def test_pair_counts_hmma_against_dmma(opm, mask_dtype):
    """opm_pair_scale(..., 3): 16-bit masks' counts on HMMA (the ring kernel's HMMA instance) equal to the DMMA
    kernel's for 0 / 1 masks with zero columns (their sums are exact) and within fp32 summation error ((S + 4) 2^-24
    relative in s1) for fractional masks, OpenFold and Boltz, partial tiles and stages, S = 0 and grid-strided tiles
    (N = 768); the DMMA kernel where the ring cannot run (N = 45, a mask off 16-byte alignment); float32 masks on the
    ring's DMMA instance, bit-equal to opm_pair_scale(..., 2)."""
    gen = torch.Generator().manual_seed(11)
    for B, S, N in ((2, 70, 48), (1, 130, 64), (1, 3, 8), (1, 0, 16), (1, 517, 768), (2, 70, 45)):
        for binary in (True, False):
            m = torch.rand(B, S, N, generator=gen)
            m = (m < 0.7).float() if binary else m
            m[:, :, :1] = 0.0
            m = m.to("cuda", mask_dtype)
            for norm in (1, 2):
                want = opm._ext.opm_pair_scale(m, norm, 1e-3, 1)
                names = _kernels_of(lambda: opm._ext.opm_pair_scale(m, norm, 1e-3, 3))
                got = opm._ext.opm_pair_scale(m, norm, 1e-3, 3)
                hmma = any("opm_pair_scale_ring_kernel<" in n and ", true>" in n for n in names)
                assert hmma == (N % 8 == 0), (B, S, N, names)
                if binary or not hmma:
                    assert torch.equal(got, want), (B, S, N, binary, norm)
                    continue
                for k in (0, 1) if norm == 1 else (0,):  # OpenFold: s2 = s1; Boltz: s2 = 1
                    err = ((got[..., k] - want[..., k]).abs() / want[..., k]).max().item()
                    assert err <= (S + 4) * 2.0 ** -24, (B, S, N, norm, k, err)
                if norm == 2:
                    assert bool((got[..., 1] == 1).all())
    store = torch.rand(1 + 2 * 40 * 64, generator=gen).to("cuda", mask_dtype)
    m = store[1:].view(2, 40, 64)  # one element off the storage's 16-byte alignment
    names = _kernels_of(lambda: opm._ext.opm_pair_scale(m, 2, 1e-3, 3))
    assert not any("ring" in n for n in names) and any("opm_pair_scale_dmma_kernel" in n for n in names), names
    m = torch.rand(1, 70, 64, generator=gen).cuda()
    names = _kernels_of(lambda: opm._ext.opm_pair_scale(m, 1, 1e-3, 3))
    assert any("opm_pair_scale_ring_kernel<float, false>" in n for n in names), names
    assert torch.equal(opm._ext.opm_pair_scale(m, 1, 1e-3, 3), opm._ext.opm_pair_scale(m, 1, 1e-3, 2))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cz", [128, 12])
def test_pair_grad_kernel_against_its_math(opm, dtype, cz):
    """opm_backward_pair_g, the pair modes' one pass over grad_out: gk = s1 g (the product in fp32, rounded
    once) bit-equal to ATen's (g.float() * s1).to(...) in float32 and in g's type; dbo (float32) within fp32
    summation error of the fp64 sums of s1 g (OpenFold) and of g (Boltz); for a contiguous g, a transposed view
    and a copy off 16-byte alignment, at 2 x 37 x 37 rows (not a multiple of a block's); a repeat call equal."""
    gen = torch.Generator().manual_seed(cz)
    g0 = torch.randn(2, 37, 37, cz, generator=gen).to("cuda", dtype)
    s0 = (torch.rand(2, 37, 37, generator=gen) * 3).cuda()
    off = torch.empty(g0.numel() + 8, dtype=dtype, device="cuda")[1:1 + g0.numel()].view_as(g0).copy_(g0)
    for g, s1 in ((g0, s0), (g0.transpose(1, 2), s0.transpose(1, 2)), (off, s0)):
        for s2_is_s1 in (True, False):
            for to_float in (True, False):
                gk, dbo = opm._ext.opm_backward_pair_g(g, s1, s2_is_s1, to_float)
                k_dtype = torch.float32 if to_float else dtype
                want = (g.float() * s1[..., None]).to(k_dtype)
                assert gk.dtype == k_dtype and gk.shape == g.shape and torch.equal(gk, want)
                w = g.double() * (s1.double()[..., None] if s2_is_s1 else 1.0)
                err = (dbo.double() - w.sum((0, 1, 2))).abs()
                assert dbo.dtype == torch.float32 and bool((err <= 1e-5 * w.abs().sum((0, 1, 2))).all()), err.max()
                gk2, dbo2 = opm._ext.opm_backward_pair_g(g, s1, s2_is_s1, to_float)
                assert torch.equal(gk2, gk) and torch.equal(dbo2, dbo)


@gpu
@pytest.mark.parametrize("pb", ["chunks", "kernels"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kind", ["dead", "fractional"])
@pytest.mark.parametrize("family", ["openfold", "boltz"])
def test_backward_against_fp64(opm, family, kind, dtype, pb):
    """The training backward of both pair modes (autograd through the module: "auto"'s forward, the
    kernels for a, b and the LayerNorm part where they run, dWo and da, db in PyTorch chunks or, with
    pair_backward("kernels"), in the row mode's kernels on s1 g where they run) against fp64 autograd of
    the reference: fp32 within 1e-4 of the largest gradient; fp16 / bf16 at most
    harness.GRAD_FP64_FACTOR x the reference's own error in that dtype (or 4 half-ulps)."""
    B, S, N, cm, cz, c = 1, 40, 37, 256, 128, 32
    ref, new = models(opm, family, cm, cz, c, 30)
    ref, new = ref.to("cuda", dtype).train(), new.to("cuda", dtype).train()
    msa, mask = inputs(B, S, N, cm, kind, 31)
    msa, mask = msa.to("cuda", dtype), mask.to("cuda", dtype)
    g = torch.randn(B, N, N, cz, generator=torch.Generator().manual_seed(32)).to("cuda", dtype)
    names = [n for n, _ in ref.named_parameters()]
    r64 = copy.deepcopy(ref).double()
    d64, w64 = _grads_of(r64, names, msa.double(), mask.double(), g.double())
    dref, wref = _grads_of(ref, names, msa, mask, g)
    with opm.pair_backward(pb):
        dnew, wnew = _grads_of(new, names, msa, mask, g)
    ran = set(new.last_backward)
    if pb == "chunks":
        assert "dWo" not in ran and "da, db" not in ran, ran
    elif opm._ab_kernel_runs(msa, c, cz, torch.float32):
        assert {"dWo", "da, db"} <= ran, ran
    for n in ["msa"] + names:
        got, want, want64 = (dnew, dref, d64) if n == "msa" else (wnew[n], wref[n], w64[n])
        assert got is not None and got.dtype == dtype and not torch.isnan(got).any(), n
        scale = want64.abs().max().item()
        err = (got.double() - want64).abs().max().item()
        if dtype == torch.float32:
            assert err <= 1e-4 * max(scale, 1e-3), f"{n}: err {err:.3e} (largest {scale:.3e})"
        else:
            e_ref = (want.double() - want64).abs().max().item()
            assert err <= max(harness.GRAD_FP64_FACTOR * e_ref, 4 * HALF_ULP[dtype] * scale), \
                f"{n}: err {err:.3e} vs the reference's {e_ref:.3e} (largest {scale:.3e})"


WALK_CASES = [(1, 40, 37, 64, 128, 32), (2, 7, 21, 20, 24, 32), (3, 5, 200, 64, 128, 32), (1, 130, 45, 64, 200, 32)]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["dead", "fractional"])
@pytest.mark.parametrize("family", ["openfold", "boltz"])
@pytest.mark.parametrize("case", WALK_CASES, ids=[f"B{c[0]}_S{c[1]}_N{c[2]}_cz{c[4]}" for c in WALK_CASES])
def test_outer_wg_pair_instance_walking_tiles(opm, family, kind, dtype, case):
    """outer_wg's 16-bit kPair instance (each tile's scales addressed from one base per tile, the row max clamped to
    2^-112, s2 bo formed during q = 0's phase B) within the fp64 check of test_every_variant_against_fp64: one tile
    per block, blocks walking several tiles (N 200, B 3: 14-15 tiles per block on 132 SMs), partial tiles (N 37, 21,
    45: rows and columns past N), two z chunks (pair_dim 200), S 130 (five phase-A stages); two calls in a row give
    the same output bit for bit."""
    B, S, N, cm, cz, c = case
    ref, new = models(opm, family, cm, cz, c, 60 + S)
    ref, new = ref.to("cuda", dtype), new.to("cuda", dtype)
    new.variant = "outer_wg"
    msa, mask = inputs(B, S, N, cm, kind, 61 + N)
    msa, mask = msa.to("cuda", dtype), mask.to("cuda", dtype)
    want64 = _ref64(ref, msa, mask)
    with torch.no_grad():
        want = ref(msa, mask)
    got = []
    for _ in range(2):
        _poison(2 * want64.numel() * 8)
        with torch.no_grad(), opm.pair_epilogue("fused"):
            got.append(new(msa, mask))
        torch.cuda.synchronize()
        assert new.last_variant == "outer_wg"
    _judge(got[0], want, want64, dtype, f"{family} {kind} {case}")
    assert torch.equal(got[0], got[1]), f"{family} {kind} {case}: two calls differ"


@gpu
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_fp16_overflow_of_a_fully_masked_pair(opm, fused):
    """OpenFold mode in fp16: a fully masked pair is (0 + bo) / eps = 1000 bo. Where |1000 bo[z]| rounds
    above 65504 the kernels return inf with bo's sign (IEEE overflow of the one rounding to fp16), as
    the fp16 reference does; elsewhere 1000 bo in fp16. Every variant, both epilogues."""
    B, S, N, cm, cz, c = 1, 16, 20, 32, 64, 32
    ref, new = models(opm, "openfold", cm, cz, c, 40)
    with torch.no_grad():
        ref.linear_out.bias[:8] = torch.tensor([100.0, -100.0, 70.0, -70.0, 65.0, 1.0, -2.5, 0.0])
    ref, new = ref.cuda().half(), new.cuda().half()
    new.load_state_dict(ref.state_dict())
    msa, mask = inputs(B, S, N, cm, "dead", 41)
    msa, mask = msa.cuda().half(), mask.cuda().half()  # position 2 masked in every sequence
    with torch.no_grad():
        want = ref(msa, mask)
    bo = ref.linear_out.bias.float()
    expect = (bo.double() * 1000).half()  # 1000 bo (exact in fp32) rounded once to fp16
    assert torch.isinf(expect[:4]).all() and torch.isfinite(expect[4:]).all()
    for v in _variants(opm):
        new.variant = v
        with torch.no_grad(), opm.pair_epilogue("fused" if fused else "unfused"):
            got = new(msa, mask)
        for i, j in ((2, 5), (7, 2), (2, 2), (0, 2), (4, 2)):  # outer_wg: (0, 2), (4, 2) in its threads' row 0
            assert torch.equal(got[0, i, j], expect.cuda()), (v, i, j, got[0, i, j, :8])
            assert torch.equal(torch.isinf(got[0, i, j]), torch.isinf(want[0, i, j])), (v, i, j)
        assert torch.isfinite(got[0, :2, 3:]).all()



@gpu
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_bf16_tiny_rows_with_large_pair_scales(opm, fused):
    """OpenFold mode in bf16 where s1 = 1 / (count + eps) is about 506 and every O row is below 2^-121
    (projections of 2^-57 with mask weights 2^-5; every product a b stays a normal float): the 16-bit
    kernels' power-of-two row scale times s1 must stay finite (a cap of 2^126 alone gives inf). The
    linear projections are zero and their biases of magnitude 1-2 times 2^-57, so each product lies in
    [2^-124, 2^-122], and the output bias is zero: the output, about 2^-112, is all outer product. Both epilogues
    (outer_wg's fused one: these rows, below 2^-112, take the clamp, which gives the cap)."""
    B, S, N, cm, cz, c = 1, 3, 20, 32, 64, 32
    ref, new = models(opm, "openfold", cm, cz, c, 50)
    g = torch.Generator().manual_seed(51)
    with torch.no_grad():
        for lin in (ref.linear_1, ref.linear_2):
            lin.weight.zero_()
            sign = torch.where(torch.rand(c, generator=g) < 0.5, -1.0, 1.0)
            lin.bias.copy_(sign * (1 + torch.rand(c, generator=g)) * 2.0 ** -57)
        ref.linear_out.bias.zero_()
    ref, new = ref.cuda().bfloat16(), new.cuda().bfloat16()
    new.load_state_dict(ref.state_dict())
    msa, _ = inputs(B, S, N, cm, "ones", 52)
    mask = torch.zeros(B, S, N)
    mask[:, 0] = 2.0 ** -5  # pair count 2^-10 everywhere
    msa, mask = msa.cuda().bfloat16(), mask.cuda().bfloat16()
    want64 = _ref64(ref, msa, mask)
    assert 2.0 ** -120 < want64.abs().max().item() < 2.0 ** -100
    with torch.no_grad():
        want = ref(msa, mask)
    for v in _variants(opm):
        new.variant = v
        _poison(2 * want64.numel() * 8)
        with torch.no_grad(), opm.pair_epilogue("fused" if fused else "unfused"):
            got = new(msa, mask)
        torch.cuda.synchronize()
        assert torch.isfinite(got).all(), (v, fused)
        _judge(got, want, want64, torch.bfloat16, f"tiny rows {v} fused={fused}")

class Stack(torch.nn.Module):
    """A small stack around an outer product mean: msa -> Linear -> OPM -> LayerNorm -> Linear."""

    def __init__(self, opm_layer, cm, cz):
        super().__init__()
        self.inp = torch.nn.Linear(cm, cm)
        self.opm = opm_layer
        self.ln = torch.nn.LayerNorm(cz)
        self.out = torch.nn.Linear(cz, cz)

    def forward(self, msa, mask, call):
        return self.out(self.ln(self.opm(self.inp(msa), mask, **call)))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["openfold3", "boltz"])
def test_converted_real_module_in_a_stack(opm, family, dtype):
    """The released module (openfold3 0.5.0 / boltz 2.2.1, skipped when not installed) inside a small
    stack, replaced by from_openfold / from_boltz: the same outputs and gradients (every parameter of
    the stack and the msa) in fp32 within 1e-4 (relative to each tensor's largest value); in bf16 both
    within test_opm_families.BF16_TOL-scaled error of the stack evaluated in fp64."""
    cm, cz, c = 64, 128, 32
    real = openfold3_module(cm, cz, c, 50) if family == "openfold3" else boltz_module(cm, cz, c, 50)
    stack = Stack(real, cm, cz)
    randomise(stack.inp, 51)
    stack = stack.to("cuda", dtype).train()
    mine = copy.deepcopy(stack)
    mine.opm = opm.from_openfold(mine.opm) if family == "openfold3" else opm.from_boltz(mine.opm)
    msa, mask = inputs(2, 24, 30, cm, "fractional", 52)
    msa, mask = msa.to("cuda", dtype), mask.to("cuda", dtype)
    call = dict(chunk_size=4)  # accepted by both (Boltz chunks only in eval mode)
    g = torch.randn(2, 30, 30, cz, generator=torch.Generator().manual_seed(53)).to("cuda", dtype)

    def run(model, x, k, gg):
        x = x.clone().requires_grad_(True)
        out = model(x, k, call)
        (out * gg).sum().backward()
        return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}

    o_real, d_real, w_real = run(stack, msa, mask, g)
    o_mine, d_mine, w_mine = run(mine, msa, mask, g)
    assert o_mine.dtype == o_real.dtype == dtype and set(w_mine) == set(w_real)
    pairs = [("out", o_mine, o_real), ("msa", d_mine, d_real)] + [(n, w_mine[n], w_real[n]) for n in w_real]
    if dtype == torch.float32:
        for n, a, b in pairs:
            tol = 1e-4 * max(b.abs().max().item(), 1e-6)
            assert (a - b).abs().max().item() <= tol, (n, (a - b).abs().max().item(), tol)
        return
    s64 = copy.deepcopy(stack).double()
    o64, d64, w64 = run(s64, msa.double(), mask.double(), g.double())
    ref64 = {"out": o64, "msa": d64, **w64}
    for n, a, b in pairs:
        want = ref64[n]
        top = want.abs().max().item()
        err_mine = (a.double() - want).abs().max().item()
        err_real = (b.double() - want).abs().max().item()
        assert err_mine <= max(harness.GRAD_FP64_FACTOR * err_real, 3e-2 * top), (n, err_mine, err_real, top)
