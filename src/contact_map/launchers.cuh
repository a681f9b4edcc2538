// contact_map: the forward's launchers and the variant dispatch.
#pragma once
#include "wgmma_kernel.cuh"
#include "tensor_map.cuh"

namespace contact_map {

// =============================================================================================
// Launchers
// =============================================================================================
struct Args {
  const float *x, *ln_w, *ln_b, *w1, *b1, *w2, *b2, *w3, *b3;
  float* out;
  float eps;
  int B, N, C, H, CP;
  bool vec;
  int device;  // the input's CUDA device (current under the forward's CUDAGuard)
};

// A device's facts that every forward needs, queried once per device (four driver calls, ~1.5 us of host time
// per forward on the H200 machine's host otherwise: NOTES.md).
struct DeviceFacts {
  int max_smem, num_sms, major, minor;
};
DeviceFacts device_facts(int device) {
  static std::mutex mu;
  static std::unordered_map<int, DeviceFacts> cache;
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  DeviceFacts f{};
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.num_sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, device));
  cache.emplace(device, f);
  return f;
}

// A kernel's MaxDynamicSharedMemorySize raised to at least `smem` on `device` (the current device, the caller's
// CUDAGuard), for every kernel of this file: cudaFuncSetAttribute only when a larger size than any set before is
// asked for (it took 1.9 us of every forward in the same profile). A larger limit also admits the smaller
// launches.
void ensure_max_dynamic_smem(const void* kernel, int device, int smem) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> set_to;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(kernel, device);
  const auto it = set_to.find(key);
  if (it != set_to.end() && it->second >= smem) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  set_to[key] = smem;
}

// Persistent launch of the fma or the mma kernel (same signature): as many blocks of `threads` threads as fit on
// the device, at most one per tile.
using KernelFn = void (*)(const float*, float*, const float*, const float*, const float*, const float*,
                          const float*, const float*, const float*, const float*, float, int, int, int, int,
                          int, bool);
int blocks_per_sm(KernelFn kernel, int device, int threads, size_t smem) {
  ensure_max_dynamic_smem(reinterpret_cast<const void*>(kernel), device, static_cast<int>(smem));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return per_sm;
}

