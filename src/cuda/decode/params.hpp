// params.hpp — what the KV-cache kernels of src/cuda/decode receive (the append, the rotary copy of q, the
// split-KV attention and its combine): plain pointers, element strides and options, built on the host from a
// validated Problem (src/cuda/backend.cu). Host and device code both include it; no CUDA or CuTe dependency.
#pragma once

#include <cstdint>

#include "common/operand.hpp"

namespace flare::cuda {

using detail::Operand;

struct KvCacheParams {
  // q (batch, seqlen_q, nheads, headdim): the call's, or its rotated copy in the workspace (then q_source is
  // the call's and the rotary kernel writes q). A varlen forward (cu_seqlens_q below) passes its packed
  // (total_q, nheads, headdim) q and out with batch_stride 0.
  Operand q;
  Operand q_source;
  // The cache. Dense: batch_stride steps cache rows (cache_batch_idx picks one per sequence). Paged:
  // batch_stride steps blocks and block_table maps key slots to blocks.
  Operand k, v;
  Operand k_new, v_new;  // (batch, seqlen_new, nheads_k, headdim[_v]); seqlen_new 0: nothing appended
  Operand out;           // (batch, seqlen_q, nheads, headdim_v)
  float* lse = nullptr;  // optional, (batch, nheads, seqlen_q) at b * lse_batch_stride + h * lse_head_stride + i
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;

  int batch = 0;
  int nheads = 0;
  int nheads_k = 0;
  int group = 1;       // nheads / nheads_k: the query heads that share a kv head
  int headdim = 0;     // of q and k (the kernel's tile may be wider: extra columns are zero)
  int headdim_v = 0;   // of v and out
  int seqlen_q = 0;    // varlen: the longest sequence's (an upper bound)
  int rows = 0;        // group * seqlen_q: the query rows of one (sequence, kv head), packed into one tile
  int row_chunks = 1;  // CTAs along those rows: ceil(rows / kDecodeRows)
  int seqlen_cache = 0;  // capacity of a sequence (dense: k.shape[1]; paged: max_blocks * block_size)
  int seqlen_new = 0;

  // Sequence b attends to keys j in [0, cache_len + seqlen_new - leftpad), key j at cache slot leftpad + j;
  // cache_len = cache_seqlens[b] (absent: seqlen_cache), leftpad = cache_leftpad[b] (absent: 0). Slot s lives
  // in dense cache row cache_batch_idx[b] (absent: b), or in block block_table[b][s / block_size], row
  // s % block_size.
  const int32_t* cache_seqlens = nullptr;
  const int32_t* cache_batch_idx = nullptr;
  const int32_t* cache_leftpad = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int block_size = 0;  // paged only

  // A varlen forward run by these kernels (flare_fwd_varlen, paged or not; src/cuda/heuristics.hpp's
  // decode_view). cu_seqlens_q: sequence b's queries are tokens [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q,
  // out and the lse (lse_batch_stride 0), its seqlen_q their count. cu_seqlens_k: where cache_seqlens is
  // absent, sequence b's key count is its span; without a block table its keys start at token
  // cu_seqlens_k[b] of k and v (batch_stride 0). Null: a dense call.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;

  // Rotary (flare.h): cos/sin rows of rotary_dim / 2 entries in q's dtype; rotary_dim 0 = none.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_row_stride = 0;
  int rotary_dim = 0;
  bool rotary_interleaved = false;
  bool rotary_per_query = false;  // causal or windowed: query i takes position cache_len + i, else cache_len

  float scale = 1.f;     // softmax scale (natural units)
  float softcap = 0.f;   // 0 = off
  int window_left = -1;  // -1 = unbounded; causal is window_right = 0
  int window_right = -1;
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  const float* sinks = nullptr;  // one logit per query head, folded into each finished row; null = none

  // Split-KV: each (sequence, kv head, row chunk) runs num_splits CTAs over parts of its keys. With more than
  // one, each writes its rows' normalised output and lse into the workspace and the combine kernel merges
  // them; with one, the attention kernel writes out and lse itself. Row r of (b, hk) and split s:
  //   part_lse[((b * nheads_k + hk) * rows + r) * num_splits + s]
  //   part_o  [that index * headdim_v + c]
  int num_splits = 1;
  float* part_o = nullptr;
  float* part_lse = nullptr;
};

}  // namespace flare::cuda
