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
// scores and 64 x head_dim / 128 output accumulators, and the shared memory holds Q, `stages` K tiles and
// `stages` V tiles (227 KB per block on sm_90).
constexpr FwdTile forward_tile(int head_dim) {
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
// store): where the two fit, the next tile's Q load overlaps this tile's epilogue.
constexpr bool forward_separate_o(int head_dim) {
  const FwdTile t = forward_tile(head_dim);
  return 2 * head_dim * (2 * t.block_m + 2 * t.stages * t.block_n) + 1024 <= kSm90SmemBytes;
}

// Shared memory of one configuration, in bytes: Q (block_m x d), O where separate, K and V rings
// (stages x block_n x d), the barriers and alignment. Element size 2 (fp16 / bf16). The kernel's SharedStorage must
// agree (static_assert there).
constexpr int forward_smem_estimate(int head_dim) {
  const FwdTile t = forward_tile(head_dim);
  const int o_rows = forward_separate_o(head_dim) ? t.block_m : 0;
  return 2 * head_dim * (t.block_m + o_rows + 2 * t.stages * t.block_n) + 2048;
}

}  // namespace flare::cuda::sm90