// per_sm: the kernel's resident blocks per SM when the caller has just asked (blocks_per_sm, which
// also sets its shared-memory attribute), else 0 and it is asked here.
void launch_persistent(KernelFn kernel, int threads, size_t smem, const Args& a, cudaStream_t stream,
                       int num_sms, int per_sm = 0) {
  if (per_sm == 0) per_sm = blocks_per_sm(kernel, a.device, threads, smem);
  TORCH_CHECK(per_sm > 0, "contact_map: kernel does not fit on the device (", num(smem),
              " bytes of shared memory)");
  const int nT = cdiv(a.N, TILE);
  const long long tiles = static_cast<long long>(a.B) * nT * (nT + 1) / 2;
  const long long slots = static_cast<long long>(per_sm) * num_sms;
  const int grid = static_cast<int>(tiles < slots ? tiles : slots);
  kernel<<<grid, threads, smem, stream>>>(a.x, a.out, a.ln_w, a.ln_b, a.w1, a.b1, a.w2, a.b2, a.w3,
                                         a.b3, a.eps, a.B, a.N, a.C, a.H, a.CP, a.vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}


template <int HP, bool W_SMEM>
void launch_fma(const Args& a, cudaStream_t stream, int num_sms) {
  launch_persistent(contact_map_fma_kernel<HP, W_SMEM>, THREADS, sizeof(float) * Smem(a.CP, HP, W_SMEM).total,
                    a, stream, num_sms);
}

template <bool W_SMEM>
void dispatch_fma_hidden(const Args& a, int HP, cudaStream_t s, int sms) {
  switch (HP) {
    case 16: launch_fma<16, W_SMEM>(a, s, sms); break;
    case 32: launch_fma<32, W_SMEM>(a, s, sms); break;
    case 64: launch_fma<64, W_SMEM>(a, s, sms); break;
    case 128: launch_fma<128, W_SMEM>(a, s, sms); break;
    default: launch_fma<256, W_SMEM>(a, s, sms); break;  // HP <= MAX_HIDDEN checked by forward()
  }
}

void dispatch_fma(const Args& a, int HP, bool w_smem, cudaStream_t s, int sms) {
  if (w_smem) dispatch_fma_hidden<true>(a, HP, s, sms);
  else dispatch_fma_hidden<false>(a, HP, s, sms);
}

// PROD (the producer-warp build) at HP <= 32 only: at HP = 64 (crop, long) NG = 2 takes half the warps out
// of products that are ~50% of the loop there, and measured 8-10% slower than without (NOTES.md).
constexpr int kProdMaxHP = 32;

// The mma kernel with 512 threads (or 256 at HP = 256: below): weights as split fragments in shared memory
// when they fit beside the tile (WF), else read from global memory. At HP <= 32: the 2-blocks-per-SM build
// (64 registers) where two blocks fit by shared memory, else the 1-block build with the producer warps
// (PROD) and the fused statistics sweep (under 64 registers per thread the PROD build at HP = 32, 2 n
// tiles per warp, spilled 8 bytes).
template <int HP, WFormat WF>
void launch_mma(const Args& a, cudaStream_t stream, int num_sms) {
  constexpr int NTHR = 512;
  const size_t smem = sizeof(float) * SmemTC(a.CP, HP, WF).total;
  if constexpr (HP <= kProdMaxHP) {
    static_assert(kMinBlocksTC<HP, NTHR> == 2, "the 2-block build at HP <= 32");
    const int per_sm = blocks_per_sm(contact_map_mma_kernel<HP, WF, NTHR, 2>, a.device, NTHR, smem);
    if (per_sm < 2)
      launch_persistent(contact_map_mma_kernel<HP, WF, NTHR, 1, true>, NTHR, smem, a, stream, num_sms);
    else
      launch_persistent(contact_map_mma_kernel<HP, WF, NTHR, 2>, NTHR, smem, a, stream, num_sms, per_sm);
  } else {
    launch_persistent(contact_map_mma_kernel<HP, WF, NTHR, kMinBlocksTC<HP, NTHR>>, NTHR, smem, a, stream, num_sms);
  }
}

template <WFormat WF>
void dispatch_mma_hidden(const Args& a, int HP, cudaStream_t s, int sms) {
  switch (HP) {
    case 16: launch_mma<16, WF>(a, s, sms); break;
    case 32: launch_mma<32, WF>(a, s, sms); break;
    case 64: launch_mma<64, WF>(a, s, sms); break;
    case 128: launch_mma<128, WF>(a, s, sms); break;
    // HP <= MAX_HIDDEN checked by forward(); at 256 the weights (>= 512 KB) never fit in shared memory,
    // and 16 warps would need more than the 128 registers per thread they may have: 8 warps
    default:
      launch_persistent(contact_map_mma_kernel<256, WFormat::kGlobal, 256>, 256,
                        sizeof(float) * SmemTC(a.CP, 256, WFormat::kGlobal).total, a, s, sms);
      break;
  }
}

// Where the small kernel runs (variant "small"): compute capability 8.0+, 8 <= C <= 64 with C % 8 == 0 (16-byte
// vectors of channels in every dtype), 1 <= H <= 32.
bool small_supported(int64_t C, int64_t H, const DeviceFacts& dev) {
  return dev.major >= 8 && C >= 8 && C <= SMALL_KC && C % 8 == 0 && H >= 1 && H <= SMALL_HP;
}

// "auto" runs the small kernel where it runs and the input has at most kSmallAutoTilesPerSm[half] tiles per SM: there a
// block's chain, not the stream of tiles, sets the time, and one launch without the params kernel wins (NOTES.md,
// small-2). fp16 / bf16: up to 2 tiles per SM (H100, KernelBench-style per call at (4, 64, 64, 64), hidden 32: 10.0 /
// 10.2 us against wgmma16's 14.1 / 11.8; at 272 tiles 11.3 against 12.5 us; at 544, 15.7 against 13.2). fp32: never
// (the same 12.2 against 12.5 us per call, but 8.4 against 6.1 us of GPU time in a CUDA graph; 17.1 against 15.4 us
// at 272 tiles).
constexpr int kSmallAutoTilesPerSm[2] = {0, 2};  // [float32, float16 / bfloat16]
int small_auto_tiles(bool half) { return kSmallAutoTilesPerSm[half ? 1 : 0]; }
bool small_preferred(int64_t B, int64_t N, int64_t C, int64_t H, bool half, const DeviceFacts& dev) {
  const int64_t nT = (N + TILE - 1) / TILE;
  const int64_t tiles = B * nT * (nT + 1) / 2;
  return small_supported(C, H, dev) && tiles <= static_cast<int64_t>(small_auto_tiles(half)) * dev.num_sms;
}

// The small kernel's channel groups: warps per 16 positions (2: 8 warps per tile).
constexpr int kSmallGroups = 2;

// The small kernel on x (B, N, N, C) and the parameters c (gamma, beta, W1, b1, W2, b2, w3, b3), all contiguous
// and of type T, x, gamma, beta and W1 16-byte aligned, into out (T): one block per tile, one launch.
template <typename T>
void run_small(const torch::Tensor& x, const std::vector<torch::Tensor>& c, double eps, const torch::Tensor& out,
               cudaStream_t stream) {
  const int N = static_cast<int>(x.size(1)), C = static_cast<int>(x.size(3)), H = static_cast<int>(c[3].numel());
  const int nT = cdiv(N, TILE);
  TORCH_CHECK(x.size(0) <= 65535 && nT <= 65535,
              "contact_map: the small kernel handles B <= 65535 and N <= 524280, got B = " + num(x.size(0)) +
                  ", N = " + num(N));
  auto p = [](const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); };
  contact_map_small_kernel<T, kSmallGroups><<<dim3(nT, nT, static_cast<unsigned>(x.size(0))), 128 * kSmallGroups, 0,
                                               stream>>>(
      p(x), p(c[0]), p(c[1]), p(c[2]), p(c[3]), p(c[4]), p(c[5]), p(c[6]), p(c[7]),
      reinterpret_cast<T*>(out.data_ptr()), static_cast<float>(eps), N, C, H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The wgmma kernel's host side: sm_90a in this build and a compute capability 9.0 device; the shapes its tiles fit.
#if defined(CM_SM90A)
constexpr bool kBuiltSm90a = true;  // the build has sm_90a code (the wgmma kernel)
#else
constexpr bool kBuiltSm90a = false;
#endif

// x (B, N, N, C) contiguous as a 4-D tensor map (C, N, N, B) with boxes of 128 bytes of channels (32 fp32,
// 64 fp16 / bf16) x 8 x 8 positions, 128-byte swizzle, zero fill out of range. Tile map: dimension 1 is x's j (stride C),
// dimension 2 its i (stride N C); mirror map: the two swapped, so that both land with row 8 il + jl.
// L2 promotion: 128 bytes (a box row's size) for the KC = 128 build, 256 bytes for KC = 64 (128 measured
// 0.6% faster at batch, NOTES.md).
template <typename T>
CUtensorMap make_tile_map(const T* x, int B, int N, int C, bool mirror,
                          CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  CUtensorMap m;
  constexpr cuuint64_t es = sizeof(T);
  const cuuint64_t row = static_cast<cuuint64_t>(C) * es, plane = static_cast<cuuint64_t>(N) * C * es;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(C), static_cast<cuuint64_t>(N), static_cast<cuuint64_t>(N),
                              static_cast<cuuint64_t>(B)};
  const cuuint64_t strides[3] = {mirror ? plane : row, mirror ? row : plane, plane * N};
  const cuuint32_t box[4] = {WgElem<T>::kBoxC, TILE, TILE, 1}, elem[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = std::is_same<T, float>::value    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                    : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode_tiled("contact_map")(&m, type, 4, const_cast<T*>(x), dims, strides, box,
                                    elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "contact_map: cuTensorMapEncodeTiled failed with CUresult " + num(static_cast<int>(r)));
  return m;
}

// The wgmma kernel's tensors, all of element type T (float, __half or __nv_bfloat16).
template <typename T>
struct WgArgs {
  const T *x, *ln_w, *ln_b, *w1, *b1, *w2, *b2, *w3, *b3;
  T* out;
  float eps;
  int B, N, C, H, device;
};

// Where "auto" runs the wgmma kernel (else the mma kernel, or for fp16 / bf16 input the fp32 kernels on a
// converted copy): built with sm_90a, a compute capability 9.0 device, C % 16 == 0, 32 <= C <= 128 (fp32;
// fp16 / bf16: 64 <= C, a box row's 128 bytes), H <= 64, N >= 8 (a box never exceeds the tensor), x
// 16-byte aligned. esize: bytes of an input element.
bool wgmma_supported(int C, int H, int N, const void* x, int esize, const DeviceFacts& dev) {
  if (!kBuiltSm90a) return false;
  return dev.major == 9 && dev.minor == 0 && C % 16 == 0 && C >= 128 / esize && C <= 128 && H <= 64 && N >= TILE &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}


// As many ring slots as fit (4 NCW or 2 NCW); one block per SM, at most one per tile.
template <typename T, int KC, int HP>
void launch_wgmma(const WgArgs<T>& a, const torch::Tensor& wpack_buf, cudaStream_t stream, int num_sms, int max_smem) {
  constexpr bool kWide = KC == 128;  // the streamlined build (contact_map_wgmma_kernel)
  // R a multiple of 2 NCW, so that every slot serves one warpgroup only (warpgroup w's uses u = 2 NCW k + 2w, + 1):
  // a parity wait is safe only for a waiter that also waited on the slot's previous phase. At R = 5 a
  // warpgroup could find the other's earlier copy into the slot still in flight, read the parity of that
  // incomplete phase as its own completed one and read the slot early (wrong outputs at batch, R = 5, in 6 of
  // 300 back-to-back calls: NOTES.md).
  constexpr int NCW = kConsumerWgs<T, KC>;
  // 8 or 12 slots where they fit (the 16-bit build's 12 x 16 KB fit on every sm_90 GPU), else 4 or 6
  int R = 4 * NCW;
  while (R > 2 * NCW && SmemWg(KC, HP, R, sizeof(T)).total > max_smem) R -= 2 * NCW;
  const int smem = SmemWg(KC, HP, R, sizeof(T)).total;
  TORCH_CHECK(smem <= max_smem, "contact_map: the wgmma kernel needs " + num(smem) + " bytes of shared memory per block; this device allows " + num(max_smem));
  auto kernel = contact_map_wgmma_kernel<T, KC, HP>;
  ensure_max_dynamic_smem(reinterpret_cast<const void*>(kernel), a.device, smem);
  const CUtensorMapL2promotion promotion = kWide ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  const CUtensorMap mt = make_tile_map(a.x, a.B, a.N, a.C, false, promotion),
                    mm = make_tile_map(a.x, a.B, a.N, a.C, true, promotion);
  constexpr int pack_threads = HP * KC + HP * HP + 32 * HP;
  float* wpack = wpack_buf.data_ptr<float>();
  constexpr int counter_at = kWgPackFloats<float, 128, 64>;  // after the largest pack: the tile counter
  TORCH_CHECK(wpack_buf.numel() >= counter_at + 4, "contact_map: internal error: wgmma parameter buffer too small");
  int* tile_counter = kWide ? reinterpret_cast<int*>(wpack + counter_at) : nullptr;
  contact_map_wgmma_params_kernel<T, KC, HP><<<cdiv(pack_threads, 256), 256, 0, stream>>>(
      a.ln_w, a.ln_b, a.w1, a.b1, a.w2, a.b2, a.w3, a.C, a.H, wpack, tile_counter);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int nT = cdiv(a.N, TILE);
  const long long tiles = static_cast<long long>(a.B) * nT * (nT + 1) / 2;
  // the KC = 128 producer counts tiles in 32 bits and decode_tile32 squares the tile row in int (either limit
  // means terabytes of input)
  TORCH_CHECK(!kWide || (tiles < (1ll << 31) && nT <= 46340),
              "contact_map: the wgmma kernel handles fewer than 2^31 tiles and N <= 370720, got " + num(tiles) +
                  " tiles, N = " + num(a.N));
  const int grid = static_cast<int>(tiles < num_sms ? tiles : num_sms);
  // a programmatic dependent launch: the kernel starts (barriers, the first tiles' copies) while the params
  // kernel runs, and waits for it (griddepcontrol.wait) only before copying wpack
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kWgThreads<NCW>);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, mt, mm, a.out, static_cast<const float*>(wpack), tile_counter, a.b3, a.eps, a.B,
                                    a.N, a.C, a.H, R));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// wpack_buf: float32 workspace of at least kWgPackFloats<float, 128, 64> + 4 elements on the input's device (the
