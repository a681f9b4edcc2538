"""Contact-map head as fused CUDA kernels (KernelBench format: defines `ModelNew`).

Drop-in replacement for `reference/contact_map.py`'s `Model`:

    x[b,i,j,c]  = LayerNorm_c(pair[b,i,j,:])                   gamma, beta, eps from `layer_norm`
    s[b,i,j,c]  = (x[b,i,j,c] + x[b,j,i,c]) / 2                symmetric in (i, j)
    h1[b,i,j,h] = relu(sum_c W1[h,c] s[b,i,j,c] + b1[h])       mlp[0]: pair_dim -> hidden_dim
    h2[b,i,j,g] = relu(sum_h W2[g,h] h1[b,i,j,h] + b2[g])      mlp[2]: hidden_dim -> hidden_dim
    out[b,i,j]  = sigmoid(sum_g w3[g] h2[b,i,j,g] + b3)        mlp[4]: hidden_dim -> 1

Tensors: pair (B, N, N, C = pair_dim) float32, float16 or bfloat16 on a CUDA device (any strides); out
(B, N, N) in pair's dtype on the same device. Parameters: the reference's (H = hidden_dim), in pair's dtype
on its device, read at every call (a later `load_state_dict` or in-place update takes effect).

Every kernel walks tiles of 8 x 8 positions (b, I, J) with I <= J, reads the tile x[b, 8I.., 8J.., :] and its
mirror x[b, 8J.., 8I.., :] from device memory once and writes out[b,i,j] and out[b,j,i] (exactly symmetric).
Variants (`ModelNew.VARIANTS` = "auto", "mma", "fma", "small", a model's: those its dimensions allow; set by
`model.variant`; `model.last_variant` names the kernel that ran: "wgmma", "wgmma16", "mma", "fma" or "small"):
  "auto"  the default: for fp16 / bf16 "small" up to small_auto_tiles_per_sm(dtype) = 2 tiles per SM (fp32: 0),
          else wgmma where it runs (its 16-bit build wgmma16 for fp16 / bf16), else "mma".
  wgmma   Hopper: needs the sm_90a build, a compute capability 9.0 GPU, 32 <= pair_dim <= 128 with
          pair_dim % 16 == 0, hidden_dim <= 64, N >= 8 and a 16-byte aligned input. A small kernel folds the
          LayerNorm affine into the first layer (W1' = W1 diag(gamma), b1' = b1 + W1 beta in fp64) and packs
          W1', W2 as split-TF32 planes; the main kernel, its programmatic dependent, runs one persistent block
          per SM. A producer thread hands out tiles (one fixed per consumer, then tickets from an atomic
          counter) and copies each tile and its mirror with the TMA engine into a ring of shared-memory slots
          (L2 evict_first). Consumer warpgroups read their rows into registers, take the LayerNorm statistics
          by the corrected two-sweep algorithm (Chan, Golub & LeVeque 1983: a first mean m, then with
          d = x - m, mean = m + sum d / C, var = (sum d^2 - (sum d)^2 / C) / C; exact on rows of one value),
          form s with one FFMA per side, then GEMM1 (wgmma m64nHk8, A from registers), relu, GEMM2 on GEMM1's
          accumulator re-split in registers, layer 3 and the sigmoid. In fp32 two consumer warpgroups take
          turns on the tensor cores. At pair_dim <= 64 a simpler KC = 64 build runs (a fixed stride of
          tiles, no cache hint, no turns).
  wgmma16 fp16 / bf16 where wgmma runs and pair_dim >= 64: the input read in its own type, statistics and s
          in fp32, s rounded once to that type, both products as wgmma m64nHk16 in that type with fp32
          accumulation, W1' and W2 rounded to it once per call, b1', b2, w3, layer 3 and the sigmoid in fp32,
          the output stored in the input's type. At pair_dim > 64 the first mean is corrected once by its
          exact residual (the fp32 build's sum of d would move s far below its 16-bit rounding); s is then
          not bit-symmetric, so both outputs are written from the i <= j position; three consumer warpgroups
          share an SM. Other fp16 / bf16 calls run the fp32 kernels on a converted copy.
  "mma"   sm_80+, every shape: the same tiles by cp.async, both products on mma.sync m16n8k8 in split TF32,
          16 warps per block (8 of them queue the next tile's first rows during GEMM1 where one block fits
          per SM and hidden_dim <= 32), weights staged once per block as split fragments (8 warps and the
          weights read through L1 at hidden_dim > 128). For the shapes and GPUs wgmma does not cover.
  "fma"   plain fp32 FMA products on the same tiles: no tensor cores, an independent check of the others.
  "small" sm_80+, 8 <= pair_dim <= 64 with pair_dim % 8 == 0, hidden_dim <= 32 (forced elsewhere it raises):
          one launch, a block of 8 warps per tile, the parameters as they are (no params kernel), mma.sync (fp32:
          split TF32; 16-bit: in that type), for a few tiles per SM (KernelBench's (4, 64, 64, 64)).

Precision: fp32 LayerNorm and accumulation, no fast-math. Split TF32 (x = hi + lo, both TF32, a*b ~ hi*hi +
hi*lo + lo*hi; CUTLASS's fp32-accurate tensor-core GEMM) with short partial sums promoted into an fp32
accumulator by ordinary adds (the tensor cores' own accumulation truncates): every k step (mma), every 16 k
(wgmma). wgmma never rounds the mean, so at offset inputs it is more accurate than the fp32 reference: at the
harness's shapes its max error against fp64 is 0.05-0.08x the fp32 reference's own, at most about 1.1x in a
single trial (NOTES.md has every kernel's figures). wgmma16's error is about the reference's own in that
dtype, set by the output's rounding. A NaN in the input gives NaN at the same outputs as the reference (the
ReLUs are max.NaN); a row of one constant value centres to 0 (wgmma: within about 2^-24 of d r).

Limits: pair_dim and hidden_dim up to 256 (larger raises a clear error); hidden_dim is zero-padded to
16/32/64/128/256. The mma and fma kernels read the weights through L1 where they do not fit beside the tile
in shared memory (correct, slower). Needs an sm_80+ GPU; tuned on the H200 only. Where |x - mean| exceeds
~1e19 sum d^2 overflows and the row gives NaN (the fp32 reference too). Tiny shapes (N <= 17) can reach a
few times the fp32 reference's (tiny) error.

Half precision and training: float16 / bfloat16 input and parameters of one dtype go to wgmma16 (above);
mixed dtypes under CUDA autocast run the fp32 kernels and return the autocast dtype, as the reference does.
The backward saves only the inputs. Where pair_dim and hidden_dim are multiples of 16 up to 128 / 64 (sm_80+;
fused_backward_runs) it is one fused kernel (contact_map_backward_kernel): per tile the forward recomputed,
the products in split TF32, fp64's ReLU masks (positions near a kink recomputed in fp64), d_pair written once
in the input's dtype, the parameters' gradients summed per block and then in float64 (bw_sum_partials_kernel).
Elsewhere PyTorch ops (contact_map_backward, float32 inside) recompute the LayerNorm, s and the MLP with the
reference's own ops for chunks of rows i of about 256 MB, never a whole (B, N, N, hidden) tensor.
`model.last_backward` names the one that ran ("fused" / "ops"). Gradients for the input and every parameter;
double backward raises.

Run: `python harness.py contact_map` (checks against the reference in fp32 and fp64, then times it against eager
PyTorch and torch.compile; `--dtype all --backward` adds fp16 / bf16 and the gradients). Build: -O3 -lineinfo
for TORCH_CUDA_ARCH_LIST (9.0 as sm_90a, for wgmma), else the visible GPUs', else 9.0 (the flags an H100 / H200
picks); the first import compiles the CUDA source (about 3 minutes on 2 cores), later imports load PyTorch's
extension cache. CONTACT_MAP_VERBOSE=1 shows the compiler output with `ptxas -v` register and spill counts.
"""
import hashlib
import importlib.util
import os
import re
import sys

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.utils.cpp_extension import load_inline

