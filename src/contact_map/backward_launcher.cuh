// contact_map: the fused backward's launcher.
#pragma once
#include "backward_kernel.cuh"

namespace contact_map {

// The fused backward: (d_pair in pair's dtype, d_ln_w, d_ln_b, d_w1, d_b1, d_w2, d_b2, d_w3, d_b3), each
// parameter's gradient in its shape and dtype (float32, float16, bfloat16 or float64). pair (B, N, N, C) fp32 /
// fp16 / bf16, 16-byte aligned; parameters and grad_out (B, N, N) any of those dtypes (used in fp32). After the
// conversions of those that are not contiguous float32 on pair's device, two launches: contact_map_backward_kernel
// (d_pair, one fp32 partial per block), bw_sum_partials_kernel. Raises where backward_supported is false.
// fp16_products: for a bfloat16 pair, the four backward products (dW2, dh1, dW1, ds) on fp16 operands (bw_gemm16s);
// other dtypes ignore it. one_conversion: see below.
std::vector<torch::Tensor> backward(torch::Tensor pair, torch::Tensor ln_w, torch::Tensor ln_b, double eps,
                                    torch::Tensor w1, torch::Tensor b1, torch::Tensor w2, torch::Tensor b2,
                                    torch::Tensor w3, torch::Tensor b3, torch::Tensor grad_out, bool fp16_products,
                                    bool one_conversion) {
  const auto dtype = pair.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kHalf || dtype == torch::kBFloat16,
              "contact_map backward: pair_repr must be float32, float16 or bfloat16, got ", c10::toString(dtype));
  TORCH_CHECK(pair.is_cuda() && pair.dim() == 4 && pair.size(1) == pair.size(2),
              "contact_map backward: pair_repr must be a CUDA tensor (B, N, N, pair_dim), got shape ",
              shape_str(pair.sizes()));
  const int64_t B = pair.size(0), N = pair.size(1), C = pair.size(3), H = b1.numel();
  TORCH_CHECK(grad_out.sizes() == c10::IntArrayRef({B, N, N}), "contact_map backward: grad_out has shape ",
              shape_str(grad_out.sizes()), ", expected ", shape_str({B, N, N}));
  TORCH_CHECK(ln_w.numel() == C && ln_b.numel() == C && w1.numel() == H * C && w2.numel() == H * H &&
              b2.numel() == H && w3.numel() == H && b3.numel() == 1,
              "contact_map backward: parameter shapes do not match pair_dim ", num(C), " and hidden_dim ", num(H));
  TORCH_CHECK(N < 46341 && B < (1LL << 31), "contact_map backward: B or N too large, got shape ",
              shape_str(pair.sizes()));
  const c10::cuda::CUDAGuard guard(pair.device());
  const int device = pair.get_device();
  const DeviceFacts dev = device_facts(device);
  TORCH_CHECK(backward_fits(C, H, dev), "contact_map backward: pair_dim ", num(C), " / hidden_dim ", num(H),
              " not supported here (multiples of 16 up to ", num(bwd::kMaxC), " / ", num(bwd::kMaxH),
              ", compute capability 8.0+)");
  const auto x = pair.contiguous();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "contact_map backward: pair_repr's data must be 16-byte aligned");
  // grad_out and the parameters as contiguous fp32 on pair's device (the kernel's scalar loads). one_conversion:
  // each that is not already goes into one buffer (a strided or other-device one copied first), by one torch::cat
  // (none for a single one; float64 among them makes the buffer float64 until the conversion) and one conversion
  // (the nine conversions, one per tensor, took ~255 us per bfloat16 crop step under torch.profiler); else one
  // conversion per tensor.
  const torch::Tensor* in[9] = {&grad_out, &ln_w, &ln_b, &w1, &b1, &w2, &b2, &w3, &b3};
  const float* f32[9];
  int64_t at[9] = {};
  std::vector<torch::Tensor> pieces, kept;  // (kept alive until the launches are queued)
  int64_t len = 0;
  for (int k = 0; k < 9; ++k) {
    const torch::Tensor& t = *in[k];
    if (!one_conversion) {
      kept.push_back(t.to(t.options().dtype(torch::kFloat32).device(pair.device())).contiguous());
      f32[k] = kept.back().data_ptr<float>();
    } else if (t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device() == pair.device()) {
      f32[k] = t.data_ptr<float>();
    } else {
      f32[k] = nullptr;
      at[k] = len;
      len += t.numel();
      pieces.push_back(t.to(pair.device()).reshape({-1}));
    }
  }
  torch::Tensor converted;
  if (!pieces.empty()) {
    converted = (pieces.size() == 1 ? pieces[0] : torch::cat(pieces)).to(torch::kFloat32).contiguous();
    for (int k = 0; k < 9; ++k)
      if (f32[k] == nullptr) f32[k] = converted.data_ptr<float>() + at[k];
  }
  auto dx = torch::empty_like(x, at::MemoryFormat::Contiguous);
  // the gradients in bw_partial_len's order, each like its parameter
  const torch::Tensor* like[8] = {&w1, &w2, &ln_w, &ln_b, &w3, &b2, &b3, &b1};
  std::vector<torch::Tensor> d(8);
  BwGrads gs{};
  for (int k = 0; k < 8; ++k) {
    const auto dt = like[k]->scalar_type();
    TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kHalf || dt == torch::kBFloat16 || dt == torch::kFloat64,
                "contact_map backward: parameters must be float32, float16, bfloat16 or float64, got ",
                c10::toString(dt));
    d[k] = torch::empty(like[k]->sizes(), x.options().dtype(dt));
    gs.ptr[k] = d[k].data_ptr();
    gs.kind[k] = dt == torch::kFloat32 ? 0 : dt == torch::kHalf ? 1 : dt == torch::kBFloat16 ? 2 : 3;
    gs.begin[k + 1] = gs.begin[k] + static_cast<int>(d[k].numel());
  }
  const int P = bw_partial_len(static_cast<int>(C), static_cast<int>(H));
  TORCH_CHECK(gs.begin[8] == P, "contact_map backward: parameter sizes do not add up to the partial's length");
  const int64_t nT = (N + TILE - 1) / TILE, tiles = B * nT * (nT + 1) / 2;
  const auto result = [&]() -> std::vector<torch::Tensor> {  // the order of contact_map_backward's returns
    return {dx, d[2], d[3], d[0], d[7], d[1], d[5], d[4], d[6]};
  };
  if (tiles == 0) {
    for (auto& t : d) t.zero_();
    return result();
  }
  const int grid = static_cast<int>(std::min<int64_t>(tiles, dev.num_sms));
  auto part = torch::empty({grid, P}, x.options().dtype(torch::kFloat32));
  const size_t smem = sizeof(float) * BwSmem(static_cast<int>(C), static_cast<int>(H)).total;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    BwArgs<T> a{reinterpret_cast<const T*>(x.data_ptr()), f32[0], f32[1], f32[2], f32[3], f32[4], f32[5], f32[6],
                f32[7], f32[8], reinterpret_cast<T*>(dx.data_ptr()), part.data_ptr<float>(), eps, static_cast<int>(B),
                static_cast<int>(N), static_cast<int>(C), static_cast<int>(H)};
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      if (fp16_products) {
        launch_backward<T, true>(a, grid, smem, device, stream);
        return;
      }
    }
    launch_backward<T, false>(a, grid, smem, device, stream);
  };
  if (dtype == torch::kFloat32) run(float{});
  else if (dtype == torch::kHalf) run(__half{});
  else run(__nv_bfloat16{});
  bw_sum_partials_kernel<<<(P + 31) / 32, 256, 0, stream>>>(part.data_ptr<float>(), grid, P, gs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return result();
}

}  // namespace contact_map
