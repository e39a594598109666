// heuristics.cpp — the host-side choices of the CUDA backend (heuristics.hpp says what each one decides). Pure
// C++, compiled into every build, so ctest checks it without nvcc.
#include "cuda/heuristics.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "common/error.hpp"
#include "cuda/decode/plan.hpp"
#include "cuda/sm90/tile_shape.hpp"

namespace flare::cuda {
namespace {

using detail::cat;
using detail::dtype_name;
using detail::Pass;
using detail::Problem;

constexpr size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// The sm90 forward's CTAs: batch x nheads x 128-row query tiles.
int64_t sm90_ctas(const Problem& p) { return p.batch * p.nheads * ((p.seqlen_q + 127) / 128); }

// Whether that grid fills at most 1 / kSm90SmallGridShare of the SMs over kSm90SmallGridMinKeys keys or more
// (sm90_slower's small grid, which the sm80 forward runs with its keys split).
bool sm90_grid_small(const Problem& p, int sm_count) {
  return p.seqlen_k >= kSm90SmallGridMinKeys && sm90_ctas(p) * kSm90SmallGridShare <= std::max(sm_count, 1);
}

}  // namespace

std::string head_dims_string(std::span<const int> dims) {
  std::string s;
  for (int d : dims) s += cat(s.empty() ? "" : ", ", d);
  return s.empty() ? "none" : s;
}

int smem_limit(int device_limit, const char* env) {
  if (env == nullptr || *env == '\0') return device_limit;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  if (*end != '\0' || v <= 0) return device_limit;  // malformed: ignored, as an unset variable
  return static_cast<int>(std::min<long>(v, device_limit));
}

int forced_forward_rows(const char* env) {
  if (env == nullptr) return 0;
  const std::string_view v(env);
  return v == "64" ? 64 : v == "128" ? 128 : 0;  // anything else: ignored, as an unset variable
}

const char* arch_path_name(ArchPath path) { return path == ArchPath::kSm90 ? "sm90" : "sm80"; }

bool requested_arch_path(const Problem& p, const char* env, flare_arch_path* out) {
  *out = p.arch_path;
  if (p.arch_path != FLARE_ARCH_PATH_AUTO || p.pass != Pass::kForward) return true;
  const std::string_view v = env == nullptr ? std::string_view() : std::string_view(env);
  if (v == "sm80") {
    *out = FLARE_ARCH_PATH_SM80;
  } else if (v == "sm90") {
    *out = FLARE_ARCH_PATH_SM90;
  } else if (!v.empty() && v != "auto") {
    return false;
  }
  return true;
}

std::string sm90_rejection(const Problem& p, const DeviceProps& dev, const BuiltKernels& built,
                           int sm90_smem_bytes) {
  if (p.pass == Pass::kBackward) return "the backward has no sm90 kernels: it runs on the sm80 path";
  if (p.pass == Pass::kKvCache) return "the KV-cache pass has no sm90 kernels";
  if (built.sm90_headdims.empty()) {
    return "this build has no sm90 kernels (configure with -DFLARE_SM90=ON and 90 in FLARE_ARCHS)";
  }
  if (dev.cc_major != 9 || dev.cc_minor != 0) {
    return cat("cuda:", p.device.index, " is sm_", dev.cc_major, dev.cc_minor,
               ": the sm90 kernels (sm_90a code) run on compute capability 9.0 only (H100, H200)");
  }
  if (p.dtype != FLARE_DTYPE_F16 && p.dtype != FLARE_DTYPE_BF16) {
    return cat("dtype ", dtype_name(p.dtype), ": the sm90 forward takes fp16 or bf16");
  }
  if (p.headdim != p.headdim_v && sm90::forward_tile(static_cast<int>(p.headdim), static_cast<int>(p.headdim_v))
                                        .block_m == 0) {
    return cat("headdim ", p.headdim, " with headdim_v ", p.headdim_v,
               ": the sm90 forward takes equal head dims, or headdim 192 with headdim_v 128");
  }
  if (std::find(built.sm90_headdims.begin(), built.sm90_headdims.end(), p.headdim) == built.sm90_headdims.end()) {
    return cat("head dim ", p.headdim, ": the sm90 forward of this build has head dims ",
               head_dims_string(built.sm90_headdims), " (exactly)");
  }
  if (p.dropout_p > 0.0f) return "dropout takes the sm80 path";
  if (sm90_smem_bytes > dev.smem_per_block) {
    return cat("the sm90 forward for head dim ", p.headdim, " needs ", sm90_smem_bytes,
               " bytes of shared memory per block but this GPU allows ", dev.smem_per_block);
  }
  return {};
}

std::string sm90_slower(const Problem& p, const DeviceProps& dev) {
  if (p.batch <= 0) return {};
  if (p.dropout_p == 0.0f && sm90_grid_small(p, dev.sm_count)) {
    return cat("the sm90 grid (", sm90_ctas(p), " CTAs) would leave most of the ", dev.sm_count, " SMs idle over ",
               p.seqlen_k, " keys: the sm80 path splits the keys across CTAs");
  }
  if (!p.varlen) return {};
  const int64_t mean = p.total_q / p.batch;
  const int64_t min_mean = p.headdim <= 64 ? kSm90VarlenMinMeanTokensHd64 : kSm90VarlenMinMeanTokens;
  if (mean >= min_mean) return {};
  return cat("a varlen batch of short sequences (", mean, " query tokens on average, under ", min_mean,
             " at head dim ", p.headdim, ") runs faster on the sm80 path");
}

PathChoice choose_arch_path(const Problem& p, flare_arch_path request, const DeviceProps& dev,
                            const BuiltKernels& built, int sm90_smem_bytes) {
  PathChoice c;
  if (request == FLARE_ARCH_PATH_SM80) return c;
  std::string why_not = sm90_rejection(p, dev, built, sm90_smem_bytes);
  if (why_not.empty() && request == FLARE_ARCH_PATH_AUTO) why_not = sm90_slower(p, dev);
  if (why_not.empty()) {
    c.path = ArchPath::kSm90;
  } else if (request == FLARE_ARCH_PATH_SM90) {
    c.unsupported = cat("the sm90 path was asked for (arch_path, or FLARE_CUDA_ARCH_PATH=sm90) but ", why_not,
                        ": ask for auto or sm80 to run this call");
  } else {
    c.fallback = std::move(why_not);
  }
  return c;
}

int sm80_tile(const Problem& p, std::span<const int> tiles) {
  const int64_t width = std::max(p.headdim, p.headdim_v);
  for (int d : tiles) {
    if (d >= width) return d;
  }
  return 0;
}

SmemChoice sm80_smem_class(Pass pass, int tile, Sm80SmemBytes bytes, const DeviceProps& dev,
                           bool all_smem_configs) {
  const char* pass_name = pass == Pass::kBackward ? "the backward" : "the forward";
  const int limit = dev.smem_per_block;
  const bool small_arch = dev.cc_major == 8 && dev.cc_minor != 0;
  SmemChoice c;
  c.cls = small_arch || bytes.large > limit ? SmemClass::kSmall : SmemClass::kLarge;
  const int needed = c.cls == SmemClass::kLarge ? bytes.large : bytes.small;
  if (needed > limit) {
    c.unsupported = cat(pass_name, " kernel for head dim tile ", tile, " needs ", needed,
                        " bytes of shared memory per block but this GPU allows ", limit);
  } else if (!all_smem_configs && pass == Pass::kBackward && c.cls == SmemClass::kSmall && dev.cc_major >= 9) {
    c.unsupported = cat(pass_name, " kernel for head dim tile ", tile, " needs ", bytes.large,
                        " bytes of shared memory per block but this GPU allows ", limit,
                        "; the kernels that fit (<= ", kSmallSmemBytes,
                        " bytes) are compiled for sm_8x only (or with FLARE_CUDA_ALL_CONFIGS=ON)");
  }
  return c;
}

int sm80_dq_splits(const Problem& p, int block_n, int sm_count) {
  if (!p.deterministic) return 1;
  const int64_t n_blocks = (p.seqlen_k + block_n - 1) / block_n;
  const int64_t heads = std::max<int64_t>(1, p.batch * p.nheads);
  const int64_t want = (2 * int64_t{sm_count} + heads - 1) / heads;
  return static_cast<int>(std::clamp<int64_t>(std::min(want, n_blocks), 1, 8));
}

BwdLayout sm80_bwd_layout(const Problem& p, int tile, int block_n, int sm_count) {
  BwdLayout l;
  auto round128 = [](int64_t x) { return (x + kRowPad - 1) / kRowPad * kRowPad; };
  l.seqlen_q_rounded = static_cast<int>(round128(p.seqlen_q));
  l.seqlen_k_rounded = static_cast<int>(round128(p.seqlen_k));
  l.q_rows = p.varlen ? round128(p.total_q + p.batch * kRowPad) : p.batch * l.seqlen_q_rounded;
  l.k_rows = p.varlen ? round128(p.total_k + p.batch * kRowPad) : p.batch * l.seqlen_k_rounded;
  l.splits = sm80_dq_splits(p, block_n, sm_count);
  l.dsum = align256(sizeof(float) * p.nheads * l.q_rows);
  l.dq = align256(sizeof(float) * l.splits * p.nheads * l.q_rows * tile);
  l.dkv = p.nheads != p.nheads_k ? 2 * align256(sizeof(float) * p.nheads * l.k_rows * tile) : 0;
  return l;
}

int decode_tile(const Problem& p, std::span<const int> tiles) {
  const int64_t need = std::max(p.headdim, p.headdim_v);
  for (int d : tiles) {
    if (d >= need) return d;
  }
  return 0;
}

int64_t decode_rows(const Problem& p) { return p.nheads / std::max<int64_t>(1, p.nheads_k) * p.seqlen_q; }

int64_t decode_row_chunks(const Problem& p) {
  return std::max<int64_t>(1, (decode_rows(p) + decode::kRows - 1) / decode::kRows);
}

int decode_splits(const Problem& p, int sm_count) {
  const int64_t keys = p.seqlen_cache + p.seqlen_new;
  const int64_t tiles = std::max<int64_t>(1, (keys + decode::kTileKeys - 1) / decode::kTileKeys);
  const int64_t most = std::min<int64_t>(tiles, decode::kMaxSplits);
  if (p.num_splits > 0) return static_cast<int>(std::clamp<int64_t>(p.num_splits, 1, most));
  const int64_t ctas = p.batch * p.nheads_k * decode_row_chunks(p);
  const int64_t target = 2 * int64_t{std::max(sm_count, 1)};
  if (ctas == 0 || ctas >= target) return 1;
  // A split count s runs the CTAs in rounds(s) = ceil(ctas * s / target) rounds, each reading 1/s of the keys
  // and paying a CTA's fixed cost (start, pipeline fill, epilogue): time(s) ~ rounds(s) * (1/s + fixed), with
  // fixed = kCtaFixedCostBytes / (the K and V bytes of one sequence's kv head). The smallest count within 2% of
  // the fastest wins. E.g. 64 CTAs on 132 SMs at 32K keys: 4 splits (256 CTAs, one round), not 5 (320: two).
  const int64_t limit = std::min(most, std::max<int64_t>(1, keys / kMinKeysPerSplit));
  const double kv_bytes = static_cast<double>(std::max<int64_t>(keys, 1)) * static_cast<double>(p.headdim + p.headdim_v) * 2.0;
  const double fixed = kCtaFixedCostBytes / kv_bytes;
  const auto time = [&](int64_t s) {
    const double rounds = static_cast<double>((ctas * s + target - 1) / target);
    return rounds * (1.0 / static_cast<double>(s) + fixed);
  };
  double fastest = time(1);
  for (int64_t s = 2; s <= limit; ++s) fastest = std::min(fastest, time(s));
  int64_t best = 1;
  while (best < limit && time(best) > 1.02 * fastest) ++best;
  return static_cast<int>(best);
}

DecodeLayout decode_layout(const Problem& p, int sm_count) {
  DecodeLayout l;
  l.splits = decode_splits(p, sm_count);
  l.row_chunks = decode_row_chunks(p);
  if (p.rotary_dim > 0) {
    l.q_rot = align256(static_cast<size_t>(p.batch * p.seqlen_q * p.nheads * p.headdim) * 2);  // fp16 / bf16
  }
  if (l.splits > 1) {
    const size_t parts = static_cast<size_t>(p.batch * p.nheads_k * decode_rows(p) * l.splits);
    l.part_o = align256(parts * static_cast<size_t>(p.headdim_v) * sizeof(float));
    l.part_lse = align256(parts * sizeof(float));
  }
  return l;
}

std::string decode_forward_rejection(const Problem& p, std::span<const int> decode_tiles) {
  if (p.dropout_p > 0.0f) return "the KV-cache kernels have no dropout";
  if (decode_tile(p, decode_tiles) == 0) {
    return cat("head dim ", std::max(p.headdim, p.headdim_v), " has no KV-cache kernel in this build (decode tiles "
               "built: ", head_dims_string(decode_tiles), ")");
  }
  return {};
}

bool forward_on_decode_kernels(const Problem& p, flare_arch_path request, std::span<const int> decode_tiles,
                               int sm_count) {
  if (p.pass != Pass::kForward) return false;
  if (p.block_table != nullptr) return true;  // paged: nothing else reads it (decode_forward_rejection refuses)
  if (request != FLARE_ARCH_PATH_AUTO || !decode_forward_rejection(p, decode_tiles).empty()) return false;
  if (p.batch <= 0 || p.nheads <= 0 || p.seqlen_q <= 0) return false;  // nothing runs either way
  const int64_t chunks = decode_row_chunks(p);
  if (chunks == 1) return true;
  const int64_t group = p.nheads / std::max<int64_t>(1, p.nheads_k);
  const int64_t q_tiles = (p.seqlen_q + 127) / 128;
  double short_by = std::max(1.0, static_cast<double>(std::max(sm_count, 1)) / static_cast<double>(sm90_ctas(p)));
  // Where the sm80 forward would split the keys instead (sm90_slower's small grid), the forward fills the GPU
  // too, and the allowance for its short grid stops at kPackedShortGridCap.
  if (sm90_grid_small(p, sm_count)) short_by = std::min(short_by, kPackedShortGridCap);
  const int64_t cost = decode_tile(p, decode_tiles) > 128 ? kPackedWalkCostWide : kPackedWalkCost;
  return static_cast<double>(chunks * cost) <= static_cast<double>(group * q_tiles) * short_by;
}

Problem decode_view(const Problem& p) {
  Problem d = p;
  d.pass = Pass::kKvCache;
  d.seqlen_new = 0;
  d.rotary_dim = 0;
  d.cache_batch_idx = nullptr;
  d.cache_leftpad = nullptr;
  d.cache_seqlens = p.seqused_k;  // varlen: seqused_k, else the cu_seqlens_k spans (sequence_of)
  // The key bound of decode_splits (and a dense call's key count): seqlen_k, cut to a paged table's capacity.
  d.seqlen_cache = p.block_table != nullptr ? std::min(p.seqlen_k, p.seqlen_cache) : p.seqlen_k;
  if (!p.varlen) {
    d.cu_seqlens_q = d.cu_seqlens_k = nullptr;
  }
  return d;
}

int forced_forward_splits(const char* env) {
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  return *end == '\0' && v >= 1 && v <= decode::kMaxSplits ? static_cast<int>(v) : 0;  // else ignored
}

int sm80_forward_splits(const Problem& p, int block_m, int sm_count, int forced, int slices) {
  if (p.pass != Pass::kForward || p.dropout_p > 0.0f || p.seqlen_q <= 0 || p.seqlen_k <= 0) return 1;
  const int64_t limit = std::clamp<int64_t>(p.seqlen_k / kMinKeysPerForwardSplit, 1, decode::kMaxSplits);
  if (forced > 0) return static_cast<int>(std::min<int64_t>(forced, limit));
  const int64_t ctas =
      p.batch * p.nheads * ((p.seqlen_q + block_m - 1) / std::max(block_m, 1)) * std::max(slices, 1);
  const int64_t slots = 2 * int64_t{std::max(sm_count, 1)};
  if (ctas == 0 || 10 * ctas >= 8 * slots) return 1;
  // Efficiency of s splits: the share of the slots its waves of CTAs keep busy.
  const auto efficiency = [&](int64_t s) {
    const double waves = static_cast<double>(ctas * s) / static_cast<double>(slots);
    return waves / std::ceil(waves);
  };
  const int64_t tiles = (p.seqlen_k + kMinKeysPerForwardSplit - 1) / kMinKeysPerForwardSplit;
  const auto eligible = [&](int64_t s) {  // s changes the key tiles per split
    return s == 1 || (tiles + s - 1) / s != (tiles + s - 2) / (s - 1);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= limit; ++s) {
    if (eligible(s)) best = std::max(best, efficiency(s));
  }
  for (int64_t s = 1; s <= limit; ++s) {
    if (eligible(s) && efficiency(s) >= 0.85 * best) return static_cast<int>(s);
  }
  return 1;
}

Sm80ForwardGrid sm80_forward_grid(const Problem& p, int natural_rows, int forced_rows, int sm_count,
                                  int forced_splits, int slices) {
  Sm80ForwardGrid g;
  g.rows = forced_rows != 0 ? forced_rows : natural_rows;
  g.forward_rows = forced_rows;
  g.splits = sm80_forward_splits(p, g.rows, sm_count, forced_splits, slices);
  if (g.splits > 1 && g.rows == 128 && forced_rows == 0 && p.seqlen_q <= 64) {
    g.rows = g.forward_rows = 64;
    g.splits = sm80_forward_splits(p, 64, sm_count, forced_splits, slices);
  }
  return g;
}

FwdSplitLayout sm80_forward_split_layout(const Problem& p, int splits) {
  FwdSplitLayout l;
  l.splits = splits;
  if (splits <= 1) return l;
  l.part_rows = p.nheads / std::max<int64_t>(1, p.nheads_k) * p.seqlen_q;
  const size_t parts = static_cast<size_t>(p.batch * p.nheads_k * l.part_rows * splits);
  l.part_o = align256(parts * static_cast<size_t>(p.headdim_v) * sizeof(float));
  l.part_lse = align256(parts * sizeof(float));
  return l;
}

}  // namespace flare::cuda
