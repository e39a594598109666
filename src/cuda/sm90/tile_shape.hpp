// tile_shape.hpp — the sm90 forward's tile table: query rows and keys per CTA step, consumer warpgroups,
// pipeline depth and register split for each head dim. Plain C++ (no CUDA), so host code and the CPU tests
// read the same table the kernels are compiled from.
#pragma once

namespace flare::cuda::sm90 {

// One forward configuration. block_m = 64 * mma_warpgroups: each consumer warpgroup owns 64 query rows of the
// tile and the two (three) of them share its key tiles.
struct FwdTile {
  int block_m;         // query rows per CTA
  int block_n;         // keys per pipeline stage
  int mma_warpgroups;  // consumer warpgroups (block_m / 64)
  int stages;          // K and V pipeline depth (each)
  int producer_regs;   // setmaxnreg for the producer warpgroup
  int consumer_regs;   // setmaxnreg for each consumer warpgroup
};

// 16-bit inputs. The key tile is as wide as the registers allow: a consumer thread holds 64 x block_n / 128
// scores and 64 x head_dim_v / 128 output accumulators, and the shared memory holds Q, `stages` K tiles and
// `stages` V tiles (227 KB per block on sm_90). head_dim_v: V's and O's head dim, head_dim's unless given;
// (192, 128) is the one pair of unequal head dims with a configuration (DeepSeek-style prefill).
constexpr FwdTile forward_tile(int head_dim, int head_dim_v = 0) {
  if (head_dim_v == 0) head_dim_v = head_dim;
  if (head_dim_v != head_dim) {
    if (head_dim == 192 && head_dim_v == 128) return {128, 112, 2, 2, 24, 240};
    return {0, 0, 0, 0, 0, 0};
  }
  switch (head_dim) {
    case 64: return {128, 128, 2, 2, 24, 240};
    case 96: return {128, 128, 2, 2, 24, 240};
    case 128: return {128, 128, 2, 2, 24, 240};
    case 192: return {128, 96, 2, 2, 24, 240};
    case 256: return {128, 80, 2, 2, 24, 240};
    default: return {0, 0, 0, 0, 0, 0};
  }
}

constexpr int kSm90SmemBytes = 227 * 1024;  // opt-in shared memory per block on sm_90

// Whether O has a staging buffer of its own (else it is staged in Q's, and the next tile's Q waits for the
// store): where the two fit, the next tile's Q load overlaps this tile's epilogue. O (block_m x head_dim_v)
// staged in Q's buffer needs head_dim_v <= head_dim.
constexpr bool forward_separate_o(int head_dim, int head_dim_v = 0) {
  if (head_dim_v == 0) head_dim_v = head_dim;
  const FwdTile t = forward_tile(head_dim, head_dim_v);
  return 2 * (t.block_m * (head_dim + head_dim_v) + t.stages * t.block_n * (head_dim + head_dim_v)) + 1024 <=
         kSm90SmemBytes;
}

// Shared memory of one configuration, in bytes: Q (block_m x d), O where separate (block_m x dv), the K and V
// rings (stages x block_n x d, and x dv), the barriers and alignment. Element size 2 (fp16 / bf16). The kernel's
// SharedStorage must agree (static_assert there).
constexpr int forward_smem_estimate(int head_dim, int head_dim_v = 0) {
  if (head_dim_v == 0) head_dim_v = head_dim;
  const FwdTile t = forward_tile(head_dim, head_dim_v);
  const int o_elems = forward_separate_o(head_dim, head_dim_v) ? t.block_m * head_dim_v : 0;
  return 2 * (t.block_m * head_dim + o_elems + t.stages * t.block_n * (head_dim + head_dim_v)) + 2048;
}

}  // namespace flare::cuda::sm90
