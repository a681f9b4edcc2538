"""The reference Models against independent float64 formulas written out by hand (no call to Model).

Each formula takes the model's parameters as float64 arrays and evaluates the op with einsum in a
different order (and, for a few entries, with plain Python loops). Models run in float32 (checked
to 2e-5 against the formula) and in float64 via .double() (checked to 1e-10).
"""
import math

import pytest
import torch

import harness

CM = harness.load_module("reference/contact_map.py")
OPM = harness.load_module("reference/outer_product_mean.py")
OPM_OF = harness.load_module("reference/outer_product_mean_openfold.py")
OPM_BZ = harness.load_module("reference/outer_product_mean_boltz.py")


def randomise(model, seed):
    """Non-trivial parameters (LayerNorm affine included), deterministic per seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 / math.sqrt(p[0].numel()) if p.dim() > 1 else 0.5
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=g))
    return model


def params64(model):
    return {k: v.detach().double() for k, v in model.state_dict().items()}


def layer_norm64(x, w, b, eps):
    mu = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mu) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    return (x - mu) / torch.sqrt(var + eps) * w + b


# --- contact map -----------------------------------------------------------------------------
def contact_map64(p, eps, pair):
    """sigmoid(MLP((LN(z)_ij + LN(z)_ji) / 2)) in float64; pair (B, N, N, c) -> (B, N, N)."""
    x = layer_norm64(pair.double(), p["layer_norm.weight"], p["layer_norm.bias"], eps)
    x = 0.5 * (x + torch.einsum("bjic->bijc", x))
    h = torch.clamp(torch.einsum("bijc,hc->bijh", x, p["mlp.0.weight"]) + p["mlp.0.bias"], min=0)
    h = torch.clamp(torch.einsum("bijc,hc->bijh", h, p["mlp.2.weight"]) + p["mlp.2.bias"], min=0)
    z = torch.einsum("bijh,h->bij", h, p["mlp.4.weight"][0]) + p["mlp.4.bias"][0]
    return 1.0 / (1.0 + torch.exp(-z))


def contact_map_entry_loops(p, eps, pair, b, i, j):
    """One output entry with Python loops (float64)."""
    c = pair.shape[-1]

    def ln(v):
        v = [float(t) for t in v]
        mu = sum(v) / c
        var = sum((t - mu) ** 2 for t in v) / c
        return [(t - mu) / math.sqrt(var + eps) * float(p["layer_norm.weight"][k]) + float(p["layer_norm.bias"][k])
                for k, t in enumerate(v)]

    u, w = ln(pair[b, i, j]), ln(pair[b, j, i])
    x = [(s + t) / 2 for s, t in zip(u, w)]
    for layer in ("mlp.0", "mlp.2"):
        W, bias = p[layer + ".weight"], p[layer + ".bias"]
        x = [max(0.0, sum(float(W[o, k]) * x[k] for k in range(len(x))) + float(bias[o])) for o in range(W.shape[0])]
    z = sum(float(p["mlp.4.weight"][0, k]) * x[k] for k in range(len(x))) + float(p["mlp.4.bias"][0])
    return 1.0 / (1.0 + math.exp(-z))


@pytest.mark.parametrize("dims", [dict(B=2, N=7, pair_dim=16, hidden_dim=8), CM.SHAPES["awkward_37"],
                                  CM.SHAPES["awkward_1"]])
def test_contact_map_matches_fp64_formula(dims):
    model = randomise(CM.Model(*CM.init_inputs_for(dims)), 1).eval()
    g = torch.Generator().manual_seed(2)
    pair = torch.randn(CM.input_shapes_for(dims)[0], generator=g) * 3 + 1
    want = contact_map64(params64(model), model.layer_norm.eps, pair)
    with torch.no_grad():
        got32 = model(pair)
        got64 = model.double()(pair.double())
    assert got32.shape == (dims["B"], dims["N"], dims["N"]) and got32.dtype == torch.float32
    torch.testing.assert_close(got64, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got32.double(), want, atol=2e-5, rtol=2e-5)
    n = dims["N"]
    for b, i, j in {(0, 0, 0), (dims["B"] - 1, n - 1, 0), (0, n // 2, n - 1)}:
        assert abs(contact_map_entry_loops(params64(model), model.layer_norm.eps, pair.double(), b, i, j)
                   - float(want[b, i, j])) < 1e-12
    torch.testing.assert_close(got64, got64.transpose(1, 2), atol=1e-12, rtol=0)  # symmetric


def test_contact_map_kernelbench_functions():
    inputs = CM.get_inputs()
    assert [tuple(x.shape) for x in inputs] == [(CM.batch_size, CM.seq_len, CM.seq_len, CM.pair_dim)]
    assert CM.get_init_inputs() == [CM.pair_dim, CM.hidden_dim]
    assert CM.init_inputs_for(CM.SHAPES["seed"]) == CM.get_init_inputs()
    m = CM.Model(*CM.get_init_inputs())
    assert [n for n, _ in m.named_children()] == ["layer_norm", "mlp"]
    assert m(*inputs).shape == (CM.batch_size, CM.seq_len, CM.seq_len)


# --- outer product mean -----------------------------------------------------------------------
def opm64(p, eps, msa, mask):
    """out[b,i,j,z] = bias_z + sum_{h,k} W[z,(h,k)] (sum_s a[b,s,i,h] b[b,s,j,k]) / max(sum_s m[b,s,i], 1)."""
    m = mask.double()
    x = layer_norm64(msa.double(), p["layer_norm.weight"], p["layer_norm.bias"], eps)
    a = (torch.einsum("bsnc,hc->bsnh", x, p["proj_a.weight"]) + p["proj_a.bias"]) * m[..., None]
    bb = (torch.einsum("bsnc,hc->bsnh", x, p["proj_b.weight"]) + p["proj_b.bias"]) * m[..., None]
    c = a.shape[-1]
    W = p["out_proj.weight"].reshape(-1, c, c)  # (c_z, h, k)
    num = torch.einsum("bsih,zhk,bsjk->bijz", a, W, bb)
    denom = torch.clamp(m.sum(1), min=1.0)  # (B, N): row i only
    return num / denom[:, :, None, None] + p["out_proj.bias"]


def opm_entry_loops(p, eps, msa, mask, b, i, j, z):
    """One output entry with Python loops (float64)."""
    S, c_m = msa.shape[1], msa.shape[-1]
    c = p["proj_a.weight"].shape[0]

    def proj(which, s, n):
        v = [float(t) for t in msa[b, s, n]]
        mu = sum(v) / c_m
        var = sum((t - mu) ** 2 for t in v) / c_m
        x = [(t - mu) / math.sqrt(var + eps) * float(p["layer_norm.weight"][k]) + float(p["layer_norm.bias"][k])
             for k, t in enumerate(v)]
        W, bias = p[which + ".weight"], p[which + ".bias"]
        return [(sum(float(W[h, k]) * x[k] for k in range(c_m)) + float(bias[h])) * float(mask[b, s, n])
                for h in range(c)]

    A = [proj("proj_a", s, i) for s in range(S)]
    Bm = [proj("proj_b", s, j) for s in range(S)]
    denom = max(sum(float(mask[b, s, i]) for s in range(S)), 1.0)
    total = 0.0
    for h in range(c):
        for k in range(c):
            o = sum(A[s][h] * Bm[s][k] for s in range(S)) / denom
            total += float(p["out_proj.weight"][z, h * c + k]) * o
    return total + float(p["out_proj.bias"][z])


def make_mask(kind, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros01":
        return (torch.rand(shape, generator=g) < 0.6).float()
    if kind == "fractional":
        return torch.rand(shape, generator=g)
    if kind == "bool":
        return torch.rand(shape, generator=g) < 0.6
    if kind == "dead":  # position 1 masked in every sequence, the rest random 0/1
        m = (torch.rand(shape, generator=g) < 0.6).float()
        m[:, :, 1] = 0
        return m
    raise ValueError(kind)


OPM_DIMS = [dict(B=2, S=3, N=6, msa_dim=8, hidden_dim=4, pair_dim=5), OPM.SHAPES["awkward_33"],
            OPM.SHAPES["awkward_17"]]


@pytest.mark.parametrize("kind", ["ones", "zeros01", "fractional", "bool", "dead"])
@pytest.mark.parametrize("dims", OPM_DIMS, ids=["tiny", "awkward_33", "awkward_17"])
def test_outer_product_mean_matches_fp64_formula(dims, kind):
    model = randomise(OPM.Model(*OPM.init_inputs_for(dims)), 3).eval()
    shapes = OPM.input_shapes_for(dims)
    g = torch.Generator().manual_seed(4)
    msa = torch.randn(shapes[0], generator=g) * 2 - 1
    mask = make_mask(kind, shapes[1], 5)
    p = params64(model)
    want = opm64(p, model.layer_norm.eps, msa, mask)
    with torch.no_grad():
        got32 = model(msa, mask)
        got64 = model.double()(msa.double(), mask.double() if mask.is_floating_point() else mask)
    assert got32.shape == (dims["B"], dims["N"], dims["N"], dims["pair_dim"]) and got32.dtype == torch.float32
    torch.testing.assert_close(got64, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got32.double(), want, atol=2e-5, rtol=2e-5)
    if dims is OPM_DIMS[0]:
        for (b, i, j, z) in [(0, 0, 0, 0), (1, 1, 4, 2), (1, 5, 1, 4)]:
            assert abs(opm_entry_loops(p, model.layer_norm.eps, msa.double(), mask, b, i, j, z)
                       - float(want[b, i, j, z])) < 1e-12
    if kind == "dead":  # a fully masked row i: a = 0 there, denominator clamps to 1 -> output = bias
        torch.testing.assert_close(got64[:, 1], p["out_proj.bias"].expand_as(got64[:, 1]), atol=1e-12, rtol=0)


def test_outer_product_mean_is_not_af2_normalised():
    """The denominator is clamp(sum_s mask[s,i], 1), not AlphaFold 2's sum_s mask[s,i] mask[s,j] + 1e-3."""
    dims = OPM_DIMS[0]
    model = randomise(OPM.Model(*OPM.init_inputs_for(dims)), 6).double().eval()
    shapes = OPM.input_shapes_for(dims)
    msa = torch.randn(shapes[0], dtype=torch.float64)
    mask = make_mask("zeros01", shapes[1], 7).double()
    p = params64(model)
    out = model(msa, mask)
    x = layer_norm64(msa, p["layer_norm.weight"], p["layer_norm.bias"], model.layer_norm.eps)
    a = (x @ p["proj_a.weight"].T + p["proj_a.bias"]) * mask[..., None]
    b = (x @ p["proj_b.weight"].T + p["proj_b.bias"]) * mask[..., None]
    outer = torch.einsum("bsih,bsjk->bijhk", a, b)
    af2 = (outer / (torch.einsum("bsi,bsj->bij", mask, mask) + 1e-3)[..., None, None]).flatten(-2)
    af2 = af2 @ p["out_proj.weight"].T + p["out_proj.bias"]
    assert (out - af2).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["fractional", "bool", "dead"])