// tile counter after the pack). pair_dim <= 64: the KC = 64 build.
template <typename T>
void dispatch_wgmma(const WgArgs<T>& a, const torch::Tensor& wpack_buf, cudaStream_t stream, int num_sms, int max_smem) {
  const bool k64 = a.C <= 64, h32 = a.H <= 32;
  if (k64 && h32) launch_wgmma<T, 64, 32>(a, wpack_buf, stream, num_sms, max_smem);
  else if (k64) launch_wgmma<T, 64, 64>(a, wpack_buf, stream, num_sms, max_smem);
  else if (h32) launch_wgmma<T, 128, 32>(a, wpack_buf, stream, num_sms, max_smem);
  else launch_wgmma<T, 128, 64>(a, wpack_buf, stream, num_sms, max_smem);
}

// The wgmma kernel on x and the parameters c (gamma, beta, W1, b1, W2, b2, w3, b3; all contiguous, of type
// T) into out (T).
template <typename T>
void run_wgmma(const torch::Tensor& x, const std::vector<torch::Tensor>& c, double eps, const torch::Tensor& out,
               int device, const DeviceFacts& dev, cudaStream_t stream) {
  auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); };
  WgArgs<T> a{ptr(x), ptr(c[0]), ptr(c[1]), ptr(c[2]), ptr(c[3]), ptr(c[4]), ptr(c[5]), ptr(c[6]), ptr(c[7]),
              reinterpret_cast<T*>(out.data_ptr()), static_cast<float>(eps), static_cast<int>(x.size(0)),
              static_cast<int>(x.size(1)), static_cast<int>(x.size(3)), static_cast<int>(c[3].numel()), device};
  // the packed parameters, then 4 floats whose first holds the tile counter (an int)
  const auto wpack = torch::empty({kWgPackFloats<float, 128, 64> + 4}, x.options().dtype(torch::kFloat32));
  dispatch_wgmma(a, wpack, stream, dev.num_sms, dev.max_smem);
}

void check_param(const torch::Tensor& p, const char* name, const torch::Tensor& x,
                 std::vector<int64_t> shape) {
  TORCH_CHECK(p.device() == x.device(), "contact_map: pair_repr is on ", x.device().str(),
              " but parameter ", name, " is on ", p.device().str(),
              "; move the module and the input to one device");
  TORCH_CHECK(p.scalar_type() == x.scalar_type(), "contact_map: parameter ", name, " must be ",
              c10::toString(x.scalar_type()), " like pair_repr, got ", c10::toString(p.scalar_type()));
  TORCH_CHECK(p.sizes() == c10::IntArrayRef(shape), "contact_map: parameter ", name, " has shape ",
              shape_str(p.sizes()), ", expected ", shape_str(shape));
}

}  // namespace contact_map
