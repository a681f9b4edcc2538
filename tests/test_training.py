"""The backwards of both kernel files (`contact_map_backward`, `outer_product_mean_backward`: PyTorch
ops, chunked recomputation) against the reference modules' autograd, on the CPU.

gradcheck at tiny shapes in fp64 (forward: the reference math; backward: ours), fp64 and fp32
gradients at larger shapes against fp64 autograd (fp32: at most 2x the fp32 reference's own error),
fp16 / bf16 gradients in their own dtype, and the memory a backward allocates (no (B, N, N, c*c) or
(B, N, N, hidden) tensor)."""
import copy
import importlib.util
import pathlib
import types

import pytest
import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

REF = pathlib.Path(__file__).resolve().parent.parent / "reference"

# The two kernel files' backwards and chunk-size functions, filled in by the fixture below (importing a
# kernel file builds its CUDA extension).
training = types.SimpleNamespace()


@pytest.fixture(scope="module", autouse=True)
def _kernel_files(kernel_module):
    cm = kernel_module("contact_map.py", "contact_map")
    opm = kernel_module("outer_product_mean.py", "outer_product_mean")
    training.contact_map_backward, training.contact_map_rows = cm.contact_map_backward, cm.contact_map_rows
    training.outer_product_mean_backward = opm.outer_product_mean_backward
    training.outer_product_mean_rows = opm.outer_product_mean_rows


