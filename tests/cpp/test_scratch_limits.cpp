// test_scratch_limits.cpp — legal inputs at the edges: scratch sized by the keys a call uses (not a KV
// cache's capacity or varlen's max_seqlen), size arithmetic that cannot wrap around, strides of
// single-element dims that do not fit in bytes, thread counts of huge problems, and outputs whose pages do
// not exist yet.
#include <gtest/gtest.h>
#include <omp.h>

#if defined(__linux__)
#  include <sys/mman.h>
#  include <unistd.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bad_input_cases.hpp"

namespace flare::badinput {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Makes a view read `extent` rows of one stored row: dimension d broadcast (stride 0).
void broadcast(flare_tensor& t, int d, int64_t extent) {
  t.shape[d] = extent;
  t.strides[d] = 0;
}

// A read-only dense KV cache of `slots` positions per sequence that stores one position (broadcast), so any
// capacity costs no memory. Every key and value is that position's: attention returns its value row.
struct BroadcastCache {
  Tensor q, k, v, out, seqlens;
  flare_kvcache_params params;

  BroadcastCache(int64_t batch, int64_t slots, int64_t heads, int64_t heads_k, int64_t dim, int64_t dim_v) {
    q = Tensor(FLARE_DTYPE_F32, {batch, 1, heads, dim}, 41);
    k = Tensor(FLARE_DTYPE_F32, {1, 1, heads_k, dim}, 42);
    v = Tensor(FLARE_DTYPE_F32, {1, 1, heads_k, dim_v}, 43);
    out = Tensor(FLARE_DTYPE_F32, {batch, 1, heads, dim_v}, 44);
    flare_kvcache_params_init(&params);
    params.q = q.view;
    params.k_cache = k.view;
    params.v_cache = v.view;
    for (flare_tensor* t : {&params.k_cache, &params.v_cache}) {
      broadcast(*t, 0, batch);
      broadcast(*t, 1, slots);
    }
    params.out = out.view;
  }
  void use_lengths(const std::vector<int32_t>& lengths) {
    seqlens = Tensor::ints(lengths);
    params.cache_seqlens = seqlens.view;
  }
  size_t workspace_bytes() {
    size_t bytes = 0;
    EXPECT_EQ(flare_kvcache_workspace_size(&params, &bytes), FLARE_OK) << flare_last_error();
    return bytes;
  }
  // Runs in a workspace of exactly the queried size; every output row must be its kv head's value row.
  void run_and_check() {
    std::vector<uint8_t> workspace(workspace_bytes());
    params.exec.workspace = workspace.data();
    params.exec.workspace_size = workspace.size();
    ASSERT_EQ(flare_fwd_kvcache(&params), FLARE_OK) << flare_last_error();
    const int64_t batch = params.q.shape[0], heads = params.q.shape[2], heads_k = params.k_cache.shape[2];
    const int64_t dim_v = params.v_cache.shape[3];
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < dim_v; ++c)
          EXPECT_NEAR(out.f32()[(b * heads + h) * dim_v + c], v.f32()[h / (heads / heads_k) * dim_v + c], 1e-5);
  }
};

// A 1-query decode over a 131072-slot cache sizes its scratch by the keys the sequences hold.
TEST(ScratchLimits, DecodeScratchFollowsKeysUsedNotCapacity) {
  BroadcastCache c(2, 131072, 4, 2, 64, 64);
  c.use_lengths({100, 3});
  c.params.exec.num_threads = 2;
  EXPECT_LT(c.workspace_bytes(), 2 * kMiB) << "131072 slots, 100 keys used";
  c.run_and_check();
}

// Full: the keys are packed once for the team, not once per thread (a 128 MiB fp32 pack at head dim 128).
TEST(ScratchLimits, DecodeOverFullCacheSharesOnePack) {
  BroadcastCache c(8, 131072, 2, 2, 128, 128);  // 16 (sequence, kv head) groups: enough for private packs
  c.params.exec.num_threads = 4;
  const size_t pack = 131072 * (128 + 128) * sizeof(float);
  EXPECT_LE(c.workspace_bytes(), pack + 8 * kMiB) << "one pack of 131072 keys, not one per thread";
}

