// plan.hpp — the arithmetic of the split-KV decode kernels as plain functions of integers, shared by the
// kernels (src/cuda/decode/attention.cuh) and the host (src/cuda/heuristics.cpp), so that
// tests/cpp/test_cuda_heuristics.cpp checks each against brute force on the CPU: which query positions a CTA's
// packed rows hold, the keys they see, how those keys are cut into splits, and where a key slot of a paged
// cache lives. No CUDA header; FLARE_HD marks what the device calls too.
#pragma once

#include <cstdint>

#include "common/attention_policy.hpp"
#include "cuda/decode/params.hpp"

namespace flare::cuda::decode {

// ---- the kernel's shape (one place: the kernels, the heuristic and the tests read these) ----------------
// A CTA holds kRows packed query rows (the m16 of one mma.sync tile) and its warps walk the keys of its split
// in tiles of kTileKeys, each warp its own tiles through its own cp.async stages (no CTA barrier in the loop);
// their partial results are merged once at the end.
inline constexpr int kRows = 16;
inline constexpr int kTileKeys = 16;  // keys per warp tile, and the unit splits are cut in
inline constexpr int kMaxSplits = 128;

// Warps per CTA and cp.async stages per warp: as many K+V tiles in flight as keep a CTA under the 99 KB of
// shared memory that every sm80-family GPU gives a block (68-72 KB; the registers then let two CTAs share an
// H100 / H200 SM at head dim 128).
constexpr int warps_for(int head_dim_tile) { return head_dim_tile <= 128 ? 4 : 2; }
constexpr int threads_for(int head_dim_tile) { return 32 * warps_for(head_dim_tile); }
constexpr int warp_stages_for(int head_dim_tile) { return head_dim_tile <= 64 ? 4 : 2; }

// Elements of one K (or V) tile of a warp stage, and the bytes of the parts of a CTA's shared memory: q, the
// warps' K and V stages (which the warps' fp32 partial outputs reuse at the end), and the warps' row maxima
// and sums.
constexpr int tile_elements(int head_dim_tile) { return kTileKeys * head_dim_tile; }
constexpr int q_smem_bytes(int head_dim_tile, int element_bytes) { return kRows * head_dim_tile * element_bytes; }
constexpr int kv_smem_bytes(int head_dim_tile, int element_bytes) {
  const int stages = warps_for(head_dim_tile) * warp_stages_for(head_dim_tile) * 2 * tile_elements(head_dim_tile) *
                     element_bytes;
  const int merge = warps_for(head_dim_tile) * kRows * head_dim_tile * 4;
  return stages > merge ? stages : merge;
}
constexpr int smem_bytes(int head_dim_tile, int element_bytes) {
  return q_smem_bytes(head_dim_tile, element_bytes) + kv_smem_bytes(head_dim_tile, element_bytes) +
         2 * warps_for(head_dim_tile) * kRows * 4;
}

// ---- one sequence of a call --------------------------------------------------------------------------------
// Sequence b as the kernels read it (KvCacheParams says where each field comes from): its queries, the first at
// token q_start of q, out and the lse; their count; its key count from leftpad on (len_k), the first at slot
// leftpad; and, without a block table, the element offset of its key rows in k and v (dense: its cache row;
// varlen: its first token).
struct Sequence {
  int q_start;
  int seqlen_q;
  int leftpad;
  int len_k;
  int64_t k_offset, v_offset;
};
FLARE_HD Sequence sequence_of(KvCacheParams const& p, int b) {
  Sequence s{0, p.seqlen_q, 0, 0, 0, 0};
  if (p.cu_seqlens_q != nullptr) {
    s.q_start = p.cu_seqlens_q[b];
    s.seqlen_q = p.cu_seqlens_q[b + 1] - s.q_start;
  }
  const int cache_len = p.cache_seqlens != nullptr ? p.cache_seqlens[b]
                        : p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]
                                                    : p.seqlen_cache;
  s.leftpad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
  s.len_k = cache_len + p.seqlen_new - s.leftpad;
  if (p.block_table == nullptr) {
    if (p.cu_seqlens_k != nullptr) {
      s.k_offset = int64_t{p.cu_seqlens_k[b]} * p.k.row_stride;
      s.v_offset = int64_t{p.cu_seqlens_k[b]} * p.v.row_stride;
    } else {
      const int64_t row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
      s.k_offset = row * p.k.batch_stride;
      s.v_offset = row * p.v.batch_stride;
    }
  }
  return s;
}

