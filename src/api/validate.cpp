// validate.cpp — flare_fwd_params / flare_bwd_params (dense and varlen) to a checked Problem, and the
// workspace check. The KV-cache pass lives in validate_kvcache.cpp; the per-tensor rules in checks.cpp.
#include "api/validate.hpp"

#include <algorithm>
#include <cstddef>

#include "api/checks.hpp"
#include "common/error.hpp"
#include "cpu/cpu_backend.hpp"

namespace flare::detail {
namespace {

// What flare_fwd_params and flare_bwd_params have in common.
struct AttnArgs {
  const char* entry;  // the entry point, for messages
  Pass pass;
  bool varlen;
  const flare_tensor& q;
  const flare_tensor& k;
  const flare_tensor& v;
  const flare_tensor& out;
  const flare_tensor& lse;
  const flare_tensor& cu_seqlens_q;
  const flare_tensor& cu_seqlens_k;
  const flare_tensor& seqused_k;
  const flare_tensor& block_table;  // forward only (absent for the backward)
  int32_t max_seqlen_q;
  int32_t max_seqlen_k;
  const flare_attn_options& attn;
  const flare_exec_options& exec;
};

// Rank of a q-like operand: 4 for the dense entry, 3 for the varlen one, with a hint at the other entry.
void require_layout_rank(const flare_tensor& t, const char* name, const AttnArgs& a, const char* dense,
                         const char* varlen) {
  const int rank = a.varlen ? 3 : 4;
  if (t.rank == rank) return;
  if (a.varlen) {
    reject(cat(name, " has rank ", t.rank, " (shape ", shape_string(t), ") but ", a.entry, " takes ",
               name, " as ", varlen, ": rank 3 (dense ", dense, " tensors go to the entry without _varlen)"));
  }
  reject(cat(name, " has rank ", t.rank, " (shape ", shape_string(t), ") but ", a.entry, " takes ", name,
             " as ", dense, ": rank 4 (packed ", varlen, " tensors go to ", a.entry, "_varlen)"));
}

// cu_seqlens (batch + 1), read on the CPU: starts at 0, nondecreasing, ends at `total`.
// Returns the longest sequence.
int64_t check_cu_seqlens(const flare_tensor& cu, const char* name, int64_t total, const char* tokens) {
  if (read_i32(cu, 0) != 0) {
    reject(cat(name, "[0] is ", read_i32(cu, 0), ": cu_seqlens must start at 0"));
  }
  int64_t longest = 0;
  const int64_t batch = cu.shape[0] - 1;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = int64_t{read_i32(cu, b + 1)} - read_i32(cu, b);
    if (len < 0) {
      reject(cat(name, "[", b + 1, "] is ", read_i32(cu, b + 1), " but ", name, "[", b, "] is ",
                 read_i32(cu, b), ": cu_seqlens must be nondecreasing"));
    }
    longest = std::max(longest, len);
  }
  if (total >= 0 && read_i32(cu, batch) != total) {
    reject(cat(name, "[", batch, "] is ", read_i32(cu, batch), " but there are ", total, " ", tokens,
               ": cu_seqlens must end at the token count"));
  }
  return longest;
}

// The bound kernels use for sequence lengths: max_seqlen when given (checked to cover `longest`), else
// `longest` (or `fallback` when the index tensors live on a device and could not be read).
int64_t resolve_max_seqlen(int32_t given, const char* name, int64_t longest, bool known,
                           int64_t fallback) {
  if (given < 0) reject(cat(name, " is ", given, ": it must be >= 0 (0 derives it from the cu_seqlens)"));
  if (given > 0 && known && given < longest) {
    reject(cat(name, " is ", given, " but a sequence has ", longest, " tokens: ", name,
               " must be >= every sequence's length (or 0 to derive it)"));
  }
  if (given > 0) return given;
  return known ? longest : fallback;
}

// Varlen index tensors: shapes, dtypes and (on the CPU) contents. Fills batch and the max lengths. A paged
// call (block_table) takes cu_seqlens_k or seqused_k or both; total_k is then unknown (-1) and the key counts
// are bounded by the block table's capacity instead (check_paged_kv).
void check_varlen_indices(const AttnArgs& a, int64_t total_q, int64_t total_k, Problem* p) {
  const bool paged = is_present(a.block_table);
  require_present(a.cu_seqlens_q, "cu_seqlens_q");
  if (!paged) require_present(a.cu_seqlens_k, "cu_seqlens_k");
  if (paged && !is_present(a.cu_seqlens_k) && !is_present(a.seqused_k)) {
    reject("cu_seqlens_k and seqused_k are both absent but block_table is given: a paged varlen call needs "
           "the key count of each sequence from seqused_k (batch) or cu_seqlens_k (batch + 1)");
  }
  const flare_tensor& cu_q = a.cu_seqlens_q;
  if (cu_q.rank != 1 || cu_q.shape[0] < 1) {
    reject(cat("cu_seqlens_q has shape ", shape_string(cu_q),
               ": it must be (batch + 1), rank 1, with batch >= 0"));
  }
  const int64_t batch = cu_q.shape[0] - 1;
  require_int32(batch, "the batch (cu_seqlens_q.shape[0] - 1)");
  require_dtype(cu_q, "cu_seqlens_q", FLARE_DTYPE_I32, "cu_seqlens are int32");
  if (is_present(a.cu_seqlens_k)) {
    require_shape(a.cu_seqlens_k, "cu_seqlens_k", {batch + 1}, "(batch + 1)");
    require_dtype(a.cu_seqlens_k, "cu_seqlens_k", FLARE_DTYPE_I32, "cu_seqlens are int32");
  }
  if (is_present(a.seqused_k)) {
    require_shape(a.seqused_k, "seqused_k", {batch}, "(batch)");
    require_dtype(a.seqused_k, "seqused_k", FLARE_DTYPE_I32, "seqused_k is int32");
  }
  p->batch = batch;
  p->cu_seqlens_q = static_cast<const int32_t*>(cu_q.data);
  p->cu_seqlens_k = is_present(a.cu_seqlens_k) ? static_cast<const int32_t*>(a.cu_seqlens_k.data) : nullptr;
  p->seqused_k = is_present(a.seqused_k) ? static_cast<const int32_t*>(a.seqused_k.data) : nullptr;

  const bool readable = a.q.device.type == FLARE_DEVICE_CPU;
  int64_t longest_q = 0;
  int64_t longest_k = 0;
  if (readable) {
    longest_q = check_cu_seqlens(cu_q, "cu_seqlens_q", total_q, "query tokens (q.shape[0])");
    if (p->cu_seqlens_k != nullptr) {
      longest_k = check_cu_seqlens(a.cu_seqlens_k, "cu_seqlens_k", total_k, "key tokens (k.shape[0])");
    }
    if (p->seqused_k != nullptr) {
      longest_k = 0;
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t used = read_i32(a.seqused_k, b);
        const int64_t keys = p->cu_seqlens_k == nullptr
                                 ? kInt32Max
                                 : int64_t{read_i32(a.cu_seqlens_k, b + 1)} - read_i32(a.cu_seqlens_k, b);
        if (used < 0 || used > keys) {
          reject(cat("seqused_k[", b, "] is ", used, " but sequence ", b, " has ", keys,
                     " keys: seqused_k must be in 0..its sequence's key count"));
        }
        longest_k = std::max(longest_k, used);
      }
    }
  }
  p->seqlen_q = resolve_max_seqlen(a.max_seqlen_q, "max_seqlen_q", longest_q, readable, total_q);
  p->seqlen_k = resolve_max_seqlen(a.max_seqlen_k, "max_seqlen_k", longest_k, readable,
                                   total_k >= 0 ? total_k : kInt32Max);
}

