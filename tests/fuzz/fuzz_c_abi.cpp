// fuzz_c_abi.cpp — a fuzz target for the C ABI on the CPU backend (LLVMFuzzerTestOneInput).
//
// The input bytes choose a pass (forward, varlen forward, backward, varlen backward, KV cache dense or paged,
// or a workspace-size query with huge extents), its shapes, dtype, options, strides and index tensors, and
// seed the values. Every buffer is allocated to exactly the extent its view claims (shape and strides), so
// any read or write past it is flare's, and AddressSanitizer reports it. What must hold for every input:
//   - no crash, no sanitizer report, no hang;
//   - a call that fails names why (flare_last_error) and writes nothing: outputs, and the caches, keep
//     their bytes;
//   - a call that succeeds on finite inputs writes finite outputs (lse: finite or -inf, never NaN or +inf).
// Built with libFuzzer under clang (-fsanitize=fuzzer), or with fuzz_driver.cpp's seeded random driver
// elsewhere; both replay the regression seeds in tests/fuzz/corpus (scripts/check-sanitizers.sh).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "flare/flare.h"

namespace {

// Reads the input front to back; past its end every read gives 0.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = v << 8 | u8();
    return v;
  }
  // An integer in [lo, hi].
  int64_t range(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    const uint64_t x = span <= 256 ? u8() : u32();
    return lo + static_cast<int64_t>(x % span);
  }
  bool flag(int one_in = 2) { return u8() % one_in == 0; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

int64_t element_size(flare_dtype dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F64: return 8;
    case FLARE_DTYPE_F16:
    case FLARE_DTYPE_BF16: return 2;
    default: return 4;
  }
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
uint16_t float_to_f16(float f) {  // inputs here are within fp16's normal range or 0, NaN, inf
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a < 0x38800000u) return static_cast<uint16_t>(sign);
  const uint32_t v = a - 0x38000000u;
  return static_cast<uint16_t>(sign | ((v + 0xfffu + ((v >> 13) & 1u)) >> 13));
}
double element_value(const void* base, flare_dtype dtype, int64_t i) {
  switch (dtype) {
    case FLARE_DTYPE_F64: return static_cast<const double*>(base)[i];
    case FLARE_DTYPE_F32: return static_cast<const float*>(base)[i];
    case FLARE_DTYPE_BF16: {
      const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case FLARE_DTYPE_F16: {
      const uint16_t h = static_cast<const uint16_t*>(base)[i];
      const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
      const double mag = e == 0x1f ? (m ? NAN : INFINITY) : e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
      return h & 0x8000 ? -mag : mag;
    }
    default: return 0;
  }
}

// One tensor: its view and a heap block of exactly the bytes the view spans (at least one, so data is never
// null; a zero-element tensor's block is never read).
struct Tensor {
  flare_tensor view{};
  std::unique_ptr<unsigned char[]> block;
  size_t bytes = 0;
  int64_t elements = 0;  // elements spanned: offsets 0 .. elements - 1 from view.data
};

// Layouts the views take: contiguous, rows padded apart, the batch dimension broadcast (stride 0: inputs
// only), or the two middle dimensions' strides swapped (heads outer).
enum class Layout { kContiguous, kPadded, kBroadcast, kHeadsOuter };

Layout pick_layout(Bytes& in, bool input) {
  switch (in.range(0, 7)) {
    case 5: return Layout::kPadded;
    case 6: return input ? Layout::kBroadcast : Layout::kPadded;
    case 7: return Layout::kHeadsOuter;
    default: return Layout::kContiguous;
  }
}

constexpr int64_t kMaxBlockBytes = int64_t{1} << 26;

// A tensor of `shape` in `layout`; nullptr-free. Returns false when its span would exceed kMaxBlockBytes.
bool make_tensor(Tensor& t, flare_dtype dtype, std::vector<int64_t> shape, Layout layout, int64_t pad) {
  const int rank = static_cast<int>(shape.size());
  flare_tensor& v = t.view;
  v.dtype = dtype;
  v.device = {FLARE_DEVICE_CPU, 0};
  v.rank = rank;
  int64_t stride = 1;
  for (int d = rank - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d] > 0 ? shape[d] : 1;
    if (layout == Layout::kPadded && d == rank - 1) stride += pad;
  }
  if (layout == Layout::kBroadcast && rank >= 3) v.strides[0] = 0;
  if (layout == Layout::kHeadsOuter && rank == 4) {
    // (b, s, h, d) stored as (b, h, s, d).
    v.strides[2] = shape[3] * shape[1];
    v.strides[1] = shape[3];
    if (shape[1] == 0) v.strides[2] = shape[3];
  }
  int64_t last = 0;
  bool empty = false;
  for (int d = 0; d < rank; ++d) {
    if (v.shape[d] <= 0) empty = true;
    else last += (v.shape[d] - 1) * v.strides[d];
  }
  t.elements = empty ? 0 : last + 1;
  const int64_t es = dtype == FLARE_DTYPE_I32 ? 4 : element_size(dtype);
  if (t.elements > kMaxBlockBytes / es) return false;
  t.bytes = static_cast<size_t>(t.elements * es);
  t.block.reset(new unsigned char[t.bytes ? t.bytes : 1]);
  v.data = t.block.get();
  return true;
}