// 3 keys of a 2^31 - 1 slot cache: scratch for 3 keys (it used to be 2^31 keys' worth: OUT_OF_MEMORY).
TEST(ScratchLimits, FewKeysOfHugeCache) {
  BroadcastCache c(1, std::numeric_limits<int32_t>::max(), 2, 1, 16, 8);
  c.use_lengths({3});
  EXPECT_LT(c.workspace_bytes(), kMiB);
  c.run_and_check();
}

// Varlen's max_seqlen_k is an upper bound: scratch follows the real lengths (cu_seqlens). The thread count
// is fixed: by default it follows the work that the bounds suggest.
TEST(ScratchLimits, VarlenScratchFollowsRealLengths) {
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    size_t exact = 0, bounded = 0;
    if (backward) {
      BwdCase c(true);
      c.params.exec.num_threads = 2;
      ASSERT_EQ(flare_bwd_workspace_size(&c.params, 1, &exact), FLARE_OK) << flare_last_error();
      c.params.max_seqlen_q = c.params.max_seqlen_k = std::numeric_limits<int32_t>::max();
      ASSERT_EQ(flare_bwd_workspace_size(&c.params, 1, &bounded), FLARE_OK) << flare_last_error();
      ASSERT_EQ(c.run_forward(), FLARE_OK) << flare_last_error();
      EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
    } else {
      FwdCase c(true);
      c.params.exec.num_threads = 2;
      ASSERT_EQ(flare_fwd_workspace_size(&c.params, 1, &exact), FLARE_OK) << flare_last_error();
      c.params.max_seqlen_q = c.params.max_seqlen_k = std::numeric_limits<int32_t>::max();
      ASSERT_EQ(flare_fwd_workspace_size(&c.params, 1, &bounded), FLARE_OK) << flare_last_error();
      EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
    }
    EXPECT_EQ(bounded, exact);
  }
}

