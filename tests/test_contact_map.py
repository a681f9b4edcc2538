"""Tests of contact_map.py's ModelNew against an fp64 evaluation of reference/contact_map.py.

CPU tests (run in CI): the CUDA source builds with nvcc, and bad inputs raise clear errors.
GPU tests (marker `gpu`, skipped without CUDA): every kernel variant on the harness's named shapes
and on awkward sizes, distributions, strides and parameter values, at atol = rtol = 1e-4.
"""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cm(kernel_module):
    return kernel_module("contact_map.py", "contact_map_under_test")


@pytest.fixture(scope="module")
def ref(load_module):
    return load_module("reference/contact_map.py", "contact_map_reference")


def _randomise(model, gen):
    """Non-trivial values for every parameter, LayerNorm affine included, scaled by 1/sqrt(fan_in)
    so that the sigmoid does not saturate (a saturated output would hide errors)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layer_norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / p.shape[1] ** 0.5)
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _pair(models, ref, C, H, seed, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    m_ref = ref.Model(C, H)
    _randomise(m_ref, gen)
    new = models.ModelNew(C, H)
    new.load_state_dict(m_ref.state_dict(), strict=True)
    return m_ref.to(device), new.to(device)


def _draw(shape, dist, gen):
    if dist == "normal":
        return torch.randn(shape, generator=gen)
    if dist == "uniform":
        return torch.rand(shape, generator=gen) * 4 - 2
    if dist == "offset":  # large mean: a naive one-pass variance loses all digits here
        return torch.randn(shape, generator=gen) + 100.0
    if dist == "heavy":  # student-t with 2 degrees of freedom
        n = torch.randn(shape, generator=gen)
        chi = torch.randn(shape + (2,), generator=gen).pow(2).sum(-1)
        return n / torch.sqrt(chi / 2)
    raise ValueError(dist)


def _check(cm_mod, m_ref, new, x, variant=None):
    """new(x) against the fp64 reference; also checks the input is unchanged and out is symmetric."""
    x_before = x.clone()
    for v in ([variant] if variant else new.VARIANTS):
        new.variant = v
        with torch.inference_mode():
            got = new(x)
        torch.cuda.synchronize()
        assert torch.equal(x, x_before), "input changed by the call"
        m64 = _copy64(m_ref)
        with torch.inference_mode():
            want = m64(x.double()).float()
        assert got.shape == want.shape and got.dtype == torch.float32 and got.device == x.device
        assert torch.isfinite(got).all()
        if want.numel() > 50 and x.shape[-1] > 1:  # a judge needs spread (pair_dim 1: LN(x) = beta)
            assert want.std() > 1e-2, f"weak oracle: reference output std {want.std():.2e}"
        bad = ~torch.isclose(got, want, atol=1e-4, rtol=1e-4)
        assert not bad.any(), (
            f"variant {v}: {int(bad.sum())} mismatches, first at {bad.nonzero()[:3].tolist()}: "
            f"got {got[bad][:3].tolist()} want {want[bad][:3].tolist()}")
        assert torch.equal(got, got.transpose(1, 2)), "output not exactly symmetric"


def _profiled(fn):
    """fn() under the CUDA profiler: (its result, the names of the GPU events it ran, space-separated)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, " ".join(e.name for e in prof.events())


def _copy64(m_ref):
    import copy
    return copy.deepcopy(m_ref).double()


# ------------------------------------------------------------------------------------------------
# CPU: build and input checks
# ------------------------------------------------------------------------------------------------
def test_builds_and_has_variants(cm):
    assert hasattr(cm, "ModelNew") and set(cm.ModelNew.VARIANTS) == {"v1", "v2", "v3", "v5", "v7", "v9", "v10", "v11", "v13", "v14", "v17", "v19", "v20"}
    assert cm.ModelNew(8, 4).variant == cm.ModelNew.VARIANTS[0]