// Random values in [-2, 2]; where `nonfinite` some become NaN or ±inf.
void fill_values(Tensor& t, std::mt19937& rng, bool nonfinite) {
  const auto dtype = static_cast<flare_dtype>(t.view.dtype);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  std::uniform_int_distribution<int> odd(0, 63);
  const float specials[3] = {NAN, INFINITY, -INFINITY};
  for (int64_t i = 0; i < t.elements; ++i) {
    float x = uni(rng);
    if (nonfinite && odd(rng) == 0) x = specials[odd(rng) % 3];
    switch (dtype) {
      case FLARE_DTYPE_F64: reinterpret_cast<double*>(t.block.get())[i] = x; break;
      case FLARE_DTYPE_F32: reinterpret_cast<float*>(t.block.get())[i] = x; break;
      case FLARE_DTYPE_BF16: reinterpret_cast<uint16_t*>(t.block.get())[i] = float_to_bf16(x); break;
      case FLARE_DTYPE_F16: reinterpret_cast<uint16_t*>(t.block.get())[i] = float_to_f16(x); break;
      default: break;
    }
  }
}

// An output poisoned with a byte pattern, and a copy of the pattern to compare against after a failure.
void poison(Tensor& t, std::vector<unsigned char>& copy) {
  std::memset(t.block.get(), 0xA5, t.bytes);
  copy.assign(t.block.get(), t.block.get() + t.bytes);
}

void fail(const char* what) {
  std::fprintf(stderr, "fuzz_c_abi: %s\n", what);
  std::abort();
}

// Every element the view reaches is finite (lse: finite or -inf).
void expect_finite(const Tensor& t, bool is_lse, const char* name) {
  const auto dtype = static_cast<flare_dtype>(t.view.dtype);
  const flare_tensor& v = t.view;
  if (t.elements == 0) return;
  int64_t idx[FLARE_MAX_RANK] = {};
  for (;;) {
    int64_t off = 0;
    for (int d = 0; d < v.rank; ++d) off += idx[d] * v.strides[d];
    const double x = element_value(v.data, dtype, off);
    if (std::isnan(x) || (std::isinf(x) && !(is_lse && x < 0))) {
      std::fprintf(stderr, "fuzz_c_abi: %s holds %g at offset %lld after a successful call\n", name, x,
                   static_cast<long long>(off));
      std::abort();
    }
    int d = v.rank - 1;
    while (d >= 0 && ++idx[d] == v.shape[d]) idx[d--] = 0;
    if (d < 0) return;
  }
}

