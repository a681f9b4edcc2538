// outer_product_mean: outer_wg's design and constants (Hopper, sm_90a).
#pragma once
#include "w_first_wg2.cuh"

namespace opm {

// outer_wg (Hopper, sm_90a): outer_first on wgmma in split TF32, for CP = 32 (hidden_dim <= 32,
// zero-padded to 32). A block owns a pair tile of kOwTI = 16 residues i x kOwTJ = 4 residues j
// (64 pairs) and 128 pair channels z (zc = z chunk), and walks the hidden channels h in kOwNQ = 4
// chunks q of kOwHC = 8:
//   phase A (per q, K = S):  O_q[(il, hl), (jl, k)] = sum_s a[s, i, 8q + hl] b[s, j, k]
//     M = 128 rows (il, hl) (warpgroup w: il in [8w, 8w + 8)), N = 128 columns (jl, k), one
//     m64n128k8 wgmma per product per 8 s, operands from shared memory; promoted into fp32 every
//     64 s as in w_first_wg2.
//   O_q -> Os[p][kk] in shared memory (fp32), p = il*4 + jl, kk = hl*32 + ((k + 8 hl) & 31) (the
//     rotation by 8 hl makes the staging stores conflict-free; Wo's packed columns follow it).
//   phase B (per q, K = 256):  acc_out[p, z] += sum_kk Os[p][kk] WoP_q[z][kk]
//     M = 64 pairs, N = 64 z per warpgroup (w: z in [64w, 64w + 64)), A = Os from registers (each
//     warpgroup loads and splits the fragments itself), B = Wo's packed planes from shared memory,
//     m64n64k8; promoted every 64 kk.
//   out[b, i, j, z] = bo[z] + inv_denom[b, i] * acc_out: the (i, j, c, c) block never leaves the SM.
// FLOPs as executed (tensor cores, each x3 for the split): per tile and q, 2 * 128 * 128 * S16
//   (phase A) + 2 * 64 * 128 * 256 (phase B): outer_first's 2 N^2 c^2 (S + c_z) with S, c, c_z
//   padded to 16, 32, 128. Over w_first's stage 2 (2 N^2 S c c_z) that is c / c_z + c / S: fewer
//   FLOPs where S > 43 at c = 32, c_z = 128 (crop, long, deep), more at shallow (S = 32).
// Operands in tile order (written by opm_prep_ow_kernel and opm_ow_params_kernel), hi plane then lo
// plane per block:
//   Aow[b][q][kb][mb] blocks of 64 rows x 16 s: row r = (i % 8) * 8 + hl of residues i in
//     [8 mb, 8 mb + 8), element (r, s % 16) at float (r / 8) 128 + (s % 16 / 4) 32 + (r % 8) 4 + s % 4
//     (8-row groups 512 bytes apart); the two blocks of one
//     tile (mb = 2 it, 2 it + 1) are adjacent: one 16 KB bulk copy.
//   Bow[b][nb][kb] blocks of 128 rows x 16 s: row r = (j % 4) * 32 + k, j in [4 nb, 4 nb + 4).
//   WoP[zc][q][hl] blocks of 128 z x 32 kl (wg_tile_off): Wo[zc*128 + z, (8q + hl) c + ((kl - 8 hl) & 31)].
//   Zeros past N, S, c, c_z.
// Pipeline: one ring of kOwStages 32 KB stages fed by one producer lane (bulk copies on full
//   mbarriers, empty mbarriers released by each consumer warp, as in w_first_wg2); per tile and q
//   the ring carries S16/16 phase-A stages (A blocks 16 KB + B block 16 KB) then 8 phase-B stages
//   (one Wo block, 32 KB each, one per hl), in the same order for producer and consumers.
// ---------------------------------------------------------------------------------------------
constexpr int kOwTI = 16, kOwTJ = 4;     // residues i, j per tile
constexpr int kOwHC = 8, kOwNQ = 4;      // h per chunk, chunks (CP = 32)
constexpr int kOwSK = 16;                // s per phase-A stage (two wgmma k steps)
constexpr int kOwZ = 128;                // pair channels per tile (two warpgroups of 64)
constexpr int kOwAPlane = 64 * kOwSK;    // floats of one plane of an A block (4 KB)
constexpr int kOwBPlane = 128 * kOwSK;   // floats of one plane of a B block (8 KB)
constexpr int kOwWPlane = kOwZ * 32;     // floats of one plane of a Wo block (16 KB)
constexpr int kOwStage = 2 * 2 * kOwAPlane + 2 * kOwBPlane;  // 32 KB: 2 A blocks + 1 B block
static_assert(kOwStage == 2 * kOwWPlane, "a phase-B stage (one Wo block) fills a ring slot");
constexpr int kOwStages = 5;
constexpr int kOwLDO = kOwHC * 32 + 4;   // Os row stride: 4 mod 32 words, conflict-free fragment loads
constexpr int kOwThreads = 128 * (kConsumerWgs + 1);  // consumer warpgroups + the producer warpgroup (setmaxnreg)
constexpr int kOwConsumerRegs = 232, kOwProducerRegs = 40;
// setmaxnreg moves registers within the block's allocation (384 threads x 168, the launch bound's
// cap): more would leave setmaxnreg.inc waiting for registers that never come
static_assert(2 * 128 * kOwConsumerRegs + 128 * kOwProducerRegs <= kOwThreads * ((65536 / kOwThreads) & ~7),
              "outer_wg: register budget of the warpgroups");
constexpr size_t kOwSmemBytes = 4ull * (kOwStages * kOwStage + 64 * kOwLDO) + 16 * kOwStages;
// fp16 / bf16 input: A and B blocks of kOwS16 = 32 s in T, element (r, k) at ow_off16h(r, k): 8-row groups
// 512 bytes apart, each 4 core matrices (8 rows x 8 k, 128 bytes) along k; one ring slot of kOwSlot16
// floats (16 KB) holds a phase-A stage (2 A blocks + 1 B block, 4 + 4 + 8 KB) or a phase-B one (two Wo
// blocks in fp16, WoP16, 8 KB each, the same layout).
constexpr int kOwS16 = 32;
constexpr int kOwABlk16 = 64 * kOwS16, kOwBBlk16 = 128 * kOwS16;  // T elements of an A / B block
constexpr int kOwSlot16 = kOwStage / 2, kOwStages16 = 12;
constexpr int kOwWBlk16 = kOwZ * 32;  // T elements of one Wo block (128 z x 32 kk): two per phase-B slot
static_assert(2 * (2 * kOwABlk16 + kOwBBlk16) == 4 * kOwSlot16 && 2 * 2 * kOwWBlk16 == 4 * kOwSlot16, "outer_wg: 16-bit slots");
// Os16 (16-bit phase B's A operand, O / denom in fp16, rows scaled): rows of kOwLDO16 words (8 mod 32:
// conflict-free 8-byte fragment loads), each 8 hl blocks of 16 words (fp16 pairs), then the rows' 1 / scale
// (Osc, 64 floats). Word ow_os16_word(hl, m) of a row holds hidden
// k = 2m, 2m + 1 (m < 16): rotated by 4 (hl / 2) words so that the staging stores are conflict-free.
// Phase B's k16 step ks of block hl reads words 8 ks + 2 t4 and 8 ks + 2 t4 + 1 of a row as the A
// fragment's k = 2 t4, 2 t4 + 1 and 2 t4 + 8, 2 t4 + 9 (mma's m16n8k16 A layout).
constexpr int kOwLDO16 = 136;
__host__ __device__ __forceinline__ int ow_os16_word(int hl, int m) { return (m + 4 * (hl >> 1)) & 15; }
// The hidden k (of block hl) at phase-B position kap (0..31: k16 step kap / 16, fragment k kap % 16).
__host__ __device__ __forceinline__ int ow_wo16_k(int hl, int kap) {
  const int ks = kap >> 4, kk = kap & 15;
  const int w = 8 * ks + 2 * ((kk & 7) >> 1) + (kk >> 3);  // the Os16 word holding it
  return 2 * ((w - 4 * (hl >> 1)) & 15) + (kk & 1);
}
__host__ __device__ __forceinline__ int ow_off16h(int r, int k) { return (r >> 3) * 256 + (k >> 3) * 64 + (r & 7) * 8 + (k & 7); }
template <typename T>  // s per A / B block: 16 (fp32 split planes) or 32 (T planes)
__host__ __device__ constexpr int ow_block_s() { return std::is_same_v<T, float> ? kOwSK : kOwS16; }
template <typename T>  // outer_wg's dynamic shared memory: the ring, Os, the mbarriers
__host__ __device__ constexpr size_t ow_smem_bytes() {
  return std::is_same_v<T, float> ? kOwSmemBytes : 4ull * (kOwStages16 * kOwSlot16 + 64 * kOwLDO16 + 64) + 16 * kOwStages16;
}
constexpr size_t kOwSmemMax = ow_smem_bytes<__half>() > kOwSmemBytes ? ow_smem_bytes<__half>() : kOwSmemBytes;

// WoP's element group e3 in [0, nzc * kOwNQ * kOwHC * kOwZ * 8): 4 consecutive kl of one z row of
// one Wo block, split into both planes (WoP: see "outer_wg" above).
template <typename P>
__device__ __forceinline__ void pack_wop4(int64_t e3, const P* __restrict__ wo, float* __restrict__ WoP, int c,
                                          int cz) {
  const int m = static_cast<int>(e3 % 8), z = static_cast<int>((e3 / 8) % kOwZ);
  const int hl = static_cast<int>((e3 / (8 * kOwZ)) % kOwHC), q = static_cast<int>((e3 / (8 * kOwZ * kOwHC)) % kOwNQ);
  const int64_t zc = e3 / (8 * kOwZ * kOwHC * kOwNQ), zz = zc * kOwZ + z;
  const int h = q * kOwHC + hl, k0 = (4 * m - 8 * hl) & 31;  // kl = 4m .. 4m+3 -> k = k0 .. k0+3
  float v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) v[u] = (zz < cz && h < c && k0 + u < c) ? ldg_f(wo, zz * c * c + h * c + k0 + u) : 0.f;
  float* dst = WoP + ((zc * kOwNQ + q) * kOwHC + hl) * (2 * kOwWPlane) + wg_tile_off(z, 4 * m);
  store_split4(dst, dst + kOwWPlane, v[0], v[1], v[2], v[3]);
}