def test_forward_rows_matches_forward(kind):
    dims = dict(B=2, S=4, N=9, msa_dim=8, hidden_dim=4, pair_dim=6)
    model = randomise(OPM.Model(*OPM.init_inputs_for(dims)), 8).eval()
    shapes = OPM.input_shapes_for(dims)
    msa = torch.randn(shapes[0], generator=torch.Generator().manual_seed(9))
    mask = make_mask(kind, shapes[1], 10)
    rows = torch.tensor([0, 1, 5, 8])
    with torch.no_grad():
        full = model(msa, mask)
        part = OPM.forward_rows(model, msa, mask, rows)
    assert part.shape == (2, 4, 9, 6)
    torch.testing.assert_close(part, full[:, rows], atol=1e-6, rtol=1e-6)
    want = opm64(params64(model), model.layer_norm.eps, msa, mask)[:, rows]
    torch.testing.assert_close(part.double(), want, atol=2e-5, rtol=2e-5)


def test_outer_product_mean_kernelbench_functions():
    msa, mask = OPM.get_inputs()
    assert tuple(msa.shape) == (OPM.batch_size, OPM.msa_depth, OPM.seq_len, OPM.msa_dim)
    assert tuple(mask.shape) == (OPM.batch_size, OPM.msa_depth, OPM.seq_len) and bool((mask == 1).all())
    assert OPM.get_init_inputs() == [OPM.msa_dim, OPM.pair_dim, OPM.hidden_dim]
    m = OPM.Model(*OPM.get_init_inputs())
    assert [n for n, _ in m.named_children()] == ["layer_norm", "proj_a", "proj_b", "out_proj"]
    assert m(msa, mask).shape == (OPM.batch_size, OPM.seq_len, OPM.seq_len, OPM.pair_dim)