struct Outputs {
  std::vector<std::pair<Tensor*, std::vector<unsigned char>>> list;
  void add(Tensor& t) {
    list.emplace_back(&t, std::vector<unsigned char>());
    poison(t, list.back().second);
  }
  // A failed call wrote nothing: every output (and cache) still holds what it held before.
  void expect_unchanged(flare_status s) const {
    const char* err = flare_last_error();
    if (err == nullptr || *err == '\0') fail("a failed call left flare_last_error empty");
    for (const auto& [t, before] : list)
      if (t->bytes && std::memcmp(t->block.get(), before.data(), t->bytes) != 0) {
        std::fprintf(stderr, "fuzz_c_abi: status %d (%s) but an output was written\n", s, err);
        std::abort();
      }
  }
};

// Index tensors: int32, one dimension (or two for block_table), values chosen by the caller.
bool make_index(Tensor& t, const std::vector<int64_t>& shape, const std::vector<int32_t>& values) {
  if (!make_tensor(t, FLARE_DTYPE_I32, shape, Layout::kContiguous, 0)) return false;
  if (!values.empty()) std::memcpy(t.block.get(), values.data(), std::min(values.size() * 4, t.bytes));
  return true;
}

// Perturbs a valid index list now and then, so validation sees the wrong ones too.
void perturb(Bytes& in, std::vector<int32_t>& values) {
  if (values.empty() || !in.flag(6)) return;
  const size_t i = static_cast<size_t>(in.range(0, static_cast<int64_t>(values.size()) - 1));
  switch (in.range(0, 3)) {
    case 0: values[i] = -1; break;
    case 1: values[i] += static_cast<int32_t>(in.range(1, 4)); break;
    case 2: values[i] = INT32_MAX; break;
    default: values[i] = static_cast<int32_t>(in.u32()); break;
  }
}

struct Shape {
  flare_dtype dtype;
  int64_t batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v;
};

Shape pick_shape(Bytes& in) {
  static const flare_dtype kDtypes[4] = {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64};
  static const int64_t kHeaddims[16] = {1, 3, 8, 16, 31, 32, 64, 80, 96, 128, 256, 257, 320, 512, 576, 577};
  Shape s;
  s.dtype = kDtypes[in.range(0, 3)];
  s.batch = in.range(0, 3);
  s.seqlen_q = in.flag(4) ? in.range(0, 3) : in.range(0, 80);
  s.seqlen_k = in.flag(4) ? in.range(0, 3) : in.range(0, 300);
  s.nheads_k = in.range(1, 3);
  s.nheads = s.nheads_k * in.range(1, 3);
  if (in.flag(16)) s.nheads = in.range(1, 7);  // not always a multiple
  s.headdim = in.flag(3) ? in.range(1, 40) : kHeaddims[in.range(0, 15)];
  s.headdim_v = in.flag(4) ? (in.flag() ? in.range(1, 40) : kHeaddims[in.range(0, 15)]) : s.headdim;
  return s;
}

void pick_options(Bytes& in, const Shape& s, flare_attn_options& a, flare_exec_options& e, Tensor& alibi) {
  static const float kScales[5] = {0.0f, 0.0f, 0.125f, 1.0f, 1e-3f};
  a.softmax_scale = kScales[in.range(0, 4)];
  a.softcap = in.flag(5) ? static_cast<float>(in.range(1, 60)) : 0.0f;
  a.causal = in.flag(3) ? 1 : 0;
  a.window_left = in.flag(4) ? static_cast<int32_t>(in.range(-1, 40)) : -1;
  a.window_right = in.flag(4) ? static_cast<int32_t>(in.range(-1, 40)) : -1;
  if (in.flag(5)) {
    std::vector<int64_t> shape = in.flag() ? std::vector<int64_t>{s.nheads} : std::vector<int64_t>{s.batch, s.nheads};
    if (make_tensor(alibi, FLARE_DTYPE_F32, shape, Layout::kContiguous, 0)) {
      for (int64_t i = 0; i < alibi.elements; ++i)
        reinterpret_cast<float*>(alibi.block.get())[i] = static_cast<float>(in.range(0, 64)) / 64.0f;
      a.alibi_slopes = alibi.view;
    }
  }
  e.num_threads = static_cast<int32_t>(in.range(0, 3));
}