// Rotary q in scratch: (batch, seqlen_q, nheads, headdim) of a broadcast q can pass 2^64 bytes. The call is
// refused with the figures, before anything is written (out here is far smaller than its claimed shape).
TEST(ScratchLimits, ScratchPast64BitsIsRefused) {
  const int64_t batch = int64_t{1} << 24, seqlen_q = int64_t{1} << 24, heads = 64, dim = 256;
  Tensor q(FLARE_DTYPE_F32, {1, 1, 1, dim}), k(FLARE_DTYPE_F32, {1, 1, 1, dim}), v(FLARE_DTYPE_F32, {1, 1, 1, 1});
  Tensor out(FLARE_DTYPE_F32, {4}), cos(FLARE_DTYPE_F32, {1, dim / 2}), sin(FLARE_DTYPE_F32, {1, dim / 2});
  flare_kvcache_params p;
  flare_kvcache_params_init(&p);
  p.q = q.view;
  broadcast(p.q, 0, batch);
  broadcast(p.q, 1, seqlen_q);
  broadcast(p.q, 2, heads);
  p.k_cache = k.view;
  p.v_cache = v.view;
  for (flare_tensor* t : {&p.k_cache, &p.v_cache}) {
    broadcast(*t, 0, batch);
    broadcast(*t, 1, 4);
  }
  const int64_t out_shape[] = {batch, seqlen_q, heads, 1};  // 2^54 elements: its span fits int64
  p.out = flare_tensor_contiguous(out.bytes(), FLARE_DTYPE_F32, kCpu, 4, out_shape);
  p.rotary_cos = cos.view;
  p.rotary_sin = sin.view;
  broadcast(p.rotary_cos, 0, 8);
  broadcast(p.rotary_sin, 0, 8);
  p.exec.num_threads = 1;
  size_t bytes = 0;
  const auto before = out.snapshot();
  for (flare_status got : {flare_kvcache_workspace_size(&p, &bytes), flare_fwd_kvcache(&p)}) {
    const std::string message = flare_last_error();
    EXPECT_EQ(got, FLARE_OUT_OF_MEMORY) << message;
    EXPECT_NE(message.find("exceeds 2^64 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("batch 16777216"), std::string::npos) << message;
  }
  EXPECT_TRUE(out.snapshot() == before);
}

// Huge-but-legal inputs report a size that the call then uses: it is never wrapped around (the size query
// once reported under 1 MB for 6e8 broadcast keys). Queried only: the call would allocate the pack.
TEST(ScratchLimits, HugeBroadcastKeysReportTheirSize) {
  FwdCase c;
  const int64_t keys = 600'000'000;
  broadcast(c.params.k, 1, keys);
  broadcast(c.params.v, 1, keys);
  c.params.exec.num_threads = 2;
  size_t bytes = 0;
  ASSERT_EQ(flare_fwd_workspace_size(&c.params, 0, &bytes), FLARE_OK) << flare_last_error();
  EXPECT_GE(bytes, keys * (16 + 8) * sizeof(float)) << "a pack of every key";
}

// With num_threads 0 a problem of more than 2^31 x 16 MFLOP (3.4e16) takes OpenMP's thread count: the
// estimate once went through an out-of-range float-to-int cast and came out as 1 thread.
TEST(ScratchLimits, ThreadCountOfHugeProblem) {
  const int most = omp_get_max_threads();
  if (most == 1) GTEST_SKIP() << "one OpenMP thread: the thread count cannot tell";
  Dims d;
  d.seqlen_q = int64_t{1} << 17;  // out's shape is claimed only: the size query reads no data
  FwdCase c(false, d);
  broadcast(c.params.q, 1, d.seqlen_q);
  broadcast(c.params.k, 1, int64_t{1} << 30);
  broadcast(c.params.v, 1, int64_t{1} << 30);
  c.params.softmax_lse = flare_tensor{};
  size_t by_default = 0, by_count = 0;
  ASSERT_EQ(flare_fwd_workspace_size(&c.params, 0, &by_default), FLARE_OK) << flare_last_error();
  c.params.exec.num_threads = most;
  ASSERT_EQ(flare_fwd_workspace_size(&c.params, 0, &by_count), FLARE_OK) << flare_last_error();
  EXPECT_EQ(by_default, by_count);
}

// A dimension of extent 1 may have any stride, even one whose byte size overflows int64 (it is never
// stepped along). Results equal those of the same tensors with ordinary strides.
TEST(ScratchLimits, HugeStridesOfSingleElementDims) {
  Dims d;
  d.seqlen_q = 1;
  d.seqlen_k = 1;
  FwdCase plain(false, d), odd(false, d);
  ASSERT_EQ(plain.run(), FLARE_OK) << flare_last_error();
  for (flare_tensor* t : {&odd.params.q, &odd.params.k, &odd.params.v, &odd.params.out})
    t->strides[1] = std::numeric_limits<int64_t>::max() / 2;
  ASSERT_EQ(odd.run(), FLARE_OK) << flare_last_error();
  EXPECT_TRUE(odd.out.snapshot() == plain.out.snapshot());
  EXPECT_TRUE(odd.lse.snapshot() == plain.lse.snapshot());
}

#if defined(__linux__)
// Fresh anonymous memory of `bytes`, no page of it present yet (as a large torch.empty is), unmapped on exit.
struct FreshMapping {
  explicit FreshMapping(size_t n) : bytes(n) {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data = m == MAP_FAILED ? nullptr : m;
  }
  ~FreshMapping() {
    if (data != nullptr) munmap(data, bytes);
  }
  // Whether the page in the middle is present.
  bool middle_resident() const {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    unsigned char present = 0;
    char* middle = static_cast<char*>(data) + bytes / 2 / page * page;
    return mincore(middle, page, &present) == 0 && (present & 1) != 0;
  }
  size_t bytes;
  void* data = nullptr;
};

// Outputs of 16 MiB in fresh memory (the CPU backend faults their pages in before the pass where the middle
// one is absent: dispatch.cpp's populate_if_fresh) get exactly what outputs in ordinary memory get: the
// forward's out and the backward's dq (deterministic), bitwise, and every byte is written.
TEST(ScratchLimits, OutputsInFreshMemory) {
  const int64_t batch = 2, seqlen_q = 8192, seqlen_k = 16, heads = 4, dim = 64;
  Tensor q(FLARE_DTYPE_F32, {batch, seqlen_q, heads, dim}, 51), k(FLARE_DTYPE_F32, {batch, seqlen_k, heads, dim}, 52),
      v(FLARE_DTYPE_F32, {batch, seqlen_k, heads, dim}, 53), dout(FLARE_DTYPE_F32, {batch, seqlen_q, heads, dim}, 54),
      out(FLARE_DTYPE_F32, {batch, seqlen_q, heads, dim}), lse(FLARE_DTYPE_F32, {batch, heads, seqlen_q}),
      dq(FLARE_DTYPE_F32, {batch, seqlen_q, heads, dim}), dk(FLARE_DTYPE_F32, {batch, seqlen_k, heads, dim}),
      dv(FLARE_DTYPE_F32, {batch, seqlen_k, heads, dim});
  const size_t bytes = static_cast<size_t>(batch * seqlen_q * heads * dim) * sizeof(float);
  ASSERT_EQ(bytes, 16 * kMiB);
  std::memset(out.bytes(), 0xff, bytes);  // NaN: every element must be written
  std::memset(dq.bytes(), 0xff, bytes);

  flare_fwd_params fp;
  flare_fwd_params_init(&fp);
  fp.q = q.view, fp.k = k.view, fp.v = v.view, fp.out = out.view, fp.softmax_lse = lse.view;
  fp.exec.num_threads = 2;
  ASSERT_EQ(flare_fwd(&fp), FLARE_OK) << flare_last_error();
  FreshMapping fresh_out(bytes);
  ASSERT_NE(fresh_out.data, nullptr);
  ASSERT_FALSE(fresh_out.middle_resident());
  fp.out.data = fresh_out.data;
  Tensor lse2(FLARE_DTYPE_F32, {batch, heads, seqlen_q});
  fp.softmax_lse = lse2.view;
  ASSERT_EQ(flare_fwd(&fp), FLARE_OK) << flare_last_error();
  EXPECT_EQ(std::memcmp(fresh_out.data, out.bytes(), bytes), 0) << "out in fresh memory differs";
  for (size_t i = 0; i < bytes / sizeof(float); ++i)
    ASSERT_TRUE(std::isfinite(reinterpret_cast<const float*>(out.bytes())[i])) << "out element " << i << " not written";

  flare_bwd_params bp;
  flare_bwd_params_init(&bp);
  bp.q = q.view, bp.k = k.view, bp.v = v.view, bp.out = out.view, bp.dout = dout.view, bp.softmax_lse = lse.view;
  bp.dq = dq.view, bp.dk = dk.view, bp.dv = dv.view;
  bp.deterministic = 1;
  bp.exec.num_threads = 2;
  ASSERT_EQ(flare_bwd(&bp), FLARE_OK) << flare_last_error();
  FreshMapping fresh_dq(bytes);
  ASSERT_NE(fresh_dq.data, nullptr);
  ASSERT_FALSE(fresh_dq.middle_resident());
  bp.dq.data = fresh_dq.data;
  Tensor dk2(FLARE_DTYPE_F32, {batch, seqlen_k, heads, dim}), dv2(FLARE_DTYPE_F32, {batch, seqlen_k, heads, dim});
  bp.dk = dk2.view, bp.dv = dv2.view;
  ASSERT_EQ(flare_bwd(&bp), FLARE_OK) << flare_last_error();
  EXPECT_EQ(std::memcmp(fresh_dq.data, dq.bytes(), bytes), 0) << "dq in fresh memory differs";
  EXPECT_EQ(std::memcmp(dk2.bytes(), dk.bytes(), static_cast<size_t>(batch * seqlen_k * heads * dim) * sizeof(float)), 0);
  for (size_t i = 0; i < bytes / sizeof(float); ++i)
    ASSERT_TRUE(std::isfinite(reinterpret_cast<const float*>(dq.bytes())[i])) << "dq element " << i << " not written";
}
#endif

}  // namespace
}  // namespace flare::badinput