# --- outer product mean, released normalisations (OpenFold family, Boltz) -------------------------
# Parameter names per family: (LayerNorm, projection a, projection b, output Linear).
OF_NAMES = ("layer_norm", "linear_1", "linear_2", "linear_out")
BZ_NAMES = ("norm", "proj_a", "proj_b", "proj_o")


def opm_pair64(p, names, ln_eps, msa, mask, normalise):
    """float64 outer product mean with a pair-count normaliser, from the parameters `p` under `names`.

    num[b,i,j,z]   = sum_{h,k} W[z,(h,k)] sum_s a[b,s,i,h] b[b,s,j,k]   (a, b projected and masked)
    count[b,i,j]   = sum_s m[b,s,i] m[b,s,j]
    normalise="openfold": (num + bias) / (count + eps)  with eps = p["eps"]
    normalise="boltz":    num / max(count, 1) + bias
    """
    ln, pa, pb, po = names
    m = mask.double()
    x = layer_norm64(msa.double(), p[ln + ".weight"], p[ln + ".bias"], ln_eps)
    a = (torch.einsum("bsnc,hc->bsnh", x, p[pa + ".weight"]) + p.get(pa + ".bias", 0.0)) * m[..., None]
    bb = (torch.einsum("bsnc,hc->bsnh", x, p[pb + ".weight"]) + p.get(pb + ".bias", 0.0)) * m[..., None]
    c = a.shape[-1]
    num = torch.einsum("bsih,zhk,bsjk->bijz", a, p[po + ".weight"].reshape(-1, c, c), bb)
    count = torch.einsum("bsi,bsj->bij", m, m)[..., None]
    if normalise == "openfold":
        return (num + p[po + ".bias"]) / (count + p["eps"])
    return num / torch.clamp(count, min=1.0) + p[po + ".bias"]


