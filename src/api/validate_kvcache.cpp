// validate_kvcache.cpp — flare_kvcache_params to a checked Problem (Pass::kKvCache).
//
// The cache is dense (batch_cache, seqlen_cache, nheads_k, headdim) or paged (num_blocks, block_size,
// nheads_k, headdim) with a block_table. On the CPU the index tensors are read here, so that every cache
// position the pass will read or write, and every rotary row it will use, is known to exist.
#include <algorithm>
#include <cstddef>
#include <vector>

#include "api/checks.hpp"
#include "api/validate.hpp"

namespace flare::detail {
namespace {

struct CacheShape {
  bool paged = false;
  int64_t batch = 0;         // sequences (q.shape[0])
  int64_t cache_rows = 0;    // dense: batch_cache; paged: num_blocks
  int64_t block_size = 0;    // paged only
  int64_t max_blocks = 0;    // paged only
  int64_t seqlen_cache = 0;  // keys a sequence can hold
  int64_t seqlen_new = 0;
};

// Shapes, dtypes and devices of every tensor; returns the cache geometry.
CacheShape check_kvcache_tensors(const flare_kvcache_params& f, Problem* p) {
  require_present(f.q, "q");
  require_present(f.k_cache, "k_cache");
  require_present(f.v_cache, "v_cache");
  require_present(f.out, "out");
  const std::pair<const flare_tensor*, const char*> all[] = {
      {&f.q, "q"}, {&f.k_cache, "k_cache"}, {&f.v_cache, "v_cache"}, {&f.k_new, "k_new"},
      {&f.v_new, "v_new"}, {&f.cache_seqlens, "cache_seqlens"}, {&f.cache_batch_idx, "cache_batch_idx"},
      {&f.cache_leftpad, "cache_leftpad"}, {&f.block_table, "block_table"}, {&f.rotary_cos, "rotary_cos"},
      {&f.rotary_sin, "rotary_sin"}, {&f.out, "out"}, {&f.softmax_lse, "softmax_lse"}};
  for (const auto& [t, name] : all) {
    if (is_present(*t)) check_tensor(*t, name);
  }
  for (const auto& [t, name] : all) {
    if (is_present(*t)) require_same_device(*t, name, f.q, "q");
  }
  if (is_present(f.k_new) != is_present(f.v_new)) {
    reject(cat(is_present(f.k_new) ? "k_new is given but v_new is absent"
                                   : "v_new is given but k_new is absent",
               ": k_new and v_new come together"));
  }
  if (is_present(f.rotary_cos) != is_present(f.rotary_sin)) {
    reject(cat(is_present(f.rotary_cos) ? "rotary_cos is given but rotary_sin is absent"
                                        : "rotary_sin is given but rotary_cos is absent",
               ": rotary_cos and rotary_sin come together"));
  }

  check_compute_dtype(f.q, "q", /*allow_fp8=*/true);
  for (const auto& [t, name] : {std::pair{&f.k_cache, "k_cache"}, {&f.v_cache, "v_cache"},
                                {&f.k_new, "k_new"}, {&f.v_new, "v_new"}, {&f.rotary_cos, "rotary_cos"},
                                {&f.rotary_sin, "rotary_sin"}}) {
    if (is_present(*t)) require_same_dtype(*t, name, f.q, "q");
  }
  require_output_dtype(f.out, "out", f.q);
  if (is_present(f.softmax_lse)) {
    require_dtype(f.softmax_lse, "softmax_lse", FLARE_DTYPE_F32, "softmax_lse is fp32");
  }
  for (const auto& [t, name] : {std::pair{&f.cache_seqlens, "cache_seqlens"},
                                {&f.cache_batch_idx, "cache_batch_idx"}, {&f.cache_leftpad, "cache_leftpad"},
                                {&f.block_table, "block_table"}}) {
    if (is_present(*t)) require_dtype(*t, name, FLARE_DTYPE_I32, "index tensors are int32");
  }

  if (f.q.rank != 4) {
    reject(cat("q has rank ", f.q.rank, " (shape ", shape_string(f.q),
               ") but flare_fwd_kvcache takes q as (batch, seqlen_q, nheads, headdim): rank 4"));
  }
  if (f.k_cache.rank != 4) {
    reject(cat("k_cache has rank ", f.k_cache.rank, " (shape ", shape_string(f.k_cache),
               ") but must have rank 4: (batch_cache, seqlen_cache, nheads_k, headdim) or, paged, "
               "(num_blocks, block_size, nheads_k, headdim)"));
  }
  if (f.v_cache.rank != 4) {
    reject(cat("v_cache has rank ", f.v_cache.rank, " (shape ", shape_string(f.v_cache),
               ") but must have rank 4 like k_cache"));
  }
  CacheShape c;
  c.paged = is_present(f.block_table);
  c.batch = f.q.shape[0];
  const int64_t seqlen_q = f.q.shape[1];
  const int64_t nheads = f.q.shape[2];
  const int64_t headdim = f.q.shape[3];
  const int64_t nheads_k = f.k_cache.shape[2];
  const int64_t headdim_v = f.v_cache.shape[3];
  check_heads(nheads, nheads_k, "k_cache");
  check_head_dims(headdim, "q.shape[3] (headdim)", headdim_v, "v_cache.shape[3] (headdim_v)", f.q.device,
                  /*kv_cache=*/true);
  require_int32(c.batch, "q.shape[0] (batch)");
  require_int32(seqlen_q, "q.shape[1] (seqlen_q)");
  require_int32(nheads, "the number of q heads");

  c.cache_rows = f.k_cache.shape[0];
  require_int32(c.cache_rows, c.paged ? "k_cache.shape[0] (num_blocks)" : "k_cache.shape[0] (batch_cache)");
  if (c.paged) {
    require_absent(f.cache_batch_idx, "cache_batch_idx",
                   "a paged cache (block_table given) maps sequences through block_table instead");
    c.block_size = f.k_cache.shape[1];
    if (c.block_size < 1) {
      reject(cat("k_cache.shape[1] (block_size) is ", c.block_size, ": a block holds >= 1 key"));
    }
    if (f.block_table.rank != 2 || f.block_table.shape[0] != c.batch) {
      reject(cat("block_table has shape ", shape_string(f.block_table),
                 " but must be (batch, max_blocks) with batch = ", c.batch));
    }
    c.max_blocks = f.block_table.shape[1];
    if (__builtin_mul_overflow(c.max_blocks, c.block_size, &c.seqlen_cache)) c.seqlen_cache = INT64_MAX;
    require_int32(c.seqlen_cache, "block_table.shape[1] * block_size (the paged cache's capacity)");
    require_shape(f.k_cache, "k_cache", {c.cache_rows, c.block_size, nheads_k, headdim},
                  "(num_blocks, block_size, nheads_k, headdim of q)");
    require_shape(f.v_cache, "v_cache", {c.cache_rows, c.block_size, nheads_k, headdim_v},
                  "(num_blocks, block_size, nheads_k, headdim_v)");
  } else {
    c.seqlen_cache = f.k_cache.shape[1];
    require_int32(c.seqlen_cache, "k_cache.shape[1] (seqlen_cache)");
    if (!is_present(f.cache_batch_idx) && c.cache_rows < c.batch) {
      reject(cat("k_cache has ", c.cache_rows, " rows (shape[0]) but q has batch ", c.batch,
                 ": without cache_batch_idx sequence b uses cache row b, so the cache needs >= batch rows"));
    }
    require_shape(f.k_cache, "k_cache", {c.cache_rows, c.seqlen_cache, nheads_k, headdim},
                  "(batch_cache, seqlen_cache, nheads_k, headdim of q)");
    require_shape(f.v_cache, "v_cache", {c.cache_rows, c.seqlen_cache, nheads_k, headdim_v},
                  "(batch_cache, seqlen_cache, nheads_k, headdim_v)");
  }
  require_shape(f.out, "out", {c.batch, seqlen_q, nheads, headdim_v}, "(batch, seqlen_q, nheads, headdim_v)");
  if (is_present(f.softmax_lse)) {
    require_shape(f.softmax_lse, "softmax_lse", {c.batch, nheads, seqlen_q}, "(batch, nheads, seqlen_q)");
  }
  if (is_present(f.k_new)) {
    if (f.k_new.rank != 4) {
      reject(cat("k_new has rank ", f.k_new.rank, " (shape ", shape_string(f.k_new),
                 ") but must be (batch, seqlen_new, nheads_k, headdim): rank 4"));
    }
    c.seqlen_new = f.k_new.shape[1];
    require_int32(c.seqlen_new, "k_new.shape[1] (seqlen_new)");
    require_shape(f.k_new, "k_new", {c.batch, c.seqlen_new, nheads_k, headdim},
                  "(batch, seqlen_new, nheads_k, headdim)");
    require_shape(f.v_new, "v_new", {c.batch, c.seqlen_new, nheads_k, headdim_v},
                  "(batch, seqlen_new of k_new, nheads_k, headdim_v)");
  }
  for (const auto& [t, name] :
       {std::pair{&f.cache_seqlens, "cache_seqlens"}, {&f.cache_batch_idx, "cache_batch_idx"},
        {&f.cache_leftpad, "cache_leftpad"}}) {
    if (is_present(*t)) require_shape(*t, name, {c.batch}, "(batch)");
  }
  if (is_present(f.rotary_cos)) {
    const flare_tensor& cos = f.rotary_cos;
    if (cos.rank != 2) {
      reject(cat("rotary_cos has rank ", cos.rank, " (shape ", shape_string(cos),
                 ") but must be (seqlen_ro, rotary_dim / 2): rank 2"));
    }
    require_shape(f.rotary_sin, "rotary_sin", {cos.shape[0], cos.shape[1]}, "the shape of rotary_cos");
    const int64_t rotary_dim = 2 * cos.shape[1];
    if (rotary_dim < 2 || rotary_dim > headdim) {
      reject(cat("rotary_cos.shape[1] is ", cos.shape[1], ", so rotary_dim is ", rotary_dim,
                 " but headdim is ", headdim, ": rotary_dim must be even, >= 2 and <= headdim"));
    }
    if (cos.shape[0] > 1 && f.rotary_sin.strides[0] != cos.strides[0]) {
      reject(cat("rotary_sin.strides[0] is ", f.rotary_sin.strides[0], " but rotary_cos.strides[0] is ",
                 cos.strides[0], ": rotary_cos and rotary_sin must share their row stride"));
    }
    require_int32(cos.shape[0], "rotary_cos.shape[0] (seqlen_ro)");
    p->rotary_cos = cos.data;
    p->rotary_sin = f.rotary_sin.data;
    p->rotary_row_stride = cos.strides[0];
    p->rotary_dim = rotary_dim;
    p->rotary_seqlen = cos.shape[0];
  }
  if (f.rotary_interleaved != 0 && f.rotary_interleaved != 1) {
    reject(cat("rotary_interleaved is ", f.rotary_interleaved, ": it must be 0 or 1"));
  }
  if (f.num_splits < 0) reject(cat("num_splits is ", f.num_splits, ": it must be 0 (heuristic) or > 0"));

  p->pass = Pass::kKvCache;
  p->dtype = static_cast<flare_dtype>(f.q.dtype);
  p->varlen = false;
  p->batch = c.batch;
  p->nheads = nheads;
  p->nheads_k = nheads_k;
  p->headdim = headdim;
  p->headdim_v = headdim_v;
  p->seqlen_q = seqlen_q;
  p->seqlen_k = c.seqlen_cache;  // an upper bound of every sequence's key range
  return c;
}

// The cache slots (block, row) sequence b appends into, one run of rows per block it touches.
struct AppendedRows {
  int64_t block, first_row, last_row;  // rows first_row..last_row of block
  int64_t b, column;                   // sequence b, block_table column
};

// Paged appends: no two appended keys may share a cache slot (two sequences, or one whose block_table names
// a block twice, would race on it and then read one value for both). `appends` holds every run of rows.
void check_appended_slots_distinct(std::vector<AppendedRows>& appends) {
  std::sort(appends.begin(), appends.end(), [](const AppendedRows& x, const AppendedRows& y) {
    return x.block != y.block ? x.block < y.block : x.first_row < y.first_row;
  });
  for (size_t i = 1; i < appends.size(); ++i) {
    const AppendedRows& x = appends[i - 1];
    const AppendedRows& y = appends[i];
    if (x.block == y.block && y.first_row <= x.last_row) {
      reject(cat("block_table[", x.b, "][", x.column, "] and block_table[", y.b, "][", y.column, "] both name block ",
                 x.block, ", and sequences ", x.b, " and ", y.b, " append k_new into its rows ", x.first_row, "..",
                 x.last_row, " and ", y.first_row, "..", y.last_row,
                 ": each appended key needs a cache slot of its own"));
    }
  }
}

// The index tensors' contents (CPU only): every sequence's cache length, left padding, cache row and
// blocks are in range, the appended keys fit, and the rotary table covers every position used.
void check_kvcache_indices(const flare_kvcache_params& f, const CacheShape& c, const Problem& p) {
  std::vector<int64_t> rows_used;  // cache_batch_idx values, to catch two sequences appending to one row
  std::vector<AppendedRows> appends;  // paged: the slots appended into, to catch two appends to one slot
  const bool windowed = p.score.window_left >= 0 || p.score.window_right >= 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    int64_t cache_len = c.seqlen_cache;
    if (is_present(f.cache_seqlens)) {
      cache_len = read_i32(f.cache_seqlens, b);
      if (cache_len < 0) reject(cat("cache_seqlens[", b, "] is ", cache_len, ": it must be >= 0"));
    }
    if (cache_len + c.seqlen_new > c.seqlen_cache) {
      const std::string where =
          c.paged ? cat("block_table has ", c.max_blocks, " columns of ", c.block_size, " keys (",
                        c.seqlen_cache, " keys)")
                  : cat("the cache holds ", c.seqlen_cache, " keys per sequence (k_cache.shape[1])");
      reject(cat("cache_seqlens[", b, "] is ", cache_len,
                 is_present(f.cache_seqlens) ? "" : " (absent: the cache counts as full)", " and k_new adds ",
                 c.seqlen_new, " keys but ", where, ": the cache must have room for the appended keys"));
    }
    int64_t leftpad = 0;
    if (is_present(f.cache_leftpad)) {
      leftpad = read_i32(f.cache_leftpad, b);
      if (leftpad < 0 || leftpad > cache_len) {
        reject(cat("cache_leftpad[", b, "] is ", leftpad, " but cache_seqlens[", b, "] is ", cache_len,
                   ": cache_leftpad must be in 0..cache_seqlens"));
      }
    }
    if (is_present(f.cache_batch_idx)) {
      const int64_t row = read_i32(f.cache_batch_idx, b);
      if (row < 0 || row >= c.cache_rows) {
        reject(cat("cache_batch_idx[", b, "] is ", row, " but k_cache has ", c.cache_rows,
                   " rows: cache_batch_idx must be in 0..batch_cache-1"));
      }
      rows_used.push_back(row);
    }
    const int64_t key_end = cache_len + c.seqlen_new;
    if (c.paged && key_end > leftpad) {
      for (int64_t j = leftpad / c.block_size; j < (key_end + c.block_size - 1) / c.block_size; ++j) {
        const int64_t block = read_i32(f.block_table, b, j);
        if (block < 0 || block >= c.cache_rows) {
          reject(cat("block_table[", b, "][", j, "] is ", block, " but k_cache has ", c.cache_rows,
                     " blocks: the blocks of keys ", leftpad, "..", key_end - 1,
                     " must be in 0..num_blocks-1"));
        }
        // The appended keys' positions cache_len..key_end-1 within this block, if any.
        const int64_t first = std::max(cache_len, j * c.block_size);
        const int64_t last = std::min(key_end, (j + 1) * c.block_size) - 1;
        if (first <= last) appends.push_back({block, first - j * c.block_size, last - j * c.block_size, b, j});
      }
    }
    if (p.rotary_dim > 0) {
      // Rotary positions are cache slots (as in FlashAttention): the first appended key sits at cache_len.
      const int64_t first = cache_len;
      int64_t rows = c.seqlen_new > 0 ? first + c.seqlen_new : 0;
      if (p.seqlen_q > 0) rows = std::max(rows, windowed ? first + p.seqlen_q : first + 1);
      if (rows > p.rotary_seqlen) {
        reject(cat("rotary_cos has ", p.rotary_seqlen, " rows but sequence ", b,
                   " uses rotary positions up to ", rows - 1,
                   ": rotary_cos/rotary_sin need a row for every position rotated"));
      }
    }
  }
  if (c.seqlen_new > 0) {
    check_appended_slots_distinct(appends);
    std::sort(rows_used.begin(), rows_used.end());
    const auto twice = std::adjacent_find(rows_used.begin(), rows_used.end());
    if (twice != rows_used.end()) {
      reject(cat("cache_batch_idx holds ", *twice, " twice: with k_new each sequence must append into its "
                 "own cache row"));
    }
  }
}

}  // namespace