// A paged varlen call's block_table against the cache k/v (num_blocks, block_size, nheads_k, headdim): shape,
// dtype, capacity and (on the CPU) every block that holds a used key. Fills the paging fields.
void check_paged_kv(const AttnArgs& a, Problem* p) {
  const flare_tensor& bt = a.block_table;
  const int64_t num_blocks = a.k.shape[0];
  const int64_t block_size = a.k.shape[1];
  require_int32(num_blocks, "k.shape[0] (num_blocks)");
  if (block_size < 1) reject(cat("k.shape[1] (block_size) is ", block_size, ": a block holds >= 1 key"));
  if (bt.rank != 2 || bt.shape[0] != p->batch) {
    reject(cat("block_table has shape ", shape_string(bt), " but must be (batch, max_blocks) with batch = ",
               p->batch, " (cu_seqlens_q.shape[0] - 1)"));
  }
  require_dtype(bt, "block_table", FLARE_DTYPE_I32, "block_table is int32");
  const int64_t max_blocks = bt.shape[1];
  int64_t capacity = 0;
  if (__builtin_mul_overflow(max_blocks, block_size, &capacity)) capacity = INT64_MAX;
  require_int32(capacity, "block_table.shape[1] * block_size (the paged cache's capacity)");
  if (a.q.device.type == FLARE_DEVICE_CPU) {
    for (int64_t b = 0; b < p->batch; ++b) {
      const int64_t keys = p->seqused_k != nullptr ? p->seqused_k[b]
                                                   : int64_t{p->cu_seqlens_k[b + 1]} - p->cu_seqlens_k[b];
      if (keys > capacity) {
        reject(cat("sequence ", b, " has ", keys, " keys but block_table has ", max_blocks, " columns of ",
                   block_size, " keys (", capacity, "): every sequence must fit in its blocks"));
      }
      for (int64_t j = 0; j < (keys + block_size - 1) / block_size; ++j) {
        const int64_t block = read_i32(bt, b, j);
        if (block < 0 || block >= num_blocks) {
          reject(cat("block_table[", b, "][", j, "] is ", block, " but k has ", num_blocks,
                     " blocks: the blocks of sequence ", b, "'s keys 0..", keys - 1, " must be in 0..num_blocks-1"));
        }
      }
    }
  }
  p->block_table = static_cast<const int32_t*>(bt.data);
  p->block_table_stride = bt.strides[0];
  p->block_size = block_size;
  p->seqlen_cache = capacity;
  p->total_k = num_blocks * block_size;
}

