// outer_product_mean: the backward's bound functions, tensor maps and the device capabilities.
#pragma once
#include "forward_bindings.cuh"
#include "tensor_map.cuh"

namespace opm {

// The backward's a and b (LayerNorm, both projections, the mask: outer_wg's prep with rows out) and
// inv_denom, as the forward computes them: msa (B, S, N, c_m) float32, float16 or bfloat16, mask (B, S, N) of a
// dtype mask_kind_of takes, parameters float32 with hidden_dim 32, c_m <= kMaxMsaDim, CUDA, on a device
// where outer_wg runs, B * S * N / 16 < 2^31 (S, N rounded up to 16). block_tiles: opm_prep_ow_kernel
// even where opm_prep16_kernel would run (launch_prep_ow; the two give bit-equal rows). Returns (a, b
// (B, S, N, 32) fp32, inv_denom (B, N)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> opm_backward_rows(at::Tensor msa, at::Tensor mask, at::Tensor ln_w,
                                                                 at::Tensor ln_b, at::Tensor wa, at::Tensor ba,
                                                                 at::Tensor wb, at::Tensor bb, double eps,
                                                                 bool block_tiles) {
  for (const at::Tensor* t : {&msa, &mask, &ln_w, &ln_b, &wa, &ba, &wb, &bb})
    TORCH_CHECK(t->is_cuda(), "outer_product_mean: opm_backward_rows takes CUDA tensors");
  TORCH_CHECK(msa.dim() == 4 && (msa.scalar_type() == at::kFloat || msa.scalar_type() == at::kHalf ||
                                 msa.scalar_type() == at::kBFloat16),
              "outer_product_mean: opm_backward_rows: msa (B, S, N, c_m) float32, float16 or bfloat16");
  const int64_t B = msa.size(0), S = msa.size(1), N = msa.size(2), cm = msa.size(3);
  TORCH_CHECK(cm >= 1 && cm <= kMaxMsaDim, "outer_product_mean: opm_backward_rows: c_m in [1, ", num(kMaxMsaDim), "]");
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == S && mask.size(2) == N,
              "outer_product_mean: opm_backward_rows: mask (B, S, N)");
  const int mask_kind = mask_kind_of(mask.scalar_type());
  TORCH_CHECK(mask_kind >= 0, "outer_product_mean: opm_backward_rows: unsupported mask dtype ", dtype_str(mask));
  for (const at::Tensor* t : {&ln_w, &ln_b, &wa, &ba, &wb, &bb})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "outer_product_mean: opm_backward_rows: float32 parameters");
  TORCH_CHECK(ln_w.numel() == cm && ln_b.numel() == cm && wa.dim() == 2 && wa.size(0) == 32 && wa.size(1) == cm &&
                  wb.sizes() == wa.sizes() && ba.numel() == 32 && bb.numel() == 32,
              "outer_product_mean: opm_backward_rows: ln_w, ln_b (c_m), wa, wb (32, c_m), ba, bb (32)");
  TORCH_CHECK(B * round_up(S, ow_sb(msa.scalar_type())) * round_up(N, 16) / 16 < (1ll << 31),
              "outer_product_mean: opm_backward_rows: B * S * N / 16 < 2^31");
  const c10::cuda::CUDAGuard guard(msa.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(msa.get_device());
  TORCH_CHECK(d.ow_ok, "outer_product_mean: opm_backward_rows needs a compute capability 9.0 device and an sm_90a build");
  const auto f32 = msa.options().dtype(at::kFloat);
  at::Tensor a = at::empty({B, S, N, 32}, f32), b = at::empty({B, S, N, 32}, f32), inv_denom = at::empty({B, N}, f32);
  if (B == 0 || N == 0) return {a, b, inv_denom};
  at::Tensor x = msa.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();  // 16-byte loads and bulk copies
  const at::Tensor m = mask.contiguous(), lw = ln_w.contiguous(), lb = ln_b.contiguous(), wa_c = wa.contiguous(),
                   ba_c = ba.contiguous(), wb_c = wb.contiguous(), bb_c = bb.contiguous();
  const OwDims od = ow_dims(S, N, 1, ow_sb(x.scalar_type()));
  const at::Tensor Wf = launch_ow_params(lw, lb, wa_c, ba_c, wb_c, bb_c, at::Tensor(), at::Tensor(), nullptr, 0,
                                         x.scalar_type() != at::kFloat, static_cast<int>(cm), 32, 0, 0, d, stream);
  launch_prep_ow<false>(x, m, mask_kind, Wf, nullptr, nullptr, a.data_ptr<float>(), b.data_ptr<float>(), B, S, N,
                        static_cast<int>(cm), static_cast<float>(eps), od, inv_denom, d, stream, block_tiles);
  return {a, b, inv_denom};
}