# The variant table, read by ModelNew, by the CUDA enum `Variant` (generated from it below: the
# forward's TORCH_CHECK reads Variant::kCount) and by the dispatch in forward(). _KERNELS names the
# kernel that ran (the forward returns its index, CUDA enum `Kernel`), for `model.last_variant`.
_VARIANT_IDS = {"auto": 0, "mma": 1, "fma": 2, "small": 3}  # first = default
_KERNELS = ("wgmma", "mma", "fma", "wgmma16", "small")

CUDA_SRC = r"""
#bundle-cuda src/contact_map/contact_map.cu
"""


def _enum_body(names):
    """The enumerators of a CUDA enum class from Python names ("auto" -> kAuto = 0, ...), then kCount."""
    return ", ".join(f"k{n.capitalize()} = {i}" for i, n in enumerate(names)) + f", kCount = {len(names)}"


assert list(_VARIANT_IDS.values()) == list(range(len(_VARIANT_IDS)))
CUDA_SRC = (CUDA_SRC
            .replace("@VARIANT_ENUM@", _enum_body(_VARIANT_IDS)).replace("@KERNEL_ENUM@", _enum_body(_KERNELS)))

#bundle-python src/common/build.py


_VERBOSE = os.environ.get("CONTACT_MAP_VERBOSE", "") not in ("", "0")
_CUDA_FLAGS = _nvcc_flags("-DCM_SM90A", _VERBOSE)