// WoP16's element group e3 in [0, nzc * kOwNQ * kOwHC * kOwZ * 8) (fp16 / bf16 input): 4 consecutive
// phase-B positions kap of one z row of one Wo block, in T = __half (exact for float16 weights; for
// bfloat16 ones too, but below 2^-14 (subnormal: absolute error under 2^-25) and above 65504), at
// ow_off16h(z, kap) of block (zc, q, hl) (kOwWBlk16 elements each; two blocks per phase-B slot).
template <typename T, typename P>
__device__ __forceinline__ void pack_wop16(int64_t e3, const P* __restrict__ wo, T* __restrict__ WoP16, int c,
                                           int cz) {
  const int m = static_cast<int>(e3 % 8), z = static_cast<int>((e3 / 8) % kOwZ);
  const int hl = static_cast<int>((e3 / (8 * kOwZ)) % kOwHC), q = static_cast<int>((e3 / (8 * kOwZ * kOwHC)) % kOwNQ);
  const int64_t zc = e3 / (8 * kOwZ * kOwHC * kOwNQ), zz = zc * kOwZ + z;
  const int h = q * kOwHC + hl;
  float v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int k = ow_wo16_k(hl, 4 * m + u);
    v[u] = (zz < cz && h < c && k < c) ? ldg_f(wo, zz * c * c + h * c + k) : 0.f;
  }
  T* dst = WoP16 + ((zc * kOwNQ + q) * kOwHC + hl) * kOwWBlk16 + ow_off16h(z, 4 * m);
  *reinterpret_cast<uint2*>(dst) = pack4_16<T>(v[0], v[1], v[2], v[3]);
}

// ---------------------------------------------------------------------------------------------
}  // namespace opm