def _load(name):
    spec = importlib.util.spec_from_file_location(f"ref_{name}", REF / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ref_cm = _load("contact_map")
ref_opm = _load("outer_product_mean")

CM_NAMES = ("layer_norm.weight", "layer_norm.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight",
            "mlp.2.bias", "mlp.4.weight", "mlp.4.bias")
OPM_NAMES = ("layer_norm.weight", "layer_norm.bias", "proj_a.weight", "proj_a.bias", "proj_b.weight",
             "proj_b.bias", "out_proj.weight", "out_proj.bias")


# ---------------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------------
def _randomise_ln(model, gen):
    """LayerNorm affine away from (1, 0), so that its gradients and dxhat = dy * w are exercised."""
    with torch.no_grad():
        ln = model.layer_norm
        ln.weight.copy_(1 + 0.5 * torch.randn(ln.weight.shape, generator=gen))
        ln.bias.copy_(0.3 * torch.randn(ln.bias.shape, generator=gen))
    return model


def _cm_model(C, H, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return _randomise_ln(ref_cm.Model(C, H), gen)


def _opm_model(c_m, c_z, c, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return _randomise_ln(ref_opm.Model(c_m, c_z, c), gen)


def _activations(shape, dist, gen):
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dist == "offset30":
        x = x + 30.0
    elif dist == "scaled":
        x = x * 100.0 + 3.0
    elif dist == "uniform":
        x = torch.rand(shape, generator=gen, dtype=torch.float64) * 4 - 2
    return x


def _mask(B, S, N, kind, gen):
    """Masks of the reference's INPUT_ROLES, with one position i masked in every sequence."""
    if kind == "ones":
        return torch.ones(B, S, N)
    if kind == "binary":
        m = (torch.rand(B, S, N, generator=gen) < 0.6).float()
    elif kind == "fractional":
        m = torch.rand(B, S, N, generator=gen)
    elif kind == "bool":
        m = torch.rand(B, S, N, generator=gen) < 0.6
    elif kind == "int":
        m = (torch.rand(B, S, N, generator=gen) < 0.6).to(torch.int32)
    else:
        raise ValueError(kind)
    m[:, :, N // 2] = 0  # sum_s m = 0 there: the clamp(min = 1) matters
    return m


def _rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item()


# ---------------------------------------------------------------------------------------------
# Reference autograd and our backward, both returning the gradients in the same order
# ---------------------------------------------------------------------------------------------
def _ref_grads(model, names, inputs, grad_out):
    """Autograd of the reference Model: gradients of <out, grad_out> w.r.t. inputs[0] and the params."""
    x = inputs[0].detach().clone().requires_grad_(True)
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    out = model(x, *inputs[1:])
    out.backward(grad_out.to(out.dtype))
    return [t.detach().clone() for t in [x.grad] + [params[n].grad for n in names]]


def _away_from_kinks(model, pair, grad_out, tol=2e-4):
    """grad_out zeroed at positions (b, i, j) whose fp64 pre-activations h1 or h2 lie within tol of
    the ReLU kink, where fp32 rounding may take either branch (then any gradient there is arbitrary).

    Those positions then add nothing to any gradient, so the comparison measures rounding only.
    """
    m = copy.deepcopy(model).double()
    with torch.no_grad():
        x = m.layer_norm(pair.double())
        s = (x + x.permute(0, 2, 1, 3)) / 2.0
        h1 = m.mlp[0](s)
        h2 = m.mlp[2](h1.relu())
        near = (h1.abs() < tol).any(-1) | (h2.abs() < tol).any(-1)
    assert near.float().mean() < 0.05  # most positions still count
    return grad_out.masked_fill(near, 0)


def _cm_ours(model, pair, grad_out, chunk_bytes=256 << 20):
    p = dict(model.named_parameters())
    args = [p[n].detach() for n in CM_NAMES]
    return training.contact_map_backward(pair, args[0], args[1], model.layer_norm.eps, *args[2:],
                                         grad_out, chunk_bytes=chunk_bytes)


def _opm_ours(model, msa, mask, grad_out, chunk_bytes=256 << 20):
    p = dict(model.named_parameters())
    args = [p[n].detach() for n in OPM_NAMES]
    return training.outer_product_mean_backward(msa, mask, args[0], args[1], model.layer_norm.eps,
                                                *args[2:], grad_out, chunk_bytes=chunk_bytes)


def _oracle_mask(mask):
    """The mask as the fp64 reference sees it: float masks in fp64, bool / integer masks as they are."""
    return mask.double() if mask.is_floating_point() else mask


# ---------------------------------------------------------------------------------------------
# gradcheck: forward = reference math (fp64), backward = the kernel files
# ---------------------------------------------------------------------------------------------
class _CM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model, chunk_bytes, pair, *params):
        ctx.model, ctx.chunk_bytes = model, chunk_bytes
        ctx.save_for_backward(pair, *params)
        return functional_call(model, dict(zip(CM_NAMES, params)), (pair,))

    @staticmethod
    def backward(ctx, grad_out):
        pair, lw, lb, w1, b1, w2, b2, w3, b3 = ctx.saved_tensors
        grads = training.contact_map_backward(pair, lw, lb, ctx.model.layer_norm.eps, w1, b1, w2, b2, w3,
                                              b3, grad_out, chunk_bytes=ctx.chunk_bytes)
        return (None, None) + tuple(grads)


class _OPM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model, chunk_bytes, mask, msa, *params):
        ctx.model, ctx.chunk_bytes = model, chunk_bytes
        ctx.save_for_backward(msa, mask, *params)
        return functional_call(model, dict(zip(OPM_NAMES, params)), (msa, mask))

    @staticmethod
    def backward(ctx, grad_out):
        msa, mask, lw, lb, wa, ba, wb, bb, wo, bo = ctx.saved_tensors
        grads = training.outer_product_mean_backward(msa, mask, lw, lb, ctx.model.layer_norm.eps, wa, ba,
                                                     wb, bb, wo, bo, grad_out, chunk_bytes=ctx.chunk_bytes)
        return (None, None, None) + tuple(grads)


@pytest.mark.parametrize("chunk_bytes", [1, 256 << 20])
def test_contact_map_gradcheck(chunk_bytes):
    B, N, C, H = 2, 5, 6, 4
    model = _cm_model(C, H, seed=1).double()
    gen = torch.Generator().manual_seed(11)
    pair = _activations((B, N, N, C), "normal", gen).requires_grad_(True)
    params = [dict(model.named_parameters())[n].detach().clone().requires_grad_(True) for n in CM_NAMES]
    assert torch.autograd.gradcheck(lambda *t: _CM.apply(model, chunk_bytes, *t), (pair, *params),
                                     eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 256 << 20])
@pytest.mark.parametrize("kind", ["fractional", "binary"])
def test_outer_product_mean_gradcheck(chunk_bytes, kind):
    B, S, N, c_m, c, c_z = 2, 3, 4, 5, 3, 4
    model = _opm_model(c_m, c_z, c, seed=2).double()
    gen = torch.Generator().manual_seed(12)
    msa = _activations((B, S, N, c_m), "normal", gen).requires_grad_(True)
    mask = _mask(B, S, N, kind, gen).double()
    mask[0, :2, 0] = 0  # partly zero column
    assert (mask.sum(1) == 0).any() and ((mask.sum(1) > 0) & (mask.sum(1) < 1)).any() == (kind == "fractional")
    params = [dict(model.named_parameters())[n].detach().clone().requires_grad_(True) for n in OPM_NAMES]
    assert torch.autograd.gradcheck(lambda *t: _OPM.apply(model, chunk_bytes, mask, *t), (msa, *params),
                                     eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# fp64: the same gradients as the reference's autograd, for any chunking
# ---------------------------------------------------------------------------------------------
def test_contact_map_fp64_matches_autograd_any_chunking():
    B, N, C, H = 2, 11, 8, 6
    model = _cm_model(C, H, seed=3).double()
    gen = torch.Generator().manual_seed(13)
    pair = _activations((B, N, N, C), "offset30", gen)
    g = torch.randn(B, N, N, generator=gen, dtype=torch.float64)
    ref = _ref_grads(model, CM_NAMES, [pair], g)
    for chunk_bytes in (1, 3000, 256 << 20):
        ours = _cm_ours(model, pair, g, chunk_bytes)
        for name, o, r in zip(("pair",) + CM_NAMES, ours, ref):
            assert o.dtype == torch.float64 and o.shape == r.shape, name
            assert _rel_err(o, r) < 1e-12, (name, chunk_bytes, _rel_err(o, r))


@pytest.mark.parametrize("kind", ["ones", "binary", "fractional", "bool", "int"])
def test_outer_product_mean_fp64_matches_autograd_any_chunking(kind):
    B, S, N, c_m, c, c_z = 2, 4, 9, 7, 5, 6
    model = _opm_model(c_m, c_z, c, seed=4).double()
    gen = torch.Generator().manual_seed(14)
    msa = _activations((B, S, N, c_m), "offset30", gen)
    mask = _mask(B, S, N, kind, gen)
    g = torch.randn(B, N, N, c_z, generator=gen, dtype=torch.float64)
    ref = _ref_grads(model, OPM_NAMES, [msa, _oracle_mask(mask)], g)
    for chunk_bytes in (1, 5000, 256 << 20):
        ours = _opm_ours(model, msa, mask, g, chunk_bytes)
        for name, o, r in zip(("msa",) + OPM_NAMES, ours, ref):
            assert o.dtype == torch.float64 and o.shape == r.shape, name
            assert _rel_err(o, r) < 1e-12, (name, chunk_bytes, _rel_err(o, r))


# ---------------------------------------------------------------------------------------------
# fp32 at larger shapes: error vs the fp64 reference <= 2x the fp32 reference's own (or <= 1e-5)
# ---------------------------------------------------------------------------------------------
def _check_fp32(ours, ref32, ref64, names):
    for name, o, r32, r64 in zip(names, ours, ref32, ref64):
        assert o.dtype == torch.float32 and o.shape == r64.shape, name
        e_ours, e_ref = _rel_err(o, r64), _rel_err(r32, r64)
        assert e_ours <= max(2 * e_ref, 1e-5), (name, e_ours, e_ref)


def _cm_chunked_bytes(B, N, C, H):
    """A chunk_bytes giving several MLP and LayerNorm chunks of more than one row, the last ragged."""
    chunk_bytes = 5 * B * N * (4 * C + 6 * H + 4) * 4
    rows_mlp, rows_ln = training.contact_map_rows(B, N, C, H, 4, chunk_bytes)
    assert 1 < rows_mlp < N and 1 < rows_ln < N and N % rows_mlp and N % rows_ln
    return chunk_bytes


@pytest.mark.parametrize("dist", ["normal", "offset30", "scaled"])
@pytest.mark.parametrize("chunked", [False, True])
def test_contact_map_fp32(dist, chunked):
    B, N, C, H = 2, 37, 48, 16
    seed = {"normal": 5, "offset30": 6, "scaled": 7}[dist] + 10 * chunked
    model = _cm_model(C, H, seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    pair64 = _activations((B, N, N, C), dist, gen)
    g64 = torch.randn(B, N, N, generator=gen, dtype=torch.float64)
    pair, g = pair64.float(), g64.float()
    chunk_bytes = _cm_chunked_bytes(B, N, C, H) if chunked else 256 << 20
    if not chunked:
        assert training.contact_map_rows(B, N, C, H, 4, chunk_bytes) == (N, N)
    g = _away_from_kinks(model, pair, g)
    ref32 = _ref_grads(model, CM_NAMES, [pair], g)
    ref64 = _ref_grads(copy.deepcopy(model).double(), CM_NAMES, [pair.double()], g.double())
    ours = _cm_ours(model, pair, g, chunk_bytes)
    _check_fp32(ours, ref32, ref64, ("pair",) + CM_NAMES)


@pytest.mark.parametrize("kind", ["ones", "binary", "fractional", "bool"])
@pytest.mark.parametrize("dist", ["normal", "offset30"])
@pytest.mark.parametrize("chunked", [False, True])
def test_outer_product_mean_fp32(kind, dist, chunked):
    B, S, N, c_m, c, c_z = 1, 7, 33, 40, 16, 24
    seed = 20 + 2 * ["ones", "binary", "fractional", "bool"].index(kind) + (dist == "offset30") + 10 * chunked
    model = _opm_model(c_m, c_z, c, seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    msa = _activations((B, S, N, c_m), dist, gen).float()
    mask = _mask(B, S, N, kind, gen)
    g = torch.randn(B, N, N, c_z, generator=gen)
    if chunked:
        chunk_bytes = int(2.4 * B * N * (2 * c * c + 2 * c_z) * 4)
        rows_outer, rows_ln = training.outer_product_mean_rows(B, S, N, c_m, c, c_z, 4, chunk_bytes)
        assert rows_outer == 2 and 1 < rows_ln < B * S * N and (B * S * N) % rows_ln
    else:
        chunk_bytes = 256 << 20
        assert training.outer_product_mean_rows(B, S, N, c_m, c, c_z, 4, chunk_bytes) == (N, B * S * N)
    ref32 = _ref_grads(model, OPM_NAMES, [msa, mask], g)
    ref64 = _ref_grads(copy.deepcopy(model).double(), OPM_NAMES, [msa.double(), _oracle_mask(mask)],
                       g.double())
    ours = _opm_ours(model, msa, mask, g, chunk_bytes)
    _check_fp32(ours, ref32, ref64, ("msa",) + OPM_NAMES)


# ---------------------------------------------------------------------------------------------
# fp16 / bf16 inputs: gradients in each tensor's dtype, close to fp32 autograd on the upcast inputs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("half_params", [False, True])
def test_contact_map_half(dtype, half_params):
    B, N, C, H = 2, 13, 16, 8
    model = _cm_model(C, H, seed=30)
    gen = torch.Generator().manual_seed(130)
    pair = _activations((B, N, N, C), "offset30", gen).to(dtype)
    g = torch.randn(B, N, N, generator=gen).to(dtype)
    if half_params:
        model = model.to(dtype)
    ref_model = copy.deepcopy(model).float()
    g = _away_from_kinks(ref_model, pair.float(), g.float()).to(dtype)
    ours = _cm_ours(model, pair, g, chunk_bytes=3000)
    ref = _ref_grads(ref_model, CM_NAMES, [pair.float()], g.float())
    want = [dtype] + [dtype if half_params else torch.float32] * len(CM_NAMES)
    for name, o, r, dt in zip(("pair",) + CM_NAMES, ours, ref, want):
        assert o.dtype == dt and o.shape == r.shape, name
        assert torch.isfinite(o).all() and _rel_err(o, r) < 1e-2, (name, _rel_err(o, r))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["binary", "bool", "half"])
def test_outer_product_mean_half(dtype, kind):
    B, S, N, c_m, c, c_z = 2, 5, 11, 12, 6, 8
    model = _opm_model(c_m, c_z, c, seed=31).to(dtype)
    gen = torch.Generator().manual_seed(131)
    msa = _activations((B, S, N, c_m), "normal", gen).to(dtype)
    mask = _mask(B, S, N, "binary" if kind == "half" else kind, gen)
    if kind == "half":
        mask = mask.to(dtype)
    g = torch.randn(B, N, N, c_z, generator=gen).to(dtype)
    ours = _opm_ours(model, msa, mask, g, chunk_bytes=2000)
    ref = _ref_grads(copy.deepcopy(model).float(), OPM_NAMES, [msa.float(), mask.float() if kind == "half" else mask],
                     g.float())
    for name, o, r in zip(("msa",) + OPM_NAMES, ours, ref):
        assert o.dtype == dtype and o.shape == r.shape, name
        assert torch.isfinite(o).all() and _rel_err(o, r) < 1e-2, (name, _rel_err(o, r))


# ---------------------------------------------------------------------------------------------
# Memory: no tensor of (B, N, N, hidden) or (B, N, N, c*c) size; the inputs are left unchanged
# ---------------------------------------------------------------------------------------------
class _Sizes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_contact_map_memory():
    B, N, C, H = 2, 24, 8, 32  # H > C: a (B, N, N, H) tensor would be the largest
    model = _cm_model(C, H, seed=40)
    gen = torch.Generator().manual_seed(140)
    pair = _activations((B, N, N, C), "normal", gen).float()
    g = torch.randn(B, N, N, generator=gen)
    chunk_bytes = 3 * B * N * ((4 * C + 6 * H + 4) * 4 + 8 * (C + H))
    rows_mlp, rows_ln = training.contact_map_rows(B, N, C, H, 4, chunk_bytes)
    assert rows_mlp == 3 and rows_ln < N
    clones = [pair.clone(), g.clone()]
    with _Sizes() as rec:
        ours = _cm_ours(model, pair, g, chunk_bytes)
    full = (B, N, N, C)
    chunk = max(rows_mlp * B * N * max(C, H), rows_ln * B * N * C)  # the largest chunk tensor
    assert chunk < B * N * N * C
    big = [s for s in rec.shapes if _numel(s) > chunk]
    assert all(s == full for s in big), big  # only d_pair (= the dy buffer in fp32)
    assert len(big) == 1
    assert torch.equal(pair, clones[0]) and torch.equal(g, clones[1])
    assert ours[0].shape == full


def test_outer_product_mean_memory():
    B, S, N, c_m, c, c_z = 1, 3, 20, 8, 8, 8
    model = _opm_model(c_m, c_z, c, seed=41)
    gen = torch.Generator().manual_seed(141)
    msa = _activations((B, S, N, c_m), "normal", gen).float()
    mask = _mask(B, S, N, "fractional", gen)
    g = torch.randn(B, N, N, c_z, generator=gen)
    chunk_bytes = 2 * B * N * (2 * c * c + 2 * c_z) * 4
    rows_outer, _ = training.outer_product_mean_rows(B, S, N, c_m, c, c_z, 4, chunk_bytes)
    assert rows_outer == 2
    clones = [msa.clone(), mask.clone(), g.clone()]
    with _Sizes() as rec:
        _opm_ours(model, msa, mask, g, chunk_bytes)
    limit = max(rows_outer * B * N * c * c, B * S * N * max(c_m, c))
    assert max(_numel(s) for s in rec.shapes) <= limit < B * N * N * c * c
    assert all(torch.equal(x, y) for x, y in zip((msa, mask, g), clones))


# ---------------------------------------------------------------------------------------------
# ModelNew's autograd and dtype handling on the CPU: the CUDA kernels replaced by the reference math
# in float32 (what the kernels compute), everything else as it runs on a GPU
# ---------------------------------------------------------------------------------------------
class _FakeOpmExtension:
    """Stands in for outer_product_mean's CUDA extension: opm_forward in float32 PyTorch ops (with keep_ab
    and hidden_dim 32, a, b and 1 / denom too, as outer_wg returns them; norm 1 / 2: the OpenFold / Boltz
    pair normalisations, recorded in norms), and a record of the dtypes it was handed (msa and the parameters float32, or all of one dtype, float16 or bfloat16; the mask of
    any dtype the kernels take)."""

    def __init__(self, real):
        self.real, self.dtypes, self.msa_dtypes, self.mask_dtypes, self.norms = real, [], [], [], []
        self.keep_o = []

    def opm_forward(self, msa, mask, lw, lb, wa, ba, wb, bb, wo, bo, eps, code, keep_ab, norm=0, norm_eps=1e-3,
                    pair_fused=False, pair_counts=0, keep_o=False):
        self.keep_o.append(keep_o)
        out_dtype = msa.dtype
        self.dtypes.append({t.dtype for t in (lw, lb, wa, ba, wb, bb, wo, bo)})
        self.norms.append((norm, norm_eps, pair_fused))
        self.msa_dtypes.append(msa.dtype)
        self.mask_dtypes.append(mask.dtype)
        msa = msa.float()
        lw, lb, wa, ba, wb, bb, wo, bo = (t.float() for t in (lw, lb, wa, ba, wb, bb, wo, bo))
        x = (msa - msa.mean(-1, keepdim=True)) / (msa.var(-1, unbiased=False, keepdim=True) + eps).sqrt() * lw + lb
        m = mask.float()[..., None]
        a, b = (x @ wa.t() + ba) * m, (x @ wb.t() + bb) * m
        B, S, N, c = a.shape
        o = (a.permute(0, 2, 3, 1).reshape(B, N * c, S) @ b.permute(0, 1, 2, 3).reshape(B, S, N * c))
        o = o.reshape(B, N, c, N, c).permute(0, 1, 3, 2, 4).reshape(B, N, N, c * c)
        denom = mask.float().sum(1).clamp(min=1)
        inv_d = 1 / denom
        if norm:  # the pair modes: s1 (o Wo^T) + s2 bo, n the pair count
            n = torch.einsum("bsi,bsj->bij", mask.float(), mask.float())
            s1 = 1 / (n + norm_eps) if norm == 1 else 1 / n.clamp(min=1)
            s2 = s1 if norm == 1 else torch.ones_like(n)
            out = s1[..., None] * (o @ wo.t()) + s2[..., None] * bo
            o = s1[..., None] * o
        else:
            o = o / denom[:, :, None, None]
            out = o @ wo.t() + bo
        kept = (o.to(out_dtype) if keep_o and c == 32 and out_dtype != torch.float32 and (not norm or pair_fused)
                else None)
        return (out, 1, a, b, inv_d, kept) if keep_ab and c == 32 else (out, 1, None, None, None, kept)

    def opm_device_caps(self, device):
        return (False, False, False)


@pytest.fixture
def opm_cpu(kernel_module, monkeypatch):
    mod = kernel_module("outer_product_mean.py", "outer_product_mean")
    fake = _FakeOpmExtension(mod._ext)
    monkeypatch.setattr(mod, "_ext", fake)
    return mod, fake


def _opm_pair(mod, seed, dtype=torch.float32, c_m=12, c_z=10, c=5):
    model = _opm_model(c_m, c_z, c, seed)
    new = mod.ModelNew(c_m, c_z, c)
    new.load_state_dict(model.state_dict())
    return model.to(dtype), new.to(dtype)


def _opm_inputs(seed, dtype=torch.float32, B=2, S=4, N=7, c_m=12):
    gen = torch.Generator().manual_seed(seed)
    msa = _activations((B, S, N, c_m), "normal", gen).to(dtype)
    return msa, _mask(B, S, N, "binary", gen).to(dtype)


@pytest.mark.parametrize("c", [5, 32])
def test_opm_model_new_gradients_match_reference(opm_cpu, c):
    """hidden_dim 5: the backward recomputes a and b; 32: it takes them from the forward (as where
    outer_wg runs), and last_backward says so; every other part ran in PyTorch ops (a CPU)."""
    mod, fake = opm_cpu
    model, new = _opm_pair(mod, seed=50, c=c)
    msa, mask = _opm_inputs(150)
    g = torch.randn(2, 7, 7, 10, generator=torch.Generator().manual_seed(250))
    want = _ref_grads(model, OPM_NAMES, [msa, mask], g)
    assert new.last_backward is None
    got = _ref_grads(new, OPM_NAMES, [msa, mask], g)
    assert new.last_backward == (("a, b",) if c == 32 else ())
    for name, w, o in zip(("msa",) + OPM_NAMES, want, got):
        assert o is not None and o.dtype == w.dtype, name
        assert torch.allclose(o, w, atol=1e-5, rtol=1e-4), (name, (o - w).abs().max().item())
    assert fake.dtypes and all(d == {torch.float32} for d in fake.dtypes)
    assert fake.msa_dtypes and all(d == torch.float32 for d in fake.msa_dtypes)


def test_opm_model_new_autograd_like_reference(opm_cpu):
    """Frozen parameters get no gradient, autograd.grad and retain_graph behave as with the
    reference, a second backward without retain_graph raises, double backward raises, and a mask
    that requires grad raises."""
    mod, _ = opm_cpu
    model, new = _opm_pair(mod, seed=51)
    msa, mask = _opm_inputs(151)
    for m in (model, new):
        m.proj_a.weight.requires_grad_(False)
        m.layer_norm.requires_grad_(False)
    outs = [m(msa, mask) for m in (model, new)]
    grads = [torch.autograd.grad((o * o).sum(), [m.out_proj.weight, m.proj_b.bias], retain_graph=True)
             for m, o in zip((model, new), outs)]
    for w, o in zip(*grads):
        assert torch.allclose(o, w, atol=1e-5, rtol=1e-4)
    for m, o in zip((model, new), outs):
        o.sum().backward(retain_graph=True)
        o.sum().backward()
        assert m.proj_a.weight.grad is None and m.layer_norm.weight.grad is None
        with pytest.raises(RuntimeError):
            o.sum().backward()
    assert torch.allclose(new.proj_b.weight.grad, model.proj_b.weight.grad, atol=1e-5, rtol=1e-4)

    x = msa.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(new(x, mask).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()
    with pytest.raises(RuntimeError, match="msa_mask"):
        new(msa, mask.clone().requires_grad_(True))
    with torch.no_grad():  # no autograd: the mask's flag does not matter
        new(msa, mask.clone().requires_grad_(True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_opm_model_new_half_precision(opm_cpu, dtype):
    """Half-precision module and inputs (KernelBench's casts, the mask too): the kernels get the msa,
    the mask and the parameters as they are (outer_wg reads float16 / bfloat16 itself); the output and
    every gradient come back in the input's dtype, close to the reference's float32."""
    mod, fake = opm_cpu
    model, new = _opm_pair(mod, seed=52)
    new = new.to(dtype)
    msa, mask = _opm_inputs(152)
    g = torch.randn(2, 7, 7, 10, generator=torch.Generator().manual_seed(252))
    out = new(msa.to(dtype), mask.to(dtype))
    assert out.dtype == dtype
    assert torch.allclose(out.float(), model(msa, mask), atol=1e-2, rtol=1e-2)
    want = _ref_grads(model, OPM_NAMES, [msa, mask], g)
    got = _ref_grads(new, OPM_NAMES, [msa.to(dtype), mask.to(dtype)], g.to(dtype))
    for name, w, o in zip(("msa",) + OPM_NAMES, want, got):
        assert o.dtype == dtype, name
        assert torch.allclose(o.float(), w, atol=2e-2, rtol=2e-2), (name, (o.float() - w).abs().max().item())
    assert fake.dtypes and all(d == {dtype} for d in fake.dtypes)
    assert fake.msa_dtypes and all(d == dtype for d in fake.msa_dtypes)
    assert fake.mask_dtypes and all(d == dtype for d in fake.mask_dtypes)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_opm_keep_o_wiring(opm_cpu, monkeypatch, dtype):
    """KEEP_O: a 16-bit forward that saves for the backward asks the extension for O (keep_o); the backward takes
    dWo from it ("dWo from O", one product over the kept O) where dWo's kernel would run, and every gradient stays
    close to the reference's. Not asked for with KEEP_O off, for O over KEEP_O_MAX_BYTES, in float32, under
    no_grad, for pair_dim over 128 or a pair mode's "chunks" backward (dWo not in its kernel there)."""
    mod, fake = opm_cpu
    monkeypatch.setattr(mod, "KEEP_O", True)
    # where dWo's kernel would run on a GPU (hidden_dim 32, pair_dim <= 128; a kept O replaces the kernel's call)
    monkeypatch.setattr(mod, "_wo_kernel_runs", lambda msa, c, c_z, ct: c == 32 and c_z <= 128)
    monkeypatch.setattr(mod, "_ab_kernel_runs", lambda *args: False)
    model, new = _opm_pair(mod, seed=54, c=32)
    new = new.to(dtype)
    msa, mask = _opm_inputs(154)
    g = torch.randn(2, 7, 7, 10, generator=torch.Generator().manual_seed(254))
    want = _ref_grads(model, OPM_NAMES, [msa, mask], g)
    got = _ref_grads(new, OPM_NAMES, [msa.to(dtype), mask.to(dtype)], g.to(dtype))
    assert fake.keep_o == [True] and new.last_backward == ("a, b", "dWo from O")
    for name, w, o in zip(("msa",) + OPM_NAMES, want, got):
        assert o.dtype == dtype, name
        if name == "out_proj.weight":  # a sum over 98 pairs of O rounded to dtype (on the CPU, its sums too)
            assert (o.float() - w).abs().max() <= 4e-2 * w.abs().max(), (o.float() - w).abs().max().item()
        else:
            assert torch.allclose(o.float(), w, atol=2e-2, rtol=2e-2), (name, (o.float() - w).abs().max().item())
    x = msa.to(dtype).requires_grad_(True)
    monkeypatch.setattr(mod, "KEEP_O_MAX_BYTES", 2 * 7 * 7 * 1024 * 2 - 1)  # one byte under this O
    new(x, mask.to(dtype))
    monkeypatch.setattr(mod, "KEEP_O_MAX_BYTES", 2 * 7 * 7 * 1024 * 2)
    new(x, mask.to(dtype))
    with torch.no_grad():
        new(x, mask.to(dtype))
    new.float()(msa.requires_grad_(True), mask)
    monkeypatch.setattr(mod, "KEEP_O", False)
    new.to(dtype)(x, mask.to(dtype))
    assert fake.keep_o == [True, False, True, False, False, False]
    # where the backward's dWo would not run in its kernel: pair_dim over 128, a pair mode's chunks
    monkeypatch.setattr(mod, "KEEP_O", True)
    mod.ModelNew(12, 129, 32).to(dtype)(x, mask.to(dtype))
    fam = mod.OpenFoldOuterProductMean(12, 10, 32).to(dtype)
    for backward in ("chunks", "kernels"):
        with mod.pair_backward(backward):
            fam(x, mask.to(dtype))
    assert fake.keep_o[6:] == [False, False, True]


@pytest.mark.parametrize("norm", [1, 2])
def test_opm_backward_dwo_from_kept_o_pair_modes(kernel_module, norm):
    """outer_product_mean_backward with the forward's O given (the pair modes: s1 O, grad_out unscaled) and dWo's
    kernel on: dWo = grad_out^T o in o's dtype, close to the chunks' float32 dWo of the same call without o (within
    two bfloat16 roundings); the other gradients unchanged."""
    mod = kernel_module("outer_product_mean.py", "outer_product_mean")
    model, new = _opm_pair(mod, seed=55, c=32)
    msa, mask = _opm_inputs(155)
    g = torch.randn(2, 7, 7, 10, generator=torch.Generator().manual_seed(255))
    params = [p.detach() for p in new.parameters()]
    eps = new.layer_norm.eps
    x = torch.nn.functional.layer_norm(msa, (12,), params[0], params[1], eps)
    a, b = (x @ params[2].t() + params[3]) * mask[..., None], (x @ params[4].t() + params[5]) * mask[..., None]
    s1, _ = mod.pair_scales(mask, norm, 1e-3)
    o = (torch.einsum("bsih,bsjk->bijhk", a, b).reshape(2, 7, 7, 1024) * s1[..., None]).to(torch.bfloat16)
    kw = dict(ab_kernel=False, ln_kernel=False, rows_kernel=False, norm=norm, norm_eps=1e-3, pair_kernels=True)
    parts = []
    got = mod.outer_product_mean_backward(msa, mask, params[0], params[1], eps, *params[2:], g, wo_kernel=True,
                                          o=o, parts=parts, **kw)
    want = mod.outer_product_mean_backward(msa, mask, params[0], params[1], eps, *params[2:], g, wo_kernel=False,
                                           **kw)
    assert parts == ["dWo from O"]
    for i, (w, t) in enumerate(zip(want, got)):
        if i == 7:  # d_wo
            bound = 2 * 2.0**-8 * (g.abs().reshape(-1, 10).t() @ o.float().abs().reshape(-1, 1024))
            assert ((t - w).abs() <= bound + 1e-6).all(), (t - w).abs().max().item()
        else:
            assert torch.equal(t, w), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [0, 1])
def test_opm_backward_g_mem_wiring(kernel_module, monkeypatch, dtype, norm):
    """G_MEM: outer_product_mean_backward with da, db from G in memory (opm_backward_g replaced by its definition in
    float32 PyTorch ops, the two products in dtype) gives every gradient of the same call with da, db from the
    chunks (float32) within dtype's rounding of da, db, dWo and dbo within a rounding ("da, db from G" in parts; G
    asked for from grad_out in dtype, Wo in dtype and float32 1 / denom); not taken with G_MEM off, S under
    G_MEM_MIN_S or G over G_MEM_MAX_BYTES."""
    mod = kernel_module("outer_product_mean.py", "outer_product_mean")
    calls = []

    def opm_backward_g(g, wo, inv_d):
        calls.append((g.dtype, wo.dtype, inv_d.dtype))
        B, N, cz = g.shape[0], g.shape[1], g.shape[3]
        G = (g.float().reshape(B, N * N, cz) @ wo.float()).reshape(B, N, N, 32, 32) * inv_d[:, :, None, None, None]
        return G.permute(0, 1, 3, 2, 4).reshape(B, 32 * N, 32 * N).to(g.dtype)

    def opm_backward_ab(a, b, inv_d, g_k, wo, ops, low):  # (where G_MEM does not take da, db)
        calls.append(ops)
        return torch.zeros_like(a), torch.zeros_like(b)

    monkeypatch.setattr(mod._ext, "opm_backward_g", opm_backward_g, raising=False)
    monkeypatch.setattr(mod._ext, "opm_backward_ab", opm_backward_ab)
    monkeypatch.setattr(mod, "G_MEM", True)
    monkeypatch.setattr(mod, "G_MEM_MIN_S", 4)
    _, new = _opm_pair(mod, seed=56, c_z=16, c=32)
    new = new.to(dtype)
    msa, mask = _opm_inputs(156, dtype)
    g = torch.randn(2, 7, 7, 16, generator=torch.Generator().manual_seed(256)).to(dtype)
    params = [p.detach() for p in new.parameters()]
    eps = new.layer_norm.eps
    kw = dict(wo_kernel=False, ln_kernel=False, rows_kernel=False, norm=norm, norm_eps=1e-3, pair_kernels=True)

    def backward(ab_kernel):
        parts = []
        grads = mod.outer_product_mean_backward(msa, mask, params[0], params[1], eps, *params[2:], g,
                                                ab_kernel=ab_kernel, parts=parts, **kw)
        return parts, grads

    parts, got = backward(True)
    assert parts == ["da, db from G"] and calls == [(dtype, dtype, torch.float32)]
    _, want = backward(False)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for i, (w, t) in enumerate(zip(want, got)):
        assert t.dtype == w.dtype == dtype, i
        rel = ((t.double() - w.double()).norm() / w.double().norm()).item()
        assert rel <= (2.0**-10 if i >= 7 else tol), (i, rel)  # (d_wo, d_bo: the chunks' in both, up to a rounding)
    for attr, value in (("G_MEM", False), ("G_MEM_MIN_S", 5), ("G_MEM_MAX_BYTES", 2 * 7 * 7 * 1024 * 2 - 1)):
        with monkeypatch.context() as m:
            m.setattr(mod, attr, value)
            assert backward(True)[0] == ["da, db"], attr
    assert calls[1:] == [mod._dtype_name(dtype)] * 3


def test_opm_converted_together(kernel_module):
    """_converted_together: each tensor converted as t.to(dtype) would (values, shapes, dtypes); where packed (two or
    more to convert), views of one buffer starting 16-byte aligned; one by one where a numel other than the last is
    not a multiple of 8 or where at most one tensor needs converting."""
    mod = kernel_module("outer_product_mean.py", "outer_product_mean")
    gen = torch.Generator().manual_seed(57)
    ts = [torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((16, 1024), (32, 24), (24,), (32,), (3,))]
    got = mod._converted_together(ts, torch.float32)
    assert all(g.dtype == torch.float32 and g.shape == t.shape and torch.equal(g, t.float()) for g, t in zip(got, ts))
    base = got[0].untyped_storage().data_ptr()
    assert all(g.untyped_storage().data_ptr() == base and g.data_ptr() % 16 == 0 for g in got)  # one buffer
    back = mod._converted_together(got, torch.bfloat16)
    assert all(torch.equal(b, t) for b, t in zip(back, ts))
    for tensors in ((ts[4], ts[0], ts[1]),      # numel 3 first
                    (ts[0], ts[1].float())):    # one to convert
        got = mod._converted_together(tensors, torch.float32)
        assert all(torch.equal(g, t.float()) and g.dtype == torch.float32 for g, t in zip(got, tensors))
        assert len({g.untyped_storage().data_ptr() for g in got}) == len(got)


def test_opm_parameter_grads_own_storage(opm_cpu):
    """A 16-bit step's parameter gradients (converted from the backward's float32 sums) each have a storage of their
    own: freeing or resizing one .grad leaves the others alone."""
    mod, _ = opm_cpu
    _, new = _opm_pair(mod, seed=58, c_m=16, c_z=16, c=32)  # (every numel a multiple of 8)
    new = new.to(torch.bfloat16)
    msa, mask = _opm_inputs(158, torch.bfloat16, c_m=16)
    new(msa.requires_grad_(True), mask).float().square().sum().backward()
    ptrs = [p.grad.untyped_storage().data_ptr() for p in new.parameters()]
    assert all(p.grad.dtype == torch.bfloat16 for p in new.parameters()) and len(set(ptrs)) == len(ptrs)


def test_opm_model_new_rejects_other_dtypes(opm_cpu):
    mod, _ = opm_cpu
    _, new = _opm_pair(mod, seed=53)
    msa, mask = _opm_inputs(153)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16, got float64"):
        new.double()(msa.double(), mask)
    new.float()
    with pytest.raises(RuntimeError, match="out_proj.weight must be float32 like msa_repr, got bfloat16"):
        new.out_proj.to(torch.bfloat16)
        new(msa, mask)


class _FakeCmExtension:
    """Stands in for contact_map's CUDA extension: forward in float32 PyTorch ops (the reference math) on
    inputs of one dtype (float32, float16 or bfloat16), the output in that dtype, and a record of the dtypes it
    was handed."""

    def __init__(self):
        self.dtypes = []

    def forward(self, pair, lw, lb, eps, w1, b1, w2, b2, w3, b3, vid):
        dtypes = {t.dtype for t in (pair, lw, lb, w1, b1, w2, b2, w3, b3)}
        assert len(dtypes) == 1, dtypes
        self.dtypes.append(dtypes)
        dtype = pair.dtype
        pair, lw, lb, w1, b1, w2, b2, w3, b3 = (t.float() for t in (pair, lw, lb, w1, b1, w2, b2, w3, b3))
        mu = pair.mean(-1, keepdim=True)
        y = (pair - mu) / ((pair - mu).pow(2).mean(-1, keepdim=True) + eps).sqrt() * lw + lb
        s = (y + y.transpose(1, 2)) / 2
        h = ((s @ w1.t() + b1).relu() @ w2.t() + b2).relu()
        return (h @ w3.t() + b3).sigmoid()[..., 0].to(dtype), 2


@pytest.fixture
def cm_cpu(kernel_module, monkeypatch):
    mod = kernel_module("contact_map.py", "contact_map")
    fake = _FakeCmExtension()
    monkeypatch.setattr(mod, "_ext", fake)
    return mod, fake


def _cm_pair(mod, seed, C=12, H=6):
    model = _cm_model(C, H, seed)
    new = mod.ModelNew(C, H)
    new.load_state_dict(model.state_dict())
    return model, new


def test_cm_model_new_gradients_match_reference(cm_cpu):
    mod, fake = cm_cpu
    model, new = _cm_pair(mod, seed=60)
    gen = torch.Generator().manual_seed(160)
    pair = _activations((2, 9, 9, 12), "normal", gen).float()
    g = torch.randn(2, 9, 9, generator=gen)
    want = _ref_grads(model, CM_NAMES, [pair], g)
    got = _ref_grads(new, CM_NAMES, [pair], g)
    for name, w, o in zip(("pair",) + CM_NAMES, want, got):
        assert o is not None and o.dtype == w.dtype, name
        assert torch.allclose(o, w, atol=1e-5, rtol=1e-4), (name, (o - w).abs().max().item())
    assert fake.dtypes and all(d == {torch.float32} for d in fake.dtypes)
    assert new.last_variant == "fma"


def test_cm_model_new_autograd_like_reference(cm_cpu):
    """Frozen parameters get no gradient, retain_graph works and a second backward without it raises,
    double backward raises."""
    mod, _ = cm_cpu
    model, new = _cm_pair(mod, seed=61)
    pair = _activations((1, 6, 6, 12), "normal", torch.Generator().manual_seed(161)).float()
    for m in (model, new):
        m.mlp[0].requires_grad_(False)
    outs = [m(pair) for m in (model, new)]
    for m, o in zip((model, new), outs):
        (o * o).sum().backward(retain_graph=True)
        (o * o).sum().backward()
        assert m.mlp[0].weight.grad is None and m.mlp[0].bias.grad is None
        with pytest.raises(RuntimeError):
            o.sum().backward()
    for (name, p), q in zip(new.named_parameters(), model.parameters()):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    x = pair.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(new(x).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cm_model_new_half_precision(cm_cpu, dtype):
    """Half-precision module and input: the kernel gets them as they are (it reads fp16 / bf16 itself), the
    output and every gradient come back in the input's dtype, close to the reference's float32."""
    mod, fake = cm_cpu
    model, new = _cm_pair(mod, seed=62)
    new = new.to(dtype)
    gen = torch.Generator().manual_seed(162)
    pair = _activations((2, 7, 7, 12), "normal", gen).float()
    g = torch.randn(2, 7, 7, generator=gen)
    out = new(pair.to(dtype))
    assert out.dtype == dtype
    assert torch.allclose(out.float(), model(pair), atol=1e-2, rtol=1e-2)
    want = _ref_grads(model, CM_NAMES, [pair], g)
    got = _ref_grads(new, CM_NAMES, [pair.to(dtype)], g.to(dtype))
    for name, w, o in zip(("pair",) + CM_NAMES, want, got):
        assert o.dtype == dtype, name
        assert torch.allclose(o.float(), w, atol=2e-2, rtol=2e-2), (name, (o.float() - w).abs().max().item())
    assert fake.dtypes and all(d == {dtype} for d in fake.dtypes)


# ---------------------------------------------------------------------------------------------
# On the GPU: the kernels' forward with this backward, every variant, against the reference
# ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("C,H,N", [(128, 64, 40), (64, 32, 24), (48, 16, 13)])
def test_cm_training_step_on_gpu(kernel_module, C, H, N):
    mod = kernel_module("contact_map.py", "contact_map")
    gen = torch.Generator().manual_seed(C + N)
    pair = _activations((2, N, N, C), "offset30", gen).float().cuda()
    g = torch.randn(2, N, N, generator=gen).cuda()
    model = _cm_model(C, H, seed=70).cuda()
    want = _ref_grads(_cm_model(C, H, seed=70).cuda().double(), CM_NAMES, [pair.double()], g.double())
    ref32 = _ref_grads(model, CM_NAMES, [pair], g)
    for variant in mod.ModelNew(C, H).VARIANTS:  # the model's own: "small" only where its dimensions allow
        new = mod.ModelNew(C, H).cuda()
        new.load_state_dict(model.state_dict())
        new.variant = variant
        got = _ref_grads(new, CM_NAMES, [pair], g)
        for name, w, o, r in zip(("pair",) + CM_NAMES, want, got, ref32):
            assert _rel_err(o, w) <= max(2 * _rel_err(r, w), 1e-5), (variant, name)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_autocast_on_gpu(kernel_module, dtype):
    """KernelBench's half-precision mode (module and every input cast, allclose at 1e-2 against the
    reference in that dtype) and autocast (the reference's output dtype) for both files."""
    cm = kernel_module("contact_map.py", "contact_map")
    opm = kernel_module("outer_product_mean.py", "outer_product_mean")
    gen = torch.Generator().manual_seed(80)
    model = _cm_model(64, 32, seed=80).cuda()
    new = cm.ModelNew(64, 32).cuda()
    new.load_state_dict(model.state_dict())
    pair = _activations((2, 33, 33, 64), "normal", gen).float().cuda()
    with torch.no_grad():
        for m in (model, new):
            m.to(dtype)
        want, got = model(pair.to(dtype)), new(pair.to(dtype))
        assert got.dtype == want.dtype == dtype
        assert torch.allclose(got, want, atol=1e-2, rtol=1e-2)
        for m in (model, new):
            m.float()
        with torch.autocast("cuda", dtype=dtype):
            want, got = model(pair), new(pair)
        assert got.dtype == want.dtype and torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)

    model = _opm_model(64, 64, 32, seed=81).cuda()
    new = opm.ModelNew(64, 64, 32).cuda()
    new.load_state_dict(model.state_dict())
    msa = _activations((2, 8, 32, 64), "normal", gen).float().cuda()
    mask = _mask(2, 8, 32, "binary", gen).cuda()
    with torch.no_grad():
        for m in (model, new):
            m.to(dtype)
        want, got = model(msa.to(dtype), mask.to(dtype)), new(msa.to(dtype), mask.to(dtype))
        assert got.dtype == want.dtype == dtype
        assert torch.allclose(got, want, atol=1e-2, rtol=1e-2)
        for m in (model, new):
            m.float()
        with torch.autocast("cuda", dtype=dtype):
            want, got = model(msa, mask), new(msa, mask)
        assert got.dtype == want.dtype and torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@gpu
def test_opm_training_step_on_gpu(kernel_module):
    mod = kernel_module("outer_product_mean.py", "outer_product_mean")
    gen = torch.Generator().manual_seed(90)
    B, S, N, c_m, c, c_z = 1, 16, 40, 64, 32, 48
    msa = _activations((B, S, N, c_m), "offset30", gen).float().cuda()
    mask = _mask(B, S, N, "binary", gen).cuda()
    g = torch.randn(B, N, N, c_z, generator=gen).cuda()
    model = _opm_model(c_m, c_z, c, seed=90).cuda()
    ref32 = _ref_grads(model, OPM_NAMES, [msa, mask], g)
    want = _ref_grads(_opm_model(c_m, c_z, c, seed=90).cuda().double(), OPM_NAMES, [msa.double(), mask.double()],
                      g.double())
    for variant in mod.ModelNew.VARIANTS:
        new = mod.ModelNew(c_m, c_z, c).cuda()
        new.load_state_dict(model.state_dict())
        new.variant = variant
        got = _ref_grads(new, OPM_NAMES, [msa, mask], g)
        for name, w, o, r in zip(("msa",) + OPM_NAMES, want, got, ref32):
            assert _rel_err(o, w) <= max(2 * _rel_err(r, w), 1e-5), (variant, name)
