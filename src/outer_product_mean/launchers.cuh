// outer_product_mean: the forward's launchers.
#pragma once
#include "pair_norm.cuh"

namespace opm {

// =============================================================================================
// Launchers
// =============================================================================================
#if defined(OPM_SM90A)
constexpr bool kBuiltSm90a = true;   // the build has sm_90a code (wgmma)
#else
constexpr bool kBuiltSm90a = false;
#endif
struct DevInfo {
  int sms = 0;
  int smem_optin = 0;
  int major = 0;       // compute capability major
  int minor = 0;
  bool tc_ok = false;  // w_first_tc/_tc2 can run: an sm_80+ device and their code built from sm_80+
                       // PTX (an extension built for older targets runs them JIT-compiled from
                       // that PTX, where the mma is a trap)
  bool wg_ok = false;  // w_first_wg2 can run: a compute capability 9.0 device, this extension built
                       // with sm_90a code (OPM_SM90A: the Python side turns 9.0 into 9.0a), and its
                       // kWgSmemBytes of shared memory per block available
  bool ow_ok = false;  // outer_wg can run: wg_ok and its kOwSmemMax per block available
};
static DevInfo dev_info(int dev) {
  static DevInfo cache[64];
  static bool have[64] = {false};
  if (dev >= 0 && dev < 64 && have[dev]) return cache[dev];
  DevInfo d;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev));
  cudaFuncAttributes fa;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, opm_wfirst_tc_kernel<1>));
  d.tc_ok = d.major >= 8 && fa.ptxVersion >= 80;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev));
  d.wg_ok = kBuiltSm90a && d.major == 9 && d.minor == 0 && kWgSmemBytes <= static_cast<size_t>(d.smem_optin);
  d.ow_ok = d.wg_ok && kOwSmemMax <= static_cast<size_t>(d.smem_optin);
  if (dev >= 0 && dev < 64) { cache[dev] = d; have[dev] = true; }
  return d;
}

static int grid_for(int64_t work_items) {  // grid-stride kernels: cap the grid, loop the rest
  return static_cast<int>(std::min<int64_t>(work_items, 1ll << 30));
}

static size_t prep_smem_bytes(int cm, int CP) {
  const int64_t LDX = round_up(cm, 4);
  const int64_t xs_floats = round_up(std::max<int64_t>(kRows1 * LDX, static_cast<int64_t>(CP) * 65), 4);
  const int64_t ws_floats = static_cast<int64_t>(kKC1) * (2 * CP + 4);
  return static_cast<size_t>(4 * (xs_floats + ws_floats));
}

template <class Kernel>
static void set_smem(Kernel k, size_t bytes, const DevInfo& d, const char* what) {
  TORCH_CHECK(bytes <= static_cast<size_t>(d.smem_optin), "outer_product_mean: ", what, " needs ", std::to_string(bytes),
              " bytes of shared memory per block, the device allows ", std::to_string(d.smem_optin));
  if (bytes > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            static_cast<int>(bytes)));
}

