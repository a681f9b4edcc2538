"""Fused outer product mean (AlphaFold-style MSA -> pair update), CUDA kernels, KernelBench format.

The op (b batch, s MSA sequence, i/j residue, m msa channel, h/k hidden channel, z pair channel):

    x[b,s,n,:]   = LayerNorm(msa[b,s,n,:])                                  (gamma, beta, eps of the module)
    a[b,s,n,h]   = (sum_m Wa[h,m] x[b,s,n,m] + ba[h]) * mask[b,s,n]
    b[b,s,n,k]   = (sum_m Wb[k,m] x[b,s,n,m] + bb[k]) * mask[b,s,n]
    denom[b,i]   = max(sum_s mask[b,s,i], 1)
    out[b,i,j,z] = bo[z] + (1 / denom[b,i]) * sum_{h,k} Wo[z, h*c+k] * sum_s a[b,s,i,h] b[b,s,j,k]

Tensors: msa_repr (B, S, N, c_m), c_m = msa_dim, float32, float16 or bfloat16, the parameters in the
same dtype; msa_mask (B, S, N), float32 / float16 / bfloat16 (any values), bool, uint8, int8, int16,
int32 or int64; gamma, beta (c_m); Wa, Wb (c, c_m), ba, bb (c), c = hidden_dim; Wo (c_z, c*c), bo
(c_z), c_z = pair_dim; out (B, N, N, c_z). The (B, N, N, c, c) outer product is never stored in
global memory; c is zero-padded to CP = 16, 32, 64 or 128.

Pair-count modes (n[b,i,j] = sum_s mask[b,s,i] mask[b,s,j], fp64 / int64): OpenFoldOuterProductMean (AlphaFold
2 / 3, OpenFold(3), Protenix: (acc + bo) / (n + eps), acc the sum above without 1 / denom), BoltzOuterProductMean
(acc / max(n, 1) + bo); from_openfold / from_boltz convert released modules (README). outer_wg and w_first_wg2
scale per pair in their epilogues (PAIR_EPILOGUE "fused"), the other variants (and "unfused") run with a zero bias,
then one sweep out * s1 + s2 bo; float masks' counts on DMMA (PAIR_COUNTS_DMMA, PAIR_COUNTS_RING; 16-bit
masks' on HMMA with PAIR_COUNTS_HMMA); the backward's s1 g and dbo in one sweep (PAIR_G_KERNEL). The settings and
their OPM_* environment variables: the comments at their definitions.
fp16: a fully masked pair gives bo / eps (OpenFold), inf above 65504 (as the reference).

Two contraction orders (FLOPs after the 4 B S N c_m c of LayerNorm + projections):
  outer_first  O[(i,h),(j,k)] = sum_s a[s,i,h] b[s,j,k] per tile on chip, then out = Wo . O: 2 B N^2 c^2 (S + c_z)
  w_first      P[s,j,h,z] = sum_k Wo[z,h*c+k] b[s,j,k] (stage 1, in j-chunks), then
               out[i,j,z] = sum_{s,h} a[s,i,h] P[s,j,h,z] (stage 2): 2 B S N c^2 c_z + 2 B N^2 S c c_z

Variants (`model.variant`; ModelNew.VARIANTS: those that run on this GPU, ALL_VARIANTS: every name; forcing
one that cannot run raises with the reason; `model.last_variant` names the one that ran):
  "auto"         the default: the candidate of least estimated time (FLOPs as executed over per-kernel rates
                 measured on the H200, kEff* in the CUDA source, plus 2 us per launch): on an H100 / H200 outer_wg
                 at most shapes, w_first_wg2 at S ~ 32 in fp32, w_first_small at tiny ones; fused_small where one
                 wave of blocks holds all its work and S <= 32 (the seed shape, where it was measured first). A
                 w_first is a candidate where one j column of P fits 32 MB: w_first_small under one wave of 128 x
                 128 tiles, else w_first_tc2 on sm_80+ (w_first_tc where 136 KB do not fit), else the FMA w_first.
  outer_wg       9.0 with the sm_90a build, hidden_dim <= 32: opm_ow_params_kernel (LayerNorm affine folded into
                 the projection weights), opm_prep_ow_kernel (LayerNorm + projections + mask on mma.sync, a and b
                 in wgmma tile order; opm_prep16_kernel, bit-equal in warp tiles, for a 16-bit msa with msa_dim
                 % 16 == 0 up to 256), opm_outer_wg_kernel<T> (persistent, warp-specialised: per 16 i x 4 j x 128
                 z tile, phase A O = a b^T and phase B out += O Wo on wgmma, fed by a producer warpgroup).
  w_first_wg2    9.0 with the sm_90a build: opm_prep_kernel, opm_pack_a_kernel, per j-chunk (<= 512 MB of P's
                 planes) opm_wfirst_proj_wg_kernel and the wgmma GEMM opm_wfirst_wg_kernel.
  outer_first    FMA, any CUDA GPU (opm_prep_kernel, opm_outer_kernel<CP>): the plain check of the fast paths.
  w_first        FMA stage 2 (opm_wfirst_gemm_kernel), any GPU, P in j-chunks of <= 32 MB.
  w_first_small  FMA stage 2 on 32 x 64 tiles, K split over warps (opm_wfirst_small_kernel): small N.
  w_first_tc     split-TF32 mma.sync stage 2, sm_80+ (opm_wfirst_tc_kernel<1>; _tc2: <2>, 64-row K stages, 136 KB).
  fused_small    the forward in one cooperative launch (opm_fused_small_kernel<T>), fp32 FMA on T.

Precision (fp32): FMA paths accumulate in fp32; tensor-core paths use split TF32 (x = hi + lo, a b ~ hi hi +
hi lo + lo hi, the dropped lo lo ~2^-21 |a b|), wgmma sums promoted every 64 k; masks summed in fp64 / int64.
Max error against fp64 over the fp32 reference's: outer_wg 0.58-1.09x, w_first_wg2 0.75-1.0x; "auto" avoids
w_first_tc / _tc2 (2.5x), the FMA w_first (7.9x) at deep (S = 2048) and outer_wg at S <= 3 (a few x, tiny).

Supported: any B, S, N >= 0 (S = 0 gives the bias everywhere; B = 0 or N = 0 an empty result, no launch),
1 <= msa_dim <= 768, 1 <= hidden_dim <= 128 (32 tuned; 64, 128 slower per FLOP), any pair_dim >= 1, outputs
over 2^31 elements, non-contiguous inputs (copied); larger sizes raise a clear error. One CUDA device.
Limits: outer_wg, fused_small need hidden_dim <= 32; outer_wg B S N / 16 < 2^31 (S rounded up to 16, 32 in 16
bits, N to 16), B N^2 / 64 < 2^31 per 128 of pair_dim; w_first_wg2 takes up to 512 MB plus about twice a's size
of working memory (no smaller fallback). Tuned on the H200 only.

Half precision: with float16 / bfloat16 inputs and parameters outer_wg reads and writes that dtype (no casts):
LayerNorm and projections on mma.sync in float16, fp32 accumulation (normalised rows, row-scaled weights), a and
b rounded to the input's dtype as the reference's are, O = a b^T on the 16-bit tensor cores, O / denom in float16
(rows scaled by powers of two) times Wo in float16 (bfloat16 weights above 65504 would overflow). Max error
against fp64: 0.54-0.93x the reference's in that dtype. fused_small reads and writes that dtype too (fp32 inside);
other variants run the float32 kernels on converted copies; under CUDA autocast, the autocast dtype.
Training: the backward (outer_product_mean_backward) saves the inputs, and a, b and 1 / denom where outer_wg or
fused_small ran with hidden_dim 32 (else recomputes them). On Hopper with hidden_dim 32, pair_dim <= 128, wgmma
kernels compute dWo and, for pair_dim % 4 == 0, da and db (O, G = (g / denom) Wo per tile on chip; split TF32, or
16-bit with pair_dim % 8 == 0), and for msa_dim 128 / 256 the LayerNorm part; else PyTorch ops build O and G for
chunks of rows i (~256 MB). The pair modes run the same kernels on s1 g (PAIR_BACKWARD). Off by default: KEEP_O (a
16-bit forward keeps O for a one-product dWo), G_MEM (a 16-bit backward forms G once in memory for two library
products, da and db). `model.last_backward` names the kernel parts; no mask gradient; double backward raises.

Run: `python harness.py outer_product_mean` (`--dtype all --backward`). Build: -O3 -lineinfo for TORCH_CUDA_ARCH_LIST,
else the visible GPUs', else 9.0 (as sm_90a), ~2.5 min on 2 cores; OPM_VERBOSE=1: nvcc commands, `-Xptxas -v`.
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

# The variant table, the one place that names the variants: a variant's id is its index here. The
# CUDA source receives it as `enum Variant` (kAuto = 0, kOuterFirst = 1, ...: "k" + the name in
# CamelCase) and kNumVariants, which its range check and dispatch read; ModelNew passes the id and
# maps the id that ran back to the name.
_ALL_VARIANTS = ("auto", "outer_first", "w_first", "w_first_small", "w_first_tc", "w_first_tc2", "w_first_wg2",
                 "outer_wg", "fused_small")


def _variant_enum(names):
    """The C++ enum of the variant ids: k + the CamelCase name = its index, then kNumVariants."""
    ids = ", ".join(f"k{''.join(w.capitalize() for w in n.split('_'))} = {i}" for i, n in enumerate(names))
    return f"enum Variant : int64_t {{ {ids}, kNumVariants = {len(names)} }};"

# =============================================================================================
# CUDA source
# =============================================================================================
_CUDA_SRC = r"""
#bundle-cuda src/outer_product_mean/outer_product_mean.cu
"""

_CUDA_SRC = _CUDA_SRC.replace("@VARIANT_ENUM@", _variant_enum(_ALL_VARIANTS))

#bundle-python src/common/build.py


_VERBOSE = os.environ.get("OPM_VERBOSE", "0") not in ("", "0")
_CUDA_FLAGS = _nvcc_flags("-DOPM_SM90A", _VERBOSE)


def _extension_name():
    """outer_product_mean_ and a hash of _CUDA_SRC, _CUDA_FLAGS and _build_environment()."""
    return _hashed_name("outer_product_mean_", _CUDA_SRC, _CUDA_FLAGS)


_ext = _load(_extension_name(), "outer_product_mean", "about 2.5 minutes", _CUDA_SRC, _CUDA_FLAGS, _VERBOSE)

# The Hopper-only variants and the index of their flag in opm_device_caps (tc_ok, wg_ok, ow_ok).
_HOPPER_CAP = {"w_first_wg2": 1, "outer_wg": 2}


def _device_caps_here():
    """opm_device_caps of the current CUDA device; all False without CUDA."""
    if not torch.cuda.is_available():
        return (False, False, False)
    return tuple(bool(x) for x in _ext.opm_device_caps(torch.cuda.current_device()))


class _VariantsHere:
    """ModelNew.VARIANTS: a tuple of the variant names that run on the current CUDA device, computed
    at each access (class or instance)."""

    def __get__(self, obj, owner=None):
        caps = _device_caps_here()
        return tuple(v for v in _ALL_VARIANTS if v not in _HOPPER_CAP or caps[_HOPPER_CAP[v]])


# =============================================================================================
# Backward: the wgmma kernels where they run (from the inputs and the forward's a, b and inv_denom, which
# outer_wg keeps), else PyTorch ops in chunks.
# =============================================================================================
def outer_product_mean_rows(B, S, N, c_m, c, c_z, itemsize, chunk_bytes):
    """(rows i per outer chunk, msa rows per LayerNorm chunk) for outer_product_mean_backward.

    An outer chunk of r rows i holds, per row, B*N positions j of two (c, c) blocks (O or G and its
    permuted copy) and g's c_z values (and their ct copy); a LayerNorm chunk of r of the B*S*N msa rows
    (contiguous in memory) holds per row about 5 c_m + 4 c values (x in ct, the LayerNorm output, its
    gradient, d_msa's, the temporaries; da, db).
    """
    outer = _rows_per_chunk(B * N * (2 * c * c + 2 * c_z) * itemsize, N, chunk_bytes)
    ln = _rows_per_chunk((5 * c_m + 4 * c) * itemsize, B * S * N, chunk_bytes)
    return outer, ln


def _wo_kernel_runs(msa, c, c_z, ct):
    """Whether out_proj's weight gradient goes to opm_bw_wo_kernel (_ext.opm_backward_wo): float32 inputs
    and parameters (ct) on a CUDA device where outer_wg runs, hidden_dim 32, pair_dim up to 128."""
    return (msa.is_cuda and ct == torch.float32 and c == 32 and 1 <= c_z <= 128
            and bool(_ext.opm_device_caps(msa.device.index)[2]))


def _ln_kernel_runs(msa, c, c_m):
    """Whether the LayerNorm part of the backward goes to opm_bw_ln_kernel (_ext.opm_backward_ln): a
    float32, float16 or bfloat16 msa on a CUDA device where outer_wg runs, hidden_dim 32, msa_dim 128 or
    256."""
    return (msa.is_cuda and msa.dtype in _FLOAT_DTYPES and c == 32 and c_m in (128, 256)
            and bool(_ext.opm_device_caps(msa.device.index)[2]))


def _rows_kernel_runs(msa, c, c_m):
    """Whether the backward's a, b and 1 / denom come from outer_wg's prep kernel (_ext.opm_backward_rows):
    a float32, float16 or bfloat16 msa on a CUDA device where outer_wg runs, hidden_dim 32, msa_dim <= 768
    and B * S * N / 16 < 2^31 (S rounded up to 16, or 32 for 16-bit msa, N to 16), as for outer_wg."""
    B, S, N = msa.shape[:3]
    pad = lambda n, m: -(-n // m) * m
    return (msa.is_cuda and msa.dtype in _FLOAT_DTYPES and c == 32 and 1 <= c_m <= 768
            and B * pad(S, 16 if msa.dtype == torch.float32 else 32) * pad(N, 16) // 16 < 2**31 and bool(_ext.opm_device_caps(msa.device.index)[2]))


def _pair_g_kernel_runs(grad_out, ct, k_dtype):
    """Whether opm_backward_pair_g forms a pair mode's s1 g (in k_dtype) and dbo: PAIR_G_KERNEL, a float32 compute
    type, grad_out float32 / float16 / bfloat16 on a CUDA device with c_z % 4 == 0 up to 1024, k_dtype float32 or
    grad_out's."""
    c_z = grad_out.shape[-1]
    return (_flag("PAIR_G_KERNEL") and ct == torch.float32 and grad_out.is_cuda and grad_out.dtype in _FLOAT_DTYPES
            and c_z % 4 == 0 and 4 <= c_z <= 1024 and k_dtype in (torch.float32, grad_out.dtype))


def _ab_kernel_runs(msa, c, c_z, ct):
    """Whether da and db go to opm_bw_ab_kernel (_ext.opm_backward_ab): as _wo_kernel_runs, with pair_dim
    a multiple of 4 (16-byte strides of grad_out's tensor map)."""
    return _wo_kernel_runs(msa, c, c_z, ct) and c_z % 4 == 0


def _g_mem_runs(B, S, N, c_z, itemsize):
    """Whether a backward whose da and db would run in opm_bw_ab_kernel on the 16-bit tensor cores forms G in memory
    instead (G_MEM): S >= G_MEM_MIN_S, pair_dim <= 128 and G at most G_MEM_MAX_BYTES."""
    return (_flag("G_MEM") and S >= G_MEM_MIN_S and c_z <= 128
            and B * N * N * 1024 * itemsize <= G_MEM_MAX_BYTES)


def _env_flag(name, default):
    """An on / off setting from the environment variable name: "1" on, "0" off, unset the default; other values
    raise (a misspelt "true" would otherwise turn the setting off in silence)."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"outer_product_mean: {name} must be 0 or 1, got {value!r}")
    return value == "1"


def _flag(name):
    """The on / off module attribute name (PAIR_G_KERNEL, PAIR_COUNTS_DMMA, PAIR_COUNTS_RING, PAIR_COUNTS_HMMA,
    LOW_MEMORY_BACKWARD, LOW_MEMORY_SPLIT_J, KEEP_O, G_MEM), which must be True or False: an assigned "0" would
    otherwise read as on."""
    value = globals()[name]
    if not isinstance(value, bool):
        raise ValueError(f"outer_product_mean: {name} must be True or False, got {value!r}")
    return value


# The normalisations (the CUDA source's enum Norm): the row count (KernelBench), the pair count + eps
# (AlphaFold / OpenFold, the bias divided too), the pair count clamped to 1 (Boltz).
NORM_ROWS, NORM_OPENFOLD, NORM_BOLTZ = 0, 1, 2


# The pair modes' epilogue where outer_wg or w_first_wg2 runs: "fused" (its kernel scales each pair itself),
# "unfused" (the row-mode kernel with a zero bias, then opm_pair_epilogue_kernel over the output, as every
# other variant): OPM_PAIR_EPILOGUE at import, then this module attribute, or
# `with pair_epilogue("unfused"):` for a block.
PAIR_EPILOGUE = os.environ.get("OPM_PAIR_EPILOGUE", "fused")
# The pair modes' dWo, da and db: "kernels" (the default: the row mode's wgmma kernels, where they run, on s1 g with
# a row scale of 1; a training step 1.75-3.9x faster than "chunks", NOTES.md), "chunks" (PyTorch ops over chunks of
# rows i): OPM_PAIR_BACKWARD at import, then this module attribute, or `with pair_backward("chunks"):` for a block.
PAIR_BACKWARD = os.environ.get("OPM_PAIR_BACKWARD", "kernels")
# With "kernels": s1 g and dbo in one sweep over grad_out by opm_backward_pair_g (True, the default) or by ATen ops
# in float32 (False): OPM_PAIR_G_KERNEL ("1" / "0") at import, then this module attribute.
PAIR_G_KERNEL = _env_flag("OPM_PAIR_G_KERNEL", True)
# The pair counts of float masks (the forward's, and the backward's on CUDA) on the fp64 tensor cores (sm_80+;
# opm_pair_scale_dmma_kernel, True, the default) or in fp64 FMA (opm_pair_scale_kernel, False; bool and integer masks
# always, in int64): OPM_PAIR_COUNTS_DMMA ("1" / "0") at import, then this attribute (True / False).
PAIR_COUNTS_DMMA = _env_flag("OPM_PAIR_COUNTS_DMMA", True)
# With DMMA: the mask's columns brought by a cp.async ring of stages (opm_pair_scale_ring_kernel, True, the default:
# the same sums, more of the mask in flight; where N times the mask's element size is a multiple of 16 bytes) or one
# chunk at a time through registers (False): OPM_PAIR_COUNTS_RING ("1" / "0") at import, then this attribute.
PAIR_COUNTS_RING = _env_flag("OPM_PAIR_COUNTS_RING", True)
# With the ring: float16 / bfloat16 masks' products on the 16-bit tensor cores with fp32 sums (the ring kernel's HMMA
# instance, True, the default: exact for 0 / 1 masks, fractional weights' sums rounded to fp32; crop's counts 8.5 ->
# 5.0 us) or in fp64 on DMMA (False): OPM_PAIR_COUNTS_HMMA ("1" / "0") at import, then this attribute. float32 masks
# stay on DMMA.
PAIR_COUNTS_HMMA = _env_flag("OPM_PAIR_COUNTS_HMMA", True)
# The backward's peak memory where its kernels run (outer_product_mean_backward's low_memory): dWo's G planes in chunks
# of 32 MB or one 64-residue i tile if larger (else 256 MB; LOW_MEMORY_SPLIT_J below), da and db in the msa's 16-bit
# type for the LayerNorm kernel (else float32), its block partials written over da, db, and the storage of the forward's
# a, b (saved for the backward like the other tensors, so saved-tensor hooks see them) freed once da, db are formed: a
# second backward through the graph recomputes them, and a hook that keeps the tensors its unpack returned finds them
# empty. True (the default): a step's peak at long 826 -> 602 MiB in 16 bits, 1385 -> 1185 in fp32 (with
# LOW_MEMORY_SPLIT_J), the step 2-3% slower there (bf5a78f; NOTES.md; fp32 +1.3% more for LOW_MEMORY_SPLIT_J); False:
# the faster step. OPM_LOW_MEMORY_BACKWARD ("1" / "0") at import, then this attribute, read at each forward (its
# backward follows the value its forward saw).
LOW_MEMORY_BACKWARD = _env_flag("OPM_LOW_MEMORY_BACKWARD", True)
# With LOW_MEMORY_BACKWARD on, where one 64-residue i tile's G planes exceed the 32 MB chunk (fp32 at N = 1024, B = 1:
# 64 MB), chunks of that tile's j blocks instead (opm_backward_wo's split_j; True, the default): there the dWo part's
# peak 32 MB lower, the fp32 step's peak at long 1192.5 -> 1184.6 MiB (then set by the LayerNorm part), the step 1.3%
# slower (NOTES.md); False: one tile per chunk. OPM_LOW_MEMORY_SPLIT_J ("1" / "0") at import, then this attribute, read
# by each low-memory backward whose dWo runs in its kernel.
LOW_MEMORY_SPLIT_J = _env_flag("OPM_LOW_MEMORY_SPLIT_J", True)
# The forward keeps O for the backward (KEEP_O): where outer_wg runs on a float16 / bfloat16 msa with hidden_dim 32 and
# gradients are needed, its fused kernel also writes O / denom (s1 O in the pair modes) in the msa's dtype, (B, N, N,
# 1024), if that takes at most KEEP_O_MAX_BYTES (per layer, until its backward) and the backward's dWo would run in its
# kernel (Hopper, pair_dim <= 128; the pair modes: the fused epilogue, pair_backward "kernels"); the backward's dWo is
# then one matrix product g^T O in place of opm_backward_wo's recomputation of O, and the tensor is freed right after it
# (LOW_MEMORY_BACKWARD). True: that memory for a faster step where S is large (crop: 128 MiB); False (the default): O
# recomputed, and a grad-mode forward (KernelBench times one) writes no O. OPM_KEEP_O ("1" / "0") at import, then this
# attribute, read at each forward.
KEEP_O = _env_flag("OPM_KEEP_O", False)
KEEP_O_MAX_BYTES = 256 << 20
# KEEP_O's dWo product: "library" (the default: a matrix product in the dtype, as the reference's) or "kernel"
# (opm_backward_wo_kept: mma.sync with fp32 sums, deterministic splits; pair_dim % 8 == 0, else the library's; not yet
# run on a GPU): OPM_KEEP_O_PRODUCT at import, then this attribute.
KEEP_O_PRODUCT = os.environ.get("OPM_KEEP_O_PRODUCT", "library")
# The backward's da and db over G in memory (G_MEM): where they would run in opm_bw_ab_kernel on the 16-bit tensor
# cores (a float16 / bfloat16 msa, pair_dim % 8 == 0), S >= G_MEM_MIN_S and G (B, 32 N, 32 N) in the msa's dtype takes
# at most G_MEM_MAX_BYTES, opm_backward_g writes G once (rows (i, h), columns (j, k)) and da = b G^T, db = a G are two
# of the library's matrix products in that dtype (the reference's backward rounds the same way), da and db rounded to
# it. True: G formed once instead of once per product, the products at the library's rate (where hidden_dim is 32,
# pair_dim <= 128 on Hopper: crop, deep, not long or shallow; crop: 128 MiB for G until da, db are formed;
# last_backward says "da, db from G"); False (the default, as True has not yet run on a GPU): opm_bw_ab_kernel.
# OPM_G_MEM ("1" / "0") at import, then this attribute, read by each backward.
G_MEM = _env_flag("OPM_G_MEM", False)
G_MEM_MAX_BYTES = 256 << 20
G_MEM_MIN_S = 256
# Each of the eight on / off attributes takes only True or False (others raise at the next call that reads it).


def _pair_counts():
    """The pair-count kernel code launch_pair_scale takes (PairCounts: 0 fp64 FMA, 1 DMMA, 2 DMMA by the ring, 3
    the ring with 16-bit masks on HMMA)."""
    if not _flag("PAIR_COUNTS_DMMA"):
        return 0
    if not _flag("PAIR_COUNTS_RING"):
        return 1
    return 3 if _flag("PAIR_COUNTS_HMMA") else 2


class _ModuleSetting:
    """`with <subclass>(mode):` sets the module attribute `attr` to mode (one of `modes`) for the block, then
    restores it; <subclass>.current() is the attribute's value, checked (it may also be assigned directly)."""

    attr, modes = "", ()

    def __init__(self, mode):
        if mode not in self.modes:
            raise ValueError(f"{type(self).__name__}: {' or '.join(repr(m) for m in self.modes)}, got {mode!r}")
        self.mode, self.saved = mode, None

    @classmethod
    def current(cls):
        mode = globals()[cls.attr]
        if mode not in cls.modes:
            raise ValueError(f"outer_product_mean: {cls.attr} must be {' or '.join(repr(m) for m in cls.modes)}, "
                             f"got {mode!r}")
        return mode

    def __enter__(self):
        self.saved, globals()[self.attr] = globals()[self.attr], self.mode
        return self

    def __exit__(self, *exc):
        globals()[self.attr] = self.saved
        return False


class pair_epilogue(_ModuleSetting):
    """`with pair_epilogue("unfused"):` (or "fused") sets PAIR_EPILOGUE for the block, then restores it."""

    attr, modes = "PAIR_EPILOGUE", ("fused", "unfused")


class pair_backward(_ModuleSetting):
    """`with pair_backward("kernels"):` (or "chunks") sets PAIR_BACKWARD for the block, then restores it."""

    attr, modes = "PAIR_BACKWARD", ("chunks", "kernels")


def pair_scales(mask, norm, eps=1e-3):
    """(s1, s2) (B, N, N) float64 of a pair mode: n = sum_s m[b,s,i] m[b,s,j] in fp64 (exact for
    0/1 and integer masks); NORM_OPENFOLD s1 = s2 = 1 / (n + eps), NORM_BOLTZ s1 = 1 / max(n, 1), s2 = 1."""
    m = mask.to(torch.float64)
    n = m.transpose(1, 2) @ m                                                      # (B, N, N)
    if norm == NORM_OPENFOLD:
        s1 = 1.0 / (n + eps)
        return s1, s1
    return 1.0 / n.clamp(min=1), torch.ones_like(n)


def _free_storage(*tensors):
    """Frees each tensor's storage (resized to 0 bytes) where it can be resized; the tensors stay, empty (a low-memory
    backward's a, b and kept O: whoever holds them, the autograd Function's saved copies too)."""
    for t in tensors:
        if t.untyped_storage().resizable():
            t.untyped_storage().resize_(0)


def _converted_together(tensors, dtype):
    """Each tensor .to(dtype): where two or more need converting, contiguous views of one concatenation converted at
    once (two launches instead of one per tensor), each at a 16-byte aligned offset (every numel but the last a multiple
    of 8; else converted one by one). The views share one storage: for the backward's own copies of the parameters."""
    if sum(t.dtype != dtype for t in tensors) < 2 or any(t.numel() % 8 for t in tensors[:-1]):
        return tuple(t.to(dtype) for t in tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(dtype)
    return tuple(v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors))


def outer_product_mean_backward(msa, mask, ln_w, ln_b, eps, wa, ba, wb, bb, wo, bo, grad_out,
                                chunk_bytes=256 << 20, wo_kernel=None, ab_kernel=None, ln_kernel=None,
                                rows_kernel=None, ab=None, parts=None, split=False, norm=0, norm_eps=1e-3,
                                pair_kernels=None, low_memory=False, release_ab=False, o=None):
    """Gradients of the outer product mean with respect to msa and every parameter (not the mask).

    norm: NORM_ROWS (0, below), or a pair mode (NORM_OPENFOLD with eps norm_eps, NORM_BOLTZ), where
    out = s1 (O Wo^T) + s2 bo with pair_scales' s1, s2 (B, N, N) (on CUDA in float32: opm_pair_scale's, as the
    forward computes them, by the kernel _pair_counts names): then dWo = sum (s1 g)^T O,
    G = (s1 g) Wo, dbo = sum s2 g (the divided bias's gradient for OpenFold): in the chunks below, or
    with pair_kernels (None: PAIR_BACKWARD == "kernels") by the dWo and da, db kernels where they run,
    handed s1 g as grad_out and a row scale of 1 (s1 g and dbo in one sweep over grad_out by
    opm_pair_grad_kernel where _pair_g_kernel_runs, else by ATen in float32); a, b and the LayerNorm part run
    as for the row mode.

    Shapes: msa (B, S, N, c_m), mask m (B, S, N) of any float, bool or integer dtype (floating masks
    other than float32 go to the kernels as float32), ln_w / ln_b (c_m,), wa / wb (c, c_m),
    ba / bb (c,), wo (c_z, c*c), bo (c_z,), grad_out g (B, N, N, c_z). Forward:
        x = LayerNorm(msa),  a = (x Wa^T + ba) * m,  b = (x Wb^T + bb) * m                (B, S, N, c)
        O[b,i,j,h,k] = sum_s a[b,s,i,h] b[b,s,j,k],  d[b,i] = max(sum_s m[b,s,i], 1)
        out[b,i,j,z] = bo[z] + sum_{hk} Wo[z, h c + k] O[b,i,j,h,k] / d[b,i]
    Backward:
        dWo[z, hk]     = sum_{b,i,j} g[b,i,j,z] O[b,i,j,hk] / d[b,i],   dbo = sum_{b,i,j} g
        G[b,i,j,hk]    = sum_z g[b,i,j,z] Wo[z, hk] / d[b,i]                             (B, r, N, c*c)
        da[b,s,i,h]    = sum_{j,k} G[b,i,j,h,k] b[b,s,j,k]
        db[b,s,j,k]    = sum_{i,h} G[b,i,j,h,k] a[b,s,i,h]
        dpa = da * m, dpb = db * m:  dWa = sum dpa^T x, dba = sum dpa (b likewise)
        dy  = dpa Wa + dpb Wb (the gradient of x), then the LayerNorm backward (module docstring).
    a, b and 1 / d: ab = (a, b, 1 / d) as the forward computed them (float32, hidden_dim 32), else
    recomputed: by outer_wg's prep kernel (opm_prep_ow_kernel writing rows, the forward's LayerNorm and
    projections) where _rows_kernel_runs holds (rows_kernel None) or rows_kernel is True, elsewhere by
    ATen's LayerNorm (torch.native_layer_norm) and addmm per contiguous chunk of the B*S*N msa rows.

    out_proj's weight gradient runs in a CUDA kernel (opm_bw_wo_kernel: O per tile on chip, wgmma) where _wo_kernel_runs
    holds (wo_kernel None) or wo_kernel is True; da and db likewise (opm_bw_ab_kernel: G per tile on chip) where
    _ab_kernel_runs holds (ab_kernel None) or ab_kernel is True. The chunks below form O where dWo has no kernel and G
    where da, db have none (none with both). These two kernels run split TF32 (about fp32's precision) for a float32 msa
    or where split is True; for a float16 / bfloat16 msa they otherwise run on that type's tensor cores (a, b, Wo, g / d
    and the intermediate O and G rounded to it, where the reference in that dtype rounds a, b, O and its products; fp32
    accumulation) and take grad_out in that type, where pair_dim % 8 == 0 (16-byte rows of it; else split TF32 on an
    fp32 copy). With both, dbo is the column sums of grad_out (opm_colsum_kernel), else the chunks' sums. The rest (the
    mask, dy, the LayerNorm backward, dWa, dba, dWb, dbb, d_ln_w, d_ln_b) runs in one sweep over the msa rows
    (opm_bw_ln_kernel: the msa in its dtype, fp32 math, its products split TF32 for a float32 msa and single TF32 for
    float16 / bfloat16 whatever split says) where _ln_kernel_runs holds (ln_kernel None) or ln_kernel is True, else in
    chunks of rows with ATen's native_layer_norm_backward. Takes detached tensors (the autograd Function's backward
    calls it under no_grad). parts: a list to which the names of the parts computed by this file's kernels are appended,
    in this order: "a, b" (given by the forward or by the prep kernel; with `ab` given, "a, b" stands for the forward's
    kernels), "dWo" (or "dWo from O"), "da, db" (or "da, db from G"), "LayerNorm", appended before they run
    (ModelNew.last_backward holds them as a tuple once the call returns). o: the forward's O times the row's factor (O /
    d; s1 O in the pair modes), (B, N, N, c*c) in the msa's dtype, as opm_forward's keep_o returns it, or None: where
    given and dWo would run in its kernel, dWo = grad_out^T o by one matrix product (KEEP_O_PRODUCT: the library's in
    that dtype, the reference's own, or opm_backward_wo_kept; part "dWo from O" in place of "dWo"), and o's storage is
    freed after it with release_ab. da, db: where _g_mem_runs holds (G_MEM) instead of their kernel, G (B, 32 N, 32 N)
    in the msa's dtype by opm_backward_g and two library products in that dtype (part "da, db from G" in place of "da,
    db").

    Memory: a, b (B, S, N, c) in ct until da, db are formed, da, db to the end; the outer product and G only for r rows
    i at a time (B, r, N, c, c), r from chunk_bytes (at least 1); x is recomputed per chunk of msa rows when needed,
    never held whole; with G_MEM, G whole (at most G_MEM_MAX_BYTES) and a, b in the msa's dtype until da, db are formed.
    low_memory (default False here; ModelNew's backward passes LOW_MEMORY_BACKWARD as its forward read it), where the
    kernels run: the dWo kernel's G planes in chunks of 32 MB (at least one 64-residue i tile: 64 MB in fp32 at N =
    1024; with LOW_MEMORY_SPLIT_J, chunks of that tile's j blocks instead), not 256; da, db in the msa's 16-bit type
    where the da / db and LayerNorm kernels run on it; the LayerNorm kernel writes its block partials over da, db's rows
    it has read (no buffer of its own: da, db hold them afterwards). release_ab: the given a, b's storage is freed
    (resized to 0 bytes, where it is resizable) once da, db are formed, whoever holds them (the autograd Function's
    saved a, b: a second backward through a retained graph finds them empty and recomputes them). The denominator sums
    float masks in fp64 and bool / integer masks in int64 (exact for 0/1 masks, as the forward kernel does). Returns
    (d_msa, d_ln_w, d_ln_b, d_wa, d_ba, d_wb, d_bb, d_wo, d_bo), each in its tensor's dtype.
    """
    B, S, N, c_m = msa.shape
    c, c_z = wa.shape[0], wo.shape[0]
    ct = torch.promote_types(msa.dtype, torch.float32)
    dev = msa.device
    Wo, Wa, Wb, lw, lb, Ba, Bb = _converted_together((wo, wa, wb, ln_w, ln_b, ba, bb), ct)
    itemsize = torch.empty((), dtype=ct).element_size()
    rows_outer, rows_ln = outer_product_mean_rows(B, S, N, c_m, c, c_z, itemsize, chunk_bytes)

    wo_in_kernel = _wo_kernel_runs(msa, c, c_z, ct) if wo_kernel is None else wo_kernel
    ab_in_kernel = _ab_kernel_runs(msa, c, c_z, ct) if ab_kernel is None else ab_kernel
    pair = norm != NORM_ROWS
    if pair and not (pair_backward.current() == "kernels" if pair_kernels is None else pair_kernels):  # chunks for dWo, da, db
        wo_in_kernel = ab_in_kernel = False
    wo_from_o = o is not None and wo_in_kernel  # (then dWo by one product over the forward's O)
    if o is not None and not wo_from_o:  # not read here (the forward's _keep_o rules it out): freed at once
        if release_ab:
            _free_storage(o)
        o = None
    wo_in_kernel = wo_in_kernel and not wo_from_o
    wo_done = wo_in_kernel or wo_from_o
    ln_in_kernel = _ln_kernel_runs(msa, c, c_m) if ln_kernel is None else ln_kernel
    rows_in_kernel = ab is not None or (_rows_kernel_runs(msa, c, c_m) if rows_kernel is None else rows_kernel)
    # dWo, da and db's products: split TF32, or in the msa's 16-bit type (grad_out's rows 16-byte aligned
    # in it for the kernels' loads and da, db's tensor map: pair_dim % 8 == 0)
    half = msa.dtype in (torch.float16, torch.bfloat16)
    ops = _dtype_name(msa.dtype) if half and not split and c_z % 8 == 0 else "split"
    g_mem = ab_in_kernel and ops != "split" and _g_mem_runs(B, S, N, c_z, msa.element_size())
    if parts is not None:
        parts += [n for n, k in (("a, b", rows_in_kernel), ("dWo", wo_in_kernel), ("dWo from O", wo_from_o),
                                 ("da, db", ab_in_kernel and not g_mem), ("da, db from G", g_mem),
                                 ("LayerNorm", ln_in_kernel)) if k]
    R = B * S * N
    msa_rows = msa.reshape(R, c_m)
    # the kernels take float32, bool and integer masks as they are
    mask_k = mask.float() if mask.is_floating_point() and mask.dtype != torch.float32 else mask
    if not (rows_in_kernel and ln_in_kernel):
        m_rows = mask.to(ct).reshape(R, 1)
    if pair and mask.is_cuda and ct == torch.float32:  # (s1, s2) as the forward computed them, one launch
        scale = _ext.opm_pair_scale(mask, norm, norm_eps, _pair_counts())              # (B, N, N, 2)
        s1, s2 = scale[..., 0], scale[..., 1]
    elif pair:
        s1, s2 = (t.to(ct) for t in pair_scales(mask, norm, norm_eps))                 # (B, N, N)
    elif not (rows_in_kernel and wo_done and ab_in_kernel):
        acc = torch.float64 if mask.is_floating_point() else torch.int64
        denom = mask.to(acc).sum(1).clamp(min=1).to(ct)                                # d (B, N)

    # a, b for all positions (B, S, N, c): outer_wg's prep kernel (LayerNorm + projections + mask, and
    # 1 / denom), or LayerNorm recomputed per chunk of rows (ATen's fused LayerNorm: the reference's own
    # kernels; each chunk a contiguous row range) and the projections by addmm
    if ab is not None:
        a, b, inv_d = ab
    elif rows_in_kernel:
        a, b, inv_d = _ext.opm_backward_rows(msa, mask_k, lw, lb, Wa, Ba, Wb, Bb, eps, False)
    else:
        a = torch.empty((B, S, N, c), dtype=ct, device=dev)
        b = torch.empty((B, S, N, c), dtype=ct, device=dev)
        a_rows, b_rows = a.view(R, c), b.view(R, c)
        for r0 in range(0, R, rows_ln):
            r1 = min(R, r0 + rows_ln)
            x = torch.native_layer_norm(msa_rows[r0:r1].to(ct), (c_m,), lw, lb, eps)[0]   # (r, c_m)
            torch.addmm(Ba, x, Wa.t(), out=a_rows[r0:r1]).mul_(m_rows[r0:r1])
            torch.addmm(Bb, x, Wb.t(), out=b_rows[r0:r1]).mul_(m_rows[r0:r1])
            del x
        if (wo_in_kernel or ab_in_kernel) and not pair:
            inv_d = denom.reciprocal()

    # grad_out as the kernels take it: float32 for split TF32, else in the msa's type (no copy where it is);
    # a pair mode hands them s1 g (rounded once to that type) and a row scale of 1
    g_k = None
    if pair and (wo_in_kernel or ab_in_kernel):
        k_dtype = ct if ops == "split" else msa.dtype
        if _pair_g_kernel_runs(grad_out, ct, k_dtype):  # one sweep: s1 g and dbo's sums
            g_k, d_bo_pair = _ext.opm_backward_pair_g(grad_out, s1.contiguous(), norm == NORM_OPENFOLD,
                                                      k_dtype == torch.float32)
        else:
            g_ct = grad_out.to(ct)
            gs = g_ct * s1[..., None]
            d_bo_pair = (gs if norm == NORM_OPENFOLD else g_ct).sum((0, 1, 2))
            del g_ct
            g_k = gs.to(k_dtype).contiguous()
            del gs
        inv_d = torch.ones((B, N), dtype=torch.float32, device=dev)
    elif wo_in_kernel or ab_in_kernel:
        g_k = grad_out.to(ct if ops == "split" else msa.dtype).contiguous()

    # Outer product and its gradient, chunks of rows i                             (B, r, N, c, c)
    if wo_in_kernel or ab_in_kernel:
        inv_d = inv_d.contiguous()
    if wo_from_o:  # sum over the pairs of g^T (O / d) (s1 O: the pair modes' grad_out unscaled)
        if KEEP_O_PRODUCT not in ("library", "kernel"):
            raise ValueError(f"outer_product_mean: KEEP_O_PRODUCT must be 'library' or 'kernel', "
                             f"got {KEEP_O_PRODUCT!r}")
        g_o = grad_out.reshape(B * N * N, c_z).to(o.dtype)
        if KEEP_O_PRODUCT == "kernel" and c_z % 8 == 0:  # float32 sums
            d_wo = _ext.opm_backward_wo_kept(g_o, o.view(B * N * N, c * c))
        else:  # in o's dtype (onto zeros: initcheck does not see the library's stores of its output)
            d_wo = torch.zeros((c_z, c * c), dtype=o.dtype, device=dev)
            d_wo.addmm_(g_o.t(), o.view(B * N * N, c * c))
        del g_o
        if release_ab:
            _free_storage(o)
        del o
    elif wo_in_kernel:
        d_wo = _ext.opm_backward_wo(a, b, inv_d, g_k, ops, (32 if low_memory else 256) << 20,
                                    low_memory and _flag("LOW_MEMORY_SPLIT_J"))
    else:
        d_wo = torch.zeros((c_z, c * c), dtype=ct, device=dev)
    if g_mem:  # G once in memory, then two products in the msa's dtype (da, db rounded to it)
        G = _ext.opm_backward_g(g_k, wo.to(msa.dtype), inv_d)                          # (B, 32 N, 32 N)
        v_a, v_b = (t.to(msa.dtype).reshape(B, S, N * c) for t in (a, b))
        da = (v_b @ G.transpose(1, 2)).view(B, S, N, c)                                # sum_{j,k} b G
        db = (v_a @ G).view(B, S, N, c)                                                # sum_{i,h} a G
        del G, v_a, v_b
        if not ln_in_kernel:
            da, db = da.to(ct), db.to(ct)
    elif ab_in_kernel:  # (da, db in the msa's type only for the LayerNorm kernel)
        da, db = _ext.opm_backward_ab(a, b, inv_d, g_k, Wo.contiguous(), ops,
                                      low_memory and ops != "split" and ln_in_kernel)
    else:
        da = torch.empty((B, S, N, c), dtype=ct, device=dev)
        db = torch.zeros((B, S, N, c), dtype=ct, device=dev)
    if wo_done and ab_in_kernel:
        d_bo = d_bo_pair if pair else _ext.opm_backward_dbo(g_k)  # (c_z % 4 == 0 where the da / db kernel runs)
    else:  # chunks: O for dWo and / or G for da, db, whichever no kernel computes
        d_bo = torch.zeros((c_z,), dtype=ct, device=dev)
        b_flat = b.reshape(B, S, N * c)                                                # (B, S, N c)
        for r0 in range(0, N, rows_outer):
            r1 = min(N, r0 + rows_outer)
            r = r1 - r0
            a_r = a[:, :, r0:r1].reshape(B, S, r * c)                                  # (B, S, r c)
            g = grad_out[:, r0:r1].to(ct)                                              # (B, r, N, c_z)
            if pair:  # s1 g; dbo = sum s2 g (s2 = s1 for OpenFold, 1 for Boltz)
                gs = g * s1[:, r0:r1, :, None]
                d_bo += (gs if norm == NORM_OPENFOLD else g).sum((0, 1, 2))
                g = gs.reshape(B * r * N, c_z)
                del gs
            else:
                d_bo += g.sum((0, 1, 2))
                g = (g / denom[:, r0:r1, None, None]).reshape(B * r * N, c_z)          # g / d (B r N, c_z)
            if not wo_done:
                # O[b,i,j,h,k]: one product (B, r c, N c) laid out (i, h, j, k), copied to (i, j, h k)
                o = (a_r.transpose(1, 2) @ b_flat).reshape(B, r, c, N, c).permute(0, 1, 3, 2, 4)
                o = o.reshape(B * r * N, c * c)                                        # (B r N, c c)
                d_wo.addmm_(g.t(), o)                                                  # (c_z, c c)
                del o
            if not ab_in_kernel:
                # G[b,i,j,h,k] = sum_z (g / d) Wo, copied to (i, h, j, k) for the two products (B, r c, N c)
                G = (g @ Wo).reshape(B, r, N, c, c).permute(0, 1, 3, 2, 4).reshape(B, r * c, N * c)
                da[:, :, r0:r1] = (b_flat @ G.transpose(1, 2)).reshape(B, S, r, c)     # sum_{j,k} G b
                db += (a_r @ G).reshape(B, S, N, c)                                    # sum_{i,h} G a
                del G
            del g, a_r
        del b_flat
    if release_ab and ab is not None:  # the given a, b are not read past here (a storage that cannot resize stays)
        _free_storage(a, b)
    del a, b, g_k

    # The mask, projections and LayerNorm backward: one CUDA pass where _ln_kernel_runs, else chunks of
    # rows (ATen's LayerNorm backward)
    if ln_in_kernel:
        d_msa, d_ln_w, d_ln_b, d_wa, d_ba, d_wb, d_bb = _ext.opm_backward_ln(
            msa_rows, da.view(R, c), db.view(R, c), mask_k.reshape(R), lw, lb, Wa.contiguous(), Wb.contiguous(), eps,
            low_memory)  # (low_memory: its block partials written over da, db's consumed rows)
        d_msa = d_msa.view(B, S, N, c_m)
    else:
        da *= m_rows.view(B, S, N, 1)                                                  # dpa (B, S, N, c)
        db *= m_rows.view(B, S, N, 1)                                                  # dpb
        d_ba = da.sum((0, 1, 2))
        d_bb = db.sum((0, 1, 2))
        d_wa = torch.zeros((c, c_m), dtype=ct, device=dev)
        d_wb = torch.zeros((c, c_m), dtype=ct, device=dev)
        d_ln_w = torch.zeros((c_m,), dtype=ct, device=dev)
        d_ln_b = torch.zeros((c_m,), dtype=ct, device=dev)
        d_msa = torch.empty((B, S, N, c_m), dtype=msa.dtype, device=dev)
        da_rows, db_rows, d_msa_rows = da.view(R, c), db.view(R, c), d_msa.view(R, c_m)
        for r0 in range(0, R, rows_ln):
            r1 = min(R, r0 + rows_ln)
            xin = msa_rows[r0:r1].to(ct)                                               # (r, c_m)
            x, mean, rstd = torch.native_layer_norm(xin, (c_m,), lw, lb, eps)
            dpa, dpb = da_rows[r0:r1], db_rows[r0:r1]                                  # (r, c)
            d_wa.addmm_(dpa.t(), x)                                                    # (c, c_m)
            d_wb.addmm_(dpb.t(), x)
            del x
            dy = (dpa @ Wa).addmm_(dpb, Wb)                                            # (r, c_m)
            dx, dlw, dlb = torch.ops.aten.native_layer_norm_backward(dy, xin, (c_m,), mean, rstd, lw, lb,
                                                                     (True, True, True))
            d_ln_w += dlw
            d_ln_b += dlb
            d_msa_rows[r0:r1] = dx
            del xin, mean, rstd, dy, dx, dlw, dlb

    # (one by one: each gradient its own storage, as autograd hands them out as .grad)
    return (d_msa, d_ln_w.to(ln_w.dtype), d_ln_b.to(ln_b.dtype), d_wa.to(wa.dtype), d_ba.to(ba.dtype),
            d_wb.to(wb.dtype), d_bb.to(bb.dtype), d_wo.to(wo.dtype), d_bo.to(bo.dtype))


# =============================================================================================
# Module
# =============================================================================================
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PARAM_NAMES = ("layer_norm.weight", "layer_norm.bias", "proj_a.weight", "proj_a.bias", "proj_b.weight",
                "proj_b.bias", "out_proj.weight", "out_proj.bias")


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _output_dtype(msa, params, names=_PARAM_NAMES):
    """(out_dtype, same): the dtype the reference returns for these tensors, under CUDA autocast the autocast dtype,
    else the one dtype of msa_repr and every parameter (float32, float16 or bfloat16; others raise); same: whether
    every parameter has msa_repr's dtype (always outside autocast, where a mismatch raises)."""
    dtype = msa.dtype
    if dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"outer_product_mean: msa_repr must be float32, float16 or bfloat16, got "
                           f"{_dtype_name(dtype)}")
    if msa.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda"), all(p.dtype == dtype for p in params)
    for name, p in zip(names, params):
        if p.dtype != dtype:
            raise RuntimeError(f"outer_product_mean: parameter {name} must be {_dtype_name(dtype)} like "
                               f"msa_repr, got {_dtype_name(p.dtype)} (cast the module and its inputs to one of "
                               "float32, float16, bfloat16)")
    return dtype, True