// The backward's out_proj weight gradient on wgmma: a, b (B, S, N, 32) fp32 (masked), inv_denom (B, N), g
// (B, N, N, c_z), c_z <= 128, CUDA, on a device where outer_wg runs (DevInfo::ow_ok). ops: "split" (split
// TF32, g fp32), "float16" or "bfloat16" (g in that type, c_z % 8 == 0; the products' operands rounded to
// it, opm_bw_wo_kernel<T>). Returns dwo (c_z, 1024) fp32. The G planes go in chunks of i tiles of at most
// chunk_bytes (at least one tile; with split_j, where one tile's planes exceed chunk_bytes, chunks of one tile's
// j blocks instead: opm_bw_wo_kernel<T, true>); each chunk's block partials are added
// into dwo in order (a fixed summation order for a given device, chunk_bytes and split_j).
at::Tensor opm_backward_wo(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g, const std::string& ops,
                           int64_t chunk_bytes, bool split_j) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && inv_denom.is_cuda() && g.is_cuda(),
              "outer_product_mean: opm_backward_wo takes CUDA tensors");
  const bool half = ops == "float16" || ops == "bfloat16";
  TORCH_CHECK(half || ops == "split", "outer_product_mean: opm_backward_wo: ops is split, float16 or bfloat16, got ", ops);
  for (const at::Tensor* t : {&a, &b, &inv_denom})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "outer_product_mean: opm_backward_wo takes float32, got ", dtype_str(*t));
  TORCH_CHECK(g.scalar_type() == (ops == "float16" ? at::kHalf : ops == "bfloat16" ? at::kBFloat16 : at::kFloat),
              "outer_product_mean: opm_backward_wo: g in ", half ? ops : "float32", ", got ", dtype_str(g));
  TORCH_CHECK(a.dim() == 4 && a.size(3) == 32 && b.sizes() == a.sizes(), "outer_product_mean: opm_backward_wo: a, b (B, S, N, 32)");
  const int64_t B = a.size(0), S = a.size(1), N = a.size(2);
  TORCH_CHECK(g.dim() == 4 && g.size(0) == B && g.size(1) == N && g.size(2) == N && g.size(3) >= 1 && g.size(3) <= 128 &&
                  (!half || g.size(3) % 8 == 0),
              "outer_product_mean: opm_backward_wo: g (B, N, N, c_z <= 128), c_z % 8 == 0 for 16-bit g");
  TORCH_CHECK(inv_denom.dim() == 2 && inv_denom.size(0) == B && inv_denom.size(1) == N,
              "outer_product_mean: opm_backward_wo: inv_denom (B, N)");
  const int cz = static_cast<int>(g.size(3));
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(a.get_device());
  TORCH_CHECK(d.ow_ok && kBwoSmemBytes <= static_cast<size_t>(d.smem_optin),
              "outer_product_mean: opm_backward_wo needs a compute capability 9.0 device and an sm_90a build");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), ic = inv_denom.contiguous();
  at::Tensor gc = g.contiguous();
  if (half && reinterpret_cast<uintptr_t>(gc.data_ptr()) % 8 != 0) gc = gc.clone();  // the prep's 8-byte loads of T
  const auto f32 = a.options();
  at::Tensor dwo = at::zeros({cz, 1024}, f32);
  if (B == 0 || S == 0 || N == 0) return dwo;
  // blocks of kOwSK s (fp32 planes) or kOwS16 (T planes); floats per a block, b block and (b, it, jt) of Gbw
  const int64_t KB16 = cdiv(S, half ? kOwS16 : kOwSK), NIT = cdiv(N, 64), NBB = cdiv(N, 4);
  const int64_t ablk = half ? kOwABlk16 / 2 : 2 * kOwAPlane, bblk = half ? kOwBBlk16 / 2 : 2 * kOwBPlane;
  const int64_t gtile = half ? 4 * 4096 : 8 * kOwStage;
  at::Tensor Abw = at::empty({B * kBwNSL * KB16 * 2 * NIT * ablk}, f32);
  at::Tensor Bbw = at::empty({B * NBB * KB16 * bblk}, f32);
  const int64_t tile_bytes = 4 * gtile * B * NBB;  // one i tile's G planes
  const bool split = split_j && chunk_bytes < tile_bytes;  // chunks of one i tile's j blocks
  const int64_t NITc = split ? 1 : std::max<int64_t>(1, std::min<int64_t>(NIT, chunk_bytes / tile_bytes));
  const int64_t NJc = split ? std::max<int64_t>(1, chunk_bytes / (4 * gtile * B)) : NBB;
  at::Tensor Gbw = at::empty({B * NITc * NJc * gtile}, f32);
  const int groups = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(B * NITc * NJc, d.sms / kBwNSL)));
  at::Tensor part = at::empty({static_cast<int64_t>(kBwNSL) * groups * 2 * 8192}, f32);
  auto run = [&](auto wo_kernel, auto wo_prep_kernel) {
    set_smem(wo_kernel, kBwoSmemBytes, d, "the backward's dWo kernel");
    for (int64_t it0 = 0; it0 < NIT; it0 += NITc)
      for (int64_t jt0 = 0; jt0 < NBB; jt0 += NJc) {
        const int64_t nitc = std::min<int64_t>(NITc, NIT - it0), njc = std::min<int64_t>(NJc, NBB - jt0);
        const bool ab = it0 == 0 && jt0 == 0;
        const int64_t items =
            (ab ? B * kBwNSL * KB16 * 2 * NIT * 256 + B * NBB * KB16 * 512 : 0) + B * nitc * njc * (half ? 1024 : 8192);
        // (g's elements are T where ops is float16 / bfloat16)
        wo_prep_kernel<<<grid_for(std::min<int64_t>(cdiv(items, kThreads), 8ll * d.sms)), kThreads, 0, stream>>>(
            ac.data_ptr<float>(), bc.data_ptr<float>(), static_cast<const float*>(gc.data_ptr()), ic.data_ptr<float>(),
            Abw.data_ptr<float>(), Bbw.data_ptr<float>(), Gbw.data_ptr<float>(), B, S, N, cz, KB16, NIT, NBB, ab, it0,
            nitc, jt0, njc);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        const int g_wo = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(B * nitc * njc, groups)));
        wo_kernel<<<kBwNSL * g_wo, kOwThreads, kBwoSmemBytes, stream>>>(
            Abw.data_ptr<float>(), Bbw.data_ptr<float>(), Gbw.data_ptr<float>(), part.data_ptr<float>(), B, KB16, NIT,
            NBB, it0, nitc, jt0, njc);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        opm_bw_wo_sum_kernel<<<static_cast<int>(cdiv(kBwNSL * 64 * 128, kThreads)), kThreads, 0, stream>>>(
            part.data_ptr<float>(), dwo.data_ptr<float>(), g_wo, cz);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
  };
  auto typed = [&](auto split_c) {  // split_c: std::bool_constant<split>
    constexpr bool kS = decltype(split_c)::value;
    if (!half) run(opm_bw_wo_kernel<float, kS>, opm_bw_wo_prep_kernel<float, kS>);
    else if (ops == "float16") run(opm_bw_wo_kernel<__half, kS>, opm_bw_wo_prep_kernel<__half, kS>);
    else run(opm_bw_wo_kernel<__nv_bfloat16, kS>, opm_bw_wo_prep_kernel<__nv_bfloat16, kS>);
  };
  if (split) typed(std::true_type{});
  else typed(std::false_type{});
  return dwo;
}