// The caller's workspace, sized exactly as the size query says (an under-report then overflows it).
struct Workspace {
  std::unique_ptr<unsigned char[]> block;
  bool set(flare_exec_options& e, flare_status s, size_t bytes) {
    if (s != FLARE_OK || bytes > static_cast<size_t>(kMaxBlockBytes) * 4) return false;
    block.reset(new unsigned char[bytes ? bytes : 1]);
    e.workspace = block.get();
    e.workspace_size = bytes;
    return true;
  }
};

// Dense or varlen sequences: the lengths of each, and the cu_seqlens / seqused_k of the varlen layout.
struct Sequences {
  std::vector<int32_t> cu_q, cu_k, used_k;
  int64_t total_q = 0, total_k = 0;
};

Sequences pick_sequences(Bytes& in, const Shape& s) {
  Sequences seq;
  seq.cu_q.push_back(0);
  seq.cu_k.push_back(0);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t lq = in.range(0, s.seqlen_q), lk = in.range(0, s.seqlen_k);
    seq.cu_q.push_back(static_cast<int32_t>(seq.cu_q.back() + lq));
    seq.cu_k.push_back(static_cast<int32_t>(seq.cu_k.back() + lk));
    seq.used_k.push_back(static_cast<int32_t>(in.range(0, lk)));
  }
  seq.total_q = seq.cu_q.back();
  seq.total_k = seq.cu_k.back();
  perturb(in, seq.cu_q);
  perturb(in, seq.cu_k);
  perturb(in, seq.used_k);
  return seq;
}

void run_forward(Bytes& in, std::mt19937& rng, bool varlen) {
  const Shape s = pick_shape(in);
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  Tensor q, k, v, out, lse, cu_q, cu_k, used_k, alibi;
  Sequences seq;
  const bool nonfinite = in.flag(8);
  const int64_t pad = in.range(1, 9);
  bool ok = true;
  if (varlen) {
    seq = pick_sequences(in, s);
    ok = make_tensor(q, s.dtype, {seq.total_q, s.nheads, s.headdim}, pick_layout(in, false), pad) &&
         make_tensor(k, s.dtype, {seq.total_k, s.nheads_k, s.headdim}, pick_layout(in, false), pad) &&
         make_tensor(v, s.dtype, {seq.total_k, s.nheads_k, s.headdim_v}, pick_layout(in, false), pad) &&
         make_tensor(out, s.dtype, {seq.total_q, s.nheads, s.headdim_v}, pick_layout(in, false), pad) &&
         make_tensor(lse, FLARE_DTYPE_F32, {s.nheads, seq.total_q}, Layout::kContiguous, 0) &&
         make_index(cu_q, {s.batch + 1}, seq.cu_q) && make_index(cu_k, {s.batch + 1}, seq.cu_k);
    if (ok && in.flag(3)) ok = make_index(used_k, {s.batch}, seq.used_k);
    p.cu_seqlens_q = cu_q.view;
    p.cu_seqlens_k = cu_k.view;
    if (used_k.block) p.seqused_k = used_k.view;
    if (in.flag(3)) {
      p.max_seqlen_q = static_cast<int32_t>(in.range(0, s.seqlen_q + 2));
      p.max_seqlen_k = static_cast<int32_t>(in.range(0, s.seqlen_k + 2));
    }
  } else {
    ok = make_tensor(q, s.dtype, {s.batch, s.seqlen_q, s.nheads, s.headdim}, pick_layout(in, true), pad) &&
         make_tensor(k, s.dtype, {s.batch, s.seqlen_k, s.nheads_k, s.headdim}, pick_layout(in, true), pad) &&
         make_tensor(v, s.dtype, {s.batch, s.seqlen_k, s.nheads_k, s.headdim_v}, pick_layout(in, true), pad) &&
         make_tensor(out, s.dtype, {s.batch, s.seqlen_q, s.nheads, s.headdim_v}, pick_layout(in, false), pad) &&
         make_tensor(lse, FLARE_DTYPE_F32, {s.batch, s.nheads, s.seqlen_q}, Layout::kContiguous, 0);
  }
  if (!ok) return;
  fill_values(q, rng, false);
  fill_values(k, rng, nonfinite);
  fill_values(v, rng, nonfinite);
  p.q = q.view;
  p.k = k.view;
  p.v = v.view;
  p.out = out.view;
  const bool with_lse = !in.flag(5);
  if (with_lse) p.softmax_lse = lse.view;
  pick_options(in, s, p.attn, p.exec, alibi);
  Workspace ws;
  if (in.flag(4)) {
    size_t bytes = 0;
    ws.set(p.exec, flare_fwd_workspace_size(&p, varlen ? 1 : 0, &bytes), bytes);
  }
  Outputs outputs;
  outputs.add(out);
  outputs.add(lse);
  const flare_status st = varlen ? flare_fwd_varlen(&p) : flare_fwd(&p);
  if (st != FLARE_OK) return outputs.expect_unchanged(st);
  if (nonfinite) return;
  // Varlen rows past the last sequence are not written; check only what the dense layout covers.
  if (!varlen) {
    expect_finite(out, false, "out");
    if (with_lse) expect_finite(lse, true, "softmax_lse");
  }
}