def _f32(t):
    """t in float32 (the kernels' dtype), t itself when it is float32 already."""
    return t if t.dtype == torch.float32 else t.float()


def _run_kernels(model, code, msa, mask, params, eps, out_dtype, same, keep_ab=False, norm=(NORM_ROWS, 0.0),
                 keep_o=False):
    """The CUDA forward, returned in out_dtype. Where msa and every parameter are float16 / bfloat16 of one
    dtype they go to the extension as they are: outer_wg reads them and runs both products on the
    16-bit tensor cores (module docstring), fused_small reads them in fp32 FMA, the other variants
    convert them to float32 inside the extension. Otherwise they are converted to float32 here. Masks of
    every dtype the kernels take go as they are. Records the variant that ran in model.last_variant.
    keep_ab: returns (out, ab, o): ab = (a, b, inv_denom), the masked projections and 1 / denom as outer_wg's prep
    or fused_small's first phase computed them where that variant ran with hidden_dim 32 (the backward then takes
    them instead of recomputing; no extra launch), else None; o the forward's O times the row's factor where keep_o
    asked for it and outer_wg kept it (opm_forward's keep_o), else None. norm: (mode, eps), NORM_ROWS or a pair mode
    (PAIR_EPILOGUE "fused": outer_wg and w_first_wg2 scale each pair in their epilogues; otherwise the kernels'
    zero-bias output rescaled per pair by opm_pair_epilogue_kernel). same: _output_dtype's (every parameter in
    msa's dtype)."""
    if not same:  # mixed dtypes (CUDA autocast): float32 copies
        msa, params = _f32(msa), [_f32(p) for p in params]
    extra = () if norm[0] == NORM_ROWS else (norm[0], float(norm[1]), pair_epilogue.current() == "fused",
                                             _pair_counts())
    out, ran, a, b, inv_d, o = _ext.opm_forward(msa, mask, *params, eps, code, keep_ab, *extra, keep_o=keep_o)
    object.__setattr__(model, "last_variant", _ALL_VARIANTS[ran])
    out = out if out.dtype == out_dtype else out.to(out_dtype)
    if not keep_ab:
        return out
    return out, (None if a is None else (a, b, inv_d)), o


