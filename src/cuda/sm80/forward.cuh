// forward.cuh — the sm80 forward kernel (FlashAttention-2 scheme): one CTA per (query tile, head, batch), or
// with split-KV per (query tile, split, head, batch), the splits merged by the KV-cache pass's combine kernel;
// Q stays in shared memory, K and V tiles stream through it with cp.async while the tensor cores work;
// scores, the online softmax and the output accumulator live in registers. Key tiles are walked from the
// last to the first, so the boundary tiles of a causal mask come first and the rest run unmasked.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/scores.cuh"
#include "cuda/sm80/configs.cuh"

namespace flare::cuda::sm80 {

// Key tiles [n_first, n_last) hold every key that a query row of [m0, m1) sees (empty when none does).
__device__ __forceinline__ void key_tiles_of(policy::WindowMask const& mask, int m0, int m1, int block_n,
                                             int& n_first, int& n_last) {
  const policy::KeyRange r = mask.keys_of_rows(m0, m1);
  const int64_t first = r.first < 0 ? 0 : r.first;
  const int64_t last = r.last;  // <= len_k - 1
  if (last < first) {
    n_first = n_last = 0;
    return;
  }
  n_first = static_cast<int>(first / block_n);
  n_last = static_cast<int>((last + block_n) / block_n);
}

// Split `split` of `splits` (split-KV, AttnParams::num_splits) keeps its run of the key tiles [n_first, n_last):
// runs of ceil(count / splits) tiles from the first, the last ones shorter or empty.
__device__ __forceinline__ void split_key_tiles(int split, int splits, int& n_first, int& n_last) {
  const int per = (n_last - n_first + splits - 1) / splits;
  const int lo = n_first + split * per;
  n_first = min(lo, n_last);
  n_last = min(lo + per, n_last);
}

// The output-column slices of a call (T::kSlicedV; else 1): ceil(headdim_v / T::kHeadDimV).
template <class T>
__host__ __device__ __forceinline__ int v_slices(AttnParams const& p) {
  if constexpr (T::kSlicedV) return (p.headdim_v + T::kHeadDimV - 1) / T::kHeadDimV;
  return 1;
}

// One CTA of the forward (forward_kernel).
// T::kPlain: compiled with the mask alone, for calls without softcap and ALiBi; else with the score transform.
// T::kDropout: compiled with dropout.
// T::kSlicedV: the CTA computes the output columns of one slice, [slice * kHeadDimV, +kHeadDimV).
// kWholeDims: for calls whose head dims fill the tile (T::kWholeDimsKernel), K and V tiles are copied without
// column predicates; else whether they need them is a run-time test.
template <class T, bool kWholeDims>
__device__ __forceinline__ void forward_tile(AttnParams const& p) {
  using Element = typename T::Element;
  constexpr bool kShaped = !T::kPlain;
  constexpr int kBlockM = T::kBlockM;
  constexpr int kBlockN = T::kBlockN;
  constexpr int kHeadDim = T::kHeadDim;
  constexpr int kHeadDimV = T::kHeadDimV;

  // Heavy (late, for causal) query tiles first; with split-KV, the splits of a tile side by side, and with
  // output slices, the slices of a split.
  const int splits = p.num_splits;
  const int slices = v_slices<T>(p);
  const int tile_index = static_cast<int>(blockIdx.x) / slices;
  const int slice = static_cast<int>(blockIdx.x) % slices;
  const int split = tile_index % splits;
  const int m_block = static_cast<int>(gridDim.x) / (splits * slices) - 1 - tile_index / splits;
  // The output columns of this CTA: [v_col0, v_col0 + v_cols) of headdim_v.
  const int v_col0 = slice * kHeadDimV;
  const int v_cols = p.headdim_v - v_col0;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const Sequence seq(p, b);
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.len_q) return;
  const int hk = h / (p.nheads / p.nheads_k);
  // The score shape and the key tiles this query tile sees: built here, or with T::kEarlyCopies after the
  // prologue's copies are issued (the key tiles, which the copies need, from the mask alone). Built later for
  // every kernel, head dim 256 ran slower (docs/tuning-sm80.md, "Forward: copy order in the prologue").
  ScoreShape shape;
  Span seen_by_all = Span::none();  // key tiles inside need no mask
  int n_first, n_last;
  if constexpr (T::kEarlyCopies) {
    key_tiles_of(policy::WindowMask{seq.len_q, seq.len_k, p.window_left, p.window_right}, m0,
                 min(m0 + kBlockM, seq.len_q), kBlockN, n_first, n_last);
  } else {
    shape = ScoreShape(p, b, h, seq.len_q, seq.len_k);
    key_tiles_of(shape.mask, m0, min(m0 + kBlockM, seq.len_q), kBlockN, n_first, n_last);
    seen_by_all = shape.keys_seen_by_all(m0, m0 + kBlockM);
  }
  if (splits > 1) split_key_tiles(split, splits, n_first, n_last);