// g (B, N, N, c_z) fp32, fp16 or bf16, contiguous, 16-byte aligned and 16-byte rows (c_z % 4 == 0 in fp32,
// % 8 == 0 in 16 bits), as a 4-D tensor map (c_z, N j, N i, B)
// with boxes of (c_z, box_j, box_i, 1), no swizzle, zeros out of range (opm_bw_ab_kernel's g slots).
CUtensorMap make_g_map(const at::Tensor& g, unsigned box_j, unsigned box_i) {
  CUtensorMap m;
  const cuuint64_t B = g.size(0), N = g.size(1), cz = g.size(3), es = g.element_size();
  const cuuint64_t dims[4] = {cz, N, N, B};
  const cuuint64_t strides[3] = {es * cz, es * cz * N, es * cz * N * N};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(cz), box_j, box_i, 1}, elem[4] = {1, 1, 1, 1};
  const auto type = g.scalar_type() == at::kHalf       ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                    : g.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const CUresult r = encode_tiled("outer_product_mean")(&m, type, 4, g.data_ptr(), dims, strides, box, elem,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "outer_product_mean: cuTensorMapEncodeTiled failed with CUresult ", static_cast<int>(r));
  return m;
}

// The backward's da and db (before the mask) on wgmma, G recomputed per tile: a, b (B, S, N, 32) fp32
// (masked), inv_denom (B, N), g (B, N, N, c_z) with c_z <= 128 and 16-byte rows (the tensor map's
// strides), wo (c_z, 1024) fp32, CUDA, on a device where outer_wg runs. ops: "split" (split TF32; g fp32,
// c_z % 4 == 0) or "float16" / "bfloat16" (g in that type, c_z % 8 == 0; the products' operands rounded
// to it, opm_bw_ab_kernel<form, T>). Returns (da, db): float32, or with out_t (16-bit ops only) in ops's type.
std::tuple<at::Tensor, at::Tensor> opm_backward_ab(at::Tensor a, at::Tensor b, at::Tensor inv_denom, at::Tensor g,
                                                   at::Tensor wo, const std::string& ops, bool out_t) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && inv_denom.is_cuda() && g.is_cuda() && wo.is_cuda(),
              "outer_product_mean: opm_backward_ab takes CUDA tensors");
  const bool half = ops == "float16" || ops == "bfloat16";
  TORCH_CHECK(half || ops == "split", "outer_product_mean: opm_backward_ab: ops is split, float16 or bfloat16, got ", ops);
  TORCH_CHECK(half || !out_t, "outer_product_mean: opm_backward_ab: out_t needs float16 or bfloat16 ops");
  for (const at::Tensor* t : {&a, &b, &inv_denom, &wo})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "outer_product_mean: opm_backward_ab takes float32, got ", dtype_str(*t));
  TORCH_CHECK(g.scalar_type() == (ops == "float16" ? at::kHalf : ops == "bfloat16" ? at::kBFloat16 : at::kFloat),
              "outer_product_mean: opm_backward_ab: g in ", half ? ops : "float32", ", got ", dtype_str(g));
  TORCH_CHECK(a.dim() == 4 && a.size(3) == 32 && b.sizes() == a.sizes(), "outer_product_mean: opm_backward_ab: a, b (B, S, N, 32)");
  const int64_t B = a.size(0), S = a.size(1), N = a.size(2);
  TORCH_CHECK(g.dim() == 4 && g.size(0) == B && g.size(1) == N && g.size(2) == N && g.size(3) >= 4 && g.size(3) <= 128 &&
                  g.size(3) % (half ? 8 : 4) == 0,
              "outer_product_mean: opm_backward_ab: g (B, N, N, c_z), c_z a multiple of 4 (16-bit g: 8) up to 128");
  TORCH_CHECK(inv_denom.dim() == 2 && inv_denom.size(0) == B && inv_denom.size(1) == N,
              "outer_product_mean: opm_backward_ab: inv_denom (B, N)");
  const int cz = static_cast<int>(g.size(3));
  TORCH_CHECK(wo.dim() == 2 && wo.size(0) == cz && wo.size(1) == 1024, "outer_product_mean: opm_backward_ab: wo (c_z, 1024)");
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(a.get_device());
  const size_t smem = half ? kAbSmemBytes16 : kAbSmemBytes;
  TORCH_CHECK(d.ow_ok && smem <= static_cast<size_t>(d.smem_optin),
              "outer_product_mean: opm_backward_ab needs a compute capability 9.0 device and an sm_90a build");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), ic = inv_denom.contiguous(), wc = wo.contiguous();
  at::Tensor gc = g.contiguous();
  if (reinterpret_cast<uintptr_t>(gc.data_ptr()) % 16 != 0) gc = gc.clone();  // 16-byte aligned: the tensor map
  const auto out_opts = out_t ? ac.options().dtype(g.scalar_type()) : ac.options();
  at::Tensor da = at::empty(ac.sizes(), out_opts), db = at::empty(ac.sizes(), out_opts);
  if (B == 0 || S == 0 || N == 0) return {da.zero_(), db.zero_()};
  const int64_t NJT = cdiv(N, 4), SB = cdiv(S, 64), NOT = cdiv(N, 32), NSC = cdiv(SB, 8);
  const int64_t vblk = half ? 4096 : 8192, wsl = half ? 4096 : kAbOperand;  // floats per Vt block, Wt slice
  const auto f32 = a.options();
  at::Tensor Vt = at::empty({2 * B * NJT * SB * vblk}, f32);
  at::Tensor Wt = at::empty({2 * 16 * wsl}, f32);
  const int64_t items = half ? 2 * (B * NJT * SB * 1024 + 16 * 64 * 16) : 2 * (B * NJT * SB * 2048 + 16 * 64 * 32);
  const auto prep = ops == "float16" ? opm_bw_ab_prep_kernel<__half>
                    : ops == "bfloat16" ? opm_bw_ab_prep_kernel<__nv_bfloat16> : opm_bw_ab_prep_kernel<float>;
  prep<<<grid_for(std::min<int64_t>(cdiv(items, kThreads), 8ll * d.sms)), kThreads, 0, stream>>>(
      ac.data_ptr<float>(), bc.data_ptr<float>(), wc.data_ptr<float>(), Vt.data_ptr<float>(), Wt.data_ptr<float>(), B, S,
      N, cz, NJT, SB);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t blocks = B * NOT * 16 * NSC;
  TORCH_CHECK(blocks < (1ll << 31), "outer_product_mean: opm_backward_ab: too many blocks");
  const float* vt = Vt.data_ptr<float>();
  const float* wt = Wt.data_ptr<float>();
  auto run = [&](auto* tp, auto* op) {  // null pointers of the products' type T and out's type O
    using T = std::remove_pointer_t<decltype(tp)>;
    using O = std::remove_pointer_t<decltype(op)>;
    const auto da_kernel = opm_bw_ab_kernel<0, T, O>;
    const auto db_kernel = opm_bw_ab_kernel<1, T, O>;
    set_smem(da_kernel, smem, d, "the backward's da kernel");
    da_kernel<<<static_cast<unsigned>(blocks), kOwThreads, smem, stream>>>(
        vt, wt, make_g_map(gc, 2, 32), ic.data_ptr<float>(), reinterpret_cast<O*>(da.data_ptr()), B, S, N, cz, NJT, SB,
        NOT, NSC);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    set_smem(db_kernel, smem, d, "the backward's db kernel");
    db_kernel<<<static_cast<unsigned>(blocks), kOwThreads, smem, stream>>>(
        vt + B * NJT * SB * vblk, wt + 16 * wsl, make_g_map(gc, 32, 2), ic.data_ptr<float>(),
        reinterpret_cast<O*>(db.data_ptr()), B, S, N, cz, NJT, SB, NOT, NSC);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  float* const f32p = nullptr;
  __half* const f16p = nullptr;
  __nv_bfloat16* const bf16p = nullptr;
  if (!half) run(f32p, f32p);
  else if (ops == "float16") out_t ? run(f16p, f16p) : run(f16p, f32p);
  else out_t ? run(bf16p, bf16p) : run(bf16p, f32p);
  return {da, db};
}