def _keep_o(msa, params, same, norm):
    """Whether a forward that saves for the backward keeps O (KEEP_O): a float16 / bfloat16 msa with its parameters
    in that dtype, where the backward's dWo would run in its kernel (_wo_kernel_runs: hidden_dim 32, pair_dim up to
    128; the pair modes with pair_backward "kernels"), and O's (B, N, N, 1024) in that dtype at most
    KEEP_O_MAX_BYTES."""
    if not (_flag("KEEP_O") and same and msa.dtype in (torch.float16, torch.bfloat16)
            and (norm[0] == NORM_ROWS or pair_backward.current() == "kernels")):
        return False
    B, _, N, _ = msa.shape
    return (B * N * N * 1024 * msa.element_size() <= KEEP_O_MAX_BYTES
            and _wo_kernel_runs(msa, params[2].shape[0], params[6].shape[0], torch.float32))


class _OuterProductMean(torch.autograd.Function):
    """out = OuterProductMean(msa, mask; params): the forward is the CUDA kernels, the backward
    outer_product_mean_backward (its Hopper kernels, else PyTorch ops), given a, b and 1 / denom from the
    forward where outer_wg ran; the parts that ran in kernels go to model.last_backward. No gradient for
    the mask; double backward raises. norm: (mode, eps) as _run_kernels takes it."""

    @staticmethod
    def forward(ctx, call, msa, mask, *params):
        # call: (model, variant code, eps, out_dtype, same, norm) in one argument (each argument costs apply time)
        model, code, eps, out_dtype, same, norm = call
        ctx.eps, ctx.model, ctx.norm = eps, model, norm
        out, ab, o = _run_kernels(model, code, msa, mask, params, eps, out_dtype, same, keep_ab=True, norm=norm,
                                  keep_o=_keep_o(msa, params, same, norm))
        ctx.low = _flag("LOW_MEMORY_BACKWARD")
        # (a low-memory backward frees a, b and o)
        ctx.save_for_backward(msa, mask, *params, *(ab or (None, None, None)), o if ab is not None else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        msa, mask, *params = ctx.saved_tensors
        # (None where none were kept or an earlier backward freed them: recomputed)
        params, ab, o = params[:8], params[8:11], params[11]
        freed = ab[0] is not None and ab[0].numel() > 0 and ab[0].untyped_storage().nbytes() == 0
        ab = None if ab[0] is None or freed else tuple(ab)
        o = None if ab is None or o is None else o
        parts = []
        grads = outer_product_mean_backward(msa, mask, params[0], params[1], ctx.eps, *params[2:], grad_out,
                                            ab=ab, parts=parts, norm=ctx.norm[0], norm_eps=ctx.norm[1],
                                            low_memory=ctx.low, release_ab=ctx.low, o=o)
        object.__setattr__(ctx.model, "last_backward", tuple(parts))
        need = ctx.needs_input_grad[1:2] + ctx.needs_input_grad[3:]
        grads = tuple(g if n else None for g, n in zip(grads, need))
        return (None, grads[0], None) + grads[1:]


def _opm(model, msa, mask, params, names, ln_eps, norm=(NORM_ROWS, 0.0)):
    """The forward of ModelNew and the family modules: params in ModelNew's order (absent projection
    biases as zeros that need no gradient), names for the dtype errors."""
    code = model._variant_code()
    out_dtype, same = _output_dtype(msa, params, names)
    if not torch.is_grad_enabled():
        return _run_kernels(model, code, msa, mask, params, ln_eps, out_dtype, same, norm=norm)
    if mask.requires_grad:
        raise RuntimeError("outer_product_mean: no gradient for msa_mask (the mask is data here); "
                           "use msa_mask.detach()")
    if msa.requires_grad or any(p.requires_grad for p in params):
        return _OuterProductMean.apply((model, code, ln_eps, out_dtype, same, norm), msa, mask, *params)
    return _run_kernels(model, code, msa, mask, params, ln_eps, out_dtype, same, norm=norm)


class _Variants:
    """The variant selection ModelNew and the family modules share (see ModelNew)."""

    ALL_VARIANTS = _ALL_VARIANTS  # every name `variant` accepts (VARIANTS: those that run here)

    # The variants that run on the current GPU (what the harness checks by default): the Hopper ones
    # only where they can run; evaluated at each access, so importing makes no CUDA call. Any name
    # of _ALL_VARIANTS may be set; one that cannot run here raises with the reason.
    VARIANTS = _VariantsHere()

    def _variant_code(self):
        if self.variant not in _ALL_VARIANTS:
            raise ValueError(f"variant must be one of {_ALL_VARIANTS} (those that run on this GPU: "
                             f"{self.VARIANTS}), got {self.variant!r}")
        return _ALL_VARIANTS.index(self.variant)

    def _init_variants(self):
        self.variant = "auto"
        self.last_variant = None
        self.last_backward = None


class ModelNew(_Variants, nn.Module):
    """Drop-in for reference/outer_product_mean.py's Model: same submodules, same order, same init.

    float32, float16 or bfloat16 (module and msa_repr in one dtype; any mask dtype the kernels take,
    float16 / bfloat16 included), computed in float16 / bfloat16 by outer_wg on Hopper (module
    docstring), else in float32, and returned in the input's dtype (the autocast dtype under CUDA
    autocast). Differentiable with respect to msa_repr and every parameter; a mask that
    requires grad raises. After a forward last_variant names the variant that ran; after a backward
    last_backward is the tuple of its parts that ran in CUDA kernels (outer_product_mean_backward's
    parts: "a, b", "dWo" or "dWo from O", "da, db" or "da, db from G", "LayerNorm"; () where PyTorch ops computed
    all).
    """

    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim)
        self.proj_b = nn.Linear(msa_dim, hidden_dim)
        self.out_proj = nn.Linear(hidden_dim * hidden_dim, pair_dim)
        self._init_variants()

    def _parameters_in_order(self):
        """(layer_norm, its parameters and the projections' in the reference's order), read at every call through
        the modules' `_modules` / `_parameters` dicts: that is what nn.Module.__getattr__ looks up, at a fraction of
        its cost (16 attribute lookups were ~5 us of a call's host time on the CPU). A weight that is not a plain
        parameter (a parametrization) is not in those dicts: then the attribute path."""
        mods = self._modules
        ln, pa, pb, po = mods.get("layer_norm"), mods.get("proj_a"), mods.get("proj_b"), mods.get("out_proj")
        if ln is not None and pa is not None and pb is not None and po is not None:
            d0, d1, d2, d3 = ln._parameters, pa._parameters, pb._parameters, po._parameters
            params = (d0.get("weight"), d0.get("bias"), d1.get("weight"), d1.get("bias"), d2.get("weight"),
                      d2.get("bias"), d3.get("weight"), d3.get("bias"))
            for p in params:  # (a loop, not all() over a generator)
                if p is None:
                    break
            else:
                return ln, params
        ln = self.layer_norm
        return ln, (ln.weight, ln.bias, self.proj_a.weight, self.proj_a.bias, self.proj_b.weight, self.proj_b.bias,
                    self.out_proj.weight, self.out_proj.bias)

    def forward(self, msa_repr, msa_mask):
        ln, params = self._parameters_in_order()
        return _opm(self, msa_repr, msa_mask, params, _PARAM_NAMES, float(ln.eps))