void run_backward(Bytes& in, std::mt19937& rng, bool varlen) {
  const Shape s = pick_shape(in);
  flare_bwd_params p;
  flare_bwd_params_init(&p);
  Tensor q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k, used_k, alibi;
  Sequences seq;
  const int64_t pad = in.range(1, 9);
  bool ok = true;
  std::vector<int64_t> qs, ks, vs, os, ls;
  if (varlen) {
    seq = pick_sequences(in, s);
    qs = {seq.total_q, s.nheads, s.headdim};
    ks = {seq.total_k, s.nheads_k, s.headdim};
    vs = {seq.total_k, s.nheads_k, s.headdim_v};
    os = {seq.total_q, s.nheads, s.headdim_v};
    ls = {s.nheads, seq.total_q};
    ok = make_index(cu_q, {s.batch + 1}, seq.cu_q) && make_index(cu_k, {s.batch + 1}, seq.cu_k);
    if (ok && in.flag(3)) ok = make_index(used_k, {s.batch}, seq.used_k);
    p.cu_seqlens_q = cu_q.view;
    p.cu_seqlens_k = cu_k.view;
    if (used_k.block) p.seqused_k = used_k.view;
  } else {
    qs = {s.batch, s.seqlen_q, s.nheads, s.headdim};
    ks = {s.batch, s.seqlen_k, s.nheads_k, s.headdim};
    vs = {s.batch, s.seqlen_k, s.nheads_k, s.headdim_v};
    os = {s.batch, s.seqlen_q, s.nheads, s.headdim_v};
    ls = {s.batch, s.nheads, s.seqlen_q};
  }
  ok = ok && make_tensor(q, s.dtype, qs, pick_layout(in, !varlen), pad) &&
       make_tensor(k, s.dtype, ks, pick_layout(in, !varlen), pad) &&
       make_tensor(v, s.dtype, vs, pick_layout(in, !varlen), pad) &&
       make_tensor(out, s.dtype, os, pick_layout(in, !varlen), pad) &&
       make_tensor(dout, s.dtype, os, pick_layout(in, !varlen), pad) &&
       make_tensor(lse, FLARE_DTYPE_F32, ls, Layout::kContiguous, 0) &&
       make_tensor(dq, s.dtype, qs, pick_layout(in, false), pad) &&
       make_tensor(dk, s.dtype, ks, pick_layout(in, false), pad) &&
       make_tensor(dv, s.dtype, vs, pick_layout(in, false), pad);
  if (!ok) return;
  for (Tensor* t : {&q, &k, &v, &dout}) fill_values(*t, rng, false);
  pick_options(in, s, p.attn, p.exec, alibi);
  // out and lse from the forward with the same arguments; where it fails, arbitrary ones (the backward must
  // then fail too, or at least not crash: its outputs are not checked).
  flare_fwd_params f;
  flare_fwd_params_init(&f);
  f.q = q.view;
  f.k = k.view;
  f.v = v.view;
  f.out = out.view;
  f.softmax_lse = lse.view;
  f.cu_seqlens_q = p.cu_seqlens_q;
  f.cu_seqlens_k = p.cu_seqlens_k;
  f.seqused_k = p.seqused_k;
  f.attn = p.attn;
  f.exec.num_threads = p.exec.num_threads;
  const bool consistent = (varlen ? flare_fwd_varlen(&f) : flare_fwd(&f)) == FLARE_OK;
  if (!consistent) {
    fill_values(out, rng, false);
    for (int64_t i = 0; i < lse.elements; ++i)
      reinterpret_cast<float*>(lse.block.get())[i] = in.flag(16) ? -INFINITY : static_cast<float>(in.range(0, 40)) / 8.0f;
  }
  p.q = q.view;
  p.k = k.view;
  p.v = v.view;
  p.out = out.view;
  p.dout = dout.view;
  p.softmax_lse = lse.view;
  p.dq = dq.view;
  p.dk = dk.view;
  p.dv = dv.view;
  p.deterministic = in.flag() ? 1 : 0;
  Workspace ws;
  if (in.flag(4)) {
    size_t bytes = 0;
    ws.set(p.exec, flare_bwd_workspace_size(&p, varlen ? 1 : 0, &bytes), bytes);
  }
  Outputs outputs;
  outputs.add(dq);
  outputs.add(dk);
  outputs.add(dv);
  const flare_status st = varlen ? flare_bwd_varlen(&p) : flare_bwd(&p);
  if (st != FLARE_OK) return outputs.expect_unchanged(st);
  // fp16 gradients may overflow legitimately (dK sums over every query of a group); varlen rows past the
  // last sequence are not written.
  if (consistent && !varlen && s.dtype != FLARE_DTYPE_F16) {
    expect_finite(dq, false, "dq");
    expect_finite(dk, false, "dk");
    expect_finite(dv, false, "dv");
  }
}