  // ---- global and shared views
  const auto gmem = [](Operand const& t, int64_t offset, int rows) {
    return gmem_rows<Element, kHeadDim>(t, offset, rows);
  };
  Tensor gQ = local_tile(gmem(p.q, seq.q_offset(p.q, b, h), seq.len_q), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                         make_coord(m_block, 0));
  const auto gmem_v = [](Operand const& t, int64_t offset, int rows) {
    return gmem_rows<Element, kHeadDimV>(t, offset, rows);
  };
  Tensor gO = local_tile(gmem_v(p.out, seq.q_offset(p.out, b, h) + v_col0, seq.len_q),
                         Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(gmem(p.k, seq.k_offset(p.k, b, hk), seq.len_k), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                         make_coord(_, 0));
  Tensor gV = local_tile(gmem_v(p.v, seq.k_offset(p.v, b, hk) + v_col0, seq.len_k),
                         Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, 0));

  extern __shared__ char smem[];
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename T::SmemLayoutV{});
  Tensor sVt = make_tensor(sV.data(), typename T::SmemLayoutVt{});

  // ---- global -> shared (cp.async, 16 bytes per thread and step)
  typename T::GmemLoad gload;
  auto gthr = gload.get_thread_slice(tid);
  Tensor tQgQ = gthr.partition_S(gQ);
  Tensor tQsQ = gthr.partition_D(sQ);
  Tensor tKgK = gthr.partition_S(gK);
  Tensor tKsK = gthr.partition_D(sK);
  typename T::GmemLoadV gload_v;  // gload's type unless V is sliced narrower than the chunk of Q and K
  auto gthr_v = gload_v.get_thread_slice(tid);
  Tensor tVgV = gthr_v.partition_S(gV);
  Tensor tVsV = gthr_v.partition_D(sV);
  Tensor tQcQ = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKcK = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tVcV = gthr_v.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  const int q_rows = seq.len_q - m0;
  const bool k_dims_whole = kWholeDims || p.headdim == kHeadDim;
  const bool v_dims_whole = kWholeDims || v_cols >= kHeadDimV;

  // ---- prologue: Q and the first (last) key tile; with T::kFirstVEarly its V too, in a copy group of its own
  // (the first visit then waits for Q and K alone). Issued here (T::kEarlyCopies) or after the set-up below.
  const auto prologue = [&]() __attribute__((always_inline)) {
    copy_rows(gload, tQgQ, tQsQ, tQcQ, q_rows, p.headdim);
    if (n_last > n_first) {
      const int rows = seq.len_k - (n_last - 1) * kBlockN;
      copy_tile(gload, tKgK(_, _, _, n_last - 1), tKsK, tKcK, rows, p.headdim, k_dims_whole && rows >= kBlockN);
      if constexpr (T::kFirstVEarly) {
        cp_async_fence();
        copy_tile(gload_v, tVgV(_, _, _, n_last - 1), tVsV, tVcV, rows, v_cols, v_dims_whole && rows >= kBlockN);
      }
    }
    cp_async_fence();
  };
  if constexpr (T::kEarlyCopies) {
    prologue();
    shape = ScoreShape(p, b, h, seq.len_q, seq.len_k);
    seen_by_all = shape.keys_seen_by_all(m0, m0 + kBlockM);
  }

  // ---- shared -> registers (ldmatrix) and the MMAs
  typename T::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(shape_only<Element>(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tSrK = thr_mma.partition_fragment_B(shape_only<Element>(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tOrVt = thr_mma.partition_fragment_B(shape_only<Element>(Shape<Int<kHeadDimV>, Int<kBlockN>>{}));

  auto copy_q = make_tiled_copy_A(typename T::SmemCopyAtom{}, mma);
  auto thr_copy_q = copy_q.get_thread_slice(tid);
  Tensor tSsQ = thr_copy_q.partition_S(sQ);
  auto copy_k = make_tiled_copy_B(typename T::SmemCopyAtom{}, mma);
  auto thr_copy_k = copy_k.get_thread_slice(tid);
  Tensor tSsK = thr_copy_k.partition_S(sK);
  auto copy_v = make_tiled_copy_B(typename T::SmemCopyAtomT{}, mma);
  auto thr_copy_v = copy_v.get_thread_slice(tid);
  Tensor tOsVt = thr_copy_v.partition_S(sVt);

  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDimV>>{});
  clear(acc_o);
  Tensor o_rc = rowcol(acc_o);
  // Tile-local (row, key) of each score this thread holds: base + constant offsets (AccCoords).
  using ScoreCoords = AccCoords<typename T::TiledMma, Shape<Int<kBlockM>, Int<kBlockN>>>;
  const ScoreCoords coords(mma, tid);
  Tensor coord_s = ScoreCoords::offsets();
  Tensor coord_rc = make_tensor(coord_s.data(), rowcol_layout(coord_s.layout()));
  constexpr int kRows = decltype(size<0>(o_rc))::value;

  float row_max[kRows];
  float row_sum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
  }
  const float f = shape.log2_factor;
  const bool dropping = T::kDropout && p.dropout_p > 0.f;  // compiled out of the kernels without it
  const DropoutStream dropout(p, b, h);
  if constexpr (!T::kEarlyCopies) prologue();

  // One key tile; `masked`: whether it takes the mask, a bool or (T::kMaskLoopApart) a compile-time constant.
  // Always inlined: called from up to three loops, a call would take the accumulators it captures by reference
  // out of registers into local memory. (ptxas schedules this form faster than the same body written in the
  // loop at head dim 64's short shape, and the same elsewhere: docs/tuning-sm80.md, "Forward: masked and
  // whole tiles apart".)
  const auto visit = [&](int n, auto masked) __attribute__((always_inline)) {
    const bool is_masked = masked;
    const int n0 = n * kBlockN;
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    const bool first = T::kFirstVEarly && n == n_last - 1;  // its V is on its way since the prologue
    if (first) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // K[n] has landed; every warp is done with V[n + 1]
    if (!first) {
      copy_tile(gload_v, tVgV(_, _, _, n), tVsV, tVcV, seq.len_k - n0, v_cols,
                v_dims_whole && seq.len_k - n0 >= kBlockN);
    }
    cp_async_fence();

    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma, copy_q, copy_k, thr_copy_q, thr_copy_k);
    Tensor s = rowcol(acc_s);
    if constexpr (kShaped) {
      shape_scores(s, coord_rc, m0 + coords.row_base, n0 + coords.col_base, shape, is_masked);
    } else if (is_masked) {
      mask_scores(s, coord_rc, m0 + coords.row_base, n0 + coords.col_base, shape);
    }

    __syncthreads();  // every warp is done reading K[n]
    if (n > n_first) {
      // Every tile before the last is whole in rows.
      copy_tile(gload, tKgK(_, _, _, n - 1), tKsK, tKcK, kBlockN, p.headdim, k_dims_whole);
    }
    cp_async_fence();

    // Online softmax: new running max, rescale what was accumulated, exponentiate this tile. Once the running
    // maxima settle (after the first few tiles, on most rows) the correction is exactly 1: the rescale of the
    // output accumulator (as many multiplies as the accumulator has registers) is skipped unless a row of the
    // warp moved its maximum (a warp-uniform branch) — where the registers allow it (T::kSkipSettledRescale).
    float correction[kRows];
    const bool moved = online_softmax(s, f, row_max, row_sum, correction);
    if (dropping) {
      // Dropout: P times its keep factors after the sum took it whole (lse stays undropped).
      uint64_t keep[kRows];
      dropout_bits<T::kDropoutColumnsPerDraw>(dropout, coord_rc, m0 + coords.row_base, n0 + coords.col_base,
                                              keep);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) s(r, c) = (keep[r] >> c) & 1 ? s(r, c) * dropout.scale : 0.f;
      }
    }
    if (!T::kSkipSettledRescale || __any_sync(0xffffffffu, moved)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= correction[r];
      }
    }
    Tensor p_tile = convert_fragment<Element>(acc_s);
    Tensor p_a = make_tensor(p_tile.data(), acc_as_a_layout(p_tile.layout()));

    cp_async_wait<1>();
    __syncthreads();  // V[n] has landed (K[n - 1] may still be in flight)
    gemm_rs(acc_o, p_a, tOrVt, tOsVt, mma, copy_v, thr_copy_v);
  };
  if constexpr (T::kMaskLoopApart) {
    // Tiles from the last (the diagonal, under a causal mask) down to the first that every row sees whole take
    // the mask, then the whole ones run without it, then (a window's left edge) the rest take it again.
    int n = n_last - 1;
    for (; n >= n_first && !seen_by_all.covers(n * kBlockN, kBlockN); --n) visit(n, std::true_type{});
    for (; n >= n_first && seen_by_all.covers(n * kBlockN, kBlockN); --n) visit(n, std::false_type{});
    for (; n >= n_first; --n) visit(n, std::true_type{});
  } else {
    for (int n = n_last - 1; n >= n_first; --n) visit(n, !seen_by_all.covers(n * kBlockN, kBlockN));
  }

  // ---- split-KV epilogue: the rows' normalised fp32 output and lse (no sink: the combine folds it) into the
  // workspace, straight from the registers; an empty split writes lse -inf, which the combine skips.
  if (splits > 1) {
    using OutCoords = AccCoords<typename T::TiledMma, Shape<Int<kBlockM>, Int<kHeadDimV>>>;
    const OutCoords out_coords(mma, tid);
    Tensor out_s = OutCoords::offsets();
    Tensor out_rc = make_tensor(out_s.data(), rowcol_layout(out_s.layout()));
    const int64_t rows0 = (int64_t{b} * p.nheads_k + hk) * p.part_rows + (h % (p.nheads / p.nheads_k)) * seq.len_q;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const int row = m0 + out_coords.row_base + get<0>(out_rc(r, 0));
      if (row >= seq.len_q) continue;
      const int64_t part = (rows0 + row) * splits + split;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) {
        const int col = out_coords.col_base + get<1>(out_rc(r, c));
        if (col < v_cols) p.part_o[part * p.headdim_v + v_col0 + col] = o_rc(r, c) * inv;
      }
      if (slice == 0 && out_coords.col_base + get<1>(out_rc(r, 0)) == 0) {
        p.part_lse[part] = sum > 0.f ? (row_max[r] * f + __log2f(sum)) * kLn2 : -INFINITY;
      }
    }
    cp_async_wait<0>();  // no copy may outlive the CTA
    return;
  }

  // ---- epilogue: normalise (the head's sink folded in), write lse and out (through shared memory, 16-byte stores)
  float* lse = p.lse != nullptr ? p.lse + seq.lse_offset(p, b, h) : nullptr;
  const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float sum = quad_sum(row_sum[r]);
    const policy::SinkFold<float> row_end =
        policy::fold_sink(sum > 0.f ? (row_max[r] * f + __log2f(sum)) * kLn2 : -INFINITY, sink);
    const float inv = sum > 0.f ? row_end.factor / sum : 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= inv;
    const int row = m0 + coords.row_base + get<0>(coord_rc(r, 0));
    if (lse != nullptr && slice == 0 && coords.col_base + get<1>(coord_rc(r, 0)) == 0 && row < seq.len_q) {
      lse[row] = row_end.lse;
    }
  }
  Tensor o_elem = convert_fragment<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename T::SmemLayoutO{});
  auto copy_o = make_tiled_copy_C(typename T::SmemCopyAtomO{}, mma);
  auto thr_copy_o = copy_o.get_thread_slice(tid);
  // Nothing may still be landing in shared memory (with no key tile to visit, the loop never waited for
  // the Q copy), and every warp is done with sQ and sV.
  cp_async_wait<0>();
  __syncthreads();
  copy(copy_o, thr_copy_o.retile_S(o_elem), thr_copy_o.partition_D(sO));
  __syncthreads();
  typename T::GmemStore gstore;
  auto sthr = gstore.get_thread_slice(tid);
  Tensor tOcO = sthr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  copy_rows<false>(gstore, sthr.partition_S(sO), sthr.partition_D(gO), tOcO, q_rows, v_cols);
}

