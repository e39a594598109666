// test_cpp_api.cpp — the C++ API (flare.hpp) is a faithful layer over the C ABI: the same calls give
// bit-identical results, errors become flare::Error with the C status and message, and the storage types
// and views behave as documented.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bad_input_cases.hpp"
#include "flare/flare.hpp"

namespace flare::badinput {
namespace {

bool same_bytes(Tensor& a, Tensor& b) { return a.snapshot() == b.snapshot(); }

TEST(CppApi, ForwardMatchesCAbiBitForBit) {
  for (bool varlen : {false, true}) {
    SCOPED_TRACE(varlen ? "varlen" : "dense");
    FwdCase c(varlen, Dims{}, FLARE_DTYPE_BF16);
    c.params.attn.causal = 1;
    c.params.attn.softcap = 5.0f;
    ASSERT_EQ(c.run(), FLARE_OK) << flare_last_error();

    Dims d;
    const VarlenLens l = varlen_lens(d);
    Tensor out(FLARE_DTYPE_BF16, q_shape(d, varlen, l, d.headdim_v), 99);
    Tensor lse(FLARE_DTYPE_F32, lse_shape(d, varlen, l), 98);
    flare::AttnOptions attn;
    attn.causal = true;
    attn.softcap = 5.0f;
    const auto view = [](const Tensor& t) { return TensorView::from_c(t.view); };
    if (varlen) {
      flare::Varlen packed;
      packed.cu_seqlens_q = view(c.cu_q);
      packed.cu_seqlens_k = view(c.cu_k);
      flare::forward_varlen(view(c.q), view(c.k), view(c.v), view(out), packed, view(lse), attn);
    } else {
      flare::forward(view(c.q), view(c.k), view(c.v), view(out), view(lse), attn);
    }
    EXPECT_TRUE(same_bytes(out, c.out));
    EXPECT_TRUE(same_bytes(lse, c.lse));
  }
}

TEST(CppApi, TypedViewsOfStdVectors) {
  // q (1, 3, 2, 4), k/v (1, 5, 1, 4): MQA with typed, contiguous views built from std::vector.
  std::vector<flare::bf16> q(24), k(20), v(20), out(24), out_c(24);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * float(i));
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.11f * float(i) + 1.0f);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.05f * float(i) - 0.4f;
  const auto tq = TensorView::contiguous(q.data(), {1, 3, 2, 4});
  const auto tk = TensorView::contiguous(k.data(), {1, 5, 1, 4});
  const auto tv = TensorView::contiguous(v.data(), {1, 5, 1, 4});
  EXPECT_EQ(tq.dtype(), FLARE_DTYPE_BF16);
  EXPECT_EQ(tq.stride(0), 24);
  EXPECT_EQ(tq.stride(1), 8);
  EXPECT_EQ(tq.stride(2), 4);
  EXPECT_EQ(tq.stride(3), 1);
  EXPECT_EQ(tq.numel(), 24);
  flare::ExecOptions exec;
  exec.num_threads = 2;
  flare::forward(tq, tk, tv, TensorView::contiguous(out.data(), {1, 3, 2, 4}), {}, {}, exec);

  flare_fwd_params p;
  flare_fwd_params_init(&p);
  const int64_t qs[] = {1, 3, 2, 4}, ks[] = {1, 5, 1, 4};
  p.q = flare_tensor_contiguous(q.data(), FLARE_DTYPE_BF16, kCpu, 4, qs);
  p.k = flare_tensor_contiguous(k.data(), FLARE_DTYPE_BF16, kCpu, 4, ks);
  p.v = flare_tensor_contiguous(v.data(), FLARE_DTYPE_BF16, kCpu, 4, ks);
  p.out = flare_tensor_contiguous(out_c.data(), FLARE_DTYPE_BF16, kCpu, 4, qs);
  p.exec.num_threads = 2;
  ASSERT_EQ(flare_fwd(&p), FLARE_OK) << flare_last_error();
  EXPECT_EQ(std::memcmp(out.data(), out_c.data(), out.size() * sizeof(flare::bf16)), 0);
  EXPECT_NE(out[0].bits, 0) << "the output was written";
}

