// contact_map: the wgmma kernel's ring and roles: the producer's copies and the epilogue.
#pragma once
#include "wgmma_tile_math.cuh"

namespace contact_map {

#if defined(CM_WG_DEVICE)
// The ring of tile slots and its barriers, as the kernel lays them out in shared memory.
template <typename T>
struct Ring {
  T* slots;         // R slots of slot_elems elements: half tile u in slot u % R
  int4* tinfo;      // (b, I, J, 0) of the tile whose first half is in slot s (KC = 128 build)
  uint64_t* full;   // full[s]: the slot's copies have landed (expect_tx, completed by the copy engine)
  uint64_t* empty;  // empty[s]: the slot's 4 consumer warps have read it
  int slot_elems, R;
};

// ---- producer -----------------------------------------------------------------------------------
// Half tile `mirror` of tile (b, I, J) into slot s: KC / kBoxC boxes (128-byte rows) completing on full[s],
// with the L2 cache policy `policy` on the reads when EVICT_FIRST.
template <typename T, int KC, bool EVICT_FIRST>
__device__ __forceinline__ void copy_half_tile(T* slots, int slot_elems, uint64_t* full, const CUtensorMap& tm_tile,
                                               const CUtensorMap& tm_mirror, unsigned bytes, uint64_t policy, int s,
                                               bool mirror, int b, int I, int J) {
  constexpr int kBoxC = WgElem<T>::kBoxC;
  mbar_expect_tx(full + s, bytes);
  T* dst = slots + s * slot_elems;
  const CUtensorMap* map = mirror ? &tm_mirror : &tm_tile;
#pragma unroll
  for (int box = 0; box < KC / kBoxC; ++box) {
    if constexpr (EVICT_FIRST)
      tma_load_4d(dst + box * PAIRS * kBoxC, map, kBoxC * box, TILE * J, TILE * I, b, full + s, policy);
    else tma_load_4d(dst + box * PAIRS * kBoxC, map, kBoxC * box, TILE * J, TILE * I, b, full + s);
  }
}

// Thread kTileThread, KC = 128: the block's tiles q < NCW are blockIdx.x + q gridDim.x, the later ones
// tickets from tile_counter (t = NCW gridDim.x + ticket; the params kernel zeroes the counter on each
// call), so blocks whose copies land sooner take more tiles. Each ticket is taken two tiles ahead (tk0
// for q + 1, tk1 for q + 2), so that the atomic's round trip is over long before its use. Each tile's
// (b, I, J) goes to the consumers in tinfo beside its first slot (ordered before their reads by the
// copies' completion on full[s]). Past the last tile, uses 2q, 2q + 2, ... get one sentinel (b = -1;
// I = 1 for the first, 0 for the others) for each consumer warpgroup, each completing its slot's phase
// with a plain arrive. The slot ps = u % R, pw = (u / R) & 1 and wrapped = u >= R of half-tile use u are
// kept incrementally, and the tile indices are 32-bit (the host checks total < 2^31): with no division
// by R and no 64-bit division the walk fits kProducerRegs128. The copies are marked L2 evict_first:
// every input byte is read once, so its lines are the first to be replaced when a later copy misses
// (under the harness's flush, which leaves L2 full of dirty lines, the other lines stay).
template <typename T, int KC, int NCW>
__device__ __forceinline__ void produce_tiles_by_ticket(const Ring<T>& rg, const CUtensorMap& tm_tile,
                                                        const CUtensorMap& tm_mirror, int* tile_counter,
                                                        long long total, long long tiles_per_b) {
  const int R = rg.R;
  int4* tinfo = rg.tinfo;
  uint64_t* full = rg.full;
  uint64_t* empty = rg.empty;
  const unsigned bytes = static_cast<unsigned>(sizeof(T) * rg.slot_elems);
  uint64_t policy = 0;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  auto copy_half = [&](int s, bool mirror, int b, int I, int J) {
    copy_half_tile<T, KC, true>(rg.slots, rg.slot_elems, full, tm_tile, tm_mirror, bytes, policy, s, mirror, b, I, J);
  };
  const unsigned total32 = static_cast<unsigned>(total), tpb32 = static_cast<unsigned>(tiles_per_b);
  int ps = 0;
  unsigned pw = 0;
  bool wrapped = false;
  auto next_slot = [&]() {
    if (++ps == R) {
      ps = 0;
      pw ^= 1;
      wrapped = true;
    }
  };
  auto wait_slot = [&]() {  // until the consumers have released slot ps's previous phase
    if (wrapped) mbar_wait(empty + ps, pw ^ 1);
  };
  unsigned t = blockIdx.x, tk0 = 0, tk1 = 0;
  for (unsigned q = 0;; ++q) {
    wait_slot();
    if (t >= total32) {
#pragma unroll
      for (int k = 0; k < NCW; ++k) {
        if (k > 0) {
          next_slot();
          next_slot();
          wait_slot();
        }
        tinfo[ps] = make_int4(-1, k == 0 ? 1 : 0, 0, 0);  // the first sentinel has I = 1
        mbar_arrive(full + ps);
      }
      break;
    }
    int b, I, J;
    decode_tile32(t, tpb32, b, I, J);
    tinfo[ps] = make_int4(b, I, J, 0);
    copy_half(ps, false, b, I, J);
    next_slot();
    wait_slot();
    copy_half(ps, true, b, I, J);
    next_slot();
    if (q + 1 < NCW) {
      t += gridDim.x;
    } else {
      if (q + 1 == NCW) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");  // tile_counter zeroed by the params kernel
        tk0 = static_cast<unsigned>(atomicAdd(tile_counter, 1));
      } else {
        tk0 = tk1;
      }
      tk1 = static_cast<unsigned>(atomicAdd(tile_counter, 1));
      t = NCW * gridDim.x + tk0;
    }
  }
}

