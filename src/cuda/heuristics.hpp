// heuristics.hpp — every host-side choice of the CUDA backend, in one place: which arch path runs a call (sm80
// or sm90), its head-dim tile, the shared-memory class of the sm80 kernels, the sm80 kernels' sequence-length
// thresholds, and the backward workspace with its deterministic dq split count.
//
// Each is a pure function of a plain problem description (detail::Problem, or the kernel params built from it),
// the device's properties and the kernels this build holds, returning a plain value or struct. None calls the
// CUDA runtime or reads the environment: src/cuda/backend.cu queries the device, reads the variables and passes
// the values in. The KV-cache pass's choices (decode tile, split count, workspace) are here too. No CUDA or CuTe
// header is included, so tests/cpp/test_cuda_heuristics.cpp checks every rule on
// the CPU; the launch code of the sm80 kernels calls the thresholds (src/cuda/sm80/configs.cuh).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "common/problem.hpp"
#include "cuda/common/params.hpp"
#include "cuda/instantiations/head_dims.hpp"
#include "flare/flare.h"

namespace flare::cuda {

// ---- inputs ------------------------------------------------------------------------------------------------

// What backend.cu learns of the call's device (cudaDeviceGetAttribute).
struct DeviceProps {
  int cc_major = 0;  // compute capability
  int cc_minor = 0;
  int sm_count = 1;
  int smem_per_block = 0;  // opt-in shared memory per block in bytes, cut by FLARE_CUDA_SMEM_LIMIT (smem_limit)
};

// The kernel units this build holds: the generated head-dim lists (head_dims.hpp) cut to FLARE_HEADDIMS and
// FLARE_SM90 (src/cuda/instantiations/dispatch.hpp says which).
struct BuiltKernels {
  std::span<const int> sm80_tiles;     // ascending
  std::span<const int> sm90_headdims;  // ascending; empty when the sm90 units are not built
  bool all_smem_configs = false;       // FLARE_CUDA_ALL_CONFIGS: the sm_90 cubin holds the small sm80 class too
};

// A generated head-dim list cut to the entries `built` keeps, as a constant for BuiltKernels.
template <size_t N>
struct HeadDimSubset {
  int dims[N] = {};
  size_t count = 0;
  constexpr HeadDimSubset(const int (&all)[N], bool (*built)(int)) {
    for (int d : all) {
      if (built(d)) dims[count++] = d;
    }
  }
  constexpr std::span<const int> span() const { return {dims, count}; }
};

// "64, 128" ("none" when empty), for messages.
std::string head_dims_string(std::span<const int> dims);

// ---- the environment's knobs, parsed (backend.cu passes getenv's value, null when unset) --------------------

// FLARE_CUDA_SMEM_LIMIT: the shared memory per block the kernels may use, the device's opt-in limit or less when
// the variable sets fewer bytes (tests run the small class on a large GPU with it). Malformed: ignored.
int smem_limit(int device_limit, const char* env);

// FLARE_CUDA_FWD_ROWS: 64 or 128 forces the sm80 forward's query rows per CTA (tests run both shapes whatever the
// lengths would pick); anything else is ignored: 0, sm80_forward_rows' rule.
int forced_forward_rows(const char* env);

// ---- which arch path runs a call -----------------------------------------------------------------------------

enum class ArchPath { kSm80, kSm90 };
const char* arch_path_name(ArchPath path);  // "sm80", "sm90"

// The path a call asks for: the params' arch_path, or for a forward call whose params say AUTO, what
// FLARE_CUDA_ARCH_PATH says (`env`: "sm80", "sm90", "auto"; unset or empty is auto). The backward has one path
// and takes no word from the variable. False when the variable has any other value and the call would read it:
// backend.cu refuses the call, since a knob that forces a path must not be misread as auto.
bool requested_arch_path(const detail::Problem& p, const char* env, flare_arch_path* out);

// Why the sm90 forward cannot run a call, or "" when it can. It runs: the forward pass, in a build with the sm90
// units, on a device of compute capability exactly 9.0 (sm_90a code runs nowhere else); fp16 or bf16;
// headdim == headdim_v, one of the sm90 head dims this build holds; dense batches (no cu_seqlens, no
// seqused_k); a kernel that fits the device's shared memory per block (`sm90_smem_bytes`: what the sm90 unit
// of the call's dtype and head dim takes, 0 where there is none). Causal, sliding windows, softcap, ALiBi,
// GQA/MQA and the LSE are all covered.
std::string sm90_rejection(const detail::Problem& p, const DeviceProps& dev, const BuiltKernels& built,
                           int sm90_smem_bytes);

// Varlen batches whose sequences hold fewer query tokens than this on average run faster on the sm80 path,
// though the sm90 path runs them: a 128-row sm90 tile of a short sequence is partly empty and walks few key
// blocks, so its prologue and epilogue weigh, where sm80 takes 64-row tiles for short work. Head dims up to 64
// (the least matmul work per tile) keep the sm80 path to longer sequences. Measured with
// bench/gpu/bench_varlen.py on an H100 (bench/results/gpu-varlen-2026-12-06-a926da4.json: mixes of 73, 303,
// 642 and 2520 tokens per sequence on average; docs/performance.md's H100 section).
inline constexpr int64_t kSm90VarlenMinMeanTokens = 512;
inline constexpr int64_t kSm90VarlenMinMeanTokensHd64 = 1024;

// A dense or varlen forward whose sm90 grid (batch x nheads x 128-row query tiles) fills at most
// 1 / kSm90SmallGridShare of the SMs over at least kSm90SmallGridMinKeys keys runs faster on the sm80 path,
// which splits the keys across CTAs (sm80_forward_splits) where the sm90 kernel leaves the SMs idle: one
// sequence of 32 heads, 32-128 query rows and 16K keys on an H100, 88-141 us against 186-190
// (bench/results/gpu-packed-2026-12-06-f297ed9.json; docs/tuning-sm90.md). Fewer rows than that mostly go to
// the KV-cache kernels first (forward_on_decode_kernels).
inline constexpr int64_t kSm90SmallGridShare = 4;
inline constexpr int64_t kSm90SmallGridMinKeys = 4096;

// Why AUTO gives a call the sm80 path although the sm90 path could run it (sm80 measured faster), or "" when
// the sm90 path is the faster: a varlen batch of short sequences (above), or a grid too small for the GPU
// (kSm90SmallGridShare). Forced sm90 still runs such a call.
std::string sm90_slower(const detail::Problem& p, const DeviceProps& dev);

struct PathChoice {
  ArchPath path = ArchPath::kSm80;
  std::string unsupported;  // not empty: the request cannot be met, the call fails with FLARE_UNSUPPORTED and this
  std::string fallback;     // sm80 under AUTO: why not sm90 (sm90_rejection's or sm90_slower's text); "" otherwise
};

// AUTO: the sm90 path where sm90_rejection and sm90_slower have nothing against the call, else the sm80 path,
// which runs every call on compute capability 8.0+ (checked apart: backend.cu names the GPU). SM80: the sm80
// path. SM90: the sm90 path where sm90_rejection allows it, or unsupported saying why not.
PathChoice choose_arch_path(const detail::Problem& p, flare_arch_path request, const DeviceProps& dev,
                            const BuiltKernels& built, int sm90_smem_bytes);

// ---- the sm80 path -------------------------------------------------------------------------------------------

// The head-dim tile of the sm80 kernels for a call: the smallest built tile >= max(headdim, headdim_v), 0 when
// there is none.
int sm80_tile(const detail::Problem& p, std::span<const int> tiles);

// Shared memory per block of the sm80 kernels of one (pass, dtype, tile) in each class (their entry points).
struct Sm80SmemBytes {
  int large = 0;
  int small = 0;
};

struct SmemChoice {
  SmemClass cls = SmemClass::kLarge;
  std::string unsupported;  // not empty: no class fits; the call fails with FLARE_UNSUPPORTED and this
};

// The shared-memory class of the sm80 kernels: small on sm_86 / sm_87 / sm_89 (the cubins those GPUs run hold
// only the small one, see sm80::body_here) and wherever the large one does not fit; else large. Unsupported
// when the class taken does not fit either, and for a backward that needs the small class on sm_90+, whose
// cubin lacks it unless the build has FLARE_CUDA_ALL_CONFIGS.
SmemChoice sm80_smem_class(detail::Pass pass, int tile, Sm80SmemBytes bytes, const DeviceProps& dev,
                           bool all_smem_configs);

// ---- wide heads (sm80 tiles above 256) -----------------------------------------------------------------
// A forward tile above kSm80WideTile splits the output's columns into slices of sm80_forward_slice(tile), one
// CTA each (the scores and softmax computed whole in every one): the output accumulator of a whole 512-wide
// row would not fit the registers. 384 -> 192, 512 and 576 -> 256 (576 is MLA's 576 / 512: two slices).
// The forward runs them in 64-row tiles (sm80_forward_rows). The backward splits the columns of dK, dV and dQ
// into sm80_backward_slice(tile): the tile in equal 64-column multiples of at most 256, as few as divide it
// (384 -> 192, 512 -> 256, 576 -> 192), since each slice repeats S = Q K^T and dP = dO V^T and no slice may
// be left with a sliver (576 in 256s would run a third CTA for 64 columns). src/cuda/sm80/configs.cuh compiles
// the kernels from these.
inline constexpr int kSm80WideTile = 256;
constexpr int sm80_forward_slice(int tile) {
  if (tile <= kSm80WideTile) return tile;
  return tile / 2 <= kSm80WideTile && tile / 2 % 64 == 0 ? tile / 2 : kSm80WideTile;
}
constexpr int sm80_backward_slice(int tile) {
  for (int n = 1; n <= tile / 64; ++n) {
    if (tile % n == 0 && tile / n % 64 == 0 && tile / n <= kSm80WideTile) return tile / n;
  }
  return tile;  // not reached for the generated tiles (multiples of 64 or at most 256)
}
// The CTAs per query tile a call of this tile and headdim_v takes: ceil(headdim_v / slice).
constexpr int sm80_forward_slices(int tile, int64_t headdim_v) {
  const int slice = sm80_forward_slice(tile);
  return headdim_v <= slice ? 1 : static_cast<int>((headdim_v + slice - 1) / slice);
}

// Query rows per CTA of the sm80 forward: 128 (the long shape, FwdShape::kLong) or 64 (kShort). 64-row tiles win
// where a 128-row CTA's work is short and, under a causal mask, a large part of it sits on the diagonal; the
// thresholds per head-dim tile and the timings behind them are in src/cuda/sm80/configs.cuh (forward_shape).
// p.forward_rows (FLARE_CUDA_FWD_ROWS) forces one. seqlen_q is the longest sequence (varlen: an upper bound).
inline int sm80_forward_rows(int head_dim_tile, AttnParams const& p) {
  const bool masked = windowed(p);
  if (p.forward_rows == 64 || head_dim_tile > kSm80WideTile) return 64;
  const int short_masked_up_to = head_dim_tile <= 64 && !shaped_scores(p) ? 512 : 1024;
  const int short_up_to = head_dim_tile < 128    ? (masked ? short_masked_up_to : 0)
                          : head_dim_tile == 128 ? 0
                          : !shaped_scores(p)    ? INT_MAX
                                                 : (masked ? 8192 : 1024);
  return p.forward_rows != 128 && p.seqlen_q <= short_up_to ? 64 : 128;
}

// ---- split-KV in the sm80 forward (AttnParams::num_splits) -------------------------------------------------
// FLARE_CUDA_FWD_SPLITS: a count >= 1 forces the sm80 forward's split count (tests check the split path on
// shapes the rule keeps whole); anything else is ignored: 0, sm80_forward_splits' rule.
int forced_forward_splits(const char* env);

// The split count of an sm80 forward call: 1 while its CTAs (batch x nheads x query tiles of block_m rows) fill
// at least 80% of the GPU's 2 x sm_count slots (two CTAs per SM); else the smallest count whose CTAs fill
// their waves of slots within 85% as well as the best count does (FlashAttention 2's rule), counting only
// counts that change the key tiles per split, each split at least kMinKeysPerForwardSplit keys, at most
// decode::kMaxSplits. Dropout calls: 1. `forced` > 0 (forced_forward_splits) replaces the rule, cut to the same
// limits. seqlen_q / seqlen_k: the longest sequences (varlen: upper bounds).
// slices: the CTAs per query tile (sm80_forward_slices), which count as CTAs.
inline constexpr int64_t kMinKeysPerForwardSplit = 128;
int sm80_forward_splits(const detail::Problem& p, int block_m, int sm_count, int forced, int slices = 1);

// The sm80 forward's query rows per CTA and split count together. A call of at most 64 query rows that splits
// takes 64-row tiles where its shape would take 128 (a 128-row tile of it is half empty; FlashAttention 2's
// split kernel runs 64-row tiles too), then its splits are counted for them: one sequence of 32 heads, 64 rows,
// 16K keys ran 92 us against 127; at 128 rows and more the 128-row shape kept its split count and ran faster
// (133 against 146-154 us; docs/tuning-sm90.md has the runs).
// natural_rows: sm80_forward_rows' choice; forced_rows / forced_splits: the knobs (0 = unset), which win.
struct Sm80ForwardGrid {
  int rows = 128;
  int splits = 1;
  int forward_rows = 0;  // AttnParams::forward_rows to launch with: forced_rows, 64 when taken here, else 0
};
Sm80ForwardGrid sm80_forward_grid(const detail::Problem& p, int natural_rows, int forced_rows, int sm_count,
                                  int forced_splits, int slices = 1);

// The workspace of an sm80 forward with `splits` > 1: the splits' fp32 outputs and lse, rows packed as the
// combine kernel reads them (AttnParams::part_rows = group x seqlen_q per (sequence, kv head)); all zero
// for one split.
struct FwdSplitLayout {
  int splits = 1;
  int64_t part_rows = 0;
  size_t part_o = 0, part_lse = 0;  // bytes, each 256-byte aligned
  size_t total() const { return part_o + part_lse; }
};
FwdSplitLayout sm80_forward_split_layout(const detail::Problem& p, int splits);

// Whether a forward call's rows see few enough key tiles for the kernel that never skips the output rescale
// (sm80 FwdConfigOf::PlainFewKeys). seqlen_k: the longest key sequence (varlen: an upper bound).
inline bool sm80_forward_few_keys(AttnParams const& p) { return p.seqlen_k <= 1024; }

// Whether a backward call takes the short-sequence configuration (sm80 BwdShortOf) where there is one: its
// longest query sequence (varlen: seqlen_q, an upper bound) is at most 512 rows.
inline bool sm80_backward_short(AttnParams const& p) { return p.seqlen_q <= 512; }

// The sm80 backward's fp32 workspace (BwdParams in params.hpp has the layout).
struct BwdLayout {
  int64_t q_rows = 0, k_rows = 0;
  int seqlen_q_rounded = 0, seqlen_k_rounded = 0;
  int splits = 1;                     // deterministic mode's dq buffers
  size_t dsum = 0, dq = 0, dkv = 0;   // bytes of each part (dkv: dk_accum + dv_accum)
  size_t total() const { return dsum + dq + dkv; }
};

// Deterministic mode's dq buffers: enough CTAs to fill the GPU twice over, at most 8 buffers (memory), at most
// one per key tile (of block_n keys: the backward kernel's key-tile height). 1 outside deterministic mode.
int sm80_dq_splits(const detail::Problem& p, int block_n, int sm_count);

// The workspace of an sm80 backward on head-dim tile `tile` (each part 256-byte aligned).
BwdLayout sm80_bwd_layout(const detail::Problem& p, int tile, int block_n, int sm_count);

// ---- the KV-cache pass (src/cuda/decode) ---------------------------------------------------------------------

// The decode attention's head-dim tile for a call: the smallest built decode tile >= max(headdim, headdim_v),
// 0 when there is none.
int decode_tile(const detail::Problem& p, std::span<const int> tiles);

// The packed query rows of one (sequence, kv head) (GQA heads x seqlen_q) and the CTAs along them.
int64_t decode_rows(const detail::Problem& p);
int64_t decode_row_chunks(const detail::Problem& p);

// The split count of a KV-cache call (p.num_splits; 0 = this rule). The host knows no sequence's length (the
// lengths live on the device and are never read back), so the rule takes the cache's capacity plus the keys
// appended, an upper bound. Explicit counts are honoured up to one split per 16-key tile of that bound and
// decode::kMaxSplits. The heuristic: one split while the (sequence, kv head, row chunk) CTAs already give every
// SM two (two CTAs of the kernel share an SM at head dim 128); else the count that finishes soonest when the
// CTAs run in rounds of two per SM, each round paying a CTA's fixed cost (wave quantisation: a count that
// spills into a second round mostly loses to a smaller one), none shorter than kMinKeysPerSplit keys and at
// most decode::kMaxSplits. kCtaFixedCostBytes: a CTA's fixed cost as the bytes it could have read meanwhile
// (about 5 us at an H200's bandwidth shared by 264 CTAs); an estimate, to be fitted on the GPU.
inline constexpr int64_t kMinKeysPerSplit = 256;
inline constexpr double kCtaFixedCostBytes = 90.0 * 1024;
int decode_splits(const detail::Problem& p, int sm_count);

// The KV-cache pass's workspace (each part 256-byte aligned): the rotated q (rotary calls) in q's dtype,
// (batch, seqlen_q, nheads, headdim), and with splits > 1 the splits' fp32 outputs and lse (KvCacheParams
// in src/cuda/decode/params.hpp has their layout).
struct DecodeLayout {
  int splits = 1;
  int64_t row_chunks = 1;
  size_t q_rot = 0, part_o = 0, part_lse = 0;  // bytes of each part
  size_t total() const { return q_rot + part_o + part_lse; }
};
DecodeLayout decode_layout(const detail::Problem& p, int sm_count);

// ---- forwards that the KV-cache kernels run ------------------------------------------------------------------
// The KV-cache kernels pack the query rows of the heads that share a kv head into 16-row tiles (each K and V
// byte is read once for all of them) and split long key ranges across CTAs, which the forward kernels do not:
// they give each query head its own 128-row tile (sm90; sm80 64 or 128) and one CTA per tile. A forward call
// runs on the KV-cache kernels:
//   - a paged varlen forward (block_table), always: the forward kernels read contiguous keys only;
//   - under AUTO, a dense or varlen forward of few query rows, by counting the walks over one (sequence, kv
//     head)'s keys each family makes (seqlen_q: the longest sequence's for varlen):
//       chunks = ceil(group x seqlen_q / 16)     the KV-cache kernels' CTAs (before splits)
//       tiles  = group x ceil(seqlen_q / 128)    the forward's query tiles
//       short  = max(1, sm_count / (batch x nheads x ceil(seqlen_q / 128)))  how far the forward's grid falls
//                short of one CTA per SM (the KV-cache kernels fill the GPU with splits)
//     it takes them when chunks == 1, or chunks x cost <= tiles x short, cost 2 (an mma.sync walk against a
//     wgmma one) or 4 past head dim 128 (two warps per CTA there). Where the sm80 forward would split the keys
//     instead (sm90_slower's small grid, 4096+ keys), short is at most kPackedShortGridCap: measured at batch
//     1, 32 heads and 16K keys (bench/results/gpu-packed-2026-12-06-f297ed9.json), 32 query rows ran 88-111 us
//     split against 126-134 packed. On an H100 against the sm90 forward
//     (bench/results/gpu-packed-2026-12-06-e025927.json; docs/tuning-sm90.md) the rule picks the faster family
//     within 8% on every measured shape; on sm80-family GPUs it is applied as measured there.
// Neither with dropout (the KV-cache kernels have none) or a head dim past the widest decode tile built.
inline constexpr int64_t kPackedWalkCost = 2;
inline constexpr double kPackedShortGridCap = 2.0;
inline constexpr int64_t kPackedWalkCostWide = 4;

// Why the KV-cache kernels cannot run forward call p, or "" when they can (dropout; no decode tile for its head
// dims in this build).
std::string decode_forward_rejection(const detail::Problem& p, std::span<const int> decode_tiles);

// Whether forward call p runs on the KV-cache kernels (the rule above). `request`: the resolved arch path
// request (requested_arch_path); a forced sm80 or sm90 path keeps a dense or unpaged varlen call on its forward
// kernels, so both stay testable on every shape.
bool forward_on_decode_kernels(const detail::Problem& p, flare_arch_path request, std::span<const int> decode_tiles,
                               int sm_count);

// Forward call p as a KV-cache problem for those kernels: no append, no rotary; the keys are k / v as they are
// (dense: every sequence's seqlen_k keys; varlen: cu_seqlens_k spans, or seqused_k; paged: the block table's
// capacity bounds them), so decode_splits and decode_layout plan it like a KV-cache call.
detail::Problem decode_view(const detail::Problem& p);

}  // namespace flare::cuda