void run_kvcache(Bytes& in, std::mt19937& rng) {
  const Shape s = pick_shape(in);
  flare_kvcache_params p;
  flare_kvcache_params_init(&p);
  Tensor q, kc, vc, kn, vn, out, lse, seqlens, batch_idx, leftpad, table, cos, sin, alibi;
  const bool paged = in.flag(3);
  const int64_t seqlen_new = in.flag() ? in.range(0, 4) : -1;  // -1: no append
  const int64_t block_size = paged ? in.range(1, 32) : 0;
  const int64_t max_blocks = paged ? in.range(1, 12) : 0;
  const int64_t num_blocks = paged ? in.range(1, 3 * max_blocks + 1) : 0;
  const int64_t batch_cache = paged ? 0 : s.batch + in.range(0, 2);
  const int64_t capacity = paged ? max_blocks * block_size : s.seqlen_k;
  const int64_t pad = in.range(1, 9);
  const std::vector<int64_t> cache_k = paged ? std::vector<int64_t>{num_blocks, block_size, s.nheads_k, s.headdim}
                                             : std::vector<int64_t>{batch_cache, s.seqlen_k, s.nheads_k, s.headdim};
  std::vector<int64_t> cache_v = cache_k;
  cache_v[3] = s.headdim_v;
  bool ok = make_tensor(q, s.dtype, {s.batch, s.seqlen_q, s.nheads, s.headdim}, pick_layout(in, true), pad) &&
            make_tensor(kc, s.dtype, cache_k, pick_layout(in, false), pad) &&
            make_tensor(vc, s.dtype, cache_v, pick_layout(in, false), pad) &&
            make_tensor(out, s.dtype, {s.batch, s.seqlen_q, s.nheads, s.headdim_v}, pick_layout(in, false), pad) &&
            make_tensor(lse, FLARE_DTYPE_F32, {s.batch, s.nheads, s.seqlen_q}, Layout::kContiguous, 0);
  if (!ok) return;
  const bool nonfinite = in.flag(8);
  fill_values(q, rng, false);
  fill_values(kc, rng, nonfinite);
  fill_values(vc, rng, nonfinite);
  p.q = q.view;
  p.k_cache = kc.view;
  p.v_cache = vc.view;
  p.out = out.view;
  if (in.flag(4) != 0) p.softmax_lse = lse.view;
  const int64_t room = seqlen_new > 0 ? seqlen_new : 0;
  std::vector<int32_t> lens, pads, idx, blocks;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t len = in.range(0, capacity > room ? capacity - room : 0);
    lens.push_back(static_cast<int32_t>(len));
    pads.push_back(static_cast<int32_t>(in.range(0, len)));
    idx.push_back(static_cast<int32_t>(b));
  }
  if (paged) {
    // Distinct blocks per sequence while they last (sequences that share a block may not both append).
    int32_t next = 0;
    for (int64_t i = 0; i < s.batch * max_blocks; ++i)
      blocks.push_back(next < num_blocks ? next++ : static_cast<int32_t>(in.range(0, num_blocks - 1)));
    perturb(in, blocks);
  }
  perturb(in, lens);
  perturb(in, pads);
  perturb(in, idx);
  if (in.flag(4) == 0 || seqlen_new > 0) {
    ok = make_index(seqlens, {s.batch}, lens);
    p.cache_seqlens = seqlens.view;
  }
  if (ok && in.flag(4)) {
    ok = make_index(leftpad, {s.batch}, pads);
    p.cache_leftpad = leftpad.view;
  }
  if (ok && !paged && in.flag(3)) {
    ok = make_index(batch_idx, {s.batch}, idx);
    p.cache_batch_idx = batch_idx.view;
  }
  if (ok && paged) {
    ok = make_index(table, {s.batch, max_blocks}, blocks);
    p.block_table = table.view;
  }
  if (ok && seqlen_new >= 0) {
    ok = make_tensor(kn, s.dtype, {s.batch, seqlen_new, s.nheads_k, s.headdim}, Layout::kContiguous, 0) &&
         make_tensor(vn, s.dtype, {s.batch, seqlen_new, s.nheads_k, s.headdim_v}, Layout::kContiguous, 0);
    if (ok) {
      fill_values(kn, rng, false);
      fill_values(vn, rng, false);
      p.k_new = kn.view;
      p.v_new = vn.view;
    }
  }
  if (ok && in.flag(4)) {
    const int64_t rotary_dim = 2 * in.range(1, (s.headdim + 1) / 2);
    const int64_t rows = capacity + 8;
    ok = make_tensor(cos, s.dtype, {rows, rotary_dim / 2}, Layout::kContiguous, 0) &&
         make_tensor(sin, s.dtype, {rows, rotary_dim / 2}, Layout::kContiguous, 0);
    if (ok) {
      fill_values(cos, rng, false);
      fill_values(sin, rng, false);
      p.rotary_cos = cos.view;
      p.rotary_sin = sin.view;
      p.rotary_interleaved = in.flag() ? 1 : 0;
    }
  }
  if (!ok) return;
  pick_options(in, s, p.attn, p.exec, alibi);
  Workspace ws;
  if (in.flag(4)) {
    size_t bytes = 0;
    ws.set(p.exec, flare_kvcache_workspace_size(&p, &bytes), bytes);
  }
  Outputs outputs;
  outputs.add(out);
  if (p.softmax_lse.rank) outputs.add(lse);
  // The caches are written only by a successful append: keep copies to compare after a failure.
  std::vector<unsigned char> kc_before(kc.block.get(), kc.block.get() + kc.bytes),
      vc_before(vc.block.get(), vc.block.get() + vc.bytes);
  const flare_status st = flare_fwd_kvcache(&p);
  if (st != FLARE_OK) {
    outputs.expect_unchanged(st);
    if ((kc.bytes && std::memcmp(kc.block.get(), kc_before.data(), kc.bytes) != 0) ||
        (vc.bytes && std::memcmp(vc.block.get(), vc_before.data(), vc.bytes) != 0))
      fail("a failed kv-cache call wrote into the cache");
    return;
  }
  if (!nonfinite) {
    expect_finite(out, false, "out");
    if (p.softmax_lse.rank) expect_finite(lse, true, "softmax_lse");
  }
}