def _extension_name():
    """contact_map_ and a hash of CUDA_SRC, _CUDA_FLAGS and _build_environment()."""
    return _hashed_name("contact_map_", CUDA_SRC, _CUDA_FLAGS)


_ext = _load(_extension_name(), "contact_map", "about 3 minutes", CUDA_SRC, _CUDA_FLAGS, _VERBOSE)


# =============================================================================================
# Backward: the fused CUDA kernel's wrapper, and PyTorch ops elsewhere (chunked recomputation, nothing saved
# but the inputs).
# =============================================================================================
def _layer_norm(x, w, b, eps):
    """PyTorch's own LayerNorm of x (..., C) as the reference's forward runs it: (y, mean, rstd)."""
    return torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, eps)


def contact_map_rows(B, N, C, H, itemsize, chunk_bytes):
    """(rows i per MLP chunk, rows i per LayerNorm chunk) for contact_map_backward.

    An MLP chunk of r rows holds, per row i, B*N positions of: y rows and y columns, s, ds (4 C values)
    and h1, r1, h2, r2, dh2, dr1 / dh1 (about 6 H values) plus the scalars, and the float64 copies of s
    and dh1 for dW1 (C + H values of 8 bytes); a LayerNorm chunk holds about 5 C values per position (dy,
    xhat, dxhat, dx, the temporary).
    """
    mlp = _rows_per_chunk(B * N * ((4 * C + 6 * H + 4) * itemsize + 8 * (C + H)), N, chunk_bytes)
    ln = _rows_per_chunk(B * N * 5 * C * itemsize, N, chunk_bytes)
    return mlp, ln


def _t_mm64(a, b):
    """a^T b in float64: a parameter's gradient sums over every position (millions at N = 1536); float64
    keeps the digits that float32 sums of that length lose (a margin: the reference's own errors come from
    its ReLU kinks, contact_map_backward)."""
    return a.t().to(torch.float64) @ b.to(torch.float64)