// Thread kTileThread, KC = 64: the block's tiles blockIdx.x + k gridDim.x in order, each decoded here
// (and again by its consumer warpgroup).
template <typename T, int KC>
__device__ __forceinline__ void produce_tiles_strided(const Ring<T>& rg, const CUtensorMap& tm_tile,
                                                      const CUtensorMap& tm_mirror, long long total,
                                                      long long tiles_per_b) {
  const int R = rg.R;
  const unsigned bytes = static_cast<unsigned>(sizeof(T) * rg.slot_elems);
  unsigned u = 0;
  for (long long t = blockIdx.x; t < total; t += gridDim.x) {
    int b, I, J;
    decode_tile(t, tiles_per_b, b, I, J);
    for (int half = 0; half < 2; ++half, ++u) {
      const int s = static_cast<int>(u % R);
      if (u >= static_cast<unsigned>(R)) mbar_wait(rg.empty + s, ((u / R) - 1) & 1);
      copy_half_tile<T, KC, false>(rg.slots, rg.slot_elems, rg.full, tm_tile, tm_mirror, bytes, 0, s, half != 0, b, I, J);
    }
  }
}

// Thread kParamsThread: the packed parameters (w1s, w2s, vec are contiguous, from w1s on), in bulk copies of
// <= 32 KB completing on wbar; launched as a programmatic dependent of the params kernel, it waits for its
// writes first (the tile copies of thread kTileThread do not depend on it).
template <typename T, int KC, int HP>
__device__ __forceinline__ void produce_params(float* w1s, const float* wpack, uint64_t* wbar) {
  constexpr int bytes = 4 * kWgPackFloats<T, KC, HP>;
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  mbar_expect_tx(wbar, bytes);
  for (int off = 0; off < bytes; off += 32768)
    bulk_copy(w1s + off / 4, wpack + off / 4, bytes - off < 32768 ? bytes - off : 32768, wbar);
}

// ---- epilogue -----------------------------------------------------------------------------------
// Per tile, after layer 3 (z0, z1: this lane's partial sums of pairs p0 and p0 + 8 over its units): z
// summed over the quad and out[b,i,j] = out[b,j,i] = sigmoid(z + b3), lanes t4 = 0 / 1 writing pair p0
// (i0, j0) / p0 + 8 (i1, j0).
template <typename T>
__device__ __forceinline__ void write_pair_outputs(float z0, float z1, int t4, bool ok0, bool ok1, int i0, int i1,
                                                   int j0, int b, int N, float bias3, T* out) {
  z0 += __shfl_xor_sync(0xffffffffu, z0, 1);
  z0 += __shfl_xor_sync(0xffffffffu, z0, 2);
  z1 += __shfl_xor_sync(0xffffffffu, z1, 1);
  z1 += __shfl_xor_sync(0xffffffffu, z1, 2);
  if (t4 < 2) {
    const bool ok = t4 == 0 ? ok0 : ok1;
    if (ok) {
      const int i = t4 == 0 ? i0 : i1;
      const T o = from_f32<T>(1.f / (1.f + expf(-((t4 == 0 ? z0 : z1) + bias3))));
      out[(static_cast<long long>(b) * N + i) * N + j0] = o;
      out[(static_cast<long long>(b) * N + j0) * N + i] = o;
    }
  }
}
#endif
}  // namespace contact_map
