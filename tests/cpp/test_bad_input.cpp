// test_bad_input.cpp — every class of bad input to the forward and backward passes (dense and varlen) is
// rejected with the right status, a message naming the argument, and no byte written. The KV-cache pass
// is in test_bad_input_kvcache.cpp. Each test starts from a valid case (bad_input_cases.hpp) and breaks
// one rule.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <tuple>

#include "bad_input_cases.hpp"
#include "cpu/cpu_backend.hpp"

namespace flare::badinput {
namespace {

constexpr flare_status kInvalid = FLARE_INVALID_ARGUMENT;

void expect_status(flare_status got, flare_status want, const char* name) {
  const std::string message = flare_last_error();
  EXPECT_EQ(got, want) << message;
  EXPECT_NE(message.find(name), std::string::npos) << "message should name '" << name << "': " << message;
}

// Runs `check(case, call)` for the dense and the varlen forward entry.
template <class Check>
void for_fwd_entries(Check check) {
  for (bool varlen : {false, true}) {
    SCOPED_TRACE(varlen ? "flare_fwd_varlen" : "flare_fwd");
    FwdCase c(varlen);
    check(c, varlen ? call_fwd_varlen : call_fwd);
  }
}
template <class Check>
void for_bwd_entries(Check check) {
  for (bool varlen : {false, true}) {
    SCOPED_TRACE(varlen ? "flare_bwd_varlen" : "flare_bwd");
    BwdCase c(varlen);
    check(c, varlen ? call_bwd_varlen : call_bwd);
  }
}

TEST(BadInput, ValidCasesRun) {
  for (bool varlen : {false, true}) {
    FwdCase f(varlen);
    EXPECT_EQ(f.run(), FLARE_OK) << flare_last_error();
    EXPECT_STREQ(flare_last_error(), "");
    BwdCase b(varlen);
    ASSERT_EQ(b.run_forward(), FLARE_OK) << flare_last_error();
    EXPECT_EQ(b.run(), FLARE_OK) << flare_last_error();
  }
}

TEST(BadInput, NullParams) {
  size_t bytes = 0;
  expect_status(flare_fwd(nullptr), kInvalid, "params");
  expect_status(flare_fwd_varlen(nullptr), kInvalid, "params");
  expect_status(flare_bwd(nullptr), kInvalid, "params");
  expect_status(flare_bwd_varlen(nullptr), kInvalid, "params");
  expect_status(flare_fwd_kvcache(nullptr), kInvalid, "params");
  expect_status(flare_fwd_workspace_size(nullptr, 0, &bytes), kInvalid, "params");
  expect_status(flare_bwd_workspace_size(nullptr, 1, &bytes), kInvalid, "params");
  expect_status(flare_kvcache_workspace_size(nullptr, &bytes), kInvalid, "params");
  EXPECT_EQ(bytes, 0u);
}

TEST(BadInput, StructSizeTooSmall) {
  // The smallest struct read is the first version's, which ends before arch_path (appended since).
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.struct_size = offsetof(flare_fwd_params, arch_path) - 8;
    expect_rejected(c, call, kInvalid, {"struct_size"});
    c.params.struct_size = 0;
    expect_rejected(c, call, kInvalid, {"struct_size"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.struct_size = sizeof(flare_bwd_params) / 2;
    expect_rejected(c, call, kInvalid, {"struct_size"});
  });
}

TEST(BadInput, StructFromBeforeArchPathRunsAsAuto) {
  // A caller built against 0.1.0's flare.h passes a struct that ends before arch_path: it is read up to its
  // size, so whatever lies after it (here a bad arch_path value) is not looked at.
  for (bool varlen : {false, true}) {
    FwdCase f(varlen);
    f.params.struct_size = offsetof(flare_fwd_params, arch_path);
    f.params.arch_path = 12345;
    EXPECT_EQ(f.run(), FLARE_OK) << flare_last_error();
    BwdCase b(varlen);
    ASSERT_EQ(b.run_forward(), FLARE_OK) << flare_last_error();
    b.params.struct_size = offsetof(flare_bwd_params, arch_path);
    b.params.arch_path = 12345;
    EXPECT_EQ(b.run(), FLARE_OK) << flare_last_error();
  }
}

TEST(BadInput, StructFromBeforeSinksIgnoresThem) {
  // A struct that ends before sinks (appended after 0.1.0) is read up to its size: a bad sinks view beyond
  // it is not looked at.
  Tensor wrong(FLARE_DTYPE_F16, {3});
  FwdCase f;
  f.params.struct_size = offsetof(flare_fwd_params, sinks);
  f.params.sinks = wrong.view;
  EXPECT_EQ(f.run(), FLARE_OK) << flare_last_error();
  BwdCase b;
  ASSERT_EQ(b.run_forward(), FLARE_OK) << flare_last_error();
  b.params.struct_size = offsetof(flare_bwd_params, sinks);
  b.params.sinks = wrong.view;
  b.params.dsinks = wrong.view;
  EXPECT_EQ(b.run(), FLARE_OK) << flare_last_error();
  KvCase k;
  k.params.struct_size = offsetof(flare_kvcache_params, sinks);
  k.params.sinks = wrong.view;
  EXPECT_EQ(k.run(), FLARE_OK) << flare_last_error();
}

TEST(BadInput, Sinks) {
  // nheads is 4 in every case.
  for_fwd_entries([](FwdCase& c, auto call) {
    Tensor wrong(FLARE_DTYPE_F32, {5});
    c.params.sinks = wrong.view;
    expect_rejected(c, call, kInvalid, {"sinks has shape (5)", "(nheads)"});
    Tensor rank2(FLARE_DTYPE_F32, {1, 4});
    c.params.sinks = rank2.view;
    expect_rejected(c, call, kInvalid, {"sinks has rank 2"});
    Tensor half(FLARE_DTYPE_BF16, {4});
    c.params.sinks = half.view;
    expect_rejected(c, call, kInvalid, {"sinks.dtype is BF16", "fp32"});
    Tensor ok(FLARE_DTYPE_F32, {4});
    c.params.sinks = ok.view;
    c.params.sinks.device = kCuda0;
    expect_rejected(c, call, kInvalid, {"sinks is on cuda:0"});
    c.params.sinks.device = kCpu;
    EXPECT_EQ(call(&c.params), FLARE_OK) << flare_last_error();
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    Tensor sinks(FLARE_DTYPE_F32, {4}), dsinks(FLARE_DTYPE_F32, {4}), wrong(FLARE_DTYPE_F32, {2});
    c.params.dsinks = dsinks.view;
    expect_rejected(c, call, kInvalid, {"dsinks is given but sinks is absent"});
    c.params.sinks = sinks.view;
    c.params.dsinks = wrong.view;
    expect_rejected(c, call, kInvalid, {"dsinks has shape (2)", "(nheads)"});
    c.params.dsinks = dsinks.view;
    c.params.dsinks.strides[0] = 0;
    c.params.dsinks.shape[0] = 4;
    expect_rejected(c, call, kInvalid, {"dsinks"});
  });
  KvCase k;
  Tensor wrong(FLARE_DTYPE_F64, {4});
  k.params.sinks = wrong.view;
  expect_rejected(k, call_kvcache, kInvalid, {"sinks.dtype is F64", "fp32"});
}

TEST(BadInput, DsinksOnCudaAreUnsupported) {
  // The CUDA backward has no sinks-gradient kernel: said before any CUDA work is looked at, with or without a
  // CUDA backend in the build.
  for_bwd_entries([](BwdCase& c, auto call) {
    Tensor sinks(FLARE_DTYPE_F32, {4}), dsinks(FLARE_DTYPE_F32, {4});
    c.params.sinks = sinks.view;
    c.params.dsinks = dsinks.view;
    move_all({&c.params.q, &c.params.k, &c.params.v, &c.params.out, &c.params.dout, &c.params.softmax_lse,
              &c.params.dq, &c.params.dk, &c.params.dv, &c.params.cu_seqlens_q, &c.params.cu_seqlens_k,
              &c.params.sinks, &c.params.dsinks}, kCuda0);
    expect_rejected(c, call, FLARE_UNSUPPORTED, {"dsinks", "sink_gradient"});
  });
}

TEST(BadInput, ArchPathValue) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.arch_path = 86;
    expect_rejected(c, call, kInvalid, {"arch_path is 86", "FLARE_ARCH_PATH_SM90"});
    size_t bytes = 7;
    expect_status(flare_fwd_workspace_size(&c.params, c.varlen, &bytes), kInvalid, "arch_path is 86");
    EXPECT_EQ(bytes, 7u);
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.arch_path = -1;
    expect_rejected(c, call, kInvalid, {"arch_path is -1"});
  });
  // Valid values pass validation on every device; the CPU runs the call whatever the path asked for (a CUDA
  // kernel family), as it ignores exec.stream.
  for (int32_t path : {FLARE_ARCH_PATH_AUTO, FLARE_ARCH_PATH_SM80, FLARE_ARCH_PATH_SM90}) {
    FwdCase f;
    f.params.arch_path = path;
    EXPECT_EQ(f.run(), FLARE_OK) << flare_last_error();
    BwdCase b;
    b.params.arch_path = path;
    ASSERT_EQ(b.run_forward(), FLARE_OK) << flare_last_error();
    EXPECT_EQ(b.run(), FLARE_OK) << flare_last_error();
  }
}