// The backward's LayerNorm part (opm_bw_ln_kernel): x_in (R, c_m) float32, float16 or bfloat16, da, db
// (R, 32) fp32 or (16-bit x_in) in x_in's dtype (before the mask), mask (R) of a dtype mask_kind_of takes, ln_w,
// ln_b (c_m), wa, wb (32, c_m) fp32, c_m 128 or 256, CUDA, on a device where outer_wg runs. Returns (d_x_in in x_in's dtype, d_ln_w,
// d_ln_b, d_wa, d_ba, d_wb, d_bb); the sums over rows in a fixed order for a given device, the same with or
// without consume. consume: da, db (two tensors that do not overlap) may be overwritten: the blocks' partials go
// into their rows where they fit (ln_part_fits), not into a buffer of 66 c_m + 64 floats per block.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> opm_backward_ln(
    at::Tensor xin, at::Tensor da, at::Tensor db, at::Tensor mask, at::Tensor ln_w, at::Tensor ln_b, at::Tensor wa,
    at::Tensor wb, double eps, bool consume) {
  for (const at::Tensor* t : {&xin, &da, &db, &mask, &ln_w, &ln_b, &wa, &wb})
    TORCH_CHECK(t->is_cuda(), "outer_product_mean: opm_backward_ln takes CUDA tensors");
  for (const at::Tensor* t : {&ln_w, &ln_b, &wa, &wb})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "outer_product_mean: opm_backward_ln takes float32, got ", dtype_str(*t));
  const auto xt = xin.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kHalf || xt == at::kBFloat16,
              "outer_product_mean: opm_backward_ln: x_in float32, float16 or bfloat16, got ", dtype_str(xin));
  const bool dab_t = da.scalar_type() != at::kFloat;  // da, db in x_in's 16-bit dtype
  TORCH_CHECK((da.scalar_type() == at::kFloat || (xt != at::kFloat && da.scalar_type() == xt)) &&
                  db.scalar_type() == da.scalar_type(),
              "outer_product_mean: opm_backward_ln: da, db both float32 or both x_in's 16-bit dtype, got ",
              dtype_str(da), ", ", dtype_str(db));
  TORCH_CHECK(xin.dim() == 2 && (xin.size(1) == 128 || xin.size(1) == 256),
              "outer_product_mean: opm_backward_ln: x_in (R, 128 or 256)");
  const int64_t R = xin.size(0), cm = xin.size(1);
  TORCH_CHECK(da.dim() == 2 && da.size(0) == R && da.size(1) == 32 && db.sizes() == da.sizes(),
              "outer_product_mean: opm_backward_ln: da, db (R, 32)");
  const int mask_kind = mask_kind_of(mask.scalar_type());
  TORCH_CHECK(mask.numel() == R && mask_kind >= 0, "outer_product_mean: opm_backward_ln: mask (R) of float32, bool or an "
              "integer dtype");
  TORCH_CHECK(ln_w.numel() == cm && ln_b.numel() == cm && wa.dim() == 2 && wa.size(0) == 32 && wa.size(1) == cm &&
                  wb.sizes() == wa.sizes(),
              "outer_product_mean: opm_backward_ln: ln_w, ln_b (c_m), wa, wb (32, c_m)");
  const c10::cuda::CUDAGuard guard(xin.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(xin.get_device());
  TORCH_CHECK(d.ow_ok, "outer_product_mean: opm_backward_ln needs a compute capability 9.0 device and an sm_90a build");
  auto aligned = [](at::Tensor t) {  // contiguous at a 16-byte aligned address (the bulk copies' sources)
    t = t.contiguous();
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
  };
  const at::Tensor xc = aligned(xin), dac = aligned(da), dbc = aligned(db), mc = mask.contiguous(),
                   lwc = ln_w.contiguous(), lbc = ln_b.contiguous(), wac = wa.contiguous(), wbc = wb.contiguous();
  if (consume) {  // the partials' chunks alternate between da and db: the two must not share bytes
    const auto lo = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); };
    const uintptr_t bytes = static_cast<uintptr_t>(dac.numel() * dac.element_size());
    TORCH_CHECK(lo(dac) + bytes <= lo(dbc) || lo(dbc) + bytes <= lo(dac),
                "outer_product_mean: opm_backward_ln: consume takes da and db that do not overlap");
  }
  const auto f32 = xin.options().dtype(at::kFloat);
  at::Tensor dx = at::empty({R, cm}, xin.options());
  at::Tensor sums = at::zeros({66 * cm + 64}, f32);  // dWa | dWb (64 x c_m), d_ln_w, d_ln_b, d_ba, d_bb
  if (R > 0) {
    const int64_t tiles = cdiv(R, kLnRows);
    const int blocks = static_cast<int>(std::min<int64_t>(tiles, d.sms));
    const int64_t n = kLnPart(cm);
    auto run = [&](auto kernel, size_t smem, auto* type, auto* dtype) {  // null pointers of x_in's, da's types
      using T = std::remove_pointer_t<decltype(type)>;
      using D = std::remove_pointer_t<decltype(dtype)>;
      // the blocks' partials in the consumed da, db (no memory of their own) where they fit, else a buffer
      const at::Tensor part = consume && ln_part_fits<D>(R, cm, blocks) ? at::Tensor() : at::empty({blocks * n}, f32);
      float* const pp = part.defined() ? part.data_ptr<float>() : nullptr;
      D* const dap = reinterpret_cast<D*>(dac.data_ptr());
      D* const dbp = reinterpret_cast<D*>(dbc.data_ptr());
      set_smem(kernel, smem, d, "the backward's LayerNorm kernel");
      kernel<<<blocks, 256, smem, stream>>>(reinterpret_cast<const T*>(xc.data_ptr()), dap, dbp, mc.data_ptr(),
                                            mask_kind, lwc.data_ptr<float>(), lbc.data_ptr<float>(),
                                            wac.data_ptr<float>(), wbc.data_ptr<float>(),
                                            reinterpret_cast<T*>(dx.data_ptr()), pp, R, static_cast<float>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      opm_ln_sum_kernel<D><<<static_cast<int>(cdiv(n, kThreads)), kThreads, 0, stream>>>(pp, dap, dbp,
                                                                                    sums.data_ptr<float>(), blocks, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto run_cm = [&](auto* type, auto* dtype) {
      using T = std::remove_pointer_t<decltype(type)>;
      using D = std::remove_pointer_t<decltype(dtype)>;
      if (cm == 256) run(opm_bw_ln_kernel<256, T, D>, ln_smem_bytes<256>(), type, dtype);
      else run(opm_bw_ln_kernel<128, T, D>, ln_smem_bytes<128>(), type, dtype);
    };
    float* const f32p = nullptr;
    __nv_bfloat16* const bf16p = nullptr;
    __half* const f16p = nullptr;
    if (xt == at::kBFloat16) dab_t ? run_cm(bf16p, bf16p) : run_cm(bf16p, f32p);
    else if (xt == at::kHalf) dab_t ? run_cm(f16p, f16p) : run_cm(f16p, f32p);
    else run_cm(f32p, f32p);
  }
  return {dx, sums.narrow(0, 64 * cm, cm), sums.narrow(0, 65 * cm, cm), sums.narrow(0, 0, 32 * cm).view({32, cm}),
          sums.narrow(0, 66 * cm, 32), sums.narrow(0, 32 * cm, 32 * cm).view({32, cm}), sums.narrow(0, 66 * cm + 32, 32)};
}

// out_proj's bias gradient: the sum of g (..., c_z) over every dimension but the last (g fp32, fp16 or
// bf16, CUDA; the sums and the result fp32), c_z % 4 == 0 and c_z <= 1024; in a fixed order for a given device (block sums added in order in fp64).
at::Tensor opm_backward_dbo(at::Tensor g) {
  const auto gt = g.scalar_type();
  TORCH_CHECK(g.is_cuda() && (gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16) && g.dim() >= 1,
              "outer_product_mean: opm_backward_dbo takes a float32, float16 or bfloat16 CUDA tensor");
  const int64_t cz = g.size(-1);
  TORCH_CHECK(cz % 4 == 0 && cz >= 4 && cz <= 1024, "outer_product_mean: opm_backward_dbo: c_z a multiple of 4 up to 1024");
  const c10::cuda::CUDAGuard guard(g.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(g.get_device());
  at::Tensor gc = g.contiguous();
  if (reinterpret_cast<uintptr_t>(gc.data_ptr()) % 16 != 0) gc = gc.clone();  // 16-byte loads (8-byte for T)
  const auto f32 = gc.options().dtype(at::kFloat);
  at::Tensor out = at::zeros({cz}, f32);
  const int64_t rows = gc.numel() / cz;
  if (rows == 0) return out;
  const int blocks = static_cast<int>(std::min<int64_t>(4ll * d.sms, cdiv(rows, 64)));
  const int64_t rpb = cdiv(rows, blocks);
  at::Tensor part = at::empty({blocks * cz}, f32);
  if (gt == at::kFloat)
    opm_colsum_kernel<<<blocks, kThreads, 0, stream>>>(gc.data_ptr<float>(), rows, static_cast<int>(cz), rpb,
                                                       part.data_ptr<float>());
  else if (gt == at::kHalf)
    opm_colsum_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const __half*>(gc.data_ptr()), rows,
                                                       static_cast<int>(cz), rpb, part.data_ptr<float>());
  else
    opm_colsum_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(gc.data_ptr()), rows,
                                                       static_cast<int>(cz), rpb, part.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  opm_block_sum_kernel<<<static_cast<int>(cdiv(cz, kThreads)), kThreads, 0, stream>>>(part.data_ptr<float>(),
                                                                                  out.data_ptr<float>(), blocks, cz);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// dWo over the forward's kept O (KEEP_O): g^T o, g (..., c_z) and o (..., 1024) float16 or bfloat16 of one dtype with
// the same rows (the pairs), CUDA, c_z % 8 == 0; the result (c_z, 1024) float32, in a fixed order for a given device
// (opm_bw_wo_kept_kernel's splits of at least 32 pairs, about two blocks per SM, added in order in fp64).
at::Tensor opm_backward_wo_kept(at::Tensor g, at::Tensor o) {
  const auto gt = g.scalar_type();
  TORCH_CHECK(g.is_cuda() && o.device() == g.device() && (gt == at::kHalf || gt == at::kBFloat16) &&
                  o.scalar_type() == gt && g.dim() >= 1 && o.dim() >= 1,
              "outer_product_mean: opm_backward_wo_kept takes float16 or bfloat16 CUDA tensors g and o of one dtype");
  const int64_t cz = g.size(-1), P = g.numel() / std::max<int64_t>(cz, 1);
  TORCH_CHECK(cz >= 8 && cz % 8 == 0 && o.size(-1) == 1024 && o.numel() == P * 1024,
              "outer_product_mean: opm_backward_wo_kept: g (..., c_z) with c_z % 8 == 0 and o (..., 1024) over the same "
              "rows, got ", shape_str(g), " and ", shape_str(o));
  const c10::cuda::CUDAGuard guard(g.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(g.get_device());
  TORCH_CHECK(d.major >= 8, "outer_product_mean: opm_backward_wo_kept needs an sm_80+ GPU (mma.sync m16n8k16)");
  at::Tensor gc = g.contiguous(), oc = o.contiguous();
  if (reinterpret_cast<uintptr_t>(gc.data_ptr()) % 16 != 0) gc = gc.clone();  // 16-byte copies
  if (reinterpret_cast<uintptr_t>(oc.data_ptr()) % 16 != 0) oc = oc.clone();
  const auto f32 = gc.options().dtype(at::kFloat);
  at::Tensor out = at::zeros({cz, 1024}, f32);
  if (P == 0) return out;
  const int64_t ZT = cdiv(cz, 128);
  const int64_t splits = std::max<int64_t>(1, std::min(cdiv(2ll * d.sms, 8 * ZT), cdiv(P, kWkRows)));
  const int64_t PS = round_up(cdiv(P, splits), kWkRows);
  const int64_t KS = cdiv(P, PS);
  at::Tensor part = at::empty({KS * cz * 1024}, f32);
  const int blocks = static_cast<int>(8 * ZT * KS);
  if (gt == at::kHalf)
    opm_bw_wo_kept_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const __half*>(gc.data_ptr()),
                                                           reinterpret_cast<const __half*>(oc.data_ptr()),
                                                           part.data_ptr<float>(), P, static_cast<int>(cz),
                                                           static_cast<int>(ZT), PS);
  else
    opm_bw_wo_kept_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(gc.data_ptr()),
                                                           reinterpret_cast<const __nv_bfloat16*>(oc.data_ptr()),
                                                           part.data_ptr<float>(), P, static_cast<int>(cz),
                                                           static_cast<int>(ZT), PS);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  opm_block_sum_kernel<<<static_cast<int>(cdiv(cz * 1024, kThreads)), kThreads, 0, stream>>>(
      part.data_ptr<float>(), out.data_ptr<float>(), static_cast<int>(KS), cz * 1024);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// G in memory (G_MEM): g (B, N, N, c_z) and wo (c_z, 1024) float16 or bfloat16 of one dtype, inv_denom (B, N) float32,
// CUDA, c_z % 8 == 0 and c_z <= 128; returns G (B, 32 N, 32 N) in g's dtype, rows (i, h) and columns (j, k):
// G[b, 32 i + h, 32 j + k] = inv_denom[b, i] sum_z g[b, i, j, z] wo[z, 32 h + k], rounded once (opm_bw_g_kernel).
at::Tensor opm_backward_g(at::Tensor g, at::Tensor wo, at::Tensor inv_denom) {
  const auto gt = g.scalar_type();
  TORCH_CHECK(g.is_cuda() && wo.device() == g.device() && inv_denom.device() == g.device() &&
                  (gt == at::kHalf || gt == at::kBFloat16) && wo.scalar_type() == gt &&
                  inv_denom.scalar_type() == at::kFloat,
              "outer_product_mean: opm_backward_g takes float16 or bfloat16 CUDA tensors g and wo of one dtype and a "
              "float32 inv_denom");
  TORCH_CHECK(g.dim() == 4 && g.size(1) == g.size(2), "outer_product_mean: opm_backward_g: g (B, N, N, c_z), got ",
              shape_str(g));
  const int64_t B = g.size(0), N = g.size(1), cz = g.size(3);
  TORCH_CHECK(cz >= 8 && cz % 8 == 0 && cz <= kGmMaxCz && wo.dim() == 2 && wo.size(0) == cz && wo.size(1) == 1024 &&
                  inv_denom.numel() == B * N,
              "outer_product_mean: opm_backward_g: c_z % 8 == 0 up to ", kGmMaxCz, ", wo (c_z, 1024), inv_denom (B, N); "
              "got g ", shape_str(g), ", wo ", shape_str(wo), ", inv_denom ", shape_str(inv_denom));
  const c10::cuda::CUDAGuard guard(g.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(g.get_device());
  TORCH_CHECK(d.major >= 8, "outer_product_mean: opm_backward_g needs an sm_80+ GPU (mma.sync m16n8k16)");
  at::Tensor gc = g.contiguous(), wc = wo.contiguous(), ic = inv_denom.contiguous();
  if (reinterpret_cast<uintptr_t>(gc.data_ptr()) % 16 != 0) gc = gc.clone();  // 16-byte copies
  if (reinterpret_cast<uintptr_t>(wc.data_ptr()) % 16 != 0) wc = wc.clone();
  at::Tensor out = at::empty({B, 32 * N, 32 * N}, gc.options());
  if (out.numel() == 0) return out;
  const int64_t JT = cdiv(N, kGmJ), blocks = B * N * JT;
  TORCH_CHECK(blocks <= INT32_MAX, "outer_product_mean: opm_backward_g: too many blocks");
  const size_t smem = gm_smem_bytes(static_cast<int>(cz), gc.element_size());
  if (gt == at::kHalf) {
    set_smem(opm_bw_g_kernel<__half>, smem, d, "the backward's G kernel");
    opm_bw_g_kernel<<<static_cast<int>(blocks), kThreads, smem, stream>>>(
        reinterpret_cast<const __half*>(gc.data_ptr()), reinterpret_cast<const __half*>(wc.data_ptr()),
        ic.data_ptr<float>(), reinterpret_cast<__half*>(out.data_ptr()), N, static_cast<int>(cz), JT);
  } else {
    set_smem(opm_bw_g_kernel<__nv_bfloat16>, smem, d, "the backward's G kernel");
    opm_bw_g_kernel<<<static_cast<int>(blocks), kThreads, smem, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(gc.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(wc.data_ptr()),
        ic.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), N, static_cast<int>(cz), JT);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// The pair modes' (gk, dbo) for the row kernels (opm_pair_grad_kernel): g (..., c_z) float32, float16 or bfloat16
// and s1 float32 with numel(g) / c_z elements (the pairs, in g's row order), CUDA; gk = s1 g in float32 (to_float)
// or g's type, g's shape; dbo (c_z) float32 = the sum of s1 g (s2_is_s1: OpenFold) or of g (Boltz) over the rows,
// in a fixed order for a given device. c_z % 4 == 0 and c_z <= 1024.
std::vector<at::Tensor> opm_backward_pair_g(at::Tensor g, at::Tensor s1, bool s2_is_s1, bool to_float) {
  const auto gt = g.scalar_type();
  TORCH_CHECK(g.is_cuda() && (gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16) && g.dim() >= 1,
              "outer_product_mean: opm_backward_pair_g takes a float32, float16 or bfloat16 CUDA tensor g");
  const int64_t cz = g.size(-1);
  TORCH_CHECK(cz % 4 == 0 && cz >= 4 && cz <= 1024,
              "outer_product_mean: opm_backward_pair_g: c_z a multiple of 4 up to 1024");
  TORCH_CHECK(s1.is_cuda() && s1.scalar_type() == at::kFloat && s1.get_device() == g.get_device() &&
                  s1.numel() * cz == g.numel(),
              "outer_product_mean: opm_backward_pair_g: s1 float32 on g's device, one value per row of g");
  const c10::cuda::CUDAGuard guard(g.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DevInfo d = dev_info(g.get_device());
  at::Tensor gc = g.contiguous();
  if (reinterpret_cast<uintptr_t>(gc.data_ptr()) % 16 != 0) gc = gc.clone();  // 16-byte loads (8-byte for 16-bit)
  const at::Tensor sc = s1.contiguous();
  at::Tensor gk = at::empty(gc.sizes(), gc.options().dtype(to_float ? at::kFloat : gt));
  const auto f32 = gc.options().dtype(at::kFloat);
  at::Tensor out = at::zeros({cz}, f32);
  const int64_t rows = gc.numel() / cz;
  if (rows == 0) return {gk, out};
  const int blocks = static_cast<int>(std::min<int64_t>(4ll * d.sms, cdiv(rows, 64)));
  const int64_t rpb = cdiv(rows, blocks);
  at::Tensor part = at::empty({blocks * cz}, f32);
  auto launch = [&](auto gtag, auto ktag) {
    using G = std::remove_pointer_t<decltype(gtag)>;
    using GK = std::remove_pointer_t<decltype(ktag)>;
    const G* gp = reinterpret_cast<const G*>(gc.data_ptr());
    GK* kp = reinterpret_cast<GK*>(gk.data_ptr());
    if (s2_is_s1)
      opm_pair_grad_kernel<G, GK, true><<<blocks, kThreads, 0, stream>>>(gp, sc.data_ptr<float>(), rows,
                                                                          static_cast<int>(cz), rpb, kp,
                                                                          part.data_ptr<float>());
    else
      opm_pair_grad_kernel<G, GK, false><<<blocks, kThreads, 0, stream>>>(gp, sc.data_ptr<float>(), rows,
                                                                           static_cast<int>(cz), rpb, kp,
                                                                           part.data_ptr<float>());
  };
  if (gt == at::kFloat) launch(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (gt == at::kHalf && to_float) launch(static_cast<__half*>(nullptr), static_cast<float*>(nullptr));
  else if (gt == at::kHalf) launch(static_cast<__half*>(nullptr), static_cast<__half*>(nullptr));
  else if (to_float) launch(static_cast<__nv_bfloat16*>(nullptr), static_cast<float*>(nullptr));
  else launch(static_cast<__nv_bfloat16*>(nullptr), static_cast<__nv_bfloat16*>(nullptr));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  opm_block_sum_kernel<<<static_cast<int>(cdiv(cz, kThreads)), kThreads, 0, stream>>>(part.data_ptr<float>(),
                                                                                  out.data_ptr<float>(), blocks, cz);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {gk, out};
}

// (tc_ok, wg_ok, ow_ok) of a CUDA device: whether w_first_tc/_tc2, w_first_wg2 and outer_wg can run there.
std::tuple<bool, bool, bool> device_caps(int64_t device) {
  const DevInfo d = dev_info(static_cast<int>(device));
  return {d.tc_ok, d.wg_ok, d.ow_ok};
}

}  // namespace opm