// ---- which queries and keys a CTA covers -------------------------------------------------------------------
// Packed row r of a (sequence, kv head) is query position r % seqlen_q of query head hk * group + r / seqlen_q.
struct QueryRange {
  int first, last;  // query positions present among the rows (first <= last)
};

// The query positions among packed rows [r0, r1) (r0 < r1): every position once the rows span seqlen_q of
// them, else the run from r0's to (r1 - 1)'s, which may wrap around.
FLARE_HD QueryRange queries_of_rows(int r0, int r1, int seqlen_q) {
  if (r1 - r0 >= seqlen_q) return {0, seqlen_q - 1};
  const int a = r0 % seqlen_q, b = (r1 - 1) % seqlen_q;
  if (a <= b) return {a, b};
  return {0, seqlen_q - 1};
}

// A half-open range of keys [begin, end) of one sequence (empty when begin >= end).
struct KeySpan {
  int begin, end;
  FLARE_HD int size() const { return end > begin ? end - begin : 0; }
};

// The keys any query of `queries` sees under `mask` (its seqlen_k is the sequence's key count).
FLARE_HD KeySpan keys_seen(policy::WindowMask const& mask, QueryRange queries) {
  const policy::KeyRange r = mask.keys_of_rows(queries.first, queries.last + 1);
  const int64_t first = r.first < 0 ? 0 : r.first;
  const int64_t end = r.last + 1 > mask.seqlen_k ? mask.seqlen_k : r.last + 1;
  if (end <= first) return {0, 0};
  return {static_cast<int>(first), static_cast<int>(end)};
}

// Split `split` of `splits` of the keys `all`: whole tiles of `tile` keys counted from all.begin, as even a
// share of them as can be; later splits may be empty. The splits are disjoint and cover `all` in order.
FLARE_HD KeySpan split_keys(KeySpan all, int splits, int split, int tile) {
  const int n = all.size();
  const int tiles = (n + tile - 1) / tile;
  const int per = (tiles + splits - 1) / splits;
  const int64_t b = int64_t{split} * per * tile, e = int64_t{split + 1} * per * tile;
  const int begin = all.begin + static_cast<int>(b < n ? b : n);
  const int end = all.begin + static_cast<int>(e < n ? e : n);
  return {begin, end};
}

// The tiles of a split's keys that warp `warp` of `warps` walks: tiles warp, warp + warps, ... of the
// kTileKeys-key tiles from keys.begin. tiles_of_warp counts them; the k-th starts at key first_key_of_tile.
FLARE_HD int tiles_of_warp(KeySpan keys, int warp, int warps) {
  const int tiles = (keys.size() + kTileKeys - 1) / kTileKeys;
  return tiles > warp ? (tiles - warp + warps - 1) / warps : 0;
}
FLARE_HD int first_key_of_tile(KeySpan keys, int warp, int warps, int k) {
  return keys.begin + (warp + k * warps) * kTileKeys;
}

// ---- the cache -----------------------------------------------------------------------------------------------
// Where cache slot `slot` of a sequence lives: a dense cache row (block = -1, row = slot), or block
// table_row[slot / block_size], row slot % block_size.
struct Slot {
  int64_t block;
  int64_t row;
};
FLARE_HD Slot slot_of(const int32_t* table_row, int block_size, int64_t slot) {
  if (table_row == nullptr) return {-1, slot};
  return {table_row[slot / block_size], slot % block_size};
}

// Whether the n slots from slot0 lie in one block of a paged cache (then one table read places all of them).
FLARE_HD bool slots_in_one_block(int64_t slot0, int n, int block_size) {
  return slot0 % block_size + n <= block_size;
}

}  // namespace flare::cuda::decode