def contact_map_backward(pair, ln_w, ln_b, eps, w1, b1, w2, b2, w3, b3, grad_out, chunk_bytes=256 << 20):
    """Gradients of out = sigmoid(MLP((y + y^T) / 2)), y = LayerNorm(pair), with respect to every input.

    Shapes: pair (B, N, N, C), ln_w / ln_b (C,), w1 (H, C), b1 (H,), w2 (H, H), b2 (H,), w3 (1, H),
    b3 (1,), grad_out g (B, N, N). Forward, per position p = (b, i, j):
        s[b,i,j,c] = (y[b,i,j,c] + y[b,j,i,c]) / 2
        h1 = s W1^T + b1,  h2 = relu(h1) W2^T + b2,  z = relu(h2) w3^T + b3,  out = sigmoid(z)
    Backward:
        dz  = g * out * (1 - out)                                 (B, r, N)
        dh2 = (dz w3) * [h2 > 0],  dh1 = (dh2 W2) * [h1 > 0]       (B, r, N, H)
        dW3 = sum_p dz relu(h2), dW2 = sum_p dh2^T relu(h1), dW1 = sum_p dh1^T s, db* = sum_p d*
        ds  = dh1 W1                                              (B, r, N, C)
        dy[b,i,j] = (ds[b,i,j] + ds[b,j,i]) / 2                   (B, N, N, C)
        then PyTorch's LayerNorm backward (aten.native_layer_norm_backward) per position.
    y, s, h1, h2 and out are recomputed with the reference's own ops (PyTorch's LayerNorm, mm then add),
    so the ReLU masks [h > 0] are the fp32 reference's. A unit within rounding of 0 takes its kink on
    either side in two evaluations, and one such position changes a weight's gradient by a whole term:
    with the forward kernel's more accurate LayerNorm the masks differ from the reference's at other
    positions than fp64's do, and the max gradient error came out 2-30x the reference's in single
    trials (H200, 2026-12-01); on the CPU at crop with a +100 offset: s 20x closer to fp64, two flipped
    masks each, mlp.0.weight 2.8e-2 against 8.3e-3.

    Memory beyond the returned gradients: one chunk (about chunk_bytes, at least one row i:
    B N (4 C + 6 H + 4) ct values and B N (C + H) float64 ones), plus the fp32 dy buffer (B, N, N, C)
    for fp16 / bf16 pair. The parameters' gradients (sums over all positions) accumulate in float64.
    Chunks of r rows i (r from chunk_bytes, at least 1): s[:, rows] needs y[:, rows] and y[:, :, rows],
    both recomputed from pair; ds/2 goes into dy[:, rows] and, transposed, into dy[:, :, rows]. dy is
    one (B, N, N, C) buffer in ct; when ct is pair's dtype it is d_pair itself, and the LayerNorm
    backward (chunks of rows i again) overwrites it in place. Returns (d_pair, d_ln_w, d_ln_b, d_w1,
    d_b1, d_w2, d_b2, d_w3, d_b3), each in its tensor's dtype.
    """
    B, N, _, C = pair.shape
    H = w1.shape[0]
    ct = torch.promote_types(pair.dtype, torch.float32)
    lw, lb = ln_w.to(ct), ln_b.to(ct)
    W1, B1, W2, B2, W3, B3 = (t.to(ct) for t in (w1, b1, w2, b2, w3, b3))
    itemsize = torch.empty((), dtype=ct).element_size()
    rows_mlp, rows_ln = contact_map_rows(B, N, C, H, itemsize, chunk_bytes)

    dy = torch.zeros((B, N, N, C), dtype=ct, device=pair.device)  # d_pair itself when ct == pair.dtype
    f64 = torch.float64
    d_w1 = torch.zeros((H, C), dtype=f64, device=pair.device)
    d_b1 = torch.zeros((H,), dtype=f64, device=pair.device)
    d_w2 = torch.zeros((H, H), dtype=f64, device=pair.device)
    d_b2 = torch.zeros((H,), dtype=f64, device=pair.device)
    d_w3 = torch.zeros((1, H), dtype=f64, device=pair.device)
    d_b3 = torch.zeros((1,), dtype=f64, device=pair.device)

    for r0 in range(0, N, rows_mlp):
        r1 = min(N, r0 + rows_mlp)
        # s[b, i, j] for i in rows: (y[b, i, j] + y[b, j, i]) / 2            (B, r, N, C)
        y_rows = _layer_norm(pair[:, r0:r1].to(ct), lw, lb, eps)[0]          # (B, r, N, C)
        y_cols = _layer_norm(pair[:, :, r0:r1].to(ct), lw, lb, eps)[0].transpose(1, 2)
        s = ((y_rows + y_cols) / 2.0).reshape(-1, C)                         # (M, C), M = B r N
        del y_rows, y_cols
        # MLP forward again                                                    (M, H), (M, 1)
        h1 = s @ W1.t() + B1
        a1 = h1.relu()
        h2 = a1 @ W2.t() + B2
        a2 = h2.relu()
        o = (a2 @ W3.t() + B3).sigmoid()                                     # (M, 1)
        # dz = g * out * (1 - out)                                            (M, 1)
        dz = grad_out[:, r0:r1].to(ct).reshape(-1, 1) * (1 - o) * o
        del o
        d_w3 += _t_mm64(dz, a2)                                              # (1, H)
        d_b3 += dz.sum(0, dtype=f64)
        dh2 = (dz @ W3) * (h2 > 0)                                           # (M, H)
        del dz, a2, h2
        d_w2 += _t_mm64(dh2, a1)                                             # (H, H)
        d_b2 += dh2.sum(0, dtype=f64)
        dh1 = (dh2 @ W2) * (h1 > 0)                                          # (M, H)
        del dh2, a1, h1
        d_w1 += _t_mm64(dh1, s)                                              # (H, C)
        d_b1 += dh1.sum(0, dtype=f64)
        del s
        ds = (dh1 @ W1).reshape(B, r1 - r0, N, C) / 2.0                      # ds / 2 (B, r, N, C)
        del dh1
        # dy[b, i, j] += ds[b, i, j] / 2 and dy[b, j, i] += ds[b, i, j] / 2
        dy[:, r0:r1] += ds
        dy[:, :, r0:r1] += ds.transpose(1, 2)
        del ds

    # LayerNorm backward, chunks of rows i                                      (B, r, N, C)
    d_pair = dy if ct == pair.dtype else torch.empty_like(pair, memory_format=torch.contiguous_format)
    d_ln_w = torch.zeros((C,), dtype=f64, device=pair.device)
    d_ln_b = torch.zeros((C,), dtype=f64, device=pair.device)
    for r0 in range(0, N, rows_ln):
        r1 = min(N, r0 + rows_ln)
        x = pair[:, r0:r1].to(ct).contiguous()
        _, mean, rstd = _layer_norm(x, lw, lb, eps)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy[:, r0:r1].contiguous(), x, [C], mean, rstd, lw, lb,
                                                                [True, True, True])
        d_ln_w += dw.to(f64)
        d_ln_b += db.to(f64)
        del x, mean, rstd
        d_pair[:, r0:r1] = dx  # may overwrite dy's own rows: they are read above
        del dx

    return (d_pair, d_ln_w.to(ln_w.dtype), d_ln_b.to(ln_b.dtype), d_w1.to(w1.dtype), d_b1.to(b1.dtype),
            d_w2.to(w2.dtype), d_b2.to(b2.dtype), d_w3.to(w3.dtype), d_b3.to(b3.dtype))