_ZERO_BIAS = {}  # (features, dtype, device) -> zeros, made once (no fill launch per call); never written


def _proj_bias(linear):
    """A projection's bias, or zeros of its dtype and device (no gradient) where it has none: one tensor per
    (features, dtype, device), made outside inference mode so that autograd may save it later."""
    if linear.bias is not None:
        return linear.bias
    w = linear.weight
    key = (linear.out_features, w.dtype, w.device)
    zeros = _ZERO_BIAS.get(key)
    if zeros is None:
        with torch.inference_mode(False):
            zeros = _ZERO_BIAS[key] = torch.zeros(linear.out_features, dtype=w.dtype, device=w.device)
    return zeros


def _flat(m, mask):
    """(*, S, N, c_m) and (*, S, N) -> (B, S, N, c_m), (B, S, N) with B the leading dims' product."""
    if m.dim() < 3:
        raise RuntimeError(f"outer_product_mean: m must be (*, S, N, c_m), got shape {tuple(m.shape)}")
    S, N, c_m = m.shape[-3:]
    return m.reshape(-1, S, N, c_m), mask.reshape(-1, S, N)


class OpenFoldOuterProductMean(_Variants, nn.Module):
    """The AlphaFold 2 / 3, OpenFold, OpenFold3 and Protenix outer product mean on the kernels (the
    module docstring's op with out = (acc + bo) / (sum_s m_si m_sj + eps), reference/
    outer_product_mean_openfold.py): OpenFold3's parameter names (layer_norm, linear_1, linear_2,
    linear_out) and forward(m, mask=None, chunk_size=None, inplace_safe=False), m (*, S, N, c_m),
    mask None = all ones; chunk_size and inplace_safe are accepted and change nothing. proj_bias: linear_1 /
    linear_2 with a bias (AlphaFold 2 / OpenFold), without (AlphaFold 3 / OpenFold3, the default).
    Dtypes, autocast, gradients, variant, last_variant, last_backward as ModelNew. from_openfold()
    converts a released module."""

    FAMILY = "openfold"

    def __init__(self, msa_dim, pair_dim, hidden_dim=32, eps=1e-3, proj_bias=False):
        super().__init__()
        self.c_m, self.c_z, self.c_hidden, self.eps = msa_dim, pair_dim, hidden_dim, eps
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.linear_1 = nn.Linear(msa_dim, hidden_dim, bias=proj_bias)
        self.linear_2 = nn.Linear(msa_dim, hidden_dim, bias=proj_bias)
        self.linear_out = nn.Linear(hidden_dim * hidden_dim, pair_dim)
        self._init_variants()

    def forward(self, m, mask=None, chunk_size=None, inplace_safe=False):
        if mask is None:
            mask = torch.ones(m.shape[:-1], dtype=torch.bool, device=m.device)
        x, k = _flat(m, mask)
        params = (self.layer_norm.weight, self.layer_norm.bias, self.linear_1.weight, _proj_bias(self.linear_1),
                  self.linear_2.weight, _proj_bias(self.linear_2), self.linear_out.weight, self.linear_out.bias)
        out = _opm(self, x, k, params, _OPENFOLD_NAMES, float(self.layer_norm.eps), (NORM_OPENFOLD, float(self.eps)))
        return out.reshape(m.shape[:-3] + out.shape[1:])


