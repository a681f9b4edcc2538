// contact_map: the wgmma kernel's design, build constants and shared-memory layout.
#pragma once
#include "small_kernel.cuh"

namespace contact_map {

// =============================================================================================
// The wgmma kernel (Hopper, sm_90a): both products on wgmma, tiles by the TMA engine
// =============================================================================================
// Per block (one per SM, kWgThreads<NCW> threads: NCW = 2 consumer warpgroups, 3 in the 16-bit KC = 128
// build):
//   warpgroups < NCW consumers (setmaxnreg up): warpgroup w takes every NCW-th tile of the block, one
//                    64-pair tile at a time: its rows into registers (then the tile's two ring slots
//                    are released), statistics, s and its split into wgmma A fragments for all of K,
//                    GEMM1 = m64nHPk8 wgmma with A from registers, GEMM1's accumulator turned in
//                    registers into GEMM2's A fragments, GEMM2, layer 3 and the output. fp32 KC = 128:
//                    the two warpgroups' GEMM1 + GEMM2 take turns (WgBarrier), so one warpgroup's
//                    products run while the other computes its statistics and s.
//   warpgroup NCW    producer (setmaxnreg down); thread kParamsThread copies the packed parameters
//                    (contact_map_wgmma_params_kernel's wpack, written by the same call just before:
//                    this kernel is its programmatic dependent and waits for it there only,
//                    griddepcontrol.wait) into shared memory on the `wbar` mbarrier; thread
//                    kTileThread queues every tile as two half tiles (the tile x[b, 8I.., 8J.., :] and
//                    its mirror x[b, 8J.., 8I.., :]) into a ring of R slots of 64 rows x KC channels:
//                    KC / 32 tensor-map copies (box 32 channels x 8 x 8 positions, 128-byte swizzle)
//                    per half, completing on the slot's `full` mbarrier; a consumer warp arrives on the
//                    slot's `empty` mbarrier once it has read it (4 arrivals free it). Slot use u counts
//                    the block's half tiles: slot u % R, mbarrier parity (u / R) & 1; tile q of the
//                    block uses u = 2q (tile) and 2q + 1 (mirror). R is 4 NCW or 2 NCW, so that each
//                    slot serves one consumer warpgroup (launch_wgmma says why).
// Two builds: KC = 128 (pair_dim 65-128) is the streamlined one (kWide): the producer walks the tiles
// itself and hands each tile's (b, I, J) to the consumers beside its slot (tinfo), taking tickets from
// an atomic counter after each block's first NCW tiles; its copies are marked L2 evict_first; the
// consumers track slots and parities incrementally, take turns on the tensor cores (fp32) and compute each
// side's LayerNorm term as one FFMA from the statistics' d = x - m (the 16-bit build, kOneSide: row_stats16,
// the tile half's term d r, then s = fmaf(d_mirror, r_mirror, term), outputs from positions with i <= j).
// KC = 64 (pair_dim 32-64) keeps the simpler path (a fixed stride of tiles decoded by each role,
// subtract-multiply terms, no ping-pong): the streamlined statistics start their sums from the first four
// 16-channel chunks, which at KC = 64 may be zero-filled padding (pair_dim 32, 48), and the rest of that
// path was built and measured at KC = 128 only (NOTES.md).
// Both halves land with row p = 8 il + jl for pair p = (i, j) = (8I + il, 8J + jl): the mirror's
// tensor map walks x with the two position strides swapped. Out-of-range positions are zero-filled
// by the copy engine (edge tiles), channels C..KC-1 likewise.
// Swizzle (the tensor map's 128B mode): channel c of row p sits at float
//   (c / 32) * 2048 + 32 p + 4 ((c / 4 % 8) ^ (p % 8)) + c % 4
// of its slot (each 32-channel box is 8 KB, 1024-byte aligned).
// Fragment rows: warp w4 (of its warpgroup) owns the 16 pairs 16 w4 + lp, lp = frag_pair(g) for the
// fragment rows g = lane / 4 and g + 8 (lp + 8): rows g = 2m and 2m + 1 are pairs whose p % 8 differ
// by 4, so a quarter-warp's 16-byte loads (two rows x lanes t = lane % 4) hit 8 distinct 16-byte bank
// groups under the swizzle: conflict-free.
// k order: lane t's 16-byte chunk 16 kk + 4 t of a row holds its A fragment columns of k steps 2 kk
// (columns t, t + 4 = channels 16 kk + 4 t, + 1) and 2 kk + 1 (channels + 2, + 3); W1's planes are
// packed in the same order (gemm1_channel). GEMM2's logical k (j, q) is hidden unit 8 j + 2 (q % 4) + q / 4
// (gemm2_unit): GEMM1's accumulator register d[4 j + q'] (row g + 8 (q' / 2), unit 8 j + 2 t + q' % 2)
// is then directly the A fragment register of GEMM2's k step j (FlashAttention-3's P.V chaining).
// Weights: W1' = W1 diag(gamma) and b1' = b1 + W1 beta (the LayerNorm affine folded in, the latter in
// fp64), split into TF32 hi / lo planes in the unswizzled K-major core-matrix layout (plane_offset), W2
// likewise with gemm2_unit's row order; packed per call by contact_map_wgmma_params_kernel, resident in
// shared memory for the block's life.
// Accumulation: per k step lo*hi, hi*lo, hi*hi on the tensor cores, into a fresh accumulator per
// kPromoSteps k steps that is then added to an fp32 accumulator (alternating two, so that one chunk runs
// while the other is promoted); both products.
// Assumptions: C % 16 == 0, 32 <= C <= KC (64 or 128), H <= HP (32 or 64); x 16-byte aligned, contiguous;
// sm_90a (elsewhere the kernel is a trap that the host never launches).
// Consumer warpgroups per block (NCW): 3 in the 16-bit KC = 128 build (kOneSide: its rows and terms fit
// 160 registers), 2 elsewhere; the producer warpgroup is warpgroup NCW, its two working threads the first
// lanes of its first two warps.
template <int NCW>
constexpr int kWgThreads = 128 * (NCW + 1);
template <int NCW>
constexpr int kTileThread = 128 * NCW;
template <int NCW>
constexpr int kParamsThread = 128 * NCW + 32;
// setmaxnreg per build: KC = 128's producer (32-bit ticket walk) fits in 24 registers, KC = 64's
// (64-bit strided walk) takes 40 (FlashAttention-3's consumer / producer split); with three consumer
// warpgroups the 512 threads share 65536 registers: 3 x 160 + 24 per lane.
constexpr int kConsumerRegs128 = 240, kProducerRegs128 = 24;
constexpr int kConsumerRegs64 = 232, kProducerRegs64 = 40;
constexpr int kConsumerRegs3 = 160;
template <int NCW>
constexpr int kRegsPerLane = (65536 / kWgThreads<NCW>) & ~7;
template <int NCW>
constexpr bool kRegsFit(int consumer, int producer) {
  return NCW * 128 * consumer + 128 * producer <= kWgThreads<NCW> * kRegsPerLane<NCW>;
}
static_assert(kRegsFit<2>(kConsumerRegs64, kProducerRegs64), "setmaxnreg budget");
static_assert(kRegsFit<2>(kConsumerRegs128, kProducerRegs128), "setmaxnreg budget");
static_assert(kRegsFit<3>(kConsumerRegs3, kProducerRegs128), "setmaxnreg budget");
// Ring slots: a multiple of 2 NCW (launch_wgmma says why), at most 4 NCW.

// Named barriers of the consumer warpgroups' turns on the tensor cores (KC = 128 build; 0 is
// __syncthreads'): warpgroup w syncs on kMmaTurn0 + w before its GEMM1, and after its GEMM2 arrives on
// the other's.
enum class WgBarrier : int { kMmaTurn0 = 1, kMmaTurn1 = 2 };
__host__ __device__ __forceinline__ int mma_turn(int warpgroup) {
  return static_cast<int>(WgBarrier::kMmaTurn0) + warpgroup;
}

// Shared memory of the wgmma kernel in bytes, from a 1024-byte aligned base: the ring, W1 and W2 planes,
// b1', b2, w3, the tile info, the mbarriers; plus 1024 for the alignment. esize: bytes of an input element
// (4: fp32 input, hi and lo planes of fp32 weights; 2: fp16 / bf16 input, one plane of weights in that type).
struct SmemWg {
  int slot_elems, ring, w1, w2, vec, bars, total;
  __host__ __device__ SmemWg(int KC, int HP, int R, int esize = 4) {
    const int planes = esize == 4 ? 2 : 1;
    slot_elems = PAIRS * KC;
    ring = esize * R * slot_elems;
    w1 = esize * planes * HP * KC;
    w2 = esize * planes * HP * HP;
    vec = 4 * 3 * HP;
    bars = 16 * R + 8 * (2 * R + 1);  // the tile info (an int4 per slot), then the mbarriers
    total = ring + w1 + w2 + vec + bars + 1024;
  }
};

// Pair (within its warp's 16) of fragment row g.
__host__ __device__ __forceinline__ int frag_pair(int g) { return ((g & 1) << 2) | (g >> 1); }
// Physical channel of GEMM1's logical k = 8 ks + q (q < 8: fragment column).
__host__ __device__ __forceinline__ int gemm1_channel(int k) {
  const int ks = k >> 3, q = k & 7;
  return 16 * (ks >> 1) + 4 * (q & 3) + 2 * (ks & 1) + (q >> 2);
}
// Hidden unit of GEMM2's logical k = 8 j + q.
__host__ __device__ __forceinline__ int gemm2_unit(int k) { return (k & ~7) + 2 * (k & 3) + ((k >> 2) & 1); }
// Float offset of B(n, k) in a plane of NR rows n (K-major, no swizzle): k step blocks of NR x 8,
// 8-row core-matrix groups 256 bytes apart (SBO), the two 4-k halves 128 bytes apart (LBO).
__host__ __device__ __forceinline__ int plane_offset(int n, int k, int NR) {
  return (k >> 3) * (NR * 8) + (n >> 3) * 64 + ((k >> 2) & 1) * 32 + (n & 7) * 4 + (k & 3);
}

// The 16-bit build (fp16 / bf16 input, wgmma k16 in that type; "wgmma16"). Its A registers per k step of 16
// (rows g, g + 8 as in the fp32 build): a[h] holds logical k = 2t, 2t + 1 of row g + 8h, a[2 + h] k = 2t + 8,
// 2t + 9. Physical channel of GEMM1's logical k = 16 ks + q: thread t's four are 16 ks + 4t .. + 3, one
// 8-byte load of a slot row.
__host__ __device__ __forceinline__ int gemm1_channel16(int k) {
  const int q = k & 15;
  return (k & ~15) + 4 * ((q & 7) >> 1) + 2 * (q >> 3) + (q & 1);
}
// Element offset of B(n, k) in a plane of 16-bit elements (K-major, no swizzle): k steps of 16 in blocks of
// NR x 16, core matrices of 8 rows x 8 k (128 bytes), the two 8-k halves 128 bytes apart (LBO), 8-row
// groups 256 bytes apart (SBO): plane_desc's strides, and HP x 16 x 2 bytes per k step as the fp32 plane's
// HP x 8 x 4. GEMM2's logical k is the hidden unit itself (the accumulator's layout is the A registers').
__host__ __device__ __forceinline__ int plane_offset16(int n, int k, int NR) {
  return (k >> 4) * (NR * 16) + (n >> 3) * 128 + ((k >> 3) & 1) * 64 + (n & 7) * 8 + (k & 7);
}
// The input's element type: float, __half or __nv_bfloat16 (kHalf), and the channels of one 128-byte box row.
template <typename T>
struct WgElem {
  static constexpr bool kHalf = !std::is_same<T, float>::value;
  static constexpr int kBoxC = 128 / static_cast<int>(sizeof(T));
};
// The consumer warpgroups of a build (NCW, kWgThreads above).
template <typename T, int KC>
constexpr int kConsumerWgs = WgElem<T>::kHalf && KC == 128 ? 3 : 2;

}  // namespace contact_map