// Everything but the backward-only tensors. Fills the problem's shape, q/k/v/out, lse and options.
void check_attention(const AttnArgs& a, Problem* p) {
  require_present(a.q, "q");
  require_present(a.k, "k");
  require_present(a.v, "v");
  require_present(a.out, "out");
  if (a.pass == Pass::kBackward) require_present(a.lse, "softmax_lse");
  const std::pair<const flare_tensor*, const char*> all[] = {
      {&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}, {&a.lse, "softmax_lse"},
      {&a.cu_seqlens_q, "cu_seqlens_q"}, {&a.cu_seqlens_k, "cu_seqlens_k"}, {&a.seqused_k, "seqused_k"},
      {&a.block_table, "block_table"}};
  for (const auto& [t, name] : all) {
    if (is_present(*t)) check_tensor(*t, name);
  }
  for (const auto& [t, name] : all) {
    if (is_present(*t)) require_same_device(*t, name, a.q, "q");
  }
  if (!a.varlen) {
    const std::string why = cat(a.entry, " is the dense entry: cu_seqlens_q, cu_seqlens_k and seqused_k "
                                         "belong to ", a.entry, "_varlen");
    require_absent(a.cu_seqlens_q, "cu_seqlens_q", why.c_str());
    require_absent(a.cu_seqlens_k, "cu_seqlens_k", why.c_str());
    require_absent(a.seqused_k, "seqused_k", why.c_str());
    require_absent(a.block_table, "block_table",
                   cat(a.entry, " is the dense entry: a paged cache (block_table) goes to ", a.entry,
                       "_varlen, or to flare_fwd_kvcache").c_str());
    if (a.max_seqlen_q != 0 || a.max_seqlen_k != 0) {
      reject(cat("max_seqlen_q/max_seqlen_k are ", a.max_seqlen_q, "/", a.max_seqlen_k, " but ", a.entry,
                 " is the dense entry: they belong to ", a.entry, "_varlen (leave them 0)"));
    }
  }
  require_layout_rank(a.q, "q", a, "(batch, seqlen_q, nheads, headdim)", "(total_q, nheads, headdim)");
  const bool paged = a.varlen && is_present(a.block_table);
  if (paged) {
    for (const auto& [t, name] : {std::pair{&a.k, "k"}, std::pair{&a.v, "v"}}) {
      if (t->rank != 4) {
        reject(cat(name, " has rank ", t->rank, " (shape ", shape_string(*t), ") but with block_table ", a.entry,
                   " takes ", name, " as a paged cache (num_blocks, block_size, nheads_k, headdim): rank 4"));
      }
    }
  } else {
    require_layout_rank(a.k, "k", a, "(batch, seqlen_k, nheads_k, headdim)", "(total_k, nheads_k, headdim)");
    require_layout_rank(a.v, "v", a, "(batch, seqlen_k, nheads_k, headdim_v)",
                        "(total_k, nheads_k, headdim_v)");
  }

  check_compute_dtype(a.q, "q", a.pass == Pass::kForward);
  require_same_dtype(a.k, "k", a.q, "q");
  require_same_dtype(a.v, "v", a.q, "q");
  require_output_dtype(a.out, "out", a.q);
  if (is_present(a.lse)) require_dtype(a.lse, "softmax_lse", FLARE_DTYPE_F32, "softmax_lse is fp32");

  // The head layout: dims 1.. of a varlen tensor are dims 2.. of a dense one.
  const int o = a.varlen ? 0 : 1;
  const int ok = paged ? 1 : o;  // the same for k and v (a paged cache's dims 2.. are heads, head dim)
  const int64_t nheads = a.q.shape[o + 1];
  const int64_t headdim = a.q.shape[o + 2];
  const int64_t nheads_k = a.k.shape[ok + 1];
  const int64_t headdim_v = a.v.shape[ok + 2];
  check_heads(nheads, nheads_k, "k");
  check_head_dims(headdim, a.varlen ? "q.shape[2] (headdim)" : "q.shape[3] (headdim)", headdim_v,
                  a.varlen ? "v.shape[2] (headdim_v)" : "v.shape[3] (headdim_v)", a.q.device);
  require_int32(nheads, "the number of q heads");

  if (a.varlen) {
    const int64_t total_q = a.q.shape[0];
    require_int32(total_q, "q.shape[0] (total_q)");
    if (paged) {
      const int64_t num_blocks = a.k.shape[0];
      const int64_t block_size = a.k.shape[1];
      require_shape(a.k, "k", {num_blocks, block_size, nheads_k, headdim},
                    "(num_blocks, block_size, nheads_k, headdim of q)");
      require_shape(a.v, "v", {num_blocks, block_size, nheads_k, headdim_v},
                    "(num_blocks, block_size of k, nheads_k, headdim_v)");
    } else {
      const int64_t total_k = a.k.shape[0];
      require_int32(total_k, "k.shape[0] (total_k)");
      require_shape(a.k, "k", {total_k, nheads_k, headdim}, "(total_k, nheads_k, headdim of q)");
      require_shape(a.v, "v", {total_k, nheads_k, headdim_v}, "(total_k of k, nheads_k, headdim_v)");
    }
    require_shape(a.out, "out", {total_q, nheads, headdim_v}, "(total_q, nheads, headdim_v)");
    if (is_present(a.lse)) require_shape(a.lse, "softmax_lse", {nheads, total_q}, "(nheads, total_q)");
    // A paged cache's key count is not a token total: cu_seqlens_k's end is then free (-1).
    check_varlen_indices(a, total_q, paged ? -1 : a.k.shape[0], p);
    p->total_q = total_q;
    p->total_k = a.k.shape[0];
    if (paged) check_paged_kv(a, p);
    p->q = varlen_operand(a.q);
    p->k = paged ? dense_operand(a.k) : varlen_operand(a.k);
    p->v = paged ? dense_operand(a.v) : varlen_operand(a.v);
    p->out = varlen_operand(a.out);
    p->lse_batch_stride = 0;
    p->lse_head_stride = is_present(a.lse) ? a.lse.strides[0] : 0;
  } else {
    const int64_t batch = a.q.shape[0];
    const int64_t seqlen_q = a.q.shape[1];
    const int64_t seqlen_k = a.k.shape[1];
    require_int32(batch, "q.shape[0] (batch)");
    require_int32(seqlen_q, "q.shape[1] (seqlen_q)");
    require_int32(seqlen_k, "k.shape[1] (seqlen_k)");
    require_shape(a.k, "k", {batch, seqlen_k, nheads_k, headdim},
                  "(batch, seqlen_k, nheads_k, headdim of q)");
    require_shape(a.v, "v", {batch, seqlen_k, nheads_k, headdim_v},
                  "(batch, seqlen_k of k, nheads_k, headdim_v)");
    require_shape(a.out, "out", {batch, seqlen_q, nheads, headdim_v}, "(batch, seqlen_q, nheads, headdim_v)");
    if (is_present(a.lse)) {
      require_shape(a.lse, "softmax_lse", {batch, nheads, seqlen_q}, "(batch, nheads, seqlen_q)");
    }
    p->batch = batch;
    p->seqlen_q = seqlen_q;
    p->seqlen_k = seqlen_k;
    p->total_q = batch * seqlen_q;
    p->total_k = batch * seqlen_k;
    p->q = dense_operand(a.q);
    p->k = dense_operand(a.k);
    p->v = dense_operand(a.v);
    p->out = dense_operand(a.out);
    p->lse_batch_stride = is_present(a.lse) ? a.lse.strides[0] : 0;
    p->lse_head_stride = is_present(a.lse) ? a.lse.strides[1] : 0;
  }

  p->pass = a.pass;
  p->dtype = static_cast<flare_dtype>(a.q.dtype);
  p->varlen = a.varlen;
  p->nheads = nheads;
  p->nheads_k = nheads_k;
  p->headdim = headdim;
  p->headdim_v = headdim_v;
  p->lse = is_present(a.lse) ? static_cast<float*>(a.lse.data) : nullptr;
  p->score = check_attn_options(a.attn, a.q, p->batch, nheads, headdim);
  check_exec_options(a.exec, a.q.device, p);
}