TEST(CppApi, BackwardMatchesCAbiBitForBit) {
  BwdCase c(false);
  c.params.attn.window_left = 2;
  ASSERT_EQ(c.run_forward(), FLARE_OK) << flare_last_error();
  ASSERT_EQ(c.run(), FLARE_OK) << flare_last_error();
  Dims d;
  Tensor dq(FLARE_DTYPE_F32, {d.batch, d.seqlen_q, d.nheads, d.headdim});
  Tensor dk(FLARE_DTYPE_F32, {d.batch, d.seqlen_k, d.nheads_k, d.headdim});
  Tensor dv(FLARE_DTYPE_F32, {d.batch, d.seqlen_k, d.nheads_k, d.headdim_v});
  const auto view = [](const Tensor& t) { return TensorView::from_c(t.view); };
  flare::AttnOptions attn;
  attn.window_left = 2;
  flare::ExecOptions exec;
  exec.deterministic = true;
  flare::backward(view(c.q), view(c.k), view(c.v), view(c.out), view(c.dout), view(c.lse), view(dq), view(dk),
                  view(dv), attn, exec);
  EXPECT_TRUE(same_bytes(dq, c.dq));
  EXPECT_TRUE(same_bytes(dk, c.dk));
  EXPECT_TRUE(same_bytes(dv, c.dv));
}

TEST(CppApi, KvCacheMatchesCAbiBitForBit) {
  KvCase c(true, true);  // paged, rotary, append
  KvCase twin(true, true);
  ASSERT_EQ(c.run(), FLARE_OK) << flare_last_error();
  const auto view = [](const Tensor& t) { return TensorView::from_c(t.view); };
  flare::KvCacheInputs in;
  in.k_new = view(twin.k_new);
  in.v_new = view(twin.v_new);
  in.cache_seqlens = view(twin.cache_seqlens);
  in.block_table = view(twin.block_table);
  in.rotary_cos = view(twin.rotary_cos);
  in.rotary_sin = view(twin.rotary_sin);
  flare::forward_kvcache(view(twin.q), view(twin.k_cache), view(twin.v_cache), view(twin.out), in,
                         view(twin.lse));
  EXPECT_TRUE(same_bytes(twin.out, c.out));
  EXPECT_TRUE(same_bytes(twin.lse, c.lse));
  EXPECT_TRUE(same_bytes(twin.k_cache, c.k_cache));
  EXPECT_TRUE(same_bytes(twin.v_cache, c.v_cache));
  size_t bytes = 0;
  ASSERT_EQ(flare_kvcache_workspace_size(&c.params, &bytes), FLARE_OK) << flare_last_error();
  EXPECT_EQ(flare::forward_kvcache_workspace_size(view(twin.q), view(twin.k_cache), view(twin.v_cache),
                                                  view(twin.out), in, view(twin.lse)),
            bytes);
}

