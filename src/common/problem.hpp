// problem.hpp — the validated, normalised description of one attention call.
//
// src/api/validate.cpp turns a params struct from the C ABI into a Problem after checking every rule;
// backends (src/cpu, src/cuda) consume only a Problem and never re-validate. It lives in src/common so that
// backends include it without including the api layer above them. Everything here is
// already checked: pointers are non-null where used, shapes agree, index tensors were read and are in range.
#pragma once

#include <cstdint>

#include "common/operand.hpp"
#include "flare/flare.h"

namespace flare::detail {

// Operands: common/operand.hpp (shared with the CUDA kernels' params).

// Scores, masks and biases (FlashAttention semantics, see flare.h). Windows are normalised: causal is
// folded into window_right = 0; -1 means unbounded.
struct ScoreParams {
  double scale = 1.0;       // resolved softmax scale (never 0); the default 1/sqrt(headdim) is exact in fp64
  float softcap = 0.0f;     // 0 = off
  int64_t window_left = -1;
  int64_t window_right = -1;
  const float* alibi_slopes = nullptr;  // fp32; slope of (b, h) = alibi_slopes[b * alibi_batch_stride + h]
  int64_t alibi_batch_stride = 0;       // 0 when slopes have shape (nheads)
};

enum class Pass { kForward, kBackward, kKvCache };

struct Problem {
  Pass pass = Pass::kForward;
  flare_dtype dtype = FLARE_DTYPE_F32;  // of q, k, v, out (and dout, dq, dk, dv)
  bool varlen = false;

  int64_t batch = 0;
  int64_t nheads = 0;     // query heads
  int64_t nheads_k = 0;   // key/value heads; nheads % nheads_k == 0
  int64_t headdim = 0;    // of q and k, 1..576 (CUDA: up to its widest kernel, 256)
  int64_t headdim_v = 0;  // of v and out, 1..512 (likewise)

  // Dense: every sequence has these lengths. Varlen: the maxima over sequences (an upper bound).
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  // Tokens in all: batch * seqlen (dense) or q.shape[0] / k.shape[0] (varlen).
  int64_t total_q = 0;
  int64_t total_k = 0;

  Operand q, k, v, out;
  Operand dout, dq, dk, dv;  // backward only

  // softmax_lse (fp32), optional in forward passes, required in backward. Row (b, h) starts at
  // lse + b * lse_batch_stride + h * lse_head_stride and holds seqlen_q entries with stride 1.
  // Varlen: lse_batch_stride = 0 and the row of token t (global index) is lse + h * lse_head_stride + t.
  float* lse = nullptr;
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;

  // Varlen (forward/backward): sequence b has queries [cu_seqlens_q[b], cu_seqlens_q[b+1]) and keys
  // [cu_seqlens_k[b], cu_seqlens_k[b+1]), the latter cut to seqused_k[b] keys when seqused_k is given.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* seqused_k = nullptr;

  // KV cache (Pass::kKvCache). k/v above describe the cache. Sequence b:
  //   cache row  = cache_batch_idx ? cache_batch_idx[b] : b        (dense cache)
  //   key range  = [leftpad, cache_len + seqlen_new), leftpad = cache_leftpad ? cache_leftpad[b] : 0,
  //                cache_len = cache_seqlens ? cache_seqlens[b] : seqlen_cache
  //   paged: key position j lives in block block_table[b * block_table_stride + j / block_size],
  //          row j % block_size (k.batch_stride is the block stride).
  // A paged varlen forward (Pass::kForward, varlen, block_table set) pages its keys the same way, with
  // leftpad 0 and sequence b's key count seqused_k[b], else its cu_seqlens_k span (cu_seqlens_k may be null).
  const int32_t* cache_seqlens = nullptr;
  const int32_t* cache_batch_idx = nullptr;
  const int32_t* cache_leftpad = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int64_t block_size = 0;     // paged only
  int64_t seqlen_cache = 0;   // dense: cache capacity per row; paged: max_blocks * block_size
  int64_t seqlen_new = 0;     // rows of k_new/v_new (0 = nothing to append)
  Operand k_new, v_new;
  // Rotary: cos/sin rows of rotary_dim / 2 entries (dtype of q), row p at rotary_cos + p * rotary_row_stride.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_row_stride = 0;
  int64_t rotary_dim = 0;     // 0 = no rotary
  int64_t rotary_seqlen = 0;  // rows available in rotary_cos/sin
  bool rotary_interleaved = false;
  // Split-KV: the key range of each sequence is cut into this many parts, run apart and merged through their
  // lse (CPU: the decode path, src/cpu/decode.hpp). 0 = the backend's heuristic.
  int64_t num_splits = 0;

  ScoreParams score;
  // Learnable sinks (flare.h): one fp32 logit per query head joining each row's softmax denominator, or
  // nullptr. dsinks (backward, optional): the sinks' gradient, fp32 (nheads), written.
  const float* sinks = nullptr;
  float* dsinks = nullptr;
  // Dropout (flare.h): each probability kept with probability 1 - dropout_p (then scaled by 1 / (1 - p)) by
  // common/philox.hpp's stream of (seed, offset); 0 = off. Forward and backward only.
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;
  bool deterministic = false;

  // Execution.
  int num_threads = 0;        // 0 = OpenMP default
  void* workspace = nullptr;  // optional caller scratch
  size_t workspace_size = 0;
  void* stream = nullptr;
  flare_device device{FLARE_DEVICE_CPU, 0};
  // The CUDA kernel family the params ask for (forward and backward; the CPU ignores it). AUTO here may still
  // be replaced by FLARE_CUDA_ARCH_PATH: src/cuda/heuristics.hpp resolves it.
  flare_arch_path arch_path = FLARE_ARCH_PATH_AUTO;
};

}  // namespace flare::detail