def test_same_parameters_as_reference_under_same_seed(cm, ref):
    torch.manual_seed(42)
    a = ref.Model(64, 32)
    torch.manual_seed(42)
    b = cm.ModelNew(64, 32)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("shape,dtype,match", [
    ((2, 5, 5, 16), torch.float64, "must be float32, got Double"),
    ((2, 5, 5, 16), torch.float16, "must be float32, got Half"),
    ((5, 5, 16), torch.float32, r"must be \(B, N, N, pair_dim\), got shape \[5, 5, 16\]"),
    ((2, 5, 6, 16), torch.float32, r"pair_dim=16\), got shape \[2, 5, 6, 16\]"),
    ((2, 5, 5, 8), torch.float32, r"pair_dim=16\), got shape \[2, 5, 5, 8\]"),
    ((2, 5, 5, 16), torch.float32, "must be a CUDA tensor, got a tensor on cpu"),
])
def test_bad_input_raises(cm, shape, dtype, match):
    model = cm.ModelNew(16, 8)
    with pytest.raises(RuntimeError, match=match):
        model(torch.randn(shape).to(dtype))


@gpu
@needs_cuda
def test_input_on_other_device_than_parameters(cm):
    model = cm.ModelNew(16, 8)  # parameters on the CPU
    with pytest.raises(RuntimeError, match=r"pair_repr is on cuda:0 but parameter layer_norm.weight is on cpu"):
        model(torch.randn(1, 3, 3, 16, device="cuda"))


def test_unknown_variant(cm):
    model = cm.ModelNew(16, 8)
    model.variant = "v0"
    with pytest.raises(ValueError, match="unknown variant"):
        model(torch.randn(1, 3, 3, 16))


def test_kernel_arguments_and_forward_only_node_in_every_grad_mode(cm, monkeypatch):
    """CPU, the kernel replaced by a recorder: ModelNew hands the kernel the current parameters (read through
    the modules' dicts, a parametrized weight through its parametrization) in every grad mode, and every way
    of asking autograd for a gradient through the output raises the forward-only error, whichever tensors
    require grad (the node's inputs are all of them: with one anchor, `backward(inputs=[p])` and
    `autograd.grad(..., allow_unused=True)` for another p returned no gradient and no error)."""
    import torch.nn.utils.parametrize as parametrize
    calls = []

    class Scale(torch.nn.Module):
        def forward(self, w):
            return 1.7 * w

    class Recorder:
        @staticmethod
        def forward(*args):
            calls.append(args)
            return torch.zeros(args[0].shape[:3])

    monkeypatch.setattr(cm, "_ext", Recorder)
    new = cm.ModelNew(8, 4)
    ln, l1, l2, l3 = new.layer_norm, new.mlp[0], new.mlp[2], new.mlp[4]
    x = torch.randn(1, 3, 3, 8)

    def assert_args(x_in, w1=None):
        got = calls[-1]
        want = (x_in, ln.weight, ln.bias, ln.eps, l1.weight if w1 is None else w1, l1.bias, l2.weight, l2.bias,
                l3.weight, l3.bias, cm._VARIANT_IDS[new.variant])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if not torch.is_tensor(w):  # eps (float) and the variant id (int)
                assert type(g) is type(w) and g == w, (g, w)
            elif w1 is None:
                assert g is w  # the module's own tensor objects
            else:
                assert torch.equal(g, w)

    out = new(x)  # grad enabled, parameters require grad: as KernelBench times it
    assert_args(x)
    assert out.requires_grad
    for ask in (lambda o: o.sum().backward(), lambda o: o.sum().backward(inputs=[l2.weight]),
                lambda o: torch.autograd.grad(o.sum(), [l3.bias], allow_unused=True)):
        with pytest.raises(RuntimeError, match="forward-only"):
            ask(new(x))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert not new(x).requires_grad
        assert_args(x)
    for p in new.parameters():
        p.requires_grad_(False)
    assert not new(x).requires_grad
    xr = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="forward-only"):
        torch.autograd.grad(new(xr).sum(), [xr], allow_unused=True)
    assert_args(xr)
    new.mlp[2].weight = torch.nn.Parameter(torch.randn(4, 4))  # a replaced parameter: the new object
    l2 = new.mlp[2]
    new(x)
    assert_args(x)
    parametrize.register_parametrization(new.mlp[0], "weight", Scale())  # not in _parameters: the fallback
    new(x)
    assert_args(x, w1=1.7 * new.mlp[0].parametrizations.weight.original)
    assert new.last_variant == new.variant and "last_variant" not in new.state_dict()