// The arch_path of a flare_fwd_params or flare_bwd_params: the field where the caller's struct_size covers
// it (it was appended after 0.1.0, whose structs end before it), else AUTO.
template <class Params>
flare_arch_path read_arch_path(const Params& params) {
  return covers(params, &Params::arch_path) ? check_arch_path(params.arch_path) : FLARE_ARCH_PATH_AUTO;
}

// The dropout fields of a flare_fwd_params or flare_bwd_params (appended after 0.1.0: off where the caller's
// struct ends before them).
template <class Params>
void read_dropout(const Params& params, Problem* p) {
  if (!covers(params, &Params::dropout_offset)) return;
  p->dropout_p = check_dropout_p(params.dropout_p);
  p->dropout_seed = params.dropout_seed;
  p->dropout_offset = params.dropout_offset;
}

}  // namespace

flare_status validate_fwd(const flare_fwd_params* params, bool varlen, Problem* problem) {
  return run_checks([&] {
    check_struct_size(params, params ? params->struct_size : 0, offsetof(flare_fwd_params, arch_path),
                      "flare_fwd_params");
    const flare_fwd_params& f = *params;
    // block_table was appended after arch_path: absent where the caller's struct ends before it.
    const bool has_block_table = covers(f, &flare_fwd_params::block_table);
    const flare_tensor no_tensor{};
    const AttnArgs args{varlen ? "flare_fwd_varlen" : "flare_fwd", Pass::kForward, varlen, f.q, f.k, f.v,
                        f.out, f.softmax_lse, f.cu_seqlens_q, f.cu_seqlens_k, f.seqused_k,
                        has_block_table ? f.block_table : no_tensor, f.max_seqlen_q, f.max_seqlen_k, f.attn,
                        f.exec};
    Problem p;
    check_attention(args, &p);
    p.arch_path = read_arch_path(f);
    if (covers(f, &flare_fwd_params::sinks)) p.sinks = check_sinks(f.sinks, "sinks", f.q, p.nheads);
    read_dropout(f, &p);
    require_no_overlap(f.out, "out");
    if (is_present(f.softmax_lse)) require_no_overlap(f.softmax_lse, "softmax_lse");
    *problem = p;
  });
}