TEST(BadInput, WorkspaceQueryArguments) {
  FwdCase c;
  expect_status(flare_fwd_workspace_size(&c.params, 0, nullptr), kInvalid, "bytes");
  size_t bytes = 7;
  expect_status(flare_fwd_workspace_size(&c.params, 2, &bytes), kInvalid, "varlen");
  BwdCase b;
  expect_status(flare_bwd_workspace_size(&b.params, -1, &bytes), kInvalid, "varlen");
  EXPECT_EQ(bytes, 7u) << "a failed query must not write *bytes";
  // The query validates like the call: a dense case asked about as varlen is rejected.
  expect_status(flare_fwd_workspace_size(&c.params, 1, &bytes), kInvalid, "q has rank 4");
}

TEST(BadInput, RequiredTensorAbsent) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.q = flare_tensor{};
    expect_rejected(c, call, kInvalid, {"q is absent"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.out.rank = 0;
    expect_rejected(c, call, kInvalid, {"out is absent"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.softmax_lse = flare_tensor{};
    expect_rejected(c, call, kInvalid, {"softmax_lse is absent"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.dk = flare_tensor{};
    expect_rejected(c, call, kInvalid, {"dk is absent"});
  });
}

TEST(BadInput, NullDataOfPresentTensor) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.q.data = nullptr;
    expect_rejected(c, call, kInvalid, {"q.data is null"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.softmax_lse.data = nullptr;
    expect_rejected(c, call, kInvalid, {"softmax_lse.data is null"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.dv.data = nullptr;
    expect_rejected(c, call, kInvalid, {"dv.data is null"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    if (c.varlen) {
      c.params.cu_seqlens_k.data = nullptr;
      expect_rejected(c, call, kInvalid, {"cu_seqlens_k.data is null"});
    }
  });
}

TEST(BadInput, NullDataAllowedForZeroElements) {
  Dims d;
  d.seqlen_q = 0;
  FwdCase c(false, d);
  c.params.q.data = nullptr;
  c.params.out.data = nullptr;
  c.params.softmax_lse.data = nullptr;
  EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  Dims empty;
  empty.batch = 0;
  for (bool varlen : {false, true}) {
    BwdCase b(varlen, empty);
    for (flare_tensor* t : {&b.params.q, &b.params.k, &b.params.v, &b.params.out, &b.params.dout,
                            &b.params.softmax_lse, &b.params.dq, &b.params.dk, &b.params.dv}) {
      t->data = nullptr;
    }
    EXPECT_EQ(b.run(), FLARE_OK) << flare_last_error();
  }
}

TEST(BadInput, WrongRank) {
  for_fwd_entries([](FwdCase& c, auto call) {
    drop_dim(c.params.k, 0);
    expect_rejected(c, call, kInvalid, {"k has rank"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    drop_dim(c.params.out, 0);
    expect_rejected(c, call, kInvalid, {"out has rank"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    if (c.varlen) {
      c.params.softmax_lse.rank = 3;
      c.params.softmax_lse.shape[2] = 1;
    } else {
      drop_dim(c.params.softmax_lse, 0);
    }
    expect_rejected(c, call, kInvalid, {"softmax_lse has rank"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.q.rank = 5;
    expect_rejected(c, call, kInvalid, {"q.rank is 5"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    drop_dim(c.params.dout, 0);
    expect_rejected(c, call, kInvalid, {"dout has shape"});
  });
}

TEST(BadInput, VarlenEntryGivenDenseTensors) {
  FwdCase dense(false);
  Tensor cu_q = Tensor::ints({0, 5, 10});
  Tensor cu_k = Tensor::ints({0, 7, 14});
  dense.params.cu_seqlens_q = cu_q.view;
  dense.params.cu_seqlens_k = cu_k.view;
  expect_rejected(dense, call_fwd_varlen, kInvalid, {"q has rank 4", "rank 3"});
  BwdCase bdense(false);
  expect_rejected(bdense, call_bwd_varlen, kInvalid, {"q has rank 4"});
}

TEST(BadInput, DenseEntryGivenVarlenArguments) {
  FwdCase c(true);
  expect_rejected(c, call_fwd, kInvalid, {"cu_seqlens_q", "flare_fwd_varlen"});
  FwdCase d(false);
  Tensor cu = Tensor::ints({0, 5, 10});
  d.params.cu_seqlens_k = cu.view;
  expect_rejected(d, call_fwd, kInvalid, {"cu_seqlens_k"});
  FwdCase e(false);
  e.params.max_seqlen_q = 5;
  expect_rejected(e, call_fwd, kInvalid, {"max_seqlen_q"});
  BwdCase b(true);
  expect_rejected(b, call_bwd, kInvalid, {"cu_seqlens_q"});
}

TEST(BadInput, ShapeMismatchForward) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.k.shape[c.varlen ? 2 : 3] = 8;  // k's headdim differs from q's
    expect_rejected(c, call, kInvalid, {"k has shape"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.v.shape[0] -= 1;  // v's batch / token count differs from k's
    expect_rejected(c, call, kInvalid, {"v has shape"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.out.shape[c.varlen ? 2 : 3] = 4;  // out's head dim is not headdim_v
    expect_rejected(c, call, kInvalid, {"out has shape"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.softmax_lse.shape[c.varlen ? 1 : 2] -= 1;
    expect_rejected(c, call, kInvalid, {"softmax_lse has shape"});
  });
  FwdCase c;
  c.params.k.shape[0] = 1;  // dense: k's batch differs from q's
  expect_rejected(c, call_fwd, kInvalid, {"k has shape", "(2, 7, 2, 16)"});
}

TEST(BadInput, ShapeMismatchBackward) {
  for (const char* name : {"dout", "dq", "dk", "dv"}) {
    for_bwd_entries([&](BwdCase& c, auto call) {
      flare_tensor* t = std::string(name) == "dout" ? &c.params.dout
                        : std::string(name) == "dq" ? &c.params.dq
                        : std::string(name) == "dk" ? &c.params.dk
                                                    : &c.params.dv;
      t->shape[t->rank - 1] -= 1;
      expect_rejected(c, call, kInvalid, {name, "must have the shape of"});
    });
  }
}

TEST(BadInput, HeadsNotAMultiple) {
  for (bool varlen : {false, true}) {
    Dims d;
    d.nheads = 4;
    d.nheads_k = 3;
    FwdCase c(varlen, d);
    expect_rejected(c, varlen ? call_fwd_varlen : call_fwd, kInvalid,
                    {"k has 3 heads but q has 4", "multiple"});
    BwdCase b(varlen, d);
    expect_rejected(b, varlen ? call_bwd_varlen : call_bwd, kInvalid, {"k has 3 heads"});
  }
  Dims zero;
  zero.nheads_k = 0;
  FwdCase c(false, zero);
  expect_rejected(c, call_fwd, kInvalid, {"k has 0 heads"});
}

TEST(BadInput, HeadDimOutOfRange) {
  // headdim (q, k) in 1..576, headdim_v (v, out) in 1..512, in any combination.
  for (bool varlen : {false, true}) {
    Dims big;
    big.headdim = 577;
    FwdCase c(varlen, big);
    expect_rejected(c, varlen ? call_fwd_varlen : call_fwd, kInvalid,
                    {"(headdim) is 577", "headdim (q, k) must be in 1..576", "headdim_v (v, out) in 1..512"});
    BwdCase bc(varlen, big);
    expect_rejected(bc, varlen ? call_bwd_varlen : call_bwd, kInvalid, {"(headdim) is 577", "1..576"});
    Dims big_v;
    big_v.headdim_v = 513;
    BwdCase b(varlen, big_v);
    expect_rejected(b, varlen ? call_bwd_varlen : call_bwd, kInvalid, {"(headdim_v) is 513", "1..512"});
    Dims mla_v;  // 576 is a q/k width only
    mla_v.headdim = 576;
    mla_v.headdim_v = 576;
    FwdCase m(varlen, mla_v);
    expect_rejected(m, varlen ? call_fwd_varlen : call_fwd, kInvalid, {"(headdim_v) is 576", "1..512"});
    Dims zero;
    zero.headdim = 0;
    FwdCase z(varlen, zero);
    expect_rejected(z, varlen ? call_fwd_varlen : call_fwd, kInvalid, {"(headdim) is 0"});
  }
}

TEST(BadInput, DtypeMismatch) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.k.dtype = FLARE_DTYPE_F16;
    expect_rejected(c, call, kInvalid, {"k.dtype is F16", "q.dtype is F32"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.out.dtype = FLARE_DTYPE_BF16;
    expect_rejected(c, call, kInvalid, {"out.dtype is BF16"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.dq.dtype = FLARE_DTYPE_F64;
    expect_rejected(c, call, kInvalid, {"dq.dtype is F64"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.dout.dtype = FLARE_DTYPE_F16;
    expect_rejected(c, call, kInvalid, {"dout.dtype"});
  });
}

TEST(BadInput, UnsupportedDtype) {
  for_fwd_entries([](FwdCase& c, auto call) {
    for (flare_tensor* t : {&c.params.q, &c.params.k, &c.params.v, &c.params.out}) t->dtype = FLARE_DTYPE_I32;
    expect_rejected(c, call, kInvalid, {"q.dtype is I32"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.q.dtype = 42;
    expect_rejected(c, call, kInvalid, {"q.dtype is 42"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.softmax_lse.dtype = FLARE_DTYPE_F64;
    expect_rejected(c, call, kInvalid, {"softmax_lse.dtype is F64", "fp32"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    if (!c.varlen) return;
    c.params.cu_seqlens_q.dtype = FLARE_DTYPE_F32;
    expect_rejected(c, call, kInvalid, {"cu_seqlens_q.dtype is F32", "int32"});
  });
  // E4M3 is valid input the CPU backend cannot run.
  for (bool varlen : {false, true}) {
    FwdCase c(varlen, Dims{}, FLARE_DTYPE_E4M3);
    c.params.out.dtype = FLARE_DTYPE_BF16;
    expect_rejected(c, varlen ? call_fwd_varlen : call_fwd, FLARE_UNSUPPORTED, {"q.dtype is E4M3", "CPU"});
  }
}

TEST(BadInput, DtypesOfEveryFloatKindRun) {
  for (flare_dtype dt : {FLARE_DTYPE_F32, FLARE_DTYPE_F16, FLARE_DTYPE_BF16, FLARE_DTYPE_F64}) {
    FwdCase c(false, Dims{}, dt);
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  }
}

TEST(BadInput, DeviceMixing) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.k.device = kCuda0;
    expect_rejected(c, call, kInvalid, {"k is on cuda:0", "q is on cpu"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.softmax_lse.device = kCuda0;
    expect_rejected(c, call, kInvalid, {"softmax_lse is on cuda:0"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    if (!c.varlen) return;
    c.params.cu_seqlens_k.device = kCuda0;
    expect_rejected(c, call, kInvalid, {"cu_seqlens_k is on cuda:0"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.dv.device = flare_device{FLARE_DEVICE_CUDA, 1};
    expect_rejected(c, call, kInvalid, {"dv is on cuda:1"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {  // two CUDA devices
    move_all({&c.params.q, &c.params.k, &c.params.v, &c.params.out, &c.params.softmax_lse,
              &c.params.cu_seqlens_q, &c.params.cu_seqlens_k}, kCuda0);
    c.params.v.device.index = 1;
    expect_rejected(c, call, kInvalid, {"v is on cuda:1"});
  });
}

TEST(BadInput, InvalidDevice) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.q.device.type = 7;
    expect_rejected(c, call, kInvalid, {"q.device.type is 7"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.out.device.index = 2;
    expect_rejected(c, call, kInvalid, {"out.device.index is 2"});
  });
}

TEST(BadInput, CudaTensorsWithoutCudaBackend) {
  if (flare_has_cuda() != 0) {
    GTEST_SKIP() << "this build has the CUDA backend: CUDA tensors are checked by the GPU suite (tests/gpu)";
  }
  for_fwd_entries([](FwdCase& c, auto call) {
    move_all({&c.params.q, &c.params.k, &c.params.v, &c.params.out, &c.params.softmax_lse,
              &c.params.cu_seqlens_q, &c.params.cu_seqlens_k}, kCuda0);
    expect_rejected(c, call, FLARE_UNSUPPORTED, {"CUDA"});
    size_t bytes = 0;
    expect_status(flare_fwd_workspace_size(&c.params, c.varlen, &bytes), FLARE_UNSUPPORTED, "CUDA");
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    move_all({&c.params.q, &c.params.k, &c.params.v, &c.params.out, &c.params.dout, &c.params.softmax_lse,
              &c.params.dq, &c.params.dk, &c.params.dv, &c.params.cu_seqlens_q, &c.params.cu_seqlens_k},
             kCuda0);
    expect_rejected(c, call, FLARE_UNSUPPORTED, {"CUDA"});
  });
  // Structural errors are still reported as such on a CUDA device.
  for_fwd_entries([](FwdCase& c, auto call) {
    move_all({&c.params.q, &c.params.k, &c.params.v, &c.params.out, &c.params.softmax_lse,
              &c.params.cu_seqlens_q, &c.params.cu_seqlens_k}, kCuda0);
    c.params.v.shape[1] = 1;
    expect_rejected(c, call, kInvalid, {"v has shape"});
  });
}

// Head dims past 256 (up to 576 / 512, the library's range) have CUDA attention kernels: validation lets them
// through on a CUDA device, so this build (no CUDA backend) refuses them for that alone, naming no head dim.
// Past the library's range they stay INVALID_ARGUMENT there too.
TEST(BadInput, WideHeadDimsOnCuda) {
  for (bool varlen : {false, true}) {
    for (auto [d, dv] : {std::pair{320, 64}, std::pair{64, 512}, std::pair{576, 512}}) {
      Dims dims;
      dims.headdim = d;
      dims.headdim_v = dv;
      FwdCase c(varlen, dims);
      move_all({&c.params.q, &c.params.k, &c.params.v, &c.params.out, &c.params.softmax_lse,
                &c.params.cu_seqlens_q, &c.params.cu_seqlens_k}, kCuda0);
      expect_rejected(c, varlen ? call_fwd_varlen : call_fwd, FLARE_UNSUPPORTED, {"no CUDA backend"});
      EXPECT_EQ(std::string(flare_last_error()).find("head dim"), std::string::npos) << flare_last_error();
      BwdCase b(varlen, dims);
      move_all({&b.params.q, &b.params.k, &b.params.v, &b.params.out, &b.params.dout, &b.params.softmax_lse,
                &b.params.dq, &b.params.dk, &b.params.dv, &b.params.cu_seqlens_q, &b.params.cu_seqlens_k},
               kCuda0);
      expect_rejected(b, varlen ? call_bwd_varlen : call_bwd, FLARE_UNSUPPORTED, {"no CUDA backend"});
      EXPECT_EQ(std::string(flare_last_error()).find("head dim"), std::string::npos) << flare_last_error();
    }
    Dims big;
    big.headdim = 600;
    FwdCase c(varlen, big);
    move_all({&c.params.q, &c.params.k, &c.params.v, &c.params.out, &c.params.softmax_lse,
              &c.params.cu_seqlens_q, &c.params.cu_seqlens_k}, kCuda0);
    expect_rejected(c, varlen ? call_fwd_varlen : call_fwd, kInvalid, {"(headdim) is 600", "1..576"});
  }
}

TEST(BadInput, NonUnitLastStride) {
  for_fwd_entries([](FwdCase& c, auto call) {
    const int last = c.params.q.rank - 1;
    c.params.q.strides[last] = 2;
    const std::string want = "q.strides[" + std::to_string(last) + "] is 2";
    expect_rejected(c, call, kInvalid, {want.c_str(), "contiguous (stride 1)"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.dk.strides[c.params.dk.rank - 1] = 0;
    expect_rejected(c, call, kInvalid, {"dk.strides", "stride 1"});
  });
}

TEST(BadInput, NegativeStridesAndShapes) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.k.strides[0] = -c.params.k.strides[0];
    expect_rejected(c, call, kInvalid, {"k.strides[0] is -", ">= 0"});
  });
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.v.shape[1] = -2;
    expect_rejected(c, call, kInvalid, {"v.shape[1] is -2"});
  });
}

TEST(BadInput, OverlappingOutput) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.out.strides[0] = 0;  // every token (or batch) writes the same rows
    expect_rejected(c, call, kInvalid, {"out has shape", "overlap"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.dq.strides[c.params.dq.rank - 2] = 1;  // heads interleave with the head dim
    expect_rejected(c, call, kInvalid, {"dq", "overlap"});
  });
}

TEST(BadInput, MisalignedData) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.v.data = static_cast<char*>(c.params.v.data) + 2;
    expect_rejected(c, call, kInvalid, {"v.data", "aligned to 4 bytes"});
  });
}

TEST(BadInput, CuSeqlensMalformed) {
  for (bool bwd : {false, true}) {
    SCOPED_TRACE(bwd ? "flare_bwd_varlen" : "flare_fwd_varlen");
    auto check = [&](auto mutate, std::initializer_list<const char*> names) {
      if (bwd) {
        BwdCase c(true);
        mutate(c.cu_q, c.cu_k, c.params.cu_seqlens_q, c.params.cu_seqlens_k);
        expect_rejected(c, call_bwd_varlen, kInvalid, names);
      } else {
        FwdCase c(true);
        mutate(c.cu_q, c.cu_k, c.params.cu_seqlens_q, c.params.cu_seqlens_k);
        expect_rejected(c, call_fwd_varlen, kInvalid, names);
      }
    };
    // cu_seqlens_q = {0, 5, 9}, total_q 9; cu_seqlens_k = {0, 7, 12}, total_k 12
    check([](Tensor&, Tensor&, flare_tensor&, flare_tensor& k) { k.shape[0] = 2; },
          {"cu_seqlens_k has shape (2)", "(batch + 1)"});
    check([](Tensor& q, Tensor&, flare_tensor&, flare_tensor&) { q.i32()[0] = 1; },
          {"cu_seqlens_q[0] is 1", "start at 0"});
    check([](Tensor&, Tensor& k, flare_tensor&, flare_tensor&) { k.i32()[1] = 13; },
          {"cu_seqlens_k[2] is 12 but cu_seqlens_k[1] is 13", "nondecreasing"});
    check([](Tensor& q, Tensor&, flare_tensor&, flare_tensor&) { q.i32()[2] = 8; },
          {"cu_seqlens_q[2] is 8", "9", "end"});
    check([](Tensor&, Tensor& k, flare_tensor&, flare_tensor&) { k.i32()[2] = 20; },
          {"cu_seqlens_k[2] is 20"});
    check([](Tensor&, Tensor&, flare_tensor& q, flare_tensor&) { q.rank = 2; q.shape[1] = 1; },
          {"cu_seqlens_q has shape"});
    check([](Tensor&, Tensor&, flare_tensor&, flare_tensor& k) { k = flare_tensor{}; },
          {"cu_seqlens_k is absent"});
  }
}

TEST(BadInput, SequsedK) {
  for_fwd_entries([](FwdCase& c, auto call) {
    if (!c.varlen) return;
    Tensor used = Tensor::ints({7, 6});  // sequence 1 has 5 keys
    c.params.seqused_k = used.view;
    expect_rejected(c, call, kInvalid, {"seqused_k[1] is 6", "5 keys"});
    used.i32()[1] = -1;
    expect_rejected(c, call, kInvalid, {"seqused_k[1] is -1"});
    Tensor wrong = Tensor::ints({1, 2, 3});
    c.params.seqused_k = wrong.view;
    expect_rejected(c, call, kInvalid, {"seqused_k has shape (3)"});
    Tensor ok = Tensor::ints({3, 5});
    c.params.seqused_k = ok.view;
    EXPECT_EQ(call(&c.params), FLARE_OK) << flare_last_error();
  });
}

TEST(BadInput, MaxSeqlenTooSmall) {
  for_fwd_entries([](FwdCase& c, auto call) {
    if (!c.varlen) return;
    c.params.max_seqlen_q = 4;  // sequence 0 has 5 queries
    expect_rejected(c, call, kInvalid, {"max_seqlen_q is 4", "5"});
    c.params.max_seqlen_q = 0;
    c.params.max_seqlen_k = -3;
    expect_rejected(c, call, kInvalid, {"max_seqlen_k is -3"});
    c.params.max_seqlen_k = 6;  // sequence 0 has 7 keys
    expect_rejected(c, call, kInvalid, {"max_seqlen_k is 6"});
    c.params.max_seqlen_q = 5;
    c.params.max_seqlen_k = 100;  // generous bounds are fine
    EXPECT_EQ(call(&c.params), FLARE_OK) << flare_last_error();
  });
}

TEST(BadInput, WindowBelowMinusOne) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.attn.window_left = -2;
    expect_rejected(c, call, kInvalid, {"attn.window_left is -2"});
    c.params.attn.window_left = 3;
    c.params.attn.window_right = -7;
    expect_rejected(c, call, kInvalid, {"attn.window_right is -7"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.attn.window_right = -100;
    expect_rejected(c, call, kInvalid, {"attn.window_right is -100"});
  });
}

TEST(BadInput, SoftcapAndScaleNotFinitePositive) {
  const float bad[] = {-1.0f, std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity()};
  for (float value : bad) {
    for_fwd_entries([&](FwdCase& c, auto call) {
      c.params.attn.softcap = value;
      expect_rejected(c, call, kInvalid, {"attn.softcap is"});
    });
    for_fwd_entries([&](FwdCase& c, auto call) {
      c.params.attn.softmax_scale = value;
      expect_rejected(c, call, kInvalid, {"attn.softmax_scale is"});
    });
    for_bwd_entries([&](BwdCase& c, auto call) {
      c.params.attn.softcap = value;
      expect_rejected(c, call, kInvalid, {"attn.softcap is"});
    });
  }
}

TEST(BadInput, CausalNotZeroOrOne) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.attn.causal = 2;
    expect_rejected(c, call, kInvalid, {"attn.causal is 2"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.attn.causal = -1;
    expect_rejected(c, call, kInvalid, {"attn.causal is -1"});
  });
}

TEST(BadInput, AlibiSlopes) {
  for_fwd_entries([](FwdCase& c, auto call) {
    Tensor wrong = Tensor(FLARE_DTYPE_F32, {5});  // nheads is 4
    c.params.attn.alibi_slopes = wrong.view;
    expect_rejected(c, call, kInvalid, {"attn.alibi_slopes has shape (5)", "(nheads)"});
    Tensor wrong_batch = Tensor(FLARE_DTYPE_F32, {3, 4});  // batch is 2
    c.params.attn.alibi_slopes = wrong_batch.view;
    expect_rejected(c, call, kInvalid, {"attn.alibi_slopes has shape (3, 4)", "(batch, nheads)"});
    Tensor rank3 = Tensor(FLARE_DTYPE_F32, {2, 4, 1});
    c.params.attn.alibi_slopes = rank3.view;
    expect_rejected(c, call, kInvalid, {"attn.alibi_slopes has rank 3"});
    Tensor half = Tensor(FLARE_DTYPE_F16, {4});
    c.params.attn.alibi_slopes = half.view;
    expect_rejected(c, call, kInvalid, {"attn.alibi_slopes.dtype is F16", "fp32"});
    Tensor ok = Tensor(FLARE_DTYPE_F32, {2, 4});
    ok.view.device = kCuda0;
    c.params.attn.alibi_slopes = ok.view;
    expect_rejected(c, call, kInvalid, {"attn.alibi_slopes is on cuda:0"});
    c.params.attn.alibi_slopes.device = kCpu;
    EXPECT_EQ(call(&c.params), FLARE_OK) << flare_last_error();
  });
}

TEST(BadInput, ExecAndFlagValues) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.exec.num_threads = -1;
    expect_rejected(c, call, kInvalid, {"exec.num_threads is -1"});
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    c.params.deterministic = 3;
    expect_rejected(c, call, kInvalid, {"deterministic is 3"});
  });
}

TEST(BadInput, NumThreadsAboveLimit) {
  const int most = flare::cpu::max_threads();
  ASSERT_GE(most, flare::cpu::kMaxThreadsFloor < omp_get_thread_limit() ? flare::cpu::kMaxThreadsFloor
                                                                         : omp_get_thread_limit());
  for (int32_t threads : {most + 1, 2000 > most ? 2000 : most + 7, std::numeric_limits<int32_t>::max()}) {
    for_fwd_entries([&](FwdCase& c, auto call) {
      c.params.exec.num_threads = threads;
      const std::string value = "exec.num_threads is " + std::to_string(threads);
      expect_rejected(c, call, kInvalid, {value.c_str(), "at most", "OMP_THREAD_LIMIT"});
      size_t bytes = 0;
      expect_status(flare_fwd_workspace_size(&c.params, c.varlen, &bytes), kInvalid, value.c_str());
    });
    for_bwd_entries([&](BwdCase& c, auto call) {
      c.params.exec.num_threads = threads;
      expect_rejected(c, call, kInvalid, {"exec.num_threads", "at most"});
    });
  }
  FwdCase c;  // the limit itself is fine (a few threads more than this machine has cores are too)
  c.params.exec.num_threads = 3;
  EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
}

TEST(BadInput, Int32Overflow) {
  const int64_t too_big = int64_t{1} << 32;
  {  // a dense sequence length: q broadcast over 2^32 positions (stride 0), so its span stays small
    FwdCase c;
    c.params.q.shape[1] = too_big;
    c.params.q.strides[1] = 0;
    c.params.q.strides[0] = 0;
    expect_rejected(c, call_fwd, kInvalid, {"q.shape[1] (seqlen_q) is 4294967296", "int32"});
  }
  {
    FwdCase c;
    c.params.k.shape[1] = too_big;
    c.params.k.strides[1] = 0;
    c.params.k.strides[0] = 0;
    expect_rejected(c, call_fwd, kInvalid, {"k.shape[1] (seqlen_k)", "int32"});
  }
  {
    FwdCase c;
    c.params.q.shape[0] = too_big;
    c.params.q.strides[0] = 0;
    expect_rejected(c, call_fwd, kInvalid, {"(batch) is 4294967296"});
  }
  {  // a varlen token count: int32 cu_seqlens cannot reach it
    FwdCase c(true);
    c.params.q.shape[0] = too_big;
    c.params.q.strides[0] = 0;
    expect_rejected(c, call_fwd_varlen, kInvalid, {"total_q", "int32"});
  }
  {
    BwdCase c(true);
    c.params.k.shape[0] = too_big;
    c.params.k.strides[0] = 0;
    expect_rejected(c, call_bwd_varlen, kInvalid, {"total_k", "int32"});
  }
  {  // a head count
    Dims d;
    d.nheads_k = 1;
    FwdCase c(false, d);
    c.params.q.shape[2] = too_big;
    c.params.q.strides[2] = 0;
    c.params.q.strides[1] = 0;
    c.params.q.strides[0] = 0;
    expect_rejected(c, call_fwd, kInvalid, {"q heads", "int32"});
  }
}

TEST(BadInput, SpanOverflowsInt64) {
  for_fwd_entries([](FwdCase& c, auto call) {
    c.params.k.strides[0] = std::numeric_limits<int64_t>::max();
    expect_rejected(c, call, kInvalid, {"k with shape", "int64"});
  });
}

// A span of exactly INT64_MAX elements fits int64, but one element more (its count) does not.
TEST(BadInput, SpanOfInt64MaxElements) {
  for_fwd_entries([](FwdCase& c, auto call) {
    flare_tensor& k = c.params.k;
    int64_t rest = 0;  // the span of every dim but the first
    for (int d = 1; d < k.rank; ++d) rest += (k.shape[d] - 1) * k.strides[d];
    k.shape[0] = 2;
    k.strides[0] = std::numeric_limits<int64_t>::max() - rest;
    expect_rejected(c, call, kInvalid, {"k with shape", "9223372036854775807 + 1 elements", "int64"});
    EXPECT_EQ(std::string(flare_last_error()).find("-9223372036854775808"), std::string::npos)
        << flare_last_error();
  });
}

TEST(BadInput, WorkspaceTooSmall) {
  for_fwd_entries([](FwdCase& c, auto call) {
    size_t needed = 0;
    ASSERT_EQ(flare_fwd_workspace_size(&c.params, c.varlen, &needed), FLARE_OK) << flare_last_error();
    ASSERT_GT(needed, 0u) << "expected the CPU forward to need scratch for this case";
    std::vector<uint8_t> workspace(needed);
    c.params.exec.workspace = workspace.data();
    c.params.exec.workspace_size = needed - 1;
    const std::string have = std::to_string(needed - 1) + " bytes";
    const std::string want = std::to_string(needed) + " bytes";
    expect_rejected(c, call, FLARE_OUT_OF_MEMORY, {"exec.workspace_size", have.c_str(), want.c_str()});
    c.params.exec.workspace_size = needed;
    EXPECT_EQ(call(&c.params), FLARE_OK) << flare_last_error();
  });
  for_bwd_entries([](BwdCase& c, auto call) {
    size_t needed = 0;
    ASSERT_EQ(flare_bwd_workspace_size(&c.params, c.varlen, &needed), FLARE_OK) << flare_last_error();
    if (needed == 0) return;
    std::vector<uint8_t> workspace(needed);
    c.params.exec.workspace = workspace.data();
    c.params.exec.workspace_size = needed / 2;
    expect_rejected(c, call, FLARE_OUT_OF_MEMORY, {"exec.workspace_size"});
  });
}

TEST(BadInput, LastErrorClearedBySuccess) {
  FwdCase c;
  c.params.attn.causal = 5;
  EXPECT_EQ(c.run(), kInvalid);
  EXPECT_STRNE(flare_last_error(), "");
  EXPECT_STREQ(flare_status_string(FLARE_INVALID_ARGUMENT), "FLARE_INVALID_ARGUMENT");
  EXPECT_STRNE(flare_last_error(), "") << "introspection must not clear the error";
  c.params.attn.causal = 1;
  EXPECT_EQ(c.run(), FLARE_OK);
  EXPECT_STREQ(flare_last_error(), "");
}

}  // namespace
}  // namespace flare::badinput