# ------------------------------------------------------------------------------------------------
# GPU: correctness
# ------------------------------------------------------------------------------------------------
NAMED = ["seed", "crop", "batch", "long", "awkward_37", "awkward_1", "awkward_129"]


@gpu
@needs_cuda
@pytest.mark.parametrize("name", NAMED)
def test_named_shapes(cm, ref, name):
    s = ref.SHAPES[name]
    m_ref, new = _pair(cm, ref, s["pair_dim"], s["hidden_dim"], seed=NAMED.index(name))
    gen = torch.Generator().manual_seed(7)
    x = _draw((s["B"], s["N"], s["N"], s["pair_dim"]), "normal", gen).cuda()
    _check(cm, m_ref, new, x)


@gpu
@needs_cuda
@pytest.mark.parametrize("B,N,C,H", [
    (1, 1, 64, 32), (2, 2, 64, 32), (1, 127, 64, 32), (1, 129, 128, 64), (3, 9, 33, 17),
    (2, 17, 7, 5), (1, 40, 1, 1), (1, 31, 256, 128), (1, 23, 256, 64), (1, 19, 96, 200),
    (1, 70, 130, 100), (2, 24, 16, 16), (1, 50, 256, 256),
    # v5/v7's other weight layouts: in shared memory at hidden 128 (pair_dim <= 40), from global
    # memory at hidden 16 and 24 (pair_dim above what fits beside the tile)
    (1, 20, 40, 100), (1, 20, 256, 16), (1, 20, 232, 24),
    # more tiles than resident blocks on an H200 (132 SMs, 1-2 blocks each), so blocks walk several
    # tiles (the carried tile index, the next tile queued in halves, padding kept across tiles) with
    # padding, odd sizes, the weights from global memory, hidden 128/256
    (2, 130, 7, 5), (4, 96, 33, 17), (1, 160, 40, 100), (1, 160, 130, 100), (1, 160, 256, 64),
    (1, 160, 96, 200),
    # v7's fused statistics pass with the weights from global memory (pair_dim 41-128, hidden 65-128)
    (1, 160, 96, 100), (2, 67, 128, 128),
    # v7 at hidden <= 32 where one block fits per SM on an H200 (the 1-block build with the fused
    # pass; v9: its producer warps, which copy only where a block has a next tile: more than 132
    # tiles); pair_dim not a multiple of 4 (4-byte copies, padding columns in the fused pass's
    # second half); hidden 16 at pair_dim >= 136 (at 113-120 one block per SM holds by 256 bytes)
    (2, 100, 128, 32), (1, 90, 104, 20), (1, 150, 160, 16), (1, 150, 157, 16), (2, 100, 101, 32),
    # v9's producers with the weights from global memory (pair_dim > 208 at hidden 17-32, > 248 at
    # hidden 16; 4-byte copies) and in shared memory without the fused pass (pair_dim 129-208)
    (1, 200, 240, 24), (1, 200, 237, 24), (1, 200, 256, 16), (1, 160, 160, 32),
    # v10, v11 (and v13, v14, v17, v19, v20) (Hopper): their four builds (pair_dim <= 64 / <= 128, hidden <= 32 / <= 64), edge tiles (N % 8),
    # N = 8 (one box), pair_dim 48 / 96 (zero-filled channel boxes), hidden 17 / 33 / 40 (padded units),
    # and more tiles than 2 x 132 warpgroups (ring slots reused, both warpgroups walking tiles)
    (1, 8, 32, 32), (1, 9, 48, 17), (2, 100, 64, 64), (1, 200, 96, 40), (3, 77, 128, 33), (1, 300, 128, 64),
    (1, 250, 64, 20),
    # v13, v14, v17, v19, v20 (pair_dim > 64): their producer's tile walk (v19: tickets) across batches with fewer tiles per batch
    # than blocks (N = 8: one tile per batch; N = 20: 6), the 240-register build at hidden <= 32 with
    # zero-filled channel chunks (pair_dim 80)
    (300, 8, 96, 16), (40, 20, 128, 32), (2, 90, 80, 24),
])
@pytest.mark.parametrize("dist", ["normal", "offset"])
def test_awkward_sizes(cm, ref, B, N, C, H, dist):
    m_ref, new = _pair(cm, ref, C, H, seed=B * 1000 + N + C + H)
    gen = torch.Generator().manual_seed(N * 31 + C)
    _check(cm, m_ref, new, _draw((B, N, N, C), dist, gen).cuda())