class BoltzOuterProductMean(_Variants, nn.Module):
    """The Boltz-1 / Boltz-2 outer product mean on the kernels (out = acc / max(sum_s m_si m_sj, 1) + bo,
    reference/outer_product_mean_boltz.py): Boltz's parameter names (norm, proj_a, proj_b without bias,
    proj_o) and forward(m, mask, chunk_size=None), m (B, S, N, c_m); chunk_size is accepted and changes
    nothing. The constructor takes the reference's (msa_dim, pair_dim, hidden_dim) order (Boltz's own
    is (c_in, c_hidden, c_out)). Dtypes, autocast, gradients, variant, last_variant, last_backward as
    ModelNew. from_boltz() converts a released module."""

    FAMILY = "boltz"

    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.c_hidden = hidden_dim
        self.norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim, bias=False)
        self.proj_b = nn.Linear(msa_dim, hidden_dim, bias=False)
        self.proj_o = nn.Linear(hidden_dim * hidden_dim, pair_dim)
        self._init_variants()

    def forward(self, m, mask, chunk_size=None):
        params = (self.norm.weight, self.norm.bias, self.proj_a.weight, _proj_bias(self.proj_a),
                  self.proj_b.weight, _proj_bias(self.proj_b), self.proj_o.weight, self.proj_o.bias)
        return _opm(self, m, mask, params, _BOLTZ_NAMES, float(self.norm.eps), (NORM_BOLTZ, 1.0))


