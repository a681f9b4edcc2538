// contact_map: the bound functions (argument checks, then the launchers).
#pragma once
#include "backward_launcher.cuh"

namespace contact_map {

// =============================================================================================
// Bound function
// =============================================================================================
// Returns (out, the Kernel that ran; -1 for an empty input, where none runs).
std::tuple<torch::Tensor, int64_t> forward(torch::Tensor pair, torch::Tensor ln_w, torch::Tensor ln_b, double eps,
                                           torch::Tensor w1, torch::Tensor b1, torch::Tensor w2, torch::Tensor b2,
                                           torch::Tensor w3, torch::Tensor b3, int64_t variant) {
  const auto dtype = pair.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kHalf || dtype == torch::kBFloat16,
              "contact_map: pair_repr must be float32, float16 or bfloat16, got ", c10::toString(dtype));
  TORCH_CHECK(pair.dim() == 4, "contact_map: pair_repr must be (B, N, N, pair_dim), got shape ",
              shape_str(pair.sizes()));
  const int64_t C = ln_w.numel(), H = b1.numel();
  TORCH_CHECK(pair.size(1) == pair.size(2) && pair.size(3) == C,
              "contact_map: pair_repr must be (B, N, N, pair_dim=", num(C), "), got shape ",
              shape_str(pair.sizes()));
  check_param(ln_w, "layer_norm.weight", pair, {C});
  check_param(ln_b, "layer_norm.bias", pair, {C});
  check_param(w1, "mlp.0.weight", pair, {H, C});
  check_param(b1, "mlp.0.bias", pair, {H});
  check_param(w2, "mlp.2.weight", pair, {H, H});
  check_param(b2, "mlp.2.bias", pair, {H});
  check_param(w3, "mlp.4.weight", pair, {1, H});
  check_param(b3, "mlp.4.bias", pair, {1});
  TORCH_CHECK(pair.is_cuda(), "contact_map: pair_repr must be a CUDA tensor, got a tensor on ",
              pair.device().str());
  TORCH_CHECK(C >= 1 && C <= MAX_PAIR_DIM, "contact_map: pair_dim must be in [1, ", num(MAX_PAIR_DIM),
              "], got ", num(C));
  TORCH_CHECK(H >= 1 && H <= MAX_HIDDEN, "contact_map: hidden_dim must be in [1, ", num(MAX_HIDDEN),
              "], got ", num(H));
  TORCH_CHECK(variant >= 0 && variant < static_cast<int64_t>(Variant::kCount), "contact_map: unknown kernel variant ",
              num(variant));
  TORCH_CHECK(pair.size(1) < (1LL << 30) && pair.size(0) < (1LL << 31),
              "contact_map: B or N too large, got shape ", shape_str(pair.sizes()));
  const Variant v = static_cast<Variant>(variant);

  TORCH_CHECK(v != Variant::kSmall || small_supported(C, H, device_facts(pair.get_device())),
              "contact_map: variant \"small\" needs pair_dim in [8, 64] with pair_dim % 8 == 0, hidden_dim <= 32 "
              "and a GPU of compute capability 8.0+, got pair_dim " + num(C) + ", hidden_dim " + num(H));

  const int64_t B = pair.size(0), N = pair.size(1);
  auto out = torch::empty({B, N, N}, pair.options());
  if (B == 0 || N == 0) return {out, -1};