def contact_map_backward_fused(pair, ln_w, ln_b, eps, w1, b1, w2, b2, w3, b3, grad_out):
    """contact_map_backward's gradients from the fused CUDA kernel (pair read once; see the kernel's comment): the same
    arguments and returns. The kernel writes d_pair (pair's dtype) and one fp32 partial of every parameter gradient
    per block; a second kernel sums the partials in float64 and writes each gradient in its parameter's dtype: for a
    contiguous pair and float32 parameters and grad_out, two launches and no other torch op (the others go to
    float32 first: one conversion each, or with BACKWARD_ONE_CONVERSION on, together by one torch.cat and one
    conversion, a strided one copied first; a strided pair copied). Only where fused_backward_runs() is True
    (otherwise the extension raises). For a bfloat16 pair with BACKWARD_FP16_PRODUCTS on, the four backward products
    (dW2, dh1, dW1, ds) take fp16 operands, one m16n8k16 per 16 k, instead of split TF32, dh2 and dh1 multiplied by
    a power of 2 per tile first (h1 and h2, whose ReLU masks the fp64 recomputation guards, stay in split TF32). A
    setting other than True / False raises ValueError."""
    for name, value in (("BACKWARD_FP16_PRODUCTS", BACKWARD_FP16_PRODUCTS),
                        ("BACKWARD_ONE_CONVERSION", BACKWARD_ONE_CONVERSION)):
        if not isinstance(value, bool):
            raise ValueError(f"contact_map: {name} must be True or False, got {value!r}")
    return tuple(_ext.backward(pair, ln_w, ln_b, float(eps), w1, b1, w2, b2, w3, b3, grad_out,
                               BACKWARD_FP16_PRODUCTS, BACKWARD_ONE_CONVERSION))