flare_status validate_bwd(const flare_bwd_params* params, bool varlen, Problem* problem) {
  return run_checks([&] {
    check_struct_size(params, params ? params->struct_size : 0, offsetof(flare_bwd_params, arch_path),
                      "flare_bwd_params");
    const flare_bwd_params& b = *params;
    const flare_tensor no_block_table{};
    const AttnArgs args{varlen ? "flare_bwd_varlen" : "flare_bwd", Pass::kBackward, varlen, b.q, b.k, b.v,
                        b.out, b.softmax_lse, b.cu_seqlens_q, b.cu_seqlens_k, b.seqused_k, no_block_table,
                        b.max_seqlen_q, b.max_seqlen_k, b.attn, b.exec};
    // The gradients mirror the forward tensors: dout like out, dq like q, dk like k, dv like v.
    const std::pair<const flare_tensor*, const char*> grads[] = {
        {&b.dout, "dout"}, {&b.dq, "dq"}, {&b.dk, "dk"}, {&b.dv, "dv"}};
    const flare_tensor* mirrors[] = {&b.out, &b.q, &b.k, &b.v};
    const char* mirror_names[] = {"out", "q", "k", "v"};
    for (const auto& [t, name] : grads) require_present(*t, name);
    Problem p;
    check_attention(args, &p);
    for (int i = 0; i < 4; ++i) {
      const auto& [t, name] = grads[i];
      check_tensor(*t, name);
      require_same_device(*t, name, b.q, "q");
      require_same_dtype(*t, name, b.q, "q");
      const flare_tensor& m = *mirrors[i];
      bool same = t->rank == m.rank;
      for (int d = 0; same && d < m.rank; ++d) same = t->shape[d] == m.shape[d];
      if (!same) {
        reject(cat(name, " has shape ", shape_string(*t), " but ", mirror_names[i], " has shape ",
                   shape_string(m), ": ", name, " must have the shape of ", mirror_names[i]));
      }
    }
    if (b.deterministic != 0 && b.deterministic != 1) {
      reject(cat("deterministic is ", b.deterministic, ": it must be 0 or 1"));
    }
    p.arch_path = read_arch_path(b);
    if (covers(b, &flare_bwd_params::sinks)) {
      p.sinks = check_sinks(b.sinks, "sinks", b.q, p.nheads);
      p.dsinks = check_sinks(b.dsinks, "dsinks", b.q, p.nheads);
      if (p.dsinks != nullptr && p.sinks == nullptr) {
        reject("dsinks is given but sinks is absent: the sinks' gradient needs the sinks of the forward");
      }
      if (p.dsinks != nullptr) require_no_overlap(b.dsinks, "dsinks");
    }
    read_dropout(b, &p);
    for (int i = 1; i < 4; ++i) require_no_overlap(*grads[i].first, grads[i].second);
    const auto operand = varlen ? varlen_operand : dense_operand;
    p.dout = operand(b.dout);
    p.dq = operand(b.dq);
    p.dk = operand(b.dk);
    p.dv = operand(b.dv);
    p.deterministic = b.deterministic == 1;
    *problem = p;
  });
}

flare_status validate_workspace(const Problem& problem) {
  if (problem.workspace == nullptr || problem.device.type != FLARE_DEVICE_CPU) return FLARE_OK;
  size_t needed = 0;
  if (flare_status s = cpu::workspace_size(problem, &needed); s != FLARE_OK) return s;
  if (problem.workspace_size < needed) {
    return fail(FLARE_OUT_OF_MEMORY,
                cat("exec.workspace_size is ", problem.workspace_size, " bytes but this call needs ", needed,
                    " bytes: give a larger workspace (see the *_workspace_size query) or NULL to let flare "
                    "allocate"));
  }
  return FLARE_OK;
}

}  // namespace flare::detail