// Huge extents that cost nothing to store (stride 0) through the workspace-size queries only: the sizes
// must be refused or reported without overflow, and no query may crash.
void run_size_query(Bytes& in) {
  static unsigned char cell[64];
  const auto huge = [&]() -> int64_t {
    switch (in.range(0, 3)) {
      case 0: return in.range(1, 1 << 20);
      case 1: return int64_t{1} << in.range(20, 62);
      case 2: return INT32_MAX + in.range(-2, 2);
      default: return in.range(0, 300);
    }
  };
  flare_tensor t[5];
  const int64_t batch = huge(), sq = huge(), sk = huge(), hk = in.range(1, 4), h = hk * in.range(1, 4);
  const int64_t d = in.range(1, 577);
  const int64_t shapes[5][4] = {{batch, sq, h, d}, {batch, sk, hk, d}, {batch, sk, hk, d}, {batch, sq, h, d},
                                {batch, h, sq, 1}};
  for (int i = 0; i < 5; ++i) {
    t[i] = flare_tensor{};
    t[i].data = cell;
    t[i].dtype = i == 4 ? FLARE_DTYPE_F32 : FLARE_DTYPE_BF16;
    t[i].device = {FLARE_DEVICE_CPU, 0};
    t[i].rank = i == 4 ? 3 : 4;
    for (int j = 0; j < t[i].rank; ++j) {
      t[i].shape[j] = shapes[i][j];
      t[i].strides[j] = (j == t[i].rank - 1 && i != 4) ? 1 : 0;
    }
  }
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  p.q = t[0];
  p.k = t[1];
  p.v = t[2];
  p.out = t[3];
  if (in.flag()) p.softmax_lse = t[4];
  p.attn.causal = in.flag() ? 1 : 0;
  p.exec.num_threads = static_cast<int32_t>(in.flag() ? in.range(0, 8) : in.u32() & 0x7fffffff);
  size_t bytes = 0;
  if (flare_fwd_workspace_size(&p, 0, &bytes) != FLARE_OK && *flare_last_error() == '\0')
    fail("a failed size query left flare_last_error empty");
  flare_bwd_params b;
  flare_bwd_params_init(&b);
  b.q = t[0];
  b.k = t[1];
  b.v = t[2];
  b.out = t[3];
  b.dout = t[3];
  b.softmax_lse = t[4];
  b.dq = t[0];
  b.dk = t[1];
  b.dv = t[2];
  b.exec.num_threads = p.exec.num_threads;
  if (flare_bwd_workspace_size(&b, 0, &bytes) != FLARE_OK && *flare_last_error() == '\0')
    fail("a failed size query left flare_last_error empty");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  std::mt19937 rng(in.u32());
  switch (in.range(0, 6)) {
    case 0: run_forward(in, rng, false); break;
    case 1: run_forward(in, rng, true); break;
    case 2: run_backward(in, rng, false); break;
    case 3: run_backward(in, rng, true); break;
    case 4:
    case 5: run_kvcache(in, rng); break;
    default: run_size_query(in); break;
  }
  return 0;
}