# The fused backward's products for bfloat16 input on fp16 operands (contact_map_backward_fused), dh2 and dh1 scaled
# by a power of 2 per tile so that a small grad_out (a mean loss: ~1e-5 per element) does not underflow fp16
# (tools/cm_backward_precision.py --g-scale). On since c4be8e4, after the fused-backward tests (grad_out times 1, 1e-6,
# 1e3), the four sanitizers and the harness's gradient checks passed on an H100 (NOTES: b7-b9, sanitizer record (q)).
# False restores split TF32 for every product.
BACKWARD_FP16_PRODUCTS = True

# The fused backward's grad_out and parameters that are not contiguous float32 converted together, by one torch.cat
# and one conversion, instead of one conversion each (nine per step where module and input are bfloat16 or float16).
# On since the fused-backward tests (gradients bit-equal to the setting off) and the four sanitizers passed on an
# H100 (2026-12-07): a crop training step's host time -21 us in bfloat16, -62 us in float16 (NOTES: b12). False
# restores one conversion per tensor.
BACKWARD_ONE_CONVERSION = True


_FUSED_FITS = {}  # (pair_dim, hidden_dim, device index) -> bool


def fused_backward_runs(pair, w1):
    """Whether contact_map_backward_fused runs for this input: a CUDA tensor (B, N, N, C) of float32, float16 or
    bfloat16, 16-byte aligned when contiguous, N < 46341, and (C, H) = w1.shape multiples of 16 up to 128 / 64 on
    a device of compute capability 8.0+ with the shared memory for them."""
    if not (pair.is_cuda and pair.dtype in _FLOAT_DTYPES and pair.dim() == 4 and pair.shape[1] < 46341):
        return False
    if pair.is_contiguous() and pair.data_ptr() % 16:
        return False
    key = (int(w1.shape[1]), int(w1.shape[0]), pair.get_device())
    fits = _FUSED_FITS.get(key)
    if fits is None:
        fits = _FUSED_FITS[key] = bool(_ext.backward_supported(*key))
    return fits