  const c10::cuda::CUDAGuard guard(pair.device());
  const bool half = dtype != torch::kFloat32;
  if (v == Variant::kSmall || (v == Variant::kAuto && small_auto_tiles(half) > 0 &&
                                small_preferred(B, N, C, H, half, device_facts(pair.get_device())))) {  // natively
    const int device = pair.get_device();
    // contiguous, and a fresh (aligned) copy where a tensor read in 16-byte vectors starts off alignment
    auto aligned = [](const torch::Tensor& t) {
      auto u = t.contiguous();
      return reinterpret_cast<uintptr_t>(u.data_ptr()) % 16 ? u.clone() : u;
    };
    const auto x = aligned(pair);
    const std::vector<torch::Tensor> c{aligned(ln_w), aligned(ln_b), aligned(w1), b1.contiguous(),
                                       w2.contiguous(), b2.contiguous(), w3.contiguous(), b3.contiguous()};
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    if (dtype == torch::kFloat32) run_small<float>(x, c, eps, out, stream);
    else if (dtype == torch::kHalf) run_small<__half>(x, c, eps, out, stream);
    else run_small<__nv_bfloat16>(x, c, eps, out, stream);
    return {out, static_cast<int64_t>(Kernel::kSmall)};
  }
  if (dtype != torch::kFloat32) {
    // fp16 / bf16: the wgmma kernel's 16-bit build where it runs ("auto"); otherwise the fp32 kernels on
    // converted copies, the output converted back
    const int device = pair.get_device();
    const DeviceFacts dev = device_facts(device);
    const auto x = pair.contiguous();
    if (v == Variant::kAuto && wgmma_supported(static_cast<int>(C), static_cast<int>(H), static_cast<int>(N),
                                               x.data_ptr(), 2, dev)) {
      const std::vector<torch::Tensor> c{ln_w.contiguous(), ln_b.contiguous(), w1.contiguous(), b1.contiguous(),
                                         w2.contiguous(),   b2.contiguous(),   w3.contiguous(), b3.contiguous()};
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
      if (dtype == torch::kHalf) run_wgmma<__half>(x, c, eps, out, device, dev, stream);
      else run_wgmma<__nv_bfloat16>(x, c, eps, out, device, dev, stream);
      return {out, static_cast<int64_t>(Kernel::kWgmma16)};
    }
    auto f = [](const torch::Tensor& t) { return t.to(torch::kFloat32); };
    const auto r = forward(f(x), f(ln_w), f(ln_b), eps, f(w1), f(b1), f(w2), f(b2), f(w3), f(b3), variant);
    return {std::get<0>(r).to(dtype), std::get<1>(r)};
  }
  auto x = pair.contiguous();
  auto w1c = w1.contiguous(), w2c = w2.contiguous(), w3c = w3.contiguous();
  auto lnw = ln_w.contiguous(), lnb = ln_b.contiguous(), b1c = b1.contiguous(),
       b2c = b2.contiguous(), b3c = b3.contiguous();

  Args a;
  a.x = x.data_ptr<float>(); a.out = out.data_ptr<float>();
  a.ln_w = lnw.data_ptr<float>(); a.ln_b = lnb.data_ptr<float>();
  a.w1 = w1c.data_ptr<float>(); a.b1 = b1c.data_ptr<float>();
  a.w2 = w2c.data_ptr<float>(); a.b2 = b2c.data_ptr<float>();
  a.w3 = w3c.data_ptr<float>(); a.b3 = b3c.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.B = static_cast<int>(B); a.N = static_cast<int>(N); a.C = static_cast<int>(C); a.H = static_cast<int>(H);
  const bool fma = v == Variant::kFma;
  a.CP = round_up(a.C, fma ? 4 : 8);  // the tensor-core k step is 8
  a.vec = (C % 4 == 0) && (reinterpret_cast<uintptr_t>(a.x) % 16 == 0);

  int HP = 16;
  while (HP < H) HP *= 2;
  const int device = pair.get_device();
  a.device = device;
  const DeviceFacts dev = device_facts(device);
  const int max_smem = dev.max_smem, num_sms = dev.num_sms;
  const size_t smem_w = sizeof(float) * Smem(a.CP, HP, true).total;
  const size_t smem_g = sizeof(float) * (fma ? Smem(a.CP, HP, false).total
                                             : SmemTC(a.CP, HP, WFormat::kGlobal).total);
  TORCH_CHECK(smem_g <= static_cast<size_t>(max_smem), "contact_map: pair_dim=", num(C),
              " needs ", num(smem_g), " bytes of shared memory per block; this device allows ",
              num(max_smem));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  Kernel ran;
  if (v == Variant::kAuto && wgmma_supported(a.C, a.H, a.N, a.x, 4, dev)) {
    run_wgmma<float>(x, {lnw, lnb, w1c, b1c, w2c, b2c, w3c, b3c}, eps, out, device, dev, stream);
    ran = Kernel::kWgmma;
  } else if (!fma) {  // kMma, and kAuto outside the wgmma kernel's shapes
    if (sizeof(float) * SmemTC(a.CP, HP, WFormat::kSplit).total <= static_cast<size_t>(max_smem))
      dispatch_mma_hidden<WFormat::kSplit>(a, HP, stream, num_sms);
    else
      dispatch_mma_hidden<WFormat::kGlobal>(a, HP, stream, num_sms);
    ran = Kernel::kMma;
  } else {
    dispatch_fma(a, HP, smem_w <= static_cast<size_t>(max_smem), stream, num_sms);
    ran = Kernel::kFma;
  }
  return {out, static_cast<int64_t>(ran)};
}

// "auto" runs the small kernel up to this many tiles per SM (where it runs), for fp16 / bf16 (half) or fp32 input.
int64_t small_auto_tiles_per_sm(bool half) { return small_auto_tiles(half); }

}  // namespace contact_map