def opm_pair_entry_loops(p, names, ln_eps, msa, mask, normalise, b, i, j, z):
    """One output entry of opm_pair64 with Python loops (float64)."""
    ln, pa, pb, po = names
    S, c_m = msa.shape[1], msa.shape[-1]
    c = p[pa + ".weight"].shape[0]

    def proj(which, s, n):
        v = [float(t) for t in msa[b, s, n]]
        mu = sum(v) / c_m
        var = sum((t - mu) ** 2 for t in v) / c_m
        x = [(t - mu) / math.sqrt(var + ln_eps) * float(p[ln + ".weight"][k]) + float(p[ln + ".bias"][k])
             for k, t in enumerate(v)]
        W = p[which + ".weight"]
        bias = [float(t) for t in p[which + ".bias"]] if which + ".bias" in p else [0.0] * c
        return [(sum(float(W[h, k]) * x[k] for k in range(c_m)) + bias[h]) * float(mask[b, s, n]) for h in range(c)]

    A = [proj(pa, s, i) for s in range(S)]
    Bm = [proj(pb, s, j) for s in range(S)]
    num = sum(float(p[po + ".weight"][z, h * c + k]) * sum(A[s][h] * Bm[s][k] for s in range(S))
              for h in range(c) for k in range(c))
    count = sum(float(mask[b, s, i]) * float(mask[b, s, j]) for s in range(S))
    bias = float(p[po + ".bias"][z])
    if normalise == "openfold":
        return (num + bias) / (count + p["eps"])
    return num / max(count, 1.0) + bias