// The forward kernel: one CTA per (query tile, split, output slice, head, batch), heavy query tiles first.
// A configuration over the small class's shared memory (wide heads) has no body in the cubins of sm_86 / sm_89,
// which cannot launch it (body_here): that keeps their compile out of the build.
template <class T, bool kWholeDims>
__global__ void __launch_bounds__(T::kThreads) forward_kernel(const __grid_constant__ AttnParams p) {
  if constexpr (T::kSmemBytes <= kSmallSmemBytes || body_here<SmemClass::kLarge>()) forward_tile<T, kWholeDims>(p);
}

// Whether a call's head dims fill T's tile (then T::kWholeDimsKernel says which kernel runs it).
template <class T>
bool whole_dims(AttnParams const& p) {
  return p.headdim == T::kHeadDim && p.headdim_v == T::kHeadDim && !T::kSlicedV;
}

// Launches the forward kernel for one traits type on `stream`, compiled with or without kWholeDims.
template <class T, bool kWholeDims>
cudaError_t launch_forward_kernel(AttnParams const& p, cudaStream_t stream) {
  if (!T::kDropout && p.dropout_p > 0.f) return cudaErrorNotSupported;  // routed past launch_forward_as's rule
  const auto kernel = forward_kernel<T, kWholeDims>;
  constexpr int kSmem = T::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
        e != cudaSuccess) {
      return e;
    }
  }
  const dim3 grid((p.seqlen_q + T::kBlockM - 1) / T::kBlockM * p.num_splits * v_slices<T>(p), p.nheads, p.batch);
  kernel<<<grid, T::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// Launches the forward for one traits type on `stream`.