@gpu
@needs_cuda
@pytest.mark.parametrize("dist", ["uniform", "heavy", "offset"])
def test_distributions(cm, ref, dist):
    m_ref, new = _pair(cm, ref, 128, 64, seed=3)
    gen = torch.Generator().manual_seed(11)
    _check(cm, m_ref, new, _draw((2, 67, 67, 128), dist, gen).cuda())


@gpu
@needs_cuda
@pytest.mark.parametrize("C,H", [(48, 33), (80, 16), (128, 64)])
def test_constant_rows(cm, ref, C, H):
    """Rows of one value: the plain two-pass mean (rounded sum times rounded 1/C) missed the value by
    an ulp at C = 48 / 80, and rstd = 1/sqrt(eps) made that 160x the reference's error (ninth session's
    review). The corrected two-pass statistics (ln_stats) make the row's centred values exactly 0."""
    m_ref, new = _pair(cm, ref, C, H, seed=C + H)
    gen = torch.Generator().manual_seed(C)
    x = _draw((2, 17, 17, C), "normal", gen)
    x[0, 3, 5] = 7.3
    x[1, 4, 4] = 12.9
    x[1, 2, 9] = -0.37
    x = x.cuda()
    _check(cm, m_ref, new, x)
    m64 = _copy64(m_ref)
    with torch.inference_mode():
        want = m64(x.double())
        e_ref = (m_ref(x).double() - want).abs().max().item()
        for v in new.VARIANTS:
            new.variant = v
            err = (new(x).double() - want).abs().max().item()
            assert err <= max(4 * e_ref, 1e-6), f"variant {v}: err {err:.2e} vs the reference's {e_ref:.2e}"


@gpu
@needs_cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0), reason="v10-v20 need an H100/H200")
def test_hopper_variants_run_their_own_kernels(cm):
    """v10, v11, v13, v14, v17, v19 and v20 fall back to v9 silently outside their tiles; inside them (crop-like
    shape, 16-byte aligned) the profiler must show the params kernel and contact_map_v10_kernel in the variant's own
    build (template argument V: 10, 11, 13, 14, 17, 19 or 20), and at pair_dim 37 neither."""
    import re
    for variant in ("v10", "v11", "v13", "v14", "v17", "v19", "v20"):
        for C, expect in ((128, True), (37, False)):
            new = cm.ModelNew(C, 64).cuda()
            new.variant = variant
            x = torch.randn(1, 40, 40, C, device="cuda")
            with torch.inference_mode():
                _, names = _profiled(lambda: new(x))
            assert ("contact_map_v10_kernel" in names) == expect, (variant, C, names[:300])
            if expect:
                assert "contact_map_v10_params_kernel" in names, (variant, names[:300])
                flags = set(re.findall(r"contact_map_v10_kernel<128, 64, (\w+)>", names))
                want = {variant[1:]}
                assert flags and flags <= want, (variant, flags, names[:300])