template <int CP>
static void launch_prep(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& ln_w,
                        const at::Tensor& ln_b, const at::Tensor& wa, const at::Tensor& ba, const at::Tensor& wb,
                        const at::Tensor& bb, const at::Tensor& wo, at::Tensor& aT, at::Tensor& bq,
                        at::Tensor& inv_denom, at::Tensor& wpack, int64_t B, int64_t S, int64_t N, int64_t Npad,
                        int cm, int c, int cz, float eps, int pack_mode, int pack_zp, const DevInfo& d,
                        cudaStream_t stream) {
  const int64_t n_row_blocks = cdiv(B * S * N, kRows1);
  const int n_den = static_cast<int>(std::min<int64_t>(cdiv(N, 32), 4 * d.sms));  // 32-column blocks
  const int n_pack = static_cast<int>(std::min<int64_t>(cdiv(static_cast<int64_t>(CP) * CP * pack_zp, kThreads), 2 * d.sms));
  const int64_t row_grid = std::min<int64_t>(n_row_blocks, 64ll * d.sms);
  const size_t smem = prep_smem_bytes(cm, CP);
  set_smem(opm_prep_kernel<CP>, smem, d, "the LayerNorm/projection kernel (64 rows of msa_dim floats)");
  const int grid = grid_for(n_den + n_pack + row_grid);
  if (grid == 0) return;
  opm_prep_kernel<CP><<<grid, kThreads, smem, stream>>>(
      x.data_ptr<float>(), mask.data_ptr(), mask_kind, ln_w.data_ptr<float>(), ln_b.data_ptr<float>(),
      wa.data_ptr<float>(), ba.data_ptr<float>(), wb.data_ptr<float>(), bb.data_ptr<float>(), wo.data_ptr<float>(),
      aT.data_ptr<float>(), bq.data_ptr<float>(), inv_denom.data_ptr<float>(), wpack.data_ptr<float>(), B, S, N,
      Npad, cm, c, cz, eps, n_row_blocks, n_den, n_pack, pack_mode, pack_zp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int CP>
static void launch_outer(const at::Tensor& aT, const at::Tensor& bq, const at::Tensor& inv_denom,
                         const at::Tensor& wt, const at::Tensor& bo, at::Tensor& out, int64_t B, int64_t S,
                         int64_t N, int64_t Npad, int cz, int CZP, const DevInfo& d, cudaStream_t stream) {
  using C = OuterCfg<CP>;
  const int64_t ntile = cdiv(N, C::TI);
  const int64_t total = B * ntile * ntile;
  set_smem(opm_outer_kernel<CP>, C::smem_bytes, d, "the outer-first kernel");
  const int grid = grid_for(total);
  if (grid == 0) return;
  opm_outer_kernel<CP><<<grid, kThreads, C::smem_bytes, stream>>>(
      aT.data_ptr<float>(), bq.data_ptr<float>(), inv_denom.data_ptr<float>(), wt.data_ptr<float>(),
      bo.data_ptr<float>(), out.data_ptr<float>(), B, S, N, Npad, cz, CZP);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// w_first_wg2 (Hopper): aT packed into At (opm_pack_a_kernel), then per j-chunk stage 1 writing the
// tile-order planes (opm_wfirst_proj_wg_kernel) and opm_wfirst_wg_kernel, one block per SM
// (persistent). Pt holds one chunk (wg_chunk_floats). pair_scale defined: a pair mode's (s1, s2) per pair,
// applied in opm_wfirst_wg_kernel's epilogue (kPair; inv_denom not read there).
static int64_t wg_chunk_floats(int64_t B, int64_t JC, int64_t KB, int CZP4) {
  return B * cdiv(JC * CZP4, kWgBRows) * KB * 2 * kWgBPlane;
}
template <int CP>
static void launch_wfirst_wg(const at::Tensor& aT, const at::Tensor& bq, const at::Tensor& inv_denom,
                             const at::Tensor& wk, const at::Tensor& bo, at::Tensor& out, at::Tensor& At,
                             at::Tensor& Pt, int64_t JC, int64_t B, int64_t S, int64_t N, int64_t Npad, int cz,
                             int CZP4, const DevInfo& d, cudaStream_t stream,
                             const at::Tensor& pair_scale = at::Tensor()) {
  const int64_t K = S * CP, KB = cdiv(K, kWgBK), MB128 = cdiv(N, 128);
  const bool kpair = pair_scale.defined();
  const auto wg_kernel = kpair ? opm_wfirst_wg_kernel<true> : opm_wfirst_wg_kernel<false>;
  set_smem(wg_kernel, kWgSmemBytes, d, "the wgmma w-first GEMM kernel");
  const size_t smem1 = kProjWgSmemBytes<CP>;
  set_smem(opm_wfirst_proj_wg_kernel<CP>, smem1, d, "the w_first_wg2 stage-1 kernel");
  const int ga = grid_for(std::min<int64_t>(cdiv(B * KB * (kWgBK / 4) * 2 * MB128 * kWgARows, kThreads), 8ll * d.sms));
  if (ga > 0) {
    opm_pack_a_kernel<<<ga, kThreads, 0, stream>>>(aT.data_ptr<float>(), At.data_ptr<float>(), B, N, Npad, K,
                                                   2 * MB128, KB);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (int64_t j0 = 0; j0 < N; j0 += JC) {
    const int64_t JCv = std::min<int64_t>(JC, N - j0), ncols = JCv * CZP4;
    const int64_t NB = cdiv(ncols, kWgBRows);  // 128-column blocks of P in this chunk
    const int64_t Sx = KB * kWgBK / CP, JCx = cdiv(NB * kWgBRows, CZP4);
    const int g1 = grid_for(B * cdiv(Sx, kProjWgSG) * cdiv(JCx, 64) * (CP / 4) * cdiv(CZP4, 32));
    if (g1 > 0) {
      opm_wfirst_proj_wg_kernel<CP><<<g1, kThreads, smem1, stream>>>(bq.data_ptr<float>(), wk.data_ptr<float>(),
                                                                    Pt.data_ptr<float>(), B, S, N, j0, JCv, CZP4,
                                                                    NB, KB);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const int64_t tiles = B * MB128 * NB;
    const int g2 = grid_for(std::min<int64_t>(tiles, d.sms));  // the kernel loops over the rest
    wg_kernel<<<g2, kWgThreads, kWgSmemBytes, stream>>>(
        At.numel() ? At.data_ptr<float>() : aT.data_ptr<float>(), Pt.numel() ? Pt.data_ptr<float>() : aT.data_ptr<float>(),
        inv_denom.data_ptr<float>(),
        kpair ? reinterpret_cast<const float2*>(pair_scale.data_ptr<float>()) : nullptr, bo.data_ptr<float>(),
        out.data_ptr<float>(), B, N, MB128, NB, KB, j0, ncols, cz, CZP4);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// outer_wg (Hopper, CP = 32): opm_ow_params_kernel (Wf, bias', WoP), opm_prep_ow_kernel (msa -> Aow,
// Bow; inv_denom), opm_outer_wg_kernel (one block per SM, persistent).
// The planes' s blocks follow the msa's dtype: sb = 16 s (float32: split TF32 planes) or 32 (fp16 / bf16:
// T planes, ow_block_s).
struct OwDims {
  int64_t KB, NIT, NBB;  // s blocks, i tiles, j tiles
  int nzc, sb;           // z chunks, s per block
};
static OwDims ow_dims(int64_t S, int64_t N, int64_t cz, int sb) {
  return {cdiv(S, sb), cdiv(N, kOwTI), cdiv(N, kOwTJ), static_cast<int>(cdiv(cz, kOwZ)), sb};
}
static int ow_sb(at::ScalarType st) { return st == at::kFloat ? ow_block_s<float>() : ow_block_s<__half>(); }
struct OwPlanes {
  at::Tensor Aow, Bow, WoP;
};
// Aow, Bow in the msa's dtype x (fp32: hi and lo planes; fp16 / bf16: T); WoP fp32 planes, or float16.
static OwPlanes ow_planes(int64_t B, const OwDims& od, const at::TensorOptions& x) {
  const auto f32 = x.dtype(at::kFloat);
  if (od.sb == kOwS16)
    return {at::empty({B * kOwNQ * od.KB * 2 * od.NIT * kOwABlk16}, x), at::empty({B * od.NBB * od.KB * kOwBBlk16}, x),
            at::empty({static_cast<int64_t>(od.nzc) * kOwNQ * kOwHC * kOwWBlk16}, x.dtype(at::kHalf))};
  return {at::empty({B * kOwNQ * od.KB * 2 * od.NIT * 2 * kOwAPlane}, f32),
          at::empty({B * od.NBB * od.KB * 2 * kOwBPlane}, f32),
          at::empty({static_cast<int64_t>(od.nzc) * kOwNQ * kOwHC * 2 * kOwWPlane}, f32)};
}
// out in the msa's dtype (float32, bfloat16 or float16), as the planes. pair_scale defined: the pair modes'
// instance (kPair) reads it (launch_pair_scale's (s1, s2), no row scale) in place of inv_denom. on defined (16-bit
// out, hidden_dim 32): the kKeepO instances also write O times the row's factor to it (B, N, N, 1024, out's dtype).
static void launch_outer_wg_fused(const OwPlanes& p, const at::Tensor& inv_denom, const float* bo, at::Tensor& out,
                                  int64_t B, int64_t N, const OwDims& od, int cz, const DevInfo& d, cudaStream_t stream,
                                  const at::Tensor& pair_scale, const at::Tensor& on = at::Tensor()) {
  const bool kp = pair_scale.defined(), ko = on.defined();
  TORCH_INTERNAL_ASSERT(!ko || (out.scalar_type() != at::kFloat && on.scalar_type() == out.scalar_type() &&
                                on.numel() == B * N * N * kOwNQ * 256 && on.is_contiguous()),
                        "outer_product_mean: outer_wg's kept O is (B, N, N, 1024) in out's 16-bit dtype");
  auto run = [&](auto kernel, auto* outp, size_t smem) {
    using OT = std::remove_pointer_t<decltype(outp)>;
    set_smem(kernel, smem, d, "the wgmma outer-first kernel");
    const int64_t tiles = B * od.nzc * od.NBB * od.NIT;  // < 2^31 (the callers' ow_tiles_ok)
    const int g = grid_for(std::min<int64_t>(tiles, d.sms));
    kernel<<<g, kOwThreads, smem, stream>>>(p.Aow.data_ptr(), p.Bow.data_ptr(), p.WoP.data_ptr(),
                                            (kp ? pair_scale : inv_denom).data_ptr<float>(), bo, outp, B, N, od.KB,
                                            od.NIT, od.NBB, od.nzc, cz,
                                            ko ? reinterpret_cast<OT*>(on.data_ptr()) : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto run16 = [&](auto* outp) {  // fp16 / bf16: the kPair and kKeepO instances
    using T = std::remove_pointer_t<decltype(outp)>;
    run(ko ? (kp ? opm_outer_wg_kernel<T, true, true> : opm_outer_wg_kernel<T, false, true>)
           : (kp ? opm_outer_wg_kernel<T, true> : opm_outer_wg_kernel<T>),
        outp, ow_smem_bytes<T>());
  };
  if (out.scalar_type() == at::kBFloat16)
    run16(reinterpret_cast<__nv_bfloat16*>(out.data_ptr()));
  else if (out.scalar_type() == at::kHalf)
    run16(reinterpret_cast<__half*>(out.data_ptr()));
  else
    run(kp ? opm_outer_wg_kernel<float, true> : opm_outer_wg_kernel<float>, out.data_ptr<float>(), ow_smem_bytes<float>());
}
// opm_prep_ow_kernel's m16 tiles per block (rows / 16): 2 to c_m = 256, else 1, the faster of 1, 2 and 4
// at crop and deep (NOTES.md, outer product mean: what did not pay).
static int po_mt(int cm) { return cm <= 256 ? 2 : 1; }
static size_t po_smem_bytes(int cm, int MT) { return 4ull * po_tile_floats(cm, MT); }
// opm_ow_params_kernel: returns Wf (float32 planes, or Wf16 for a 16-bit msa: w16), then bias' and
// isc (64 floats each) in one tensor, and writes WoP for od.nzc z groups (none with nzc 0: wo and WoP
// are then not read).
// The parameters all float32, or all float16 / bfloat16 (then Wf's tail holds bo as fp32 too: c_z floats
// after isc, the fused kernel's bias); wo, bo: undefined tensors where nzc is 0 (not read).
static int64_t ow_wf_floats(int cm) { return cdiv(cm, 16) * 8 * 256; }  // Wf's weights; bias' follows
static at::Tensor launch_ow_params(const at::Tensor& ln_w, const at::Tensor& ln_b, const at::Tensor& wa,
                                   const at::Tensor& ba, const at::Tensor& wb, const at::Tensor& bb, const at::Tensor& wo,
                                   const at::Tensor& bo, void* WoP, int wo16, int w16, int cm, int c, int cz, int nzc,
                                   const DevInfo& d, cudaStream_t stream) {
  const int64_t U = cdiv(cm, 16);
  const bool p16 = ln_w.scalar_type() != at::kFloat;
  at::Tensor Wf = at::empty({ow_wf_floats(cm) + 128 + (p16 ? cz : 0)}, ln_w.options().dtype(at::kFloat));
  const int64_t nrest = (w16 ? 0 : U * 8 * 32) + static_cast<int64_t>(nzc) * kOwNQ * kOwHC * kOwZ * 8 + (p16 ? cz : 0);
  const int gpar = grid_for(kPoBiasBlocks + std::min<int64_t>(cdiv(nrest, kThreads), 2ll * d.sms));
  float* wf = Wf.data_ptr<float>();
  auto run = [&](auto tag) {
    using P = decltype(tag);
    auto ptr = [](const at::Tensor& t) { return t.defined() ? reinterpret_cast<const P*>(t.data_ptr()) : nullptr; };
    opm_ow_params_kernel<P><<<gpar, kThreads, 0, stream>>>(ptr(ln_w), ptr(ln_b), ptr(wa), ptr(ba), ptr(wb), ptr(bb),
                                                          ptr(wo), ptr(bo), wf, wf + ow_wf_floats(cm),
                                                          p16 ? wf + ow_wf_floats(cm) + 128 : nullptr, WoP, wo16, w16, cm,
                                                          c, cz, nzc);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (ln_w.scalar_type() == at::kBFloat16) run(__nv_bfloat16());
  else if (ln_w.scalar_type() == at::kHalf) run(__half());
  else run(float());
  return Wf;
}
// opm_prep_ow_kernel<MT, T, kPlanes> over every tile of x (float32, bfloat16 or float16; od.sb =
// ow_sb(x's dtype)), beside its inv_denom blocks: the planes Aow, Bow where kPlanes (x's dtype, see
// ow_planes), the rows a_rows, b_rows (B, S, N, 32) fp32 where not null. Wf from launch_ow_params.
// A 16-bit x with c_m % 16 == 0, c_m <= 256 at an 8-byte aligned address goes to opm_prep16_kernel (warp
// tiles), unless block_tiles; everything else to opm_prep_ow_kernel (block tiles).
static bool p16_runs(const at::Tensor& x, int cm, bool block_tiles) {
  return !block_tiles && x.scalar_type() != at::kFloat && cm % 16 == 0 && cm >= 16 && cm <= 16 * kP16MaxU &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0;
}
template <bool kPlanes>
static void launch_prep16(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& Wf, void* Aow,
                          void* Bow, float* a_rows, float* b_rows, int64_t B, int64_t S, int64_t N, int cm, float eps,
                          const OwDims& od, at::Tensor& inv_denom, const DevInfo& d, cudaStream_t stream) {
  const int64_t ntiles = B * (od.sb / 8) * od.KB * (16 * od.NIT / 2);  // warp tiles, < 2^31 (the callers' ow_tiles_ok)
  // inv_denom blocks, then tile blocks: 2 per SM (launch bounds, shared memory under half an SM's), all
  // resident at once
  const int n_den = static_cast<int>(std::min<int64_t>(cdiv(N, 32), std::max(1, d.sms / 4)));
  const int64_t gtiles = std::max<int64_t>(1, std::min<int64_t>(cdiv(ntiles, kP16Warps), 2ll * d.sms - n_den));
  const float* biasf = Wf.data_ptr<float>() + ow_wf_floats(cm);
  auto run = [&](auto kernel, const auto* xp, size_t smem) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    set_smem(kernel, smem, d, "the 16-bit LayerNorm/projection kernel of outer_wg");
    kernel<<<grid_for(n_den + gtiles), kP16Threads, smem, stream>>>(
        xp, mask.data_ptr(), mask_kind, Wf.data_ptr<float>(), biasf, static_cast<T*>(Aow), static_cast<T*>(Bow), B, S,
        N, cm, eps, od.KB, od.NIT, od.NBB, inv_denom.data_ptr<float>(), n_den, a_rows, b_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  const auto* xh = reinterpret_cast<const __half*>(x.data_ptr());
  // (bfloat16 at a compile-time U: ptxas keeps all c_m / 2 widened values of the lane between the
  // statistics and the products and spills 528 bytes, so bfloat16 takes U at run time alone)
  if (x.scalar_type() == at::kBFloat16)
    run(opm_prep16_kernel<__nv_bfloat16, kPlanes, 0>, xb, p16_smem_bytes<__nv_bfloat16>(cm));
  else if (cm == 16 * kP16MaxU) run(opm_prep16_kernel<__half, kPlanes, kP16MaxU>, xh, p16_smem_bytes<__half>(cm));
  else run(opm_prep16_kernel<__half, kPlanes, 0>, xh, p16_smem_bytes<__half>(cm));
}
template <bool kPlanes>
static void launch_prep_ow(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& Wf, void* Aow,
                           void* Bow, float* a_rows, float* b_rows, int64_t B, int64_t S, int64_t N, int cm, float eps,
                           const OwDims& od, at::Tensor& inv_denom, const DevInfo& d, cudaStream_t stream,
                           bool block_tiles = false) {
  TORCH_INTERNAL_ASSERT(od.sb == ow_sb(x.scalar_type()), "outer_product_mean: the planes' s blocks follow msa's dtype");
  if (p16_runs(x, cm, block_tiles)) {
    launch_prep16<kPlanes>(x, mask, mask_kind, Wf, Aow, Bow, a_rows, b_rows, B, S, N, cm, eps, od, inv_denom, d,
                           stream);
    return;
  }
  const int MT = po_mt(cm);
  const int64_t ntiles = B * (od.sb / 4) * od.KB * (16 * od.NIT / (4 * MT));  // < 2^31 (the callers' ow_tiles_ok)
  const size_t smem = po_smem_bytes(cm, MT);
  const int n_den = static_cast<int>(std::min<int64_t>(cdiv(N, 32), 2 * d.sms));  // inv_denom blocks
  // one block per tile (a persistent grid, each block loading its next tile's x and Wf during the
  // current one, measured slower: NOTES.md, outer product mean: what did not pay)
  const int gprep = grid_for(n_den + ntiles);  // (ntiles = 0 when S = 0: inv_denom still runs)
  if (gprep == 0) return;
  const float* biasf = Wf.data_ptr<float>() + ow_wf_floats(cm);
  auto run = [&](auto kernel, const auto* xp) {
    set_smem(kernel, smem, d, "the tensor-core LayerNorm/projection kernel of outer_wg");
    kernel<<<gprep, kPoThreads, smem, stream>>>(xp, mask.data_ptr(), mask_kind, Wf.data_ptr<float>(), biasf, Aow, Bow, B,
                                                S, N, cm, eps, od.KB, od.NIT, od.NBB, inv_denom.data_ptr<float>(), n_den,
                                                a_rows, b_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
    if (MT == 2) run(opm_prep_ow_kernel<2, __nv_bfloat16, kPlanes>, xp);
    else run(opm_prep_ow_kernel<1, __nv_bfloat16, kPlanes>, xp);
  } else if (x.scalar_type() == at::kHalf) {
    const auto* xp = reinterpret_cast<const __half*>(x.data_ptr());
    if (MT == 2) run(opm_prep_ow_kernel<2, __half, kPlanes>, xp);
    else run(opm_prep_ow_kernel<1, __half, kPlanes>, xp);
  } else {
    const float* xp = x.data_ptr<float>();
    if (MT == 2) run(opm_prep_ow_kernel<2, float, kPlanes>, xp);
    else run(opm_prep_ow_kernel<1, float, kPlanes>, xp);
  }
}
// x and out: float32 (split TF32), or both bfloat16 / float16 (the prep reads x as it is, phase A on the
// 16-bit tensor cores, the fused kernel writes out in that type). pair_scale: see launch_outer_wg_fused.
static void launch_outer_wg(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& ln_w,
                            const at::Tensor& ln_b, const at::Tensor& wa, const at::Tensor& ba, const at::Tensor& wb,
                            const at::Tensor& bb, const at::Tensor& wo, const at::Tensor& bo, at::Tensor& inv_denom,
                            at::Tensor& out, int64_t B, int64_t S, int64_t N, int cm, int c, int cz, float eps,
                            float* a_rows, float* b_rows, const DevInfo& d, cudaStream_t stream,
                            const at::Tensor& pair_scale = at::Tensor(), const at::Tensor& on = at::Tensor()) {
  TORCH_INTERNAL_ASSERT(out.scalar_type() == x.scalar_type(), "outer_product_mean: outer_wg's out has msa's dtype");
  const OwDims od = ow_dims(S, N, cz, ow_sb(x.scalar_type()));
  const OwPlanes p = ow_planes(B, od, x.options());
  const int wo16 = x.scalar_type() != at::kFloat;  // 16-bit input: phase B in float16
  const at::Tensor Wf = launch_ow_params(ln_w, ln_b, wa, ba, wb, bb, wo, bo, p.WoP.data_ptr(), wo16, wo16, cm, c, cz,
                                         od.nzc, d, stream);
  // bo as fp32: the parameter itself, or its copy in Wf's tail (16-bit parameters)
  const float* bof = ln_w.scalar_type() == at::kFloat ? bo.data_ptr<float>() : Wf.data_ptr<float>() + ow_wf_floats(cm) + 128;
  launch_prep_ow<true>(x, mask, mask_kind, Wf, p.Aow.data_ptr(), p.Bow.data_ptr(), a_rows, b_rows, B, S, N, cm, eps, od,
                       inv_denom, d, stream);
  launch_outer_wg_fused(p, inv_denom, bof, out, B, N, od, cz, d, stream, pair_scale, on);
}

// The pair modes' per-pair (s1, s2) (opm_pair_scale_kernel; see "Normalisations"): a float2 (B, N, N)
// tensor (as float32 (B, N, N, 2)); with inv_denom defined, s1 over the row scale the kernels applied. counts: how
// float masks' counts are summed on a compute capability 8.0+ device: kCountsDmma by opm_pair_scale_dmma_kernel,
// kCountsRing by opm_pair_scale_ring_kernel where its copies' alignment holds (else the DMMA kernel), kCountsHmma as
// kCountsRing but 16-bit masks by its HMMA instance, kCountsFma (and older devices) by the fp64 FMA kernel.
static at::Tensor launch_pair_scale(const at::Tensor& mask, int mask_kind, int64_t B, int64_t S, int64_t N, int norm,
                                    double eps, const at::Tensor& inv_denom, const DevInfo& d, cudaStream_t stream,
                                    int counts) {
  at::Tensor scale = at::empty({B, N, N, 2}, mask.options().dtype(at::kFloat));
  const int64_t tiles = B * cdiv(N, kPsT) * cdiv(N, kPsT);
  const int g = grid_for(std::min<int64_t>(tiles, 4ll * d.sms));
  if (g == 0) return scale;
  const float* inv = inv_denom.defined() ? inv_denom.data_ptr<float>() : nullptr;
  float2* sp = reinterpret_cast<float2*>(scale.data_ptr<float>());
  if (counts != kCountsFma && mask_is_float(mask_kind) && d.major >= 8) {
    const bool ring = counts >= kCountsRing && N * mask.element_size() % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(mask.data_ptr()) % 16 == 0;
    auto run = [&](auto* m) {
      using M = std::remove_const_t<std::remove_pointer_t<decltype(m)>>;
      if constexpr (sizeof(M) == 2) {
        if (ring && counts == kCountsHmma) {
          opm_pair_scale_ring_kernel<M, true><<<g, kPdThreads, 0, stream>>>(m, B, S, N, norm, eps, inv, sp);
          return;
        }
      }
      if (ring) opm_pair_scale_ring_kernel<M><<<g, kPdThreads, 0, stream>>>(m, B, S, N, norm, eps, inv, sp);
      else opm_pair_scale_dmma_kernel<M><<<g, kPdThreads, 0, stream>>>(m, B, S, N, norm, eps, inv, sp);
    };
    if (mask_kind == kF32) run(mask.data_ptr<float>());
    else if (mask_kind == kF16) run(reinterpret_cast<const __half*>(mask.data_ptr()));
    else run(reinterpret_cast<const __nv_bfloat16*>(mask.data_ptr()));
  } else if (mask_is_float(mask_kind))
    opm_pair_scale_kernel<double><<<g, kPsThreads, 0, stream>>>(mask.data_ptr(), mask_kind, B, S, N, norm, eps, inv, sp);
  else
    opm_pair_scale_kernel<long long><<<g, kPsThreads, 0, stream>>>(mask.data_ptr(), mask_kind, B, S, N, norm, eps, inv, sp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return scale;
}
// out = out * s1 + s2 * bo in place (opm_pair_epilogue_kernel), out float32, float16 or bfloat16 (B, N, N, cz)
// contiguous, bo float32 (cz) contiguous; 16-byte vectors where pair_dim and the addresses allow.
static void launch_pair_epilogue(at::Tensor& out, const at::Tensor& scale, const at::Tensor& bo, const DevInfo& d,
                                 cudaStream_t stream) {
  const int64_t pairs = out.numel() / std::max<int64_t>(out.size(3), 1);
  const int cz = static_cast<int>(out.size(3));
  const int ve = 16 / static_cast<int>(out.element_size());
  const bool vec = cz % ve == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(bo.data_ptr()) % 16 == 0;
  const int64_t work = pairs * (vec ? cz / ve : cz);
  const int g = grid_for(std::min<int64_t>(cdiv(work, kThreads), 32ll * d.sms));
  if (g == 0) return;
  const float2* sp = reinterpret_cast<const float2*>(scale.data_ptr<float>());
  auto run = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    if (vec) opm_pair_epilogue_kernel<T, true><<<g, kThreads, 0, stream>>>(o, sp, bo.data_ptr<float>(), pairs, cz);
    else opm_pair_epilogue_kernel<T, false><<<g, kThreads, 0, stream>>>(o, sp, bo.data_ptr<float>(), pairs, cz);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (out.scalar_type() == at::kBFloat16) run(reinterpret_cast<__nv_bfloat16*>(out.data_ptr()));
  else if (out.scalar_type() == at::kHalf) run(reinterpret_cast<__half*>(out.data_ptr()));
  else run(out.data_ptr<float>());
}

// small: stage 2 by opm_wfirst_small_kernel (32 x 64 tiles, K split over warps) instead of the
// 128 x 128 opm_wfirst_gemm_kernel; tc (1 or 2): by opm_wfirst_tc_kernel<tc> (split TF32).
template <int CP>
static void launch_wfirst(const at::Tensor& aT, const at::Tensor& bq, const at::Tensor& inv_denom,
                          const at::Tensor& wk, const at::Tensor& bo, at::Tensor& out, at::Tensor& P, int64_t JC,
                          int64_t B, int64_t S, int64_t N, int64_t Npad, int cz, int CZP4, bool small, int tc,
                          const DevInfo& d, cudaStream_t stream) {
  const size_t smem2 = small ? 4 * kSmallSmemFloats
                       : tc == 1 ? kTcSmemBytes<1>
                       : tc == 2 ? kTcSmemBytes<2>
                                 : 4 * 2 * 2 * kKC * kTile;  // see each kernel
  if (small) set_smem(opm_wfirst_small_kernel, smem2, d, "the small w-first GEMM kernel");
  else if (tc == 1) set_smem(opm_wfirst_tc_kernel<1>, smem2, d, "the split-TF32 w-first GEMM kernel");
  else if (tc == 2) set_smem(opm_wfirst_tc_kernel<2>, smem2, d, "the split-TF32 w-first GEMM kernel (v2)");
  else set_smem(opm_wfirst_gemm_kernel, smem2, d, "the w-first GEMM kernel");
  const int64_t ldp = JC * CZP4;
  const int64_t ncol1 = static_cast<int64_t>(CP) * CZP4;  // stage-1 columns (h, z)
  const float* Pp = P.numel() ? P.data_ptr<float>() : aT.data_ptr<float>();
  for (int64_t j0 = 0; j0 < N; j0 += JC) {
    const int64_t JCv = std::min<int64_t>(JC, N - j0);
    const int g1 = grid_for(B * S * cdiv(JCv, 64) * cdiv(ncol1, 128));
    if (g1 > 0) {
      opm_wfirst_proj_kernel<CP><<<g1, kThreads, 0, stream>>>(bq.data_ptr<float>(), wk.data_ptr<float>(),
                                                             P.data_ptr<float>(), B, S, N, j0, JCv, ldp, CZP4);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (tc) {
      const int g2 = grid_for(B * cdiv(N, kTile) * cdiv(JCv * CZP4, kTile));
      auto kernel = tc == 1 ? opm_wfirst_tc_kernel<1> : opm_wfirst_tc_kernel<2>;
      kernel<<<g2, kTcThreads, smem2, stream>>>(
          aT.data_ptr<float>(), Pp, inv_denom.data_ptr<float>(), bo.data_ptr<float>(), out.data_ptr<float>(),
          B, S, N, Npad, CP, j0, JCv, ldp, cz, CZP4);
    } else if (small) {
      const int g2 = grid_for(B * cdiv(N, kSmM) * cdiv(JCv * CZP4, kSmN));
      opm_wfirst_small_kernel<<<g2, kThreads, smem2, stream>>>(
          aT.data_ptr<float>(), Pp, inv_denom.data_ptr<float>(), bo.data_ptr<float>(), out.data_ptr<float>(),
          B, S, N, Npad, CP, j0, JCv, ldp, cz, CZP4);
    } else {
      const int g2 = grid_for(B * cdiv(N, kTile) * cdiv(JCv * CZP4, kTile));
      opm_wfirst_gemm_kernel<<<g2, kThreads, smem2, stream>>>(
          aT.data_ptr<float>(), Pp, inv_denom.data_ptr<float>(), bo.data_ptr<float>(), out.data_ptr<float>(),
          B, S, N, Npad, CP, j0, JCv, ldp, cz, CZP4);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// fused_small: opm_fused_small_kernel<T> in one cooperative launch (every block resident: the grid is at
// most the blocks that fit at once, and the tasks beyond it are walked). x, the parameters and out are all
// float32 or all of one 16-bit dtype (the kernel's T); a_rows, b_rows (B, S, N, 32) fp32 (the backward's a,
// b where hidden_dim is 32); inv_denom (B, N) written where not null.
struct FsLaunch {
  int per_sm = 0;  // resident blocks per SM (0: not queried yet)
  bool coop = false;
};
template <typename T>
static FsLaunch fs_launch_info(int dev, const DevInfo& d) {
  static FsLaunch cache[64];
  if (dev >= 0 && dev < 64 && cache[dev].per_sm > 0) return cache[dev];
  FsLaunch f;
  int coop = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  f.coop = coop != 0;
  set_smem(opm_fused_small_kernel<T>, kFsSmemBytes, d, "the fused_small kernel");
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&f.per_sm, opm_fused_small_kernel<T>, kFsThreads,
                                                               kFsSmemBytes));
  TORCH_CHECK(f.per_sm >= 1, "outer_product_mean: the fused_small kernel (", std::to_string(kFsSmemBytes),
              " bytes of shared memory, ", std::to_string(kFsThreads), " threads) fits no block on an SM of this GPU");
  if (dev >= 0 && dev < 64) cache[dev] = f;
  return f;
}
static void launch_fused_small(const at::Tensor& x, const at::Tensor& mask, int mask_kind, const at::Tensor& ln_w,
                               const at::Tensor& ln_b, const at::Tensor& wa, const at::Tensor& ba, const at::Tensor& wb,
                               const at::Tensor& bb, const at::Tensor& wo, const at::Tensor& bo, at::Tensor& a_rows,
                               at::Tensor& b_rows, float* inv_denom, at::Tensor& out, int64_t B, int64_t S, int64_t N,
                               int cm, int c, int cz, float eps, const DevInfo& d, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(out.scalar_type() == x.scalar_type() && wo.scalar_type() == x.scalar_type(),
                        "outer_product_mean: fused_small reads and writes one dtype");
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "outer_product_mean: x 16-byte aligned");
  const int64_t nic = cdiv(N, kFsNI), njc = cdiv(N, kFsJT);
  const int nzc = static_cast<int>(cdiv(cz, kFsZT));
  const int64_t ntasks = B * nic * njc * nzc;
  const size_t el = x.element_size();
  auto aligned = [&](const at::Tensor& t, size_t bytes) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0; };
  const int flags = (cm % 4 == 0 ? kFsVecX : 0) | (cm % 4 == 0 && aligned(wa, 4 * el) && aligned(wb, 4 * el) ? kFsVecW : 0) |
                    (c == kFsCP && aligned(wo, 16) ? kFsVecWo : 0);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const FsLaunch f = fs_launch_info<T>(x.get_device(), d);
    TORCH_CHECK(f.coop, "outer_product_mean: variant fused_small needs a GPU with cooperative launches");
    const int grid = static_cast<int>(std::min<int64_t>(ntasks, static_cast<int64_t>(f.per_sm) * d.sms));
    auto tp = [](const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); };
    const T *xp = tp(x), *lwp = tp(ln_w), *lbp = tp(ln_b), *wap = tp(wa), *bap = tp(ba), *wbp = tp(wb), *bbp = tp(bb),
            *wop = tp(wo), *bop = tp(bo);
    const void* mp = mask.data_ptr();
    float *ap = a_rows.data_ptr<float>(), *bp = b_rows.data_ptr<float>();
    T* op = reinterpret_cast<T*>(out.data_ptr());
    int mk = mask_kind, cmv = cm, cv = c, czv = cz, nzcv = nzc, fl = flags;
    float epsv = eps;
    int64_t Bv = B, Sv = S, Nv = N, nicv = nic, njcv = njc;
    void* args[] = {&xp, &mp, &mk, &lwp, &lbp, &wap, &bap, &wbp, &bbp, &wop, &bop, &ap, &bp, &inv_denom, &op,
                    &Bv, &Sv, &Nv, &cmv, &cv, &czv, &epsv, &nicv, &njcv, &nzcv, &fl};
    C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(opm_fused_small_kernel<T>), dim3(grid),
                                               dim3(kFsThreads), args, kFsSmemBytes, stream));
  };
  if (x.scalar_type() == at::kBFloat16) run(__nv_bfloat16());
  else if (x.scalar_type() == at::kHalf) run(__half());
  else run(float());
}

}  // namespace opm