_OPENFOLD_NAMES = ("layer_norm.weight", "layer_norm.bias", "linear_1.weight", "linear_1.bias", "linear_2.weight",
                   "linear_2.bias", "linear_out.weight", "linear_out.bias")
_BOLTZ_NAMES = ("norm.weight", "norm.bias", "proj_a.weight", "proj_a.bias", "proj_b.weight", "proj_b.bias",
                "proj_o.weight", "proj_o.bias")
# The family modules by the FAMILY a reference module declares (harness.py judges the one of its reference).
FAMILIES = {"openfold": OpenFoldOuterProductMean, "boltz": BoltzOuterProductMean}


def _converted(new, real):
    """new with real's parameters (strict state_dict load), dtype, device and training mode."""
    w = real.state_dict()
    first = next(iter(w.values()))
    new = new.to(device=first.device, dtype=first.dtype)
    new.load_state_dict(w, strict=True)
    return new.train(real.training)


def from_openfold(module):
    """An OpenFoldOuterProductMean with the weights, eps, LayerNorm eps, projection biases, dtype, device
    and training mode of a released OuterProductMean of OpenFold3, OpenFold or Protenix (attributes
    layer_norm, linear_1, linear_2, linear_out, eps; a LayerNorm with weight and bias)."""
    ln = module.layer_norm
    if getattr(ln, "weight", None) is None or getattr(ln, "bias", None) is None:
        raise ValueError("from_openfold: the module's layer_norm needs a weight and a bias")
    c_m, c = ln.weight.shape[0], module.linear_1.weight.shape[0]
    new = OpenFoldOuterProductMean(c_m, module.linear_out.weight.shape[0], c, eps=float(module.eps),
                                   proj_bias=module.linear_1.bias is not None)
    new.layer_norm.eps = float(ln.eps)
    return _converted(new, module)


def from_boltz(module):
    """A BoltzOuterProductMean with the weights, LayerNorm eps, dtype, device and training mode of a
    released Boltz OuterProductMean (norm, proj_a, proj_b, proj_o)."""
    c_m, c = module.norm.weight.shape[0], module.proj_a.weight.shape[0]
    new = BoltzOuterProductMean(c_m, module.proj_o.weight.shape[0], c)
    new.norm.eps = float(module.norm.eps)
    return _converted(new, module)


batch_size = 2
msa_depth = 8
seq_len = 32
msa_dim = 64
hidden_dim = 32
pair_dim = 64


def get_inputs():
    return [torch.randn(batch_size, msa_depth, seq_len, msa_dim), torch.ones(batch_size, msa_depth, seq_len)]


def get_init_inputs():
    return [msa_dim, pair_dim, hidden_dim]