@gpu
@needs_cuda
@pytest.mark.parametrize("C", [64, 128])
def test_nan_propagates(cm, ref, C):
    """A NaN in x[b, i, j] makes the reference's out[b, i, j] and out[b, j, i] NaN (LayerNorm of the
    row, then ReLU keeps NaN) and nothing else; every variant must agree (fmaxf-ReLUs dropped it).
    pair_dim 64: the Hopper variants run v11's kernel; 128: their own (v20: its FFMA terms)."""
    m_ref, new = _pair(cm, ref, C, 32, seed=21)
    x = torch.randn(1, 20, 20, C, device="cuda")
    x[0, 3, 5, 7] = float("nan")
    with torch.inference_mode():
        want_nan = torch.isnan(m_ref(x))
    assert want_nan.sum() == 2 and want_nan[0, 3, 5] and want_nan[0, 5, 3]
    for v in new.VARIANTS:
        new.variant = v
        with torch.inference_mode():
            got = new(x)
        assert torch.equal(torch.isnan(got), want_nan), f"variant {v}: NaN at {torch.isnan(got).nonzero().tolist()}"


@gpu
@needs_cuda
def test_non_contiguous_and_misaligned(cm, ref):
    m_ref, new = _pair(cm, ref, 64, 32, seed=5)
    gen = torch.Generator().manual_seed(5)
    base = _draw((2, 64, 33, 33), "normal", gen).cuda()
    _check(cm, m_ref, new, base.permute(0, 2, 3, 1))               # permuted
    wide = _draw((2, 33, 33, 80), "normal", gen).cuda()
    _check(cm, m_ref, new, wide[..., 3:67])                         # sliced last dim
    flat = _draw((1 + 2 * 33 * 33 * 64,), "normal", gen).cuda()
    _check(cm, m_ref, new, flat[1:].view(2, 33, 33, 64))            # 4-byte but not 16-byte aligned


@gpu
@needs_cuda
def test_empty(cm):
    new = cm.ModelNew(64, 32).cuda()
    with torch.inference_mode():
        assert new(torch.randn(0, 5, 5, 64, device="cuda")).shape == (0, 5, 5)
        assert new(torch.randn(2, 0, 0, 64, device="cuda")).shape == (2, 0, 0)


@gpu
@needs_cuda
def test_parameters_read_at_each_call(cm, ref):
    m_ref, new = _pair(cm, ref, 64, 32, seed=8)
    x = torch.randn(1, 20, 20, 64, device="cuda")
    with torch.inference_mode():
        first = new(x)
    _randomise(m_ref, torch.Generator().manual_seed(99))
    new.load_state_dict(m_ref.state_dict())
    new.layer_norm.eps = 1e-3
    m_ref.layer_norm.eps = 1e-3
    with torch.inference_mode():
        second = new(x)
    assert not torch.allclose(first, second)
    _check(cm, m_ref, new, x)


@gpu
@needs_cuda
def test_grad_enabled_forward_then_backward_raises(cm, ref):
    m_ref, new = _pair(cm, ref, 64, 32, seed=9)
    x = torch.randn(1, 12, 12, 64, device="cuda")
    out = new(x)  # grad enabled, parameters require grad: as KernelBench times it
    with torch.no_grad():
        want = m_ref(x)
    assert torch.allclose(out.detach(), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="forward-only"):
        out.sum().backward()


@gpu
@needs_cuda
def test_output_poisoned_buffers_and_repeat_calls_agree(cm, ref):
    """Fill the caching allocator's blocks with NaN first: every output element must be written."""
    m_ref, new = _pair(cm, ref, 64, 32, seed=10)
    x = torch.randn(3, 45, 45, 64, device="cuda")
    for _ in range(3):
        junk = torch.full((3 * 45 * 45 * 4,), float("nan"), device="cuda")
        del junk
        with torch.inference_mode():
            got = new(x)
        assert torch.isfinite(got).all()
    _check(cm, m_ref, new, x)


