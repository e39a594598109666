// params.hpp — what a CUDA attention kernel receives: plain pointers, element strides and options, built on
// the host from a validated Problem (src/cuda/backend.cu). Host and device code both include this file;
// it has no CUDA or CuTe dependency.
#pragma once

#include <cstdint>

#include "common/operand.hpp"

namespace flare::cuda {

// Operands are common/operand.hpp's: element (b, t, h, c) of a dense tensor is at
//   data + b * batch_stride + t * row_stride + h * head_stride + c;
// varlen tensors have batch_stride 0, and token t of sequence b is cu_seqlens[b] + t.
using detail::Operand;

struct AttnParams {
  Operand q, k, v, out;
  float* lse = nullptr;  // optional in the forward; row (b, h) at lse + b * lse_batch_stride + h * lse_head_stride
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;

  int batch = 0;
  int nheads = 0;
  int nheads_k = 0;
  int headdim = 0;    // of q and k (the kernel's tile may be wider: extra columns are zero)
  int headdim_v = 0;  // of v and out
  int seqlen_q = 0;   // dense: every sequence; varlen: an upper bound
  int seqlen_k = 0;

  const int32_t* cu_seqlens_q = nullptr;  // varlen when non-null (then cu_seqlens_k is too)
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* seqused_k = nullptr;

  float scale = 1.f;        // softmax scale (natural units)
  float scale_log2 = 1.f;   // scale * log2(e)
  float softcap = 0.f;      // 0 = off
  int window_left = -1;     // -1 = unbounded; causal is window_right = 0
  int window_right = -1;
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  // Learnable sinks (flare.h): one fp32 logit per query head, folded into each finished row (forward
  // epilogues, policy::fold_sink); null when the call has none. The backward needs nothing from them: the
  // forward's lse counts them.
  const float* sinks = nullptr;
  // Dropout (flare.h; common/philox.hpp): P_ij kept with probability 1 - p and scaled by dropout_scale, dropped
  // when word j % 4 of the element's Philox draw is below dropout_threshold. dropout_p 0: off. The sm80
  // forward and backward take it; the sm90 forward leaves such calls to them.
  float dropout_p = 0.f;
  float dropout_scale = 1.f;
  uint32_t dropout_threshold = 0;
  uint32_t dropout_k0 = 0, dropout_k1 = 0, dropout_offset = 0;  // philox::DropoutKey

  // Query rows per forward CTA: 0 = by the sequence lengths (sm80::forward_shape); 64 or 128 forces that tile
  // (tests, through FLARE_CUDA_FWD_ROWS: each shape must be checked whatever the lengths pick).
  int forward_rows = 0;

  // Split-KV in the sm80 forward (heuristics.hpp: sm80_forward_splits): with num_splits > 1 each query tile's
  // key tiles are cut into that many runs, one CTA each, and every CTA writes its rows' normalised fp32 output
  // and lse (no sink) into the workspace for the KV-cache pass's combine kernel (src/cuda/decode/kernels.cu),
  // which merges them into out and lse. Rows are packed as the combine reads them: row i of query head h is
  // row (h % group) * len_q + i of (sequence b, kv head h / group), of part_rows (group x seqlen_q) in all;
  //   part_lse[((b * nheads_k + hk) * part_rows + row) * num_splits + split],  part_o[that * headdim_v + c].
  int num_splits = 1;
  int part_rows = 0;
  float* part_o = nullptr;
  float* part_lse = nullptr;
};

// True when a call has softcap or ALiBi: the score transform, which kernels may compile separately.
inline bool shaped_scores(AttnParams const& p) { return p.softcap > 0.f || p.alibi_slopes != nullptr; }

// True when a call has a mask: causal (window_right = 0) or a sliding window.
inline bool windowed(AttnParams const& p) { return p.window_left >= 0 || p.window_right >= 0; }

// Kernel configurations come in two shared-memory classes: kLarge uses up to 208 KB per block (sm_80 allows
// 163 KB, sm_90 227 KB), kSmall at most kSmallSmemBytes (the 99 KB of sm_86 / sm_89). backend.cu picks the
// class per call; src/cuda/sm80/configs.cuh holds the shapes of each.
enum class SmemClass { kLarge, kSmall };
constexpr int kSmallSmemBytes = 99 * 1024;

// Rows every sequence is padded by in the backward workspace (a multiple of every tile height).
constexpr int kRowPad = 128;

struct BwdParams : AttnParams {
  Operand dout, dq, dk, dv;

  // Workspace (fp32), laid out by the host (backend.cu). Query rows of sequence b start at row
  // q_row0(b) = varlen ? cu_seqlens_q[b] + b * kRowPad : b * seqlen_q_rounded (likewise for keys), so every
  // sequence owns whole 128-row tiles; per head there are q_rows (k_rows) such rows.
  //   dsum     (nheads, q_rows)                  rowsum(dout * out) of each query row
  //   dq_accum (dq_splits, nheads, q_rows, headdim_rounded); each query tile of the backward kernel's height
  //            in the order its threads hold the elements (src/cuda/sm80/backward.cuh), not row-major
  //   dk_accum, dv_accum (nheads, k_rows, headdim[_v]_rounded), GQA/MQA only: per-query-head gradients,
  //            summed over each group in a fixed order afterwards.
  float* dsum = nullptr;
  float* dq_accum = nullptr;
  float* dk_accum = nullptr;
  float* dv_accum = nullptr;
  int64_t q_rows = 0;
  int64_t k_rows = 0;
  int seqlen_q_rounded = 0;
  int seqlen_k_rounded = 0;
  int headdim_rounded = 0;   // the kernel's head-dim tile (q/k and v alike)
  int dq_splits = 1;         // deterministic mode: CTAs that accumulate dq into separate buffers
  bool deterministic = false;
};

}  // namespace flare::cuda
