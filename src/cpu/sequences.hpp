// sequences.hpp — where the rows of one (sequence, head) live: dense batches, varlen (cu_seqlens) and the
// KV cache (cache_batch_idx, leftpad, paged block_table) all reduce to a Sequence and RowPtrs.
// Per-ISA like the kernels (see simd.hpp for why).
#pragma once

#include "common/attention_policy.hpp"
#include "common/problem.hpp"
#include "cpu/simd.hpp"

namespace flare::cpu::FLARE_ISA {

using detail::Operand;
using detail::Pass;
using detail::Problem;

// Row t of one head of one sequence. Dense rows: base + t * row_bytes. Paged rows: block
// blocks[t / block_size], row t % block_size. offset shifts logical row 0 (cache_leftpad).
struct RowPtr {
  char* base = nullptr;
  int64_t row_bytes = 0;
  const int32_t* blocks = nullptr;
  int64_t block_size = 0;
  int64_t block_bytes = 0;
  int64_t offset = 0;

  char* row(int64_t t) const {
    t += offset;
    if (blocks == nullptr) return base + t * row_bytes;
    return base + blocks[t / block_size] * block_bytes + (t % block_size) * row_bytes;
  }
};

// Requests one input row (bytes long) into the caches ahead of its copy into a pack. Rows of one head sit
// a head stride apart (often a power of two of 1 KiB or more), a pattern the hardware prefetchers follow
// poorly across pages, and the packing copies are bound by these reads.
inline constexpr int64_t kPrefetchRows = 8;

// Whether the packs request their input rows ahead (prefetch_ahead, RowsAhead). Not at the AMX level: on
// Sapphire Rapids, whose prefetchers follow these rows, the requests cost more than they saved, where on Zen 4
// (the avx512bf16 level) they pay (docs/tuning-cpu.md).
#if defined(FLARE_AMX_LEVEL)
inline constexpr bool kRequestPackRows = false;
#else
inline constexpr bool kRequestPackRows = true;
#endif

// The copy of row i of `rows` (n rows) is under way: request row i + kPrefetchRows, where there is one.
inline void prefetch_ahead(const RowPtr& rows, int64_t i, int64_t n, int64_t bytes) {
  if (kRequestPackRows && i + kPrefetchRows < n) prefetch_bytes(rows.row(i + kPrefetchRows), bytes);
}

// The input rows a pack will copy next (up to three operands, rows [first, first + count)), requested into
// the L2 cache a few at a time while other work runs, so that the pack reads them from the cache instead of
// waiting on memory one row at a time. Empty (count 0) requests nothing.
struct RowsAhead {
  static constexpr int kMaxOperands = 3;
  RowPtr rows[kMaxOperands] = {};
  int64_t bytes[kMaxOperands] = {};
  int operands = 0;
  int64_t first = 0, count = 0;

  void add(const RowPtr& r, int64_t row_bytes) {
    rows[operands] = r;
    bytes[operands++] = row_bytes;
  }
  // Requests row first + i of every operand (nothing past count).
  void request(int64_t i) const {
    if (!kRequestPackRows || i >= count) return;
    for (int a = 0; a < operands; ++a) prefetch_bytes<Fetch::kL2>(rows[a].row(first + i), bytes[a]);
  }
  // Requests part `part` of `parts` equal parts of the rows.
  void request_part(int64_t part, int64_t parts) const {
    for (int64_t i = count * part / parts; i < count * (part + 1) / parts; ++i) request(i);
  }
};

struct Sequence {
  int64_t b = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t stored_k = 0;  // key rows the sequence owns in k/v (varlen: cu_seqlens_k span, >= seqused_k)
  int64_t q_token = 0;   // global token index of query 0 (varlen), else 0
  int64_t k_token = 0;   // global token index of key 0 (varlen), else 0
  int64_t cache_row = 0; // kv cache: the batch row of a dense cache
  int64_t leftpad = 0;   // kv cache: position of key 0