FAMILIES = {  # id: (reference module, parameter names, normaliser, extra constructor arguments)
    "openfold": (OPM_OF, OF_NAMES, "openfold", {}),
    "openfold_bias_eps": (OPM_OF, OF_NAMES, "openfold", dict(eps=0.25, proj_bias=True)),
    "boltz": (OPM_BZ, BZ_NAMES, "boltz", {}),
}


def family_model(fam, dims, seed):
    mod, names, normalise, kw = FAMILIES[fam]
    model = randomise(mod.Model(*mod.init_inputs_for(dims), **kw), seed).eval()
    p = params64(model)
    p["eps"] = getattr(model, "eps", None)
    return model, p, names, normalise, getattr(model, names[0]).eps


@pytest.mark.parametrize("kind", ["ones", "zeros01", "fractional", "bool", "dead"])
@pytest.mark.parametrize("dims", OPM_DIMS, ids=["tiny", "awkward_33", "awkward_17"])
@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_family_references_match_fp64_formula(fam, dims, kind):
    model, p, names, normalise, ln_eps = family_model(fam, dims, 31)
    shapes = OPM_OF.input_shapes_for(dims)
    msa = torch.randn(shapes[0], generator=torch.Generator().manual_seed(32)) * 2 - 1
    mask = make_mask(kind, shapes[1], 33)
    want = opm_pair64(p, names, ln_eps, msa, mask, normalise)
    with torch.no_grad():
        got32 = model(msa, mask)
        got64 = model.double()(msa.double(), mask.double() if mask.is_floating_point() else mask)
    assert got32.shape == (dims["B"], dims["N"], dims["N"], dims["pair_dim"]) and got32.dtype == torch.float32
    torch.testing.assert_close(got64, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got32.double(), want, atol=2e-5, rtol=2e-5)
    if dims is OPM_DIMS[0]:
        for (b, i, j, z) in [(0, 0, 0, 0), (1, 1, 4, 2), (1, 5, 1, 4)]:
            loops = opm_pair_entry_loops(p, names, ln_eps, msa.double(), mask, normalise, b, i, j, z)
            assert abs(loops - float(want[b, i, j, z])) < 1e-10 * max(1.0, abs(loops))
    if kind == "dead":  # position 1 masked in every sequence: pair count 0 along row 1 and column 1
        bias = p[names[3] + ".bias"]
        edge = bias / p["eps"] if normalise == "openfold" else bias  # (0 + bias) / eps, or 0 / 1 + bias
        for out in (got64[:, 1], got64[:, :, 1]):
            torch.testing.assert_close(out, edge.expand_as(out), atol=1e-9, rtol=1e-12)


