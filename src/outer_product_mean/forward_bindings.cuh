// outer_product_mean: the forward's bound function (argument checks, 'auto', the launches).
#pragma once
#include "launchers.cuh"

namespace opm {

// =============================================================================================
// Bound function
// =============================================================================================
// Error-message pieces as std::string. Streaming integers, shapes, devices or dtypes through
// c10::str (TORCH_CHECK) from this nvcc-compiled file crashed inside libstdc++
// (std::ostream::_M_insert<long>) on the torch 2.11 GPU image (seen 2026-11-29), so every number,
// shape, device and dtype in a message is converted to std::string first (as contact_map.py does).
template <typename T>
static std::string num(T v) { return std::to_string(v); }
static std::string shape_str(const at::Tensor& t) {
  std::string r = "[";
  const auto s = t.sizes();
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
static std::string dev_str(const at::Tensor& t) { return t.device().str(); }
static std::string dtype_str(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

static int mask_kind_of(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kBool: return kBool;
    case at::kByte: return kU8;
    case at::kChar: return kI8;
    case at::kShort: return kI16;
    case at::kInt: return kI32;
    case at::kLong: return kI64;
    default: return -1;
  }
}

// variant: a Variant id (kAuto or the variant to force). msa: float32, or bfloat16 / float16 with the
// parameters float32 or all of msa's dtype: outer_wg then reads msa (and the parameters) as they are,
// runs both products on the 16-bit tensor cores and writes out in msa's dtype (fused_small too where the
// parameters have msa's dtype, computing in fp32); the other variants run on float32 copies and return
// float32. Returns (out, the id of the variant that ran, a, b, inv_denom): with keep_ab, where outer_wg
// or fused_small ran with hidden_dim 32, a and b (B, S, N, 32) fp32 as its prep computed them (the
// backward's inputs, opm_backward_rows' outputs) and inv_denom (B, N); else undefined tensors (None).
// norm: kNormRows (the kernels' own row scale), or a pair mode (kNormOpenFold with eps norm_eps, kNormBoltz;
// see "Normalisations"): the variant runs with a zero bias, then opm_pair_scale_kernel and
// opm_pair_epilogue_kernel rescale its output in place; with pair_fused, outer_wg instead runs its kPair
// instance (the scale per pair in its own epilogue, the bias as given), w_first_wg2 its opm_wfirst_wg_kernel<true>.
// pair_counts: how float masks' pair counts are summed (PairCounts: 0 fp64 FMA, 1 DMMA, 2 DMMA fed by a cp.async
// ring, 3 the ring with 16-bit masks on HMMA; launch_pair_scale).
// keep_o: where outer_wg runs on a 16-bit msa with hidden_dim 32 (the pair modes: with pair_fused), the sixth
// output is O times the row's factor (O / denom; s1 O in the pair modes), (B, N, N, 1024) in msa's dtype, as its
// fused kernel's phase A summed it (the backward's dWo = g^T of it); else an undefined tensor (None).
std::tuple<at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor, at::Tensor> opm_forward(
    at::Tensor msa, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa, at::Tensor ba, at::Tensor wb,
    at::Tensor bb, at::Tensor wo, at::Tensor bo, double eps, int64_t variant, bool keep_ab, int64_t norm,
    double norm_eps, bool pair_fused, int64_t pair_counts, bool keep_o) {
  // ---- checks that need no device: rank, dtype, sizes, limits ----
  TORCH_CHECK(msa.dim() == 4, "outer_product_mean: msa_repr must be 4-D (B, S, N, msa_dim), got shape ",
              shape_str(msa));
  TORCH_CHECK(msa.scalar_type() == at::kFloat || msa.scalar_type() == at::kBFloat16 || msa.scalar_type() == at::kHalf,
              "outer_product_mean: msa_repr must be float32, bfloat16 or float16, got ", dtype_str(msa));
  const bool half_input = msa.scalar_type() != at::kFloat;
  const int64_t B = msa.size(0), S = msa.size(1), N = msa.size(2), cm = msa.size(3);
  TORCH_CHECK(ln_w.dim() == 1 && ln_b.dim() == 1 && ln_w.size(0) == cm && ln_b.size(0) == cm,
              "outer_product_mean: msa_repr has msa_dim = ", num(cm), " (shape ", shape_str(msa),
              ") but layer_norm weight/bias have shapes ", shape_str(ln_w), " / ", shape_str(ln_b));
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == S && mask.size(2) == N,
              "outer_product_mean: msa_mask must have shape (B, S, N) = (", num(B), ", ", num(S), ", ", num(N),
              ") to match msa_repr ", shape_str(msa), ", got ", shape_str(mask));
  const int mask_kind = mask_kind_of(mask.scalar_type());
  TORCH_CHECK(mask_kind >= 0, "outer_product_mean: unsupported msa_mask dtype ", dtype_str(mask),
              "; use float32, float16, bfloat16, bool, uint8, int8, int16, int32 or int64");
  TORCH_CHECK(wa.dim() == 2 && wa.size(1) == cm && ba.dim() == 1 && ba.size(0) == wa.size(0),
              "outer_product_mean: proj_a weight must be (hidden_dim, msa_dim = ", num(cm), ") with bias (hidden_dim), got ",
              shape_str(wa), " and ", shape_str(ba));
  const int64_t c = wa.size(0);
  TORCH_CHECK(wb.dim() == 2 && wb.size(0) == c && wb.size(1) == cm && bb.dim() == 1 && bb.size(0) == c,
              "outer_product_mean: proj_b weight must be (", num(c), ", ", num(cm), ") with bias (", num(c), "), got ",
              shape_str(wb), " and ", shape_str(bb));
  TORCH_CHECK(wo.dim() == 2 && wo.size(1) == c * c && bo.dim() == 1 && bo.size(0) == wo.size(0),
              "outer_product_mean: out_proj weight must be (pair_dim, hidden_dim^2 = ", num(c * c),
              ") with bias (pair_dim), got ", shape_str(wo), " and ", shape_str(bo));
  const int64_t cz = wo.size(0);
  TORCH_CHECK(c >= 1 && c <= kMaxHidden, "outer_product_mean: hidden_dim must be in [1, ", num(kMaxHidden), "], got ", num(c));
  TORCH_CHECK(cm >= 1 && cm <= kMaxMsaDim, "outer_product_mean: msa_dim must be in [1, ", num(kMaxMsaDim),
              "] (64 rows of msa are kept in shared memory), got ", num(cm));
  TORCH_CHECK(cz >= 1, "outer_product_mean: pair_dim must be >= 1, got ", num(cz));
  // parameters: float32, or all of msa's dtype where that is float16 / bfloat16 (converted below where
  // the variant is not outer_wg)
  const bool p16 = half_input && ln_w.scalar_type() == msa.scalar_type();
  for (const at::Tensor* p : {&ln_w, &ln_b, &wa, &ba, &wb, &bb, &wo, &bo})
    TORCH_CHECK(p->scalar_type() == (p16 ? msa.scalar_type() : at::kFloat), "outer_product_mean: parameters must be ",
                p16 ? "all " : "", p16 ? dtype_str(msa) : std::string("float32"), p16 ? " like msa_repr" : "", ", got ",
                dtype_str(*p));
  TORCH_CHECK(norm >= kNormRows && norm <= kNormBoltz, "outer_product_mean: norm code must be 0-2, got ", num(norm));
  TORCH_CHECK(pair_counts >= kCountsFma && pair_counts <= kCountsHmma,
              "outer_product_mean: pair_counts must be 0-3, got ", num(pair_counts));
  const int counts = static_cast<int>(pair_counts);
  TORCH_CHECK(variant >= 0 && variant < kNumVariants, "outer_product_mean: variant code must be 0-",
              num(kNumVariants - 1), ", got ", num(variant));
  TORCH_CHECK(variant != kFusedSmall || c <= kFsCP, "outer_product_mean: variant fused_small needs hidden_dim <= ",
              num(kFsCP), " (this model: ", num(c), "); use outer_first or w_first_small");

  // ---- device checks ----
  TORCH_CHECK(msa.is_cuda(), "outer_product_mean: msa_repr must be a CUDA tensor, got a tensor on ", dev_str(msa),
              " (move the model and inputs with .cuda())");
  TORCH_CHECK(mask.device() == msa.device(), "outer_product_mean: msa_mask is on ", dev_str(mask),
              " but msa_repr is on ", dev_str(msa));
  for (const at::Tensor* p : {&ln_w, &ln_b, &wa, &ba, &wb, &bb, &wo, &bo})
    TORCH_CHECK(p->device() == msa.device(), "outer_product_mean: the parameters are on ", dev_str(*p),
                " but msa_repr is on ", dev_str(msa), " (call model.to(msa_repr.device))");

  const c10::cuda::CUDAGuard guard(msa.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(msa.get_device());
  TORCH_CHECK((variant != kWFirstTc && variant != kWFirstTc2) || d.tc_ok,
              "outer_product_mean: variants w_first_tc and w_first_tc2 need an sm_80+ GPU (TF32 mma.sync) and this "
              "extension built for sm_80+ (TORCH_CUDA_ARCH_LIST); this GPU has compute capability ", num(d.major), ".x");
  TORCH_CHECK(variant != kWFirstWg2 || d.wg_ok, "outer_product_mean: variant w_first_wg2 needs a compute "
              "capability 9.0 GPU (H100/H200: wgmma; this GPU: ", num(d.major), ".", num(d.minor), "), this "
              "extension built with sm_90a code (TORCH_CUDA_ARCH_LIST with 9.0 or 9.0a, not a name such as "
              "Hopper; this build: ", kBuiltSm90a ? "yes" : "no", ") and ", num(kWgSmemBytes), " bytes of "
              "shared memory per block (this GPU: ", num(d.smem_optin), ")");
  // outer_wg's prep decodes its warp tiles (4 s x 4 n each, S padded to its s blocks, N to 16) and its fused
  // kernel its tiles (16 i x 4 j x 128 z) in 32 bits
  const bool ow_tiles_ok = B * round_up(S, ow_sb(msa.scalar_type())) * round_up(N, 16) / 16 < (1ll << 31) &&
                           B * cdiv(N, kOwTI) * cdiv(N, kOwTJ) * cdiv(cz, kOwZ) < (1ll << 31);
  TORCH_CHECK(variant != kOuterWg || ow_tiles_ok, "outer_product_mean: variant outer_wg needs B * S * N / 16 < 2^31 (S "
              "rounded up to 16, or to 32 for float16 / bfloat16, N to 16) and B * N^2 / 64 < 2^31 (per 128 of "
              "pair_dim, N rounded up to 16), got B = ", num(B), ", S = ", num(S), ", N = ", num(N),
              "; use outer_first or w_first_wg2");
  TORCH_CHECK(variant != kOuterWg || (d.ow_ok && c <= 32), "outer_product_mean: variant outer_wg",
              " needs hidden_dim <= 32 "
              "(this model: ", num(c), "), a compute capability 9.0 GPU (this GPU: ", num(d.major), ".", num(d.minor),
              "), this extension built with sm_90a code (this build: ", kBuiltSm90a ? "yes" : "no", ") and ",
              num(kOwSmemMax), " bytes of shared memory per block (this GPU: ", num(d.smem_optin), ")");
  int CP = c <= 16 ? 16 : c <= 32 ? 32 : c <= 64 ? 64 : 128;
  const int64_t Npad = round_up(N, 4);
  const int64_t CZP = round_up(cz, kZC), CZP4 = round_up(cz, 4);

  // contraction order for "auto": the smaller estimated time (FLOPs as executed, i.e. with c padded
  // to CP, over the measured or predicted efficiency of each path, plus a fixed cost per launch);
  // w_first only if one j column of P fits the chunk cap. Constants: see kEff* above.
  const int64_t p_col_bytes = 4 * B * S * CP * CZP4;
  const int64_t JC = std::max<int64_t>(1, std::min<int64_t>(N, kPChunkBytes / std::max<int64_t>(p_col_bytes, 1)));
  // w_first_wg2: a chunk of P's tile-order planes (hi and lo, K padded to kWgBK, columns to whole
  // 128-column blocks) up to kPChunkBytesWg: as many j as fill whole blocks under the cap (>= 1)
  const int64_t KB = cdiv(S * CP, kWgBK);
  const int64_t wg_block_bytes = 4 * B * KB * 2 * kWgBPlane;  // one 128-column block of P, all K
  const bool wg_fits = wg_block_bytes <= kPChunkBytesWg;
  const int64_t JCw = std::max<int64_t>(
      1, std::min<int64_t>(N, kPChunkBytesWg / std::max<int64_t>(wg_block_bytes, 1) * kWgBRows / CZP4));
  const bool w_small = B * cdiv(N, kTile) * cdiv(JC * CZP4, kTile) < d.sms;  // 128-tile grid under one wave
  int64_t used = variant;
  if (variant == kAuto) {
    const double cp = CP, nn = static_cast<double>(B) * N * N, bsn = static_cast<double>(B) * S * N;
    // every path but outer_wg starts with opm_prep_kernel (FMA): 2 B S N c_m 2CP FLOPs at kEffPrep
    const double t_prep = 2.0 * bsn * cm * 2 * cp / kEffPrep + kLaunchS;
    const double t_outer = t_prep + 2.0 * nn * cp * cp * (S + cz) / kEffOuter + kLaunchS;
    const double nchunk = static_cast<double>(cdiv(N, JC));
    // stage 2: the small kernel under one wave of 128 x 128 tiles, else split TF32 on sm_80+
    // (w_first_tc2 where its shared memory fits, else w_first_tc)
    const bool w_tc = !w_small && d.tc_ok;
    const bool tc2_fits = kTcSmemBytes<2> <= static_cast<size_t>(d.smem_optin);  // 136 KB: not the 100 KB parts
    const double t_w = t_prep + 2.0 * bsn * cp * cp * CZP4 / kEffProj +
                       2.0 * nn * S * cp * CZP4 / (w_small ? kEffSmall : w_tc ? (tc2_fits ? kEffWTc : kEffWTc1) : kEffW) +
                       2.0 * nchunk * kLaunchS;
    // w_first_wg2 (Hopper): stage 1 writing the split planes, stage 2 on wgmma; not where its first
    // chunk has fewer 128 x 128 tiles than SMs (those go to w_first_small, as for w_first)
    const bool wg_small = B * cdiv(N, kTile) * cdiv(JCw * CZP4, kTile) < d.sms;
    const double t_wg = d.wg_ok && !wg_small && wg_fits
                            ? t_prep + 2.0 * bsn * cp * cp * CZP4 / kEffProjWg + 2.0 * nn * S * cp * CZP4 / kEffWg +
                                  2.0 * static_cast<double>(cdiv(N, JCw)) * kLaunchS + kLaunchS
                            : 1e30;
    // outer_wg (Hopper, hidden_dim <= 32): whole waves of tiles (one tile per SM at a time), each
    // tile's phase-A and phase-B FLOPs (S, c, c_z padded to 16 (32 in fp16 / bf16), 32, 128) at their
    // own rates (the 16-bit ones for fp16 / bf16 inputs), plus its prep and its three launches
    const OwDims od = ow_dims(S, N, cz, ow_sb(msa.scalar_type()));
    const double ow_rate_a = half_input ? kEffOwA16 : kEffOwA, ow_rate_b = half_input ? kEffOwB16 : kEffOwB;
    const double ow_waves = std::ceil(static_cast<double>(B * od.nzc * od.NBB * od.NIT) / d.sms);
    const double ow_tile_s = kOwNQ * (2.0 * 128 * 128 * od.sb * od.KB / (ow_rate_a / d.sms) +
                                      2.0 * 64 * kOwZ * kOwHC * 32 / (ow_rate_b / d.sms));
    // + its tensor-core prep (opm_prep_ow_kernel): the larger of its bytes (msa read, the Aow / Bow
    // planes written) at kBwPrepOw and its tensor-core FLOPs (x3 for the split; rows and K padded
    // as executed) at kEffPrepOw
    const double el = msa.element_size(), plane_bytes = half_input ? el : 2 * 4.0;  // T, or fp32 hi + lo
    // the prep's passes in TF32 units (its float16 products, m16n8k16, run at twice the TF32 rate)
    const double passes = !half_input ? 3 : msa.scalar_type() == at::kBFloat16 ? 0.5 : 1.5;
    const double ow_prep_bytes = el * bsn * cm + plane_bytes * B * od.sb * od.KB * 32 * (16.0 * od.NIT + 4.0 * od.NBB);
    const double ow_prep_flops = passes * 2.0 * B * od.sb * od.KB * 16.0 * od.NIT * 16.0 * cdiv(cm, 16) * 64;
    const double ow_prep_s = std::max(ow_prep_bytes / kBwPrepOw, ow_prep_flops / kEffPrepOw);
    const double t_ow = d.ow_ok && c <= 32 && ow_tiles_ok ? ow_waves * ow_tile_s + ow_prep_s + 3 * kLaunchS : 1e30;
    const bool w_fits = p_col_bytes <= kPChunkBytes;
    used = (t_w < t_outer && w_fits) ? (w_small ? kWFirstSmall : w_tc ? (tc2_fits ? kWFirstTc2 : kWFirstTc) : kWFirst)
                                     : kOuterFirst;
    if (t_wg < std::min(t_outer, w_fits ? t_w : 1e30)) used = kWFirstWg2;
    if (t_ow < std::min({t_outer, w_fits ? t_w : 1e30, t_wg})) used = kOuterWg;  // (t_ow finite only if ow_tiles_ok)
    // fused_small (one cooperative launch) where one wave of blocks holds all its work (each task (b, 32 i,
    // 4 j, 8 z) and each group of kFsRows msa rows one block's) and S <= 32: at the seed shape it beat every
    // other variant in each dtype (NOTES: fused_small); with more tasks per block or more sequences its
    // FMA loop at 12.5% occupancy loses to the tensor-core paths. Only where its shared memory fits.
    if (c <= kFsCP && S <= 32 && kFsSmemBytes <= static_cast<size_t>(d.smem_optin)) {
      const FsLaunch f = fs_launch_info<float>(msa.get_device(), d);
      const int64_t blocks = static_cast<int64_t>(f.per_sm) * d.sms;
      const int64_t fs_tasks = B * cdiv(N, kFsNI) * cdiv(N, kFsJT) * cdiv(cz, kFsZT);
      if (f.coop && fs_tasks <= blocks && B * S * N <= kFsRows * blocks) used = kFusedSmall;
    }
  }
  if (used == kOuterWg) CP = 32;  // outer_wg's tiles are built for CP = 32 (c <= 32 zero-padded)

  auto f32 = msa.options().dtype(at::kFloat);
  // bfloat16 / float16 in and out: outer_wg, and fused_small where the parameters have msa's dtype too
  const bool half_io = half_input && (used == kOuterWg || (used == kFusedSmall && p16));
  at::Tensor out = at::empty({B, N, N, cz}, half_io ? msa.options() : f32);
  if (out.numel() == 0) return {out, used, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};

  // contiguous and 16-byte aligned (the prep kernels' 16-byte loads and bulk copies): a contiguous view
  // at an odd storage offset is copied; a 16-bit msa becomes float32 except where the variant reads it
  // (half_io); a float32 one is taken as it is
  at::Tensor x = half_io || !half_input ? msa.contiguous() : msa.contiguous().to(at::kFloat);
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();
  const at::Tensor m = mask.contiguous();
  // 16-bit parameters go to outer_wg's params kernel and fused_small as they are, as float32 to the others
  const bool pf = !p16 || used == kOuterWg || used == kFusedSmall;
  auto prm = [&](const at::Tensor& t) { return pf ? t.contiguous() : t.contiguous().to(at::kFloat); };
  const at::Tensor lw = prm(ln_w), lb = prm(ln_b);
  const at::Tensor wa_c = prm(wa), ba_c = prm(ba), wb_c = prm(wb), bb_c = prm(bb);
  const at::Tensor wo_c = prm(wo);
  // pair modes: outer_wg's and w_first_wg2's kPair instances with pair_fused, else the kernels add no bias (the
  // epilogue adds s2 bo)
  const bool pair = norm != kNormRows, fused = pair && pair_fused && (used == kOuterWg || used == kWFirstWg2);
  const at::Tensor bo_c = pair && !fused ? at::zeros_like(prm(bo)) : prm(bo);
  at::Tensor inv_denom = at::empty({B, N}, f32);
  const at::Tensor pscale = fused ? launch_pair_scale(m, mask_kind, B, S, N, static_cast<int>(norm), norm_eps,
                                                      at::Tensor(), d, stream, counts)
                                  : at::Tensor();
  // the pair modes' epilogue over out, after the kernels (which applied the row scale inv_denom)
  auto finish = [&]() {
    if (!pair || fused) return;
    const at::Tensor scale = launch_pair_scale(m, mask_kind, B, S, N, static_cast<int>(norm), norm_eps, inv_denom, d,
                                               stream, counts);
    at::Tensor bo_f = bo.to(at::kFloat).contiguous();
    if (reinterpret_cast<uintptr_t>(bo_f.data_ptr()) % 16 != 0) bo_f = bo_f.clone();
    launch_pair_epilogue(out, scale, bo_f, d, stream);
  };
  if (used == kOuterWg) {  // outer_wg: its own prep (no aT, bq)
    at::Tensor a, b;
    if (keep_ab && c == 32) {
      a = at::empty({B, S, N, 32}, f32);
      b = at::empty({B, S, N, 32}, f32);
    }
    at::Tensor on;
    if (keep_o && c == 32 && out.scalar_type() != at::kFloat && (!pair || fused))
      on = at::empty({B, N, N, 1024}, out.options());
    launch_outer_wg(x, m, mask_kind, lw, lb, wa_c, ba_c, wb_c, bb_c, wo_c, bo_c, inv_denom, out, B, S, N,
                    static_cast<int>(cm), static_cast<int>(c), static_cast<int>(cz), static_cast<float>(eps),
                    a.defined() ? a.data_ptr<float>() : nullptr, b.defined() ? b.data_ptr<float>() : nullptr,
                    d, stream, pscale, on);
    finish();
    if (!a.defined()) return {out, used, a, b, at::Tensor(), on};
    return {out, used, a, b, inv_denom, on};
  }
  if (used == kFusedSmall) {  // one kernel; its a and b rows (channels padded to 32) are the kept a, b at c = 32
    at::Tensor a = at::empty({B, S, N, kFsCP}, f32), b = at::empty({B, S, N, kFsCP}, f32);
    const bool keep = keep_ab && c == kFsCP;
    // (inv_denom also for the pair modes' epilogue, which divides out the row scale the kernel applied)
    launch_fused_small(x, m, mask_kind, lw, lb, wa_c, ba_c, wb_c, bb_c, wo_c, bo_c, a, b,
                       keep || pair ? inv_denom.data_ptr<float>() : nullptr, out, B, S, N, static_cast<int>(cm),
                       static_cast<int>(c), static_cast<int>(cz), static_cast<float>(eps), d, stream);
    finish();
    if (!keep) return {out, used, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    return {out, used, a, b, inv_denom, at::Tensor()};
  }
  // aT's rows are Npad = round_up(N, 4) long for 16-byte copies. The kernels copy a row's last group of 4 by
  // cp.async with src-size 4 (N - i0) < 16, which reads only the valid floats and zero-fills the rest, but
  // compute-sanitizer's initcheck counts the whole 16 bytes as read: zeros in the padding, which the prep
  // does not write, make that visible as initialised (one memset, only where N % 4 != 0).
  at::Tensor aT = Npad > N ? at::zeros({B, S, CP, Npad}, f32) : at::empty({B, S, CP, Npad}, f32);
  at::Tensor bq = at::empty({B, S, N, CP}, f32);
  const int pack_mode = used == kOuterFirst ? 0 : 1;
  const int64_t pack_zp = used == kOuterFirst ? CZP : CZP4;
  at::Tensor wpack = at::empty({static_cast<int64_t>(CP) * CP * pack_zp}, f32);

#define OPM_DISPATCH(CPV, ...)                               \
  switch (CPV) {                                             \
    case 16: { constexpr int kCP = 16; __VA_ARGS__; break; } \
    case 32: { constexpr int kCP = 32; __VA_ARGS__; break; } \
    case 64: { constexpr int kCP = 64; __VA_ARGS__; break; } \
    default: { constexpr int kCP = 128; __VA_ARGS__; break; } \
  }

  OPM_DISPATCH(CP, launch_prep<kCP>(x, m, mask_kind, lw, lb, wa_c, ba_c, wb_c, bb_c, wo_c, aT, bq, inv_denom, wpack,
                                    B, S, N, Npad, static_cast<int>(cm), static_cast<int>(c), static_cast<int>(cz),
                                    static_cast<float>(eps), pack_mode, static_cast<int>(pack_zp), d, stream));
  if (used == kOuterFirst) {
    OPM_DISPATCH(CP, launch_outer<kCP>(aT, bq, inv_denom, wpack, bo_c, out, B, S, N, Npad, static_cast<int>(cz),
                                       static_cast<int>(CZP), d, stream));
  } else if (used == kWFirstWg2) {
    at::Tensor At = at::empty({B * 2 * cdiv(N, 128) * KB * 2 * kWgAPlane}, f32);
    at::Tensor Pt = at::empty({wg_chunk_floats(B, JCw, KB, static_cast<int>(CZP4))}, f32);
    OPM_DISPATCH(CP, launch_wfirst_wg<kCP>(aT, bq, inv_denom, wpack, bo_c, out, At, Pt, JCw, B, S, N, Npad,
                                           static_cast<int>(cz), static_cast<int>(CZP4), d, stream, pscale));
  } else {
    at::Tensor P = at::empty({B * S * CP * JC * CZP4}, f32);
    OPM_DISPATCH(CP, launch_wfirst<kCP>(aT, bq, inv_denom, wpack, bo_c, out, P, JC, B, S, N, Npad,
                                        static_cast<int>(cz), static_cast<int>(CZP4), used == kWFirstSmall,
                                        used == kWFirstTc ? 1 : used == kWFirstTc2 ? 2 : 0, d, stream));
  }
#undef OPM_DISPATCH
  finish();
  return {out, used, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

// A pair mode's (s1, s2) per pair as the forward computes them (launch_pair_scale, no row scale): mask (B, S, N) of a
// dtype mask_kind_of takes, CUDA; norm 1 (OpenFold, eps) or 2 (Boltz); counts: PairCounts (0 fp64 FMA, 1 DMMA, 2 DMMA
// fed by a cp.async ring, 3 the ring on HMMA for 16-bit masks; True / False read as 1 / 0), for float masks where the
// device has DMMA. Returns float32 (B, N, N, 2).
at::Tensor opm_pair_scale(at::Tensor mask, int64_t norm, double eps, int64_t counts) {
  TORCH_CHECK(mask.is_cuda() && mask.dim() == 3 && mask_kind_of(mask.scalar_type()) >= 0,
              "outer_product_mean: opm_pair_scale takes a (B, S, N) CUDA mask of a float, bool or integer dtype, got ",
              dtype_str(mask), " ", shape_str(mask), " on ", dev_str(mask));
  TORCH_CHECK(norm == kNormOpenFold || norm == kNormBoltz, "outer_product_mean: opm_pair_scale: norm 1 or 2, got ",
              norm);
  TORCH_CHECK(counts >= kCountsFma && counts <= kCountsHmma, "outer_product_mean: opm_pair_scale: counts 0-3, got ",
              counts);
  const c10::cuda::CUDAGuard guard(mask.device());
  const at::Tensor m = mask.contiguous();
  return launch_pair_scale(m, mask_kind_of(m.scalar_type()), m.size(0), m.size(1), m.size(2), static_cast<int>(norm),
                           eps, at::Tensor(), dev_info(m.get_device()), c10::cuda::getCurrentCUDAStream(),
                           static_cast<int>(counts));
}

}  // namespace opm