  policy::WindowMask mask(const Problem& p) const {
    return {seqlen_q, seqlen_k, p.score.window_left, p.score.window_right};
  }
};

inline Sequence sequence_of(const Problem& p, int64_t b) {
  Sequence s;
  s.b = b;
  if (p.pass == Pass::kKvCache) {
    s.seqlen_q = p.seqlen_q;
    s.leftpad = p.cache_leftpad ? p.cache_leftpad[b] : 0;
    const int64_t cached = p.cache_seqlens ? p.cache_seqlens[b] : p.seqlen_cache;
    s.seqlen_k = cached + p.seqlen_new - s.leftpad;
    s.cache_row = p.cache_batch_idx ? p.cache_batch_idx[b] : b;
  } else if (p.varlen) {
    s.q_token = p.cu_seqlens_q[b];
    s.seqlen_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    if (p.block_table != nullptr) {  // paged keys: the sequence's own blocks, from position 0
      s.seqlen_k = p.seqused_k ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
      s.stored_k = s.seqlen_k;
      return s;
    }
    s.k_token = p.cu_seqlens_k[b];
    s.stored_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    s.seqlen_k = p.seqused_k ? p.seqused_k[b] : s.stored_k;
    return s;
  } else {
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
  }
  s.stored_k = s.seqlen_k;
  return s;
}

// Bytes between consecutive indices of a dimension with this stride. Validation bounds (extent - 1) * stride
// times the element size, so only a dimension of extent 1 (never stepped along) can have a stride whose byte
// size does not fit in int64; its step is then left at 0 instead of overflowing.
inline int64_t stride_bytes(int64_t stride, int64_t es) {
  int64_t bytes = 0;
  return __builtin_mul_overflow(stride, es, &bytes) ? 0 : bytes;
}

// The most queries and keys any one sequence of the call has: what per-sequence scratch is sized by. Not the
// problem's seqlen_q / seqlen_k, which are bounds (a KV cache's capacity, varlen's max_seqlen) that can far
// exceed what a call uses. O(batch), reading the index tensors (on the CPU, validated).
struct Lengths {
  int64_t queries = 0, keys = 0;
};
inline Lengths longest_sequence(const Problem& p) {
  if (p.pass != Pass::kKvCache && !p.varlen) return {p.seqlen_q, p.seqlen_k};
  Lengths most;
  for (int64_t b = 0; b < p.batch; ++b) {
    const Sequence s = sequence_of(p, b);
    most.queries = smax(most.queries, s.seqlen_q);
    most.keys = smax(most.keys, s.seqlen_k);
  }
  return most;
}

// Rows of a query-side operand (q, out, dout, dq): dense by batch, varlen by token.
inline RowPtr query_rows(const Problem& p, const Operand& op, const Sequence& s, int64_t h) {
  const int64_t es = dtype_size(p.dtype);
  RowPtr r;
  r.base = static_cast<char*>(op.data) + (s.b * op.batch_stride + s.q_token * op.row_stride + h * op.head_stride) * es;
  r.row_bytes = stride_bytes(op.row_stride, es);
  return r;
}

// Rows of a key-side operand (k, v, dk, dv), including the KV cache's batch index, leftpad and paging.
inline RowPtr key_rows(const Problem& p, const Operand& op, const Sequence& s, int64_t hk) {
  const int64_t es = dtype_size(p.dtype);
  RowPtr r;
  r.row_bytes = stride_bytes(op.row_stride, es);
  char* data = static_cast<char*>(op.data);
  if (p.block_table != nullptr) {  // a paged KV cache (flare_fwd_kvcache, or paged varlen: leftpad 0)
    r.offset = s.leftpad;
    r.base = data + hk * op.head_stride * es;
    r.blocks = p.block_table + s.b * p.block_table_stride;
    r.block_size = p.block_size;
    r.block_bytes = stride_bytes(op.batch_stride, es);
    return r;
  }
  if (p.pass == Pass::kKvCache) {
    r.offset = s.leftpad;
    r.base = data + (s.cache_row * op.batch_stride + hk * op.head_stride) * es;
    return r;
  }
  r.base = data + (s.b * op.batch_stride + s.k_token * op.row_stride + hk * op.head_stride) * es;
  return r;
}

// The softmax_lse row of head h (seqlen_q entries, stride 1), or nullptr when no lse is wanted.
inline float* lse_row(const Problem& p, const Sequence& s, int64_t h) {
  if (p.lse == nullptr) return nullptr;
  return p.lse + s.b * p.lse_batch_stride + h * p.lse_head_stride + s.q_token;
}

inline float alibi_slope(const Problem& p, const Sequence& s, int64_t h) {
  return p.score.alibi_slopes ? p.score.alibi_slopes[s.b * p.score.alibi_batch_stride + h] : 0.0f;
}

// The sink logit of query head h (flare.h), or -inf when the call has none.
inline float sink_of(const Problem& p, int64_t h) { return p.sinks ? p.sinks[h] : -__builtin_inff(); }

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace flare::cpu::FLARE_ISA