TEST(CppApi, ErrorsThrowWithStatusAndMessage) {
  Dims d;
  d.nheads_k = 3;
  FwdCase c(false, d);
  const auto view = [](const Tensor& t) { return TensorView::from_c(t.view); };
  c.out.fill(kSentinel);
  const std::vector<uint8_t> before = c.out.snapshot();
  try {
    flare::forward(view(c.q), view(c.k), view(c.v), view(c.out));
    FAIL() << "expected flare::Error";
  } catch (const flare::Error& e) {
    EXPECT_EQ(e.status(), FLARE_INVALID_ARGUMENT);
    EXPECT_STREQ(e.what(), flare_last_error());
    EXPECT_NE(std::string(e.what()).find("k has 3 heads but q has 4"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(c.out.snapshot() == before);

  FwdCase cuda;
  flare_tensor q = cuda.q.view;
  q.device = kCuda0;
  EXPECT_THROW(flare::forward(TensorView::from_c(q), view(cuda.k), view(cuda.v), view(cuda.out)),
               flare::Error);
  try {
    flare::forward_workspace_size(view(cuda.q), view(cuda.k), view(cuda.v), view(cuda.out), {}, {},
                                  flare::ExecOptions{nullptr, -1});
    FAIL() << "expected flare::Error";
  } catch (const flare::Error& e) {
    EXPECT_EQ(e.status(), FLARE_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("exec.num_threads is -1"), std::string::npos) << e.what();
  }
  // A flare::Error is a std::runtime_error.
  EXPECT_THROW(flare::check(FLARE_UNSUPPORTED), std::runtime_error);
  EXPECT_NO_THROW(flare::check(FLARE_OK));
}

TEST(CppApi, SinksReachEveryPass) {
  // AttnOptions::sinks gives the same bits as the C ABI's sinks field; dsinks comes back from the backward,
  // and a forward handed dsinks throws.
  const auto view = [](const Tensor& t) { return TensorView::from_c(t.view); };
  Tensor sinks(FLARE_DTYPE_F32, {4}, 77);
  BwdCase c(false);
  flare_fwd_params f;
  flare_fwd_params_init(&f);
  f.q = c.params.q;
  f.k = c.params.k;
  f.v = c.params.v;
  f.out = c.params.out;
  f.softmax_lse = c.params.softmax_lse;
  f.sinks = sinks.view;
  ASSERT_EQ(flare_fwd(&f), FLARE_OK) << flare_last_error();
  Tensor dsinks_c(FLARE_DTYPE_F32, {4}), dsinks(FLARE_DTYPE_F32, {4});
  c.params.sinks = sinks.view;
  c.params.dsinks = dsinks_c.view;
  ASSERT_EQ(c.run(), FLARE_OK) << flare_last_error();

  Dims d;
  Tensor out(FLARE_DTYPE_F32, {d.batch, d.seqlen_q, d.nheads, d.headdim_v});
  Tensor lse(FLARE_DTYPE_F32, {d.batch, d.nheads, d.seqlen_q});
  flare::AttnOptions attn;
  attn.sinks = view(sinks);
  flare::forward(view(c.q), view(c.k), view(c.v), view(out), view(lse), attn);
  EXPECT_TRUE(same_bytes(out, c.out));
  EXPECT_TRUE(same_bytes(lse, c.lse));
  Tensor dq(FLARE_DTYPE_F32, {d.batch, d.seqlen_q, d.nheads, d.headdim});
  Tensor dk(FLARE_DTYPE_F32, {d.batch, d.seqlen_k, d.nheads_k, d.headdim});
  Tensor dv(FLARE_DTYPE_F32, {d.batch, d.seqlen_k, d.nheads_k, d.headdim_v});
  attn.dsinks = view(dsinks);
  flare::backward(view(c.q), view(c.k), view(c.v), view(c.out), view(c.dout), view(c.lse), view(dq), view(dk),
                  view(dv), attn);
  EXPECT_TRUE(same_bytes(dq, c.dq));
  EXPECT_TRUE(same_bytes(dsinks, dsinks_c));
  EXPECT_NE(dsinks.f32()[0], 0.0f);
  try {
    flare::forward(view(c.q), view(c.k), view(c.v), view(out), view(lse), attn);
    FAIL() << "expected flare::Error";
  } catch (const flare::Error& e) {
    EXPECT_EQ(e.status(), FLARE_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("dsinks"), std::string::npos) << e.what();
  }
}

TEST(CppApi, ArchPathReachesTheParams) {
  FwdCase c;
  const auto view = [](const Tensor& t) { return TensorView::from_c(t.view); };
  flare::ExecOptions exec;
  EXPECT_EQ(flare::forward_params(view(c.q), view(c.k), view(c.v), view(c.out), {}, {}, exec).arch_path,
            FLARE_ARCH_PATH_AUTO);
  exec.arch_path = flare::ArchPath::kSm90;
  EXPECT_EQ(flare::forward_params(view(c.q), view(c.k), view(c.v), view(c.out), {}, {}, exec).arch_path,
            FLARE_ARCH_PATH_SM90);
  exec.arch_path = flare::ArchPath::kSm80;
  EXPECT_EQ(flare::backward_params(view(c.q), view(c.k), view(c.v), view(c.out), view(c.out), view(c.lse),
                                   view(c.q), view(c.k), view(c.v), {}, exec)
                .arch_path,
            FLARE_ARCH_PATH_SM80);
  // On the CPU a valid path is accepted and ignored; a value outside flare_arch_path is refused.
  exec.arch_path = flare::ArchPath::kSm90;
  EXPECT_NO_THROW(flare::forward(view(c.q), view(c.k), view(c.v), view(c.out), view(c.lse), {}, exec));
  exec.arch_path = static_cast<flare::ArchPath>(7);
  try {
    flare::forward(view(c.q), view(c.k), view(c.v), view(c.out), {}, {}, exec);
    FAIL() << "expected flare::Error";
  } catch (const flare::Error& e) {
    EXPECT_EQ(e.status(), FLARE_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("arch_path is 7"), std::string::npos) << e.what();
  }
}

TEST(CppApi, TensorViewRejectsBadRanks) {
  float x = 0.0f;
  try {
    TensorView::contiguous(&x, {1, 1, 1, 1, 1});
    FAIL() << "expected flare::Error";
  } catch (const flare::Error& e) {
    EXPECT_EQ(e.status(), FLARE_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("rank 5"), std::string::npos) << e.what();
  }
  EXPECT_THROW(TensorView::strided(&x, {1, 1}, {1}), flare::Error);
  EXPECT_THROW(TensorView(&x, FLARE_DTYPE_F32, Device::cpu(), std::span<const int64_t>(),
                          std::span<const int64_t>()),
               flare::Error);
  const TensorView absent;
  EXPECT_FALSE(absent.present());
  EXPECT_EQ(absent.numel(), 0);
  const auto strided = TensorView::strided(&x, {2, 3}, {5, 1}, Device::cuda(1));
  EXPECT_EQ(strided.device().raw.type, FLARE_DEVICE_CUDA);
  EXPECT_EQ(strided.device().raw.index, 1);
  EXPECT_EQ(strided.stride(0), 5);
  EXPECT_EQ(strided.dtype(), FLARE_DTYPE_F32);
  const int32_t* idx = nullptr;
  EXPECT_EQ(TensorView::contiguous(idx, {0}).dtype(), FLARE_DTYPE_I32);
  const double* d = nullptr;
  EXPECT_EQ(TensorView::contiguous(d, {0}).dtype(), FLARE_DTYPE_F64);
  const flare::f16* h = nullptr;
  EXPECT_EQ(TensorView::contiguous(h, {0}).dtype(), FLARE_DTYPE_F16);
}

TEST(CppApi, HalfAndBfloatConversions) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(flare::f16(1.0f).bits, 0x3c00);
  EXPECT_EQ(flare::f16(-2.0f).bits, 0xc000);
  EXPECT_EQ(flare::f16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(flare::f16(65519.0f).bits, 0x7bff);  // below the halfway point: rounds down
  EXPECT_EQ(flare::f16(65520.0f).bits, 0x7c00);  // halfway, ties to even: infinity
  EXPECT_EQ(flare::f16(-inf).bits, 0xfc00);
  EXPECT_EQ(flare::f16(std::ldexp(1.0f, -24)).bits, 0x0001);  // smallest subnormal
  EXPECT_EQ(flare::f16(std::ldexp(1.0f, -25)).bits, 0x0000);  // half of it: ties to even (0)
  EXPECT_EQ(flare::f16(std::ldexp(1.5f, -24)).bits, 0x0002);  // 1.5 ulp: ties to even (2)
  EXPECT_EQ(flare::f16(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00);  // tie between 1 and 1+2^-10: even
  EXPECT_TRUE(std::isnan(flare::f16(std::nanf("")).to_float()));
  EXPECT_EQ(flare::f16::from_bits(0x0001).to_float(), std::ldexp(1.0f, -24));
  EXPECT_EQ(flare::f16::from_bits(0x3555).to_float(), 0.333251953125f);
  EXPECT_EQ(static_cast<float>(flare::f16(0.1f)), 0.0999755859375f);

  EXPECT_EQ(flare::bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(flare::bf16(-inf).bits, 0xff80);
  EXPECT_EQ(flare::bf16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);  // tie: even
  EXPECT_EQ(flare::bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82);  // tie: even (up)
  EXPECT_EQ(flare::bf16(std::numeric_limits<float>::max()).bits, 0x7f80);  // rounds to infinity
  EXPECT_TRUE(std::isnan(flare::bf16(std::nanf("")).to_float()));
  EXPECT_EQ(flare::bf16::from_bits(0x4049).to_float(), 3.140625f);
  for (float x : {0.0f, -0.0f, 1.5f, -3.25f, std::ldexp(1.0f, -100), std::ldexp(3.0f, 90)}) {
    EXPECT_EQ(flare::bf16(x).to_float(), x);  // exactly representable in bf16
  }
}

TEST(CppApi, IntrospectionMatchesC) {
  const std::string version = std::to_string(FLARE_VERSION_MAJOR) + "." +
                              std::to_string(FLARE_VERSION_MINOR) + "." + std::to_string(FLARE_VERSION_PATCH);
  EXPECT_EQ(flare::version(), version);
  EXPECT_EQ(flare::cpu_isa(), flare_cpu_isa());
  EXPECT_FALSE(flare::cpu_isa().empty());
  EXPECT_EQ(flare::has_cuda(), flare_has_cuda() == 1);
  EXPECT_STREQ(flare_status_string(FLARE_OK), "FLARE_OK");
  EXPECT_STREQ(flare_status_string(FLARE_OUT_OF_MEMORY), "FLARE_OUT_OF_MEMORY");
  // 7: unused, and inside the enum's range (0..7), so a C++ caller can form it.
  EXPECT_STREQ(flare_status_string(static_cast<flare_status>(7)), "FLARE_UNKNOWN_STATUS");
}

TEST(CppApi, BuildConfigLines) {
  const std::string config = flare::build_config();
  ASSERT_FALSE(config.empty());
  EXPECT_EQ(config.back(), '\n');
  std::vector<std::string> keys;
  size_t start = 0;
  for (size_t end; (end = config.find('\n', start)) != std::string::npos; start = end + 1) {
    const std::string line = config.substr(start, end - start);
    const size_t eq = line.find('=');
    ASSERT_NE(eq, std::string::npos) << line;
    keys.push_back(line.substr(0, eq));
  }
  const std::vector<std::string> expected = {"version",      "compiler",      "cpu_isas",    "cuda",
                                             "cuda_version", "cuda_archs",    "cuda_sm90",   "cuda_headdims",
                                             "cuda_passes",  "cuda_reason"};
  EXPECT_EQ(keys, expected);
  EXPECT_NE(config.find("version=" + flare::version() + "\n"), std::string::npos);
  EXPECT_NE(config.find(std::string("cuda=") + (flare::has_cuda() ? "1" : "0") + "\n"), std::string::npos);
  EXPECT_NE(config.find(flare::cpu_isa()), std::string::npos);
}

TEST(CppApi, ParamsInitDefaults) {
  flare_fwd_params f;
  std::memset(&f, 0x5a, sizeof f);
  flare_fwd_params_init(&f);
  EXPECT_EQ(f.struct_size, sizeof(flare_fwd_params));
  EXPECT_EQ(f.attn.window_left, -1);
  EXPECT_EQ(f.attn.window_right, -1);
  EXPECT_EQ(f.attn.softmax_scale, 0.0f);
  EXPECT_EQ(f.attn.causal, 0);
  EXPECT_EQ(f.q.rank, 0);
  EXPECT_EQ(f.softmax_lse.rank, 0);
  EXPECT_EQ(f.max_seqlen_q, 0);
  EXPECT_EQ(f.exec.workspace, nullptr);
  EXPECT_EQ(f.arch_path, FLARE_ARCH_PATH_AUTO);
  flare_bwd_params b;
  std::memset(&b, 0x5a, sizeof b);
  flare_bwd_params_init(&b);
  EXPECT_EQ(b.struct_size, sizeof(flare_bwd_params));
  EXPECT_EQ(b.deterministic, 0);
  EXPECT_EQ(b.attn.window_right, -1);
  EXPECT_EQ(b.arch_path, FLARE_ARCH_PATH_AUTO);
  flare_kvcache_params k;
  std::memset(&k, 0x5a, sizeof k);
  flare_kvcache_params_init(&k);
  EXPECT_EQ(k.struct_size, sizeof(flare_kvcache_params));
  EXPECT_EQ(k.block_table.rank, 0);
  EXPECT_EQ(k.num_splits, 0);
  EXPECT_EQ(k.attn.window_left, -1);
  flare_fwd_params_init(nullptr);  // a no-op, not a crash

  const int64_t shape[] = {2, 0, 3};
  const flare_tensor t = flare_tensor_contiguous(nullptr, FLARE_DTYPE_F16, kCpu, 3, shape);
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(t.strides[1], 3);
  EXPECT_EQ(flare_tensor_contiguous(nullptr, FLARE_DTYPE_F16, kCpu, 5, shape).rank, 0);
}

}  // namespace
}  // namespace flare::badinput