flare_status validate_kvcache(const flare_kvcache_params* params, Problem* problem) {
  return run_checks([&] {
    check_struct_size(params, params ? params->struct_size : 0, offsetof(flare_kvcache_params, sinks),
                      "flare_kvcache_params");
    const flare_kvcache_params& f = *params;
    Problem p;
    const CacheShape c = check_kvcache_tensors(f, &p);
    p.score = check_attn_options(f.attn, f.q, c.batch, p.nheads, p.headdim);
    check_exec_options(f.exec, f.q.device, &p);
    if (f.q.device.type == FLARE_DEVICE_CPU) check_kvcache_indices(f, c, p);

    require_no_overlap(f.out, "out");
    if (is_present(f.softmax_lse)) require_no_overlap(f.softmax_lse, "softmax_lse");
    if (c.seqlen_new > 0) {
      require_no_overlap(f.k_cache, "k_cache");
      require_no_overlap(f.v_cache, "v_cache");
    }

    p.k = dense_operand(f.k_cache);  // paged: batch_stride is the block stride
    p.v = dense_operand(f.v_cache);
    p.out = dense_operand(f.out);
    p.q = dense_operand(f.q);
    p.lse = is_present(f.softmax_lse) ? static_cast<float*>(f.softmax_lse.data) : nullptr;
    p.lse_batch_stride = is_present(f.softmax_lse) ? f.softmax_lse.strides[0] : 0;
    p.lse_head_stride = is_present(f.softmax_lse) ? f.softmax_lse.strides[1] : 0;
    const auto index = [](const flare_tensor& t) {
      return is_present(t) ? static_cast<const int32_t*>(t.data) : nullptr;
    };
    p.cache_seqlens = index(f.cache_seqlens);
    p.cache_batch_idx = index(f.cache_batch_idx);
    p.cache_leftpad = index(f.cache_leftpad);
    p.block_table = index(f.block_table);
    p.block_table_stride = c.paged ? f.block_table.strides[0] : 0;
    p.block_size = c.block_size;
    p.seqlen_cache = c.seqlen_cache;
    p.seqlen_new = c.seqlen_new;
    if (c.seqlen_new > 0) {
      p.k_new = dense_operand(f.k_new);
      p.v_new = dense_operand(f.v_new);
    }
    p.rotary_interleaved = f.rotary_interleaved == 1;
    p.num_splits = f.num_splits;
    if (covers(f, &flare_kvcache_params::sinks)) p.sinks = check_sinks(f.sinks, "sinks", f.q, p.nheads);
    *problem = p;
  });
}

}  // namespace flare::detail