template <class T>
cudaError_t launch_forward(AttnParams const& p, cudaStream_t stream) {
  return whole_dims<T>(p) ? launch_forward_kernel<T, T::kWholeDimsKernel>(p, stream)
                          : launch_forward_kernel<T, false>(p, stream);
}

// Launches one shape's configuration: its kernel with the mask alone where it has one and the call takes it
// (FwdConfigOf::Plain; for few keys and whole head dims its twin without the skipped rescale where there is
// one, FwdConfigOf::PlainFewKeys), else the one with the score transform.
template <class Config>
cudaError_t launch_forward_config(AttnParams const& p, cudaStream_t stream) {
  using Plain = typename Config::Plain;
  using FewKeys = typename Config::PlainFewKeys;
  if constexpr (!std::is_void_v<Plain>) {
    if (!shaped_scores(p) && (windowed(p) || !Config::kPlainMaskedOnly)) {
      if constexpr (!std::is_void_v<FewKeys>) {
        static_assert(FewKeys::kWholeDimsKernel, "PlainFewKeys is compiled for whole head dims only");
        if (forward_few_keys(p) && whole_dims<FewKeys>(p)) return launch_forward_kernel<FewKeys, true>(p, stream);
      }
      return launch_forward<Plain>(p, stream);
    }
  }
  return launch_forward<typename Config::type>(p, stream);
}