@gpu
@needs_cuda
def test_more_than_2_31_elements(cm, ref):
    """(1, 4100, 4100, 128): 2.15e9 elements, 8.6 GB. Checked on a sampled sub-grid of positions:
    out[R, R] depends only on x[R][:, R] and its mirror, so the reference runs on that block."""
    free, _ = torch.cuda.mem_get_info()
    if free < 12e9:
        pytest.skip("needs 12 GB of free device memory")
    m_ref, new = _pair(cm, ref, 128, 64, seed=12)
    x = torch.empty(1, 4100, 4100, 128, device="cuda")
    x.normal_(generator=torch.Generator(device="cuda").manual_seed(12))
    with torch.inference_mode():
        got = new(x)
    rows = torch.tensor([0, 1, 2047, 2048, 4095, 4096, 4097, 4099], device="cuda")
    sub = x[:, rows][:, :, rows]
    del x
    with torch.inference_mode():
        want = _copy64(m_ref)(sub.double()).float()
    assert torch.allclose(got[:, rows][:, :, rows], want, atol=1e-4, rtol=1e-4)


@gpu
@needs_cuda
def test_back_to_back_calls_are_deterministic(cm, ref):
    """The same input 200 times back to back (no sync between calls) must give the same output every
    time. With 5 ring slots (batch-like shapes before the eleventh session) a consumer warpgroup could
    read a slot the other warpgroup's copy was still filling: 6 of 300 v13 calls were wrong."""
    m_ref, new = _pair(cm, ref, 128, 32, seed=5)
    x = torch.randn(8, 256, 256, 128, device="cuda")
    with torch.inference_mode():
        for v in ("v20", "v19", "v17", "v14", "v13", "v11", "v10"):
            new.variant = v
            first = new(x).clone()
            outs = [new(x) for _ in range(200)]
            torch.cuda.synchronize()
            wrong = sum(not torch.equal(o, first) for o in outs)
            assert wrong == 0, f"variant {v}: {wrong} of 200 calls differ"


@gpu
@needs_cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0), reason="v13-v19 need an H100/H200")
@pytest.mark.parametrize("variant,base", [("v14", "v13"), ("v17", "v14"), ("v19", "v17")])
@pytest.mark.parametrize("B,N,C,H", [
    # tiles per block's two consumer warpgroups on 132 SMs (H100 / H200 SXM; other SM counts give other
    # splits, still of both kinds): 1 / 0 (15 tiles), 1 / 1 or 1 / 0 (153), 5 / 4 or 4 / 4 (1176),
    # 16 / 16 (4224): equal counts, one more for warpgroup 0, and warpgroup 1 without a tile
    (1, 40, 128, 32), (1, 130, 128, 64), (1, 384, 128, 64), (8, 256, 128, 32),
])
def test_schedule_variants_match_their_base_bit_for_bit(cm, ref, variant, base, B, N, C, H):
    """v14 is v13 with the two consumer warpgroups' products taking turns (named barriers), v17 is v14 with
    the tile copies' L2 evict_first hint, v19 is v17 with the tiles handed out by an atomic counter: the same
    arithmetic in the same order per tile, so their outputs must equal their base's bit for bit, call after
    call (v19: the blocks' tile counts differ from call to call; with 15 and 153 tiles some blocks' second
    tile is past the end, so their sentinels come without a ticket). The barriers carry no data: a missing arrival
    shows as a hang (pytest sets no timeout: the run stalls), an extra one only as a changed schedule,
    which this bit-equality cannot see; nor can it see the cache hint (only timing does)."""
    m_ref, new = _pair(cm, ref, C, H, seed=B + N + H)
    x = torch.randn(B, N, N, C, generator=torch.Generator().manual_seed(N), dtype=torch.float32).cuda() + 0.3
    with torch.inference_mode():
        new.variant = base
        want = new(x).clone()
        new.variant = variant
        outs = [new(x) for _ in range(20)]
        torch.cuda.synchronize()
    assert new.last_variant == variant
    wrong = sum(not torch.equal(o, want) for o in outs)
    assert wrong == 0, f"{wrong} of 20 {variant} calls differ from {base}"


