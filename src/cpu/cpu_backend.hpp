// cpu_backend.hpp — the CPU backend's entry points, called by src/api after validation.
//
// Each takes a validated Problem (src/common/problem.hpp) and returns FLARE_OK, or FLARE_OUT_OF_MEMORY
// (with flare_last_error set) when scratch cannot be had. Outputs are written only after scratch is secured.
#pragma once

#include <cstddef>

#include "common/merge_problem.hpp"
#include "common/problem.hpp"

namespace flare::cpu {

// The head dims the CPU backend takes (src/api checks them): headdim (q, k) in 1..kMaxHeaddim and headdim_v
// (v, out) in 1..kMaxHeaddimV, in any combination. 512 covers the widest heads of dense models; 576 / 512 is
// DeepSeek's MLA in its absorbed form (q and k: the 512-wide latent plus 64 rotary dims; v: the latent). Every
// engine sizes its tiles and packs by the call's head dims; only a few fixed rows (a zero row for unused keys'
// gradients, a row held in fp64) are sized by these bounds.
inline constexpr int64_t kMaxHeaddim = 576;
inline constexpr int64_t kMaxHeaddimV = 512;
static_assert(kMaxHeaddimV <= kMaxHeaddim, "rows sized kMaxHeaddim hold a head of either width");

// The FMA engines (forward.hpp, backward.hpp) have tile shapes for heads up to kNarrowHeaddim and for wider
// ones, each its own instantiation: a tile tuned at head dim 128 keeps K, V and Q blocks that overflow L2 at
// 512, and a tile cut for 512 would slow the common narrow heads.
inline constexpr int64_t kNarrowHeaddim = 256;
enum class HeadWidth { kNarrow, kWide };
inline HeadWidth head_width(const detail::Problem& p) {
  return p.headdim > kNarrowHeaddim || p.headdim_v > kNarrowHeaddim ? HeadWidth::kWide : HeadWidth::kNarrow;
}

flare_status forward(const detail::Problem& p);
flare_status backward(const detail::Problem& p);
// Appends k_new/v_new (rotated if asked) into the cache, then attends q (rotated if asked) to it.
flare_status kvcache(const detail::Problem& p);

// flare_merge_states: the LSE merge of two partial results (merge.cpp). Needs no scratch.
flare_status merge_states(const detail::MergeProblem& p);

// Whether a KV-cache call runs the decode path (decode.hpp: GQA heads packed, split-KV) instead of the
// forward's tiles: few query rows per (sequence, kv head) — the group's heads x seqlen_q at most
// kDecodeMaxRows — in fp32/fp16/bf16 (fp64, the checking dtype, keeps the forward).
inline constexpr int64_t kDecodeMaxRows = 64;
// A dense forward takes the decode path too when each kv head has at most kForwardDecodeMaxRows query rows
// (decode-like calls: one or a few queries against many keys), where packing the keys for the forward's
// tiles would cost more than the rows' products; not with dropout, which only the tiles draw, and not varlen:
// the decode path gives every sequence the call's seqlen_q rows, as a KV-cache call has.
inline constexpr int64_t kForwardDecodeMaxRows = 8;
inline bool use_decode_path(const detail::Problem& p) {
  if (p.dtype == FLARE_DTYPE_F64) return false;
  const int64_t rows = p.nheads / p.nheads_k * p.seqlen_q;
  if (p.pass == detail::Pass::kKvCache) return rows <= kDecodeMaxRows;
  return p.pass == detail::Pass::kForward && !p.varlen && p.dropout_p == 0.0f && rows <= kForwardDecodeMaxRows;
}

// KV cache helpers (kvcache.cpp): scratch beyond the forward pass's, and the step before attending —
// appends k_new/v_new into the cache (rotated if asked) and returns the problem to attend with (q replaced by
// its rotated copy in scratch when rotary is asked), on nt threads.
// kvcache_extra_scratch is SIZE_MAX when the size does not fit in size_t.
size_t kvcache_extra_scratch(const detail::Problem& p);
detail::Problem kvcache_prepare(const detail::Problem& p, char* scratch, int nt);

// The most threads a call may ask for (exec.num_threads): the larger of kMaxThreadsFloor and the processor
// count, and never past OpenMP's thread limit. Far more threads than processors only cost memory (scratch
// and a stack per thread), and a team libgomp cannot create ends the process instead of failing the call.
inline constexpr int kMaxThreadsFloor = 1024;
int max_threads();

// Scratch bytes the pass allocates for this problem (what *_workspace_size reports, and what a caller's
// workspace must hold), or FLARE_OUT_OF_MEMORY with the figures when that size does not fit in size_t.
flare_status workspace_size(const detail::Problem& p, size_t* bytes);

// "amx", "avx512bf16", "avx512", "avx2" or "generic": the SIMD level in use (see flare_cpu_isa in flare.h).
const char* isa_name();

}  // namespace flare::cpu