# =============================================================================================
# Module
# =============================================================================================
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PARAM_NAMES = ("layer_norm.weight", "layer_norm.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                "mlp.4.weight", "mlp.4.bias")


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _output_dtype(pair, params):
    """(out_dtype, mixed): the dtype the reference returns for these tensors, under CUDA autocast the autocast dtype,
    else the one dtype of pair_repr and every parameter (float32, float16 or bfloat16; others raise); mixed: under
    autocast, whether pair_repr or a parameter differs from it (the kernels then take float32 copies)."""
    dtype = pair.dtype
    if dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"contact_map: pair_repr must be float32, float16 or bfloat16, got {_dtype_name(dtype)}")
    if pair.is_cuda and torch.is_autocast_enabled("cuda"):
        out_dtype = torch.get_autocast_dtype("cuda")
        return out_dtype, dtype != out_dtype or any(p.dtype != dtype for p in params)
    for name, p in zip(_PARAM_NAMES, params):
        if p.dtype != dtype:
            raise RuntimeError(f"contact_map: parameter {name} must be {_dtype_name(dtype)} like pair_repr, got "
                               f"{_dtype_name(p.dtype)} (cast the module and its input to one of float32, float16, "
                               "bfloat16)")
    return dtype, False


def _f32(t):
    """t in float32 (the kernels' dtype), t itself when it is float32 already."""
    return t if t.dtype == torch.float32 else t.float()


def _run_kernel(model, pair, params, eps, vid, out_dtype, mixed):
    """The CUDA forward: input and parameters of one dtype go in as they are (fp16 / bf16: the 16-bit wgmma
    build where it runs, else the extension converts to float32); mixed dtypes (CUDA autocast) in float32.
    The output is returned in out_dtype. Records the kernel that ran in model.last_variant (None after an
    empty input)."""
    if mixed:
        pair, params = _f32(pair), [_f32(p) for p in params]
    out, kernel = _ext.forward(pair, params[0], params[1], eps, *params[2:], vid)
    # a plain attribute: skips nn.Module.__setattr__ (~1 us)
    object.__setattr__(model, "last_variant", _KERNELS[kernel] if kernel >= 0 else None)
    return out if out.dtype == out_dtype else out.to(out_dtype)