// Calls with dropout take the short shape's kernel with the score transform, the one kernel that carries
// dropout (FwdTraits::kDropout).
template <class Element, int kHeadDim, SmemClass kClass>
cudaError_t launch_forward_as(AttnParams const& p, cudaStream_t stream) {
  using Short = FwdConfigOf<Element, kHeadDim, FwdShape::kShort, kClass>;
  static_assert(Short::type::kDropout, "dropout calls need a kernel that carries it");
  if (p.dropout_p > 0.f) return launch_forward<typename Short::type>(p, stream);
  if (forward_shape(kHeadDim, p) == FwdShape::kShort) return launch_forward_config<Short>(p, stream);
  return launch_forward_config<FwdConfigOf<Element, kHeadDim, FwdShape::kLong, kClass>>(p, stream);
}

// Runs the forward with the configuration for this call's mask, lengths and shared-memory class.
template <class Element, int kHeadDim>
cudaError_t launch_forward_for(AttnParams const& p, cudaStream_t stream, SmemClass c = SmemClass::kLarge) {
  return c == SmemClass::kLarge ? launch_forward_as<Element, kHeadDim, SmemClass::kLarge>(p, stream)
                                : launch_forward_as<Element, kHeadDim, SmemClass::kSmall>(p, stream);
}

}  // namespace flare::cuda::sm80