@gpu
@needs_cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0), reason="v19, v20 need an H100/H200")
@pytest.mark.parametrize("variant,base", [("v19", "v17"), ("v20", "v20")])
@pytest.mark.parametrize("B,N,C,H", [(8, 256, 128, 32), (2, 200, 128, 64)])
def test_dynamic_tiles_write_every_output_on_every_call(cm, ref, variant, base, B, N, C, H):
    """v19 and v20 hand tiles out from a counter that their params kernel zeroes on every call. If a call started
    from a stale count, tiles would be skipped and their outputs left as the allocator's old bytes: each
    call's output block is poisoned with NaN first (a freed NaN block of the output's size), every call
    must equal the base's output bit for bit (v19: v17's; v20: its own first call's, as its arithmetic is its
    own), and the last must match the fp64 reference at atol = rtol = 1e-4."""
    m_ref, new = _pair(cm, ref, C, H, seed=N + H)
    x = torch.randn(B, N, N, C, generator=torch.Generator().manual_seed(B + N), dtype=torch.float32).cuda()
    with torch.inference_mode():
        new.variant = base
        want_base = new(x).clone()
        want = _copy64(m_ref)(x.double()).float()
        new.variant = variant
        for _ in range(12):
            junk = torch.full((B, N, N), float("nan"), device="cuda")
            del junk
            got = new(x)
            torch.cuda.synchronize()
            assert torch.isfinite(got).all(), "an output element was not written"
            assert torch.equal(got, want_base)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@gpu
@needs_cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0), reason="v20 needs an H100/H200")
@pytest.mark.parametrize("B,N,C,H,scale,offset", [
    # +30 offset (the statistics' d = x - m carries the row's spread, the delta the mean's rounding), x100 inputs,
    # pair_dim 96 (zero-filled channel chunks keep x = 0 and get the term c), hidden 64 / 32, edge tiles (N % 8)
    (1, 200, 128, 32, 1.0, 30.0), (2, 96, 128, 32, 100.0, 0.0), (1, 130, 128, 64, 1.0, 0.2), (1, 67, 96, 33, 1.0, -5.0),
])
def test_v20_fma_terms_stay_within_the_accuracy_goal(cm, ref, B, N, C, H, scale, offset):
    """v20 computes each side's LayerNorm term (x - mean) rstd / 2 as fmaf(d, r, -delta r) from the statistics'
    d = x - m (other roundings than v19). In its own kernel (the profiler shows contact_map_v10_kernel<128, *, 20>),
    its max error against fp64 must stay within issue 5's goal, 2x the fp32 reference's own, and its outputs must
    stay exactly symmetric (_check). At the +30 offset its mean is never rounded where v19's is: its error must be
    at most half v19's there (device run 4: 3.6e-7 against 1.8e-6)."""
    import re
    m_ref, new = _pair(cm, ref, C, H, seed=B + N + C + H)
    gen = torch.Generator().manual_seed(N + C)
    x = (torch.randn(B, N, N, C, generator=gen) * scale + offset).cuda()
    _check(cm, m_ref, new, x, variant="v20")
    with torch.inference_mode():
        want = _copy64(m_ref)(x.double())
        e_ref = (m_ref(x).double() - want).abs().max().item()
        new.variant = "v19"
        e19 = (new(x).double() - want).abs().max().item()
        new.variant = "v20"
        got, names = _profiled(lambda: new(x))
        err = (got.double() - want).abs().max().item()
    assert set(re.findall(r"contact_map_v10_kernel<128, \d+, (\w+)>", names)) == {"20"}, names[:300]
    assert err <= 2 * e_ref, f"v20: err {err:.2e} vs the fp32 reference's {e_ref:.2e}"
    if offset >= 30:
        assert err <= 0.5 * e19, f"v20: err {err:.2e} vs v19's {e19:.2e}"