class _ContactMap(torch.autograd.Function):
    """out = ContactMap(pair; params): the forward is the CUDA kernel, the backward the fused kernel
    (contact_map_backward_fused) where it runs, else contact_map_backward (PyTorch ops); recorded in
    model.last_backward ("fused" / "ops"). Double backward raises."""

    @staticmethod
    def forward(ctx, call, pair, *params):
        # call: (model, eps, variant id, out_dtype, mixed) in one argument (each argument costs apply time)
        ctx.call = call
        ctx.save_for_backward(pair, *params)
        return _run_kernel(call[0], pair, params, *call[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        pair, *params = ctx.saved_tensors
        fused = fused_backward_runs(pair, params[2])
        run = contact_map_backward_fused if fused else contact_map_backward
        model, eps = ctx.call[:2]
        grads = run(pair, params[0], params[1], eps, *params[2:], grad_out)
        object.__setattr__(model, "last_backward", "fused" if fused else "ops")
        return (None,) + tuple(g if n else None for g, n in zip(grads, ctx.needs_input_grad[1:]))


def _small_fits(pair_dim, hidden_dim):
    """Whether the small kernel takes these dimensions (small_supported in the CUDA source, less the device)."""
    return 8 <= pair_dim <= 64 and pair_dim % 8 == 0 and 1 <= hidden_dim <= 32


def small_auto_tiles_per_sm(dtype=torch.float32):
    """"auto" runs the small kernel where it runs and an input of this dtype has at most this many tiles per SM
    (float32: 0, never; float16 / bfloat16: 2)."""
    return int(_ext.small_auto_tiles_per_sm(dtype != torch.float32))


def _auto_runs_small(B, N, pair_dim, hidden_dim, dtype, device=None):
    """Whether "auto" runs the small kernel for a (B, N, N, pair_dim) input of this dtype (module and input in one
    dtype) on this CUDA device (small_preferred in the CUDA source)."""
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    tiles = B * ((N + 7) // 8) * ((N + 7) // 8 + 1) // 2
    return (props.major >= 8 and _small_fits(pair_dim, hidden_dim)
            and tiles <= small_auto_tiles_per_sm(dtype) * props.multi_processor_count)


class _VariantsFor:
    """ModelNew.VARIANTS: on the class every variant; on a model the variants that run for its dimensions
    ("small": _small_fits)."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return tuple(_VARIANT_IDS)
        hidden_dim, pair_dim = obj._parameters_in_order()[1][2].shape
        return tuple(v for v in _VARIANT_IDS if v != "small" or _small_fits(pair_dim, hidden_dim))


class ModelNew(nn.Module):
    """Contact-map head: pair (B, N, N, pair_dim) on a CUDA device -> contact probabilities (B, N, N).

    Same submodules, names and creation order as the reference `Model` (so `load_state_dict` and
    seeding work identically). float32, float16 or bfloat16 (module and input in one dtype; fp16 / bf16
    products in that precision where the 16-bit wgmma build runs, else computed in float32), returned in the
    input's dtype (the autocast dtype under CUDA autocast). Differentiable
    with respect to the input and every parameter. Raises RuntimeError for a CPU input, an input on
    another device than the parameters, another dtype, a shape other than (B, N, N, pair_dim), or
    pair_dim / hidden_dim above 256. `variant` selects "auto", "mma", "fma" or "small" (`VARIANTS`: those that
    run for the model's dimensions); after a call `last_variant` names the kernel that ran ("wgmma",
    "wgmma16", "mma", "fma" or "small"; None after an empty input, where none runs), after a backward
    `last_backward` the backward that ran ("fused": the CUDA kernel, pair_dim / hidden_dim multiples of 16 up
    to 128 / 64: fused_backward_runs(); else "ops": PyTorch ops).
    """

    VARIANTS = _VariantsFor()

    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(
            nn.Linear(pair_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, 1),
        )
        self.variant = next(iter(_VARIANT_IDS))
        self.last_variant = None
        self.last_backward = None

    def _parameters_in_order(self):
        """(layer_norm, (gamma, beta, W1, b1, W2, b2, w3, b3)), read at every call.

        Through the modules' `_modules` / `_parameters` dicts: that is what `nn.Module.__getattr__` and
        `nn.Sequential.__getitem__` look up, at several times the cost (the attribute path took ~8 us of a
        call's host time on the CPU). A weight that is not a plain parameter (a parametrization) is not in
        those dicts: then the attribute path."""
        ln, mlp = self._modules.get("layer_norm"), self._modules.get("mlp")
        if ln is not None and mlp is not None:
            sub = mlp._modules
            l1, l2, l3 = sub.get("0"), sub.get("2"), sub.get("4")
            if l1 is not None and l2 is not None and l3 is not None:
                p0, p1, p2, p3 = ln._parameters, l1._parameters, l2._parameters, l3._parameters
                params = (p0.get("weight"), p0.get("bias"), p1.get("weight"), p1.get("bias"), p2.get("weight"),
                          p2.get("bias"), p3.get("weight"), p3.get("bias"))
                for p in params:  # (a loop, not all() over a generator: ~1 us less per call)
                    if p is None:
                        break
                else:
                    return ln, params
        ln, l1, l2, l3 = self.layer_norm, self.mlp[0], self.mlp[2], self.mlp[4]
        return ln, (ln.weight, ln.bias, l1.weight, l1.bias, l2.weight, l2.bias, l3.weight, l3.bias)

    def forward(self, pair_repr):
        vid = _VARIANT_IDS.get(self.variant)
        if vid is None:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {self.VARIANTS}")
        ln, params = self._parameters_in_order()
        eps = float(ln.eps)
        out_dtype, mixed = _output_dtype(pair_repr, params)
        if torch.is_grad_enabled() and (pair_repr.requires_grad or any(p.requires_grad for p in params)):
            return _ContactMap.apply((self, eps, vid, out_dtype, mixed), pair_repr, *params)
        return _run_kernel(self, pair_repr, params, eps, vid, out_dtype, mixed)