def test_family_normalisations_differ_where_documented():
    """Same weights in both families (names mapped): with all-ones masks the two agree once the place
    of the bias is accounted for; pair counts below 1 (fractional masks) are where clamp(count, 1) and
    count + 1e-3 part."""
    dims = OPM_DIMS[0]
    bz = randomise(OPM_BZ.Model(*OPM_BZ.init_inputs_for(dims)), 34).double().eval()
    of = OPM_OF.Model(*OPM_OF.init_inputs_for(dims)).double().eval()
    rename = dict(zip(BZ_NAMES, OF_NAMES))
    of.load_state_dict({rename[k.split(".")[0]] + "." + k.split(".")[1]: v for k, v in bz.state_dict().items()},
                       strict=True)
    shapes = OPM_OF.input_shapes_for(dims)
    S = shapes[0][1]
    msa = torch.randn(shapes[0], dtype=torch.float64, generator=torch.Generator().manual_seed(35))
    bias = bz.proj_o.bias
    with torch.no_grad():
        ones = torch.ones(shapes[1], dtype=torch.float64)
        # Boltz: W.o / S + bias; OpenFold: (W.o + bias) / (S + eps)
        torch.testing.assert_close(of(msa, ones), (S * (bz(msa, ones) - bias) + bias) / (S + 1e-3),
                                   atol=1e-12, rtol=1e-12)
        frac = make_mask("fractional", shapes[1], 36).double()
        count = torch.einsum("bsi,bsj->bij", frac, frac)
        assert bool((count < 1).any()) and bool((count >= 1).any())
        of_num = of(msa, frac) * (count + 1e-3)[..., None] - bias   # W.o, from each family's output
        bz_num = (bz(msa, frac) - bias) * torch.clamp(count, min=1)[..., None]
        torch.testing.assert_close(of_num, bz_num, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", ["fractional", "bool", "dead"])
@pytest.mark.parametrize("mod", [OPM_OF, OPM_BZ], ids=["openfold", "boltz"])
def test_family_forward_rows_matches_forward(mod, kind):
    dims = dict(B=2, S=4, N=9, msa_dim=8, hidden_dim=4, pair_dim=6)
    model = randomise(mod.Model(*mod.init_inputs_for(dims)), 37).eval()
    shapes = mod.input_shapes_for(dims)
    msa = torch.randn(shapes[0], generator=torch.Generator().manual_seed(38))
    mask = make_mask(kind, shapes[1], 39)
    rows = torch.tensor([0, 1, 5, 8])
    with torch.no_grad():
        full = model(msa, mask)
        part = mod.forward_rows(model, msa, mask, rows)
    assert part.shape == (2, 4, 9, 6)
    torch.testing.assert_close(part, full[:, rows], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mod, names", [(OPM_OF, OF_NAMES), (OPM_BZ, BZ_NAMES)], ids=["openfold", "boltz"])
def test_family_kernelbench_functions(mod, names):
    msa, mask = mod.get_inputs()
    assert tuple(msa.shape) == (mod.batch_size, mod.msa_depth, mod.seq_len, mod.msa_dim)
    assert tuple(mask.shape) == (mod.batch_size, mod.msa_depth, mod.seq_len) and bool((mask == 1).all())
    assert mod.get_init_inputs() == [mod.msa_dim, mod.pair_dim, mod.hidden_dim]
    assert mod.SHAPES == OPM.SHAPES  # the same named shapes as reference/outer_product_mean.py
    m = mod.Model(*mod.get_init_inputs())
    assert tuple(n for n, _ in m.named_children()) == names
    # no bias on the projections by default (OpenFold3 / AlphaFold 3, Boltz); the output Linear has one
    assert sorted(m.state_dict()) == sorted([names[0] + ".weight", names[0] + ".bias", names[1] + ".weight",
                                             names[2] + ".weight", names[3] + ".weight", names[3] + ".bias"])
    assert m(msa, mask).shape == (mod.batch_size, mod.seq_len, mod.seq_len, mod.pair_dim)
    if mod is OPM_OF:
        assert m.eps == 1e-3
        with torch.no_grad():
            torch.testing.assert_close(m(msa), m(msa, mask), atol=0, rtol=0)  # no mask = all ones


@pytest.mark.parametrize("mod", [CM, OPM, OPM_OF, OPM_BZ],
                         ids=["contact_map", "outer_product_mean", "outer_product_mean_openfold",
                              "outer_product_mean_boltz"])
def test_shape_tables_are_consistent(mod):
    for name, dims in mod.SHAPES.items():
        shapes = mod.input_shapes_for(dims)
        assert len(shapes) == len(mod.INPUT_ROLES), name
        assert mod.flops(dims) > 0 and mod.min_bytes(dims) > 0 and mod.peak_bytes(dims) > 0, name
        n_in = sum(math.prod(s) for s in shapes)
        assert mod.min_bytes(dims) > 4 * n_in, name  # inputs plus the output
        mod.Model(*mod.init_inputs_for(dims)) if dims.get("N", 0) <= 1536 else None
    assert "seed" in mod.SHAPES and any(n.startswith("awkward") for n in mod.SHAPES)
