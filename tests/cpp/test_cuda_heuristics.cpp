// test_cuda_heuristics.cpp — the CUDA backend's host-side choices (src/cuda/heuristics.hpp), on the CPU: no GPU
// and no nvcc needed. Every combination of device, build, pass and feature maps to a path whose kernels exist,
// fallbacks to the sm80 path say why, forced paths run or refuse with a reason, and the sm80 kernels' classes,
// thresholds, split counts and workspace follow their rules. The KV-cache pass's split count, workspace and the
// decode kernels' arithmetic (src/cuda/decode/plan.hpp: packed rows, visible keys, split ranges, page-table
// walk) are checked against brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda/decode/plan.hpp"
#include "cuda/heuristics.hpp"

namespace flare::cuda {
namespace {

using detail::Pass;
using detail::Problem;

constexpr DeviceProps kA100{8, 0, 108, 163 * 1024};
constexpr DeviceProps kRtx3090{8, 6, 82, 99 * 1024};
constexpr DeviceProps kL40{8, 9, 142, 99 * 1024};
constexpr DeviceProps kH200{9, 0, 132, 227 * 1024};
constexpr DeviceProps kB200{10, 0, 148, 227 * 1024};
constexpr DeviceProps kDevices[] = {kA100, kRtx3090, kL40, kH200, kB200};

// The builds a test runs against: everything generated, no sm90 units, and a FLARE_HEADDIMS=128 build.
const BuiltKernels kFull{kSm80HeadDims, kSm90HeadDims};
const BuiltKernels kNoSm90{kSm80HeadDims, {}};
constexpr int kOnly128[] = {128};
const BuiltKernels kBuilt128{kOnly128, kOnly128};

constexpr int kSm90Smem = 200 * 1024;  // what an sm90 unit might take; fits the H200's 227 KB

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }
bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }
bool has(std::span<const int> list, int64_t d) { return std::find(list.begin(), list.end(), d) != list.end(); }

// A dense bf16 forward, (2, 1024, 16 heads, 128), no features.
Problem forward_call(int64_t headdim = 128) {
  Problem p;
  p.pass = Pass::kForward;
  p.dtype = FLARE_DTYPE_BF16;
  p.batch = 2;
  p.nheads = p.nheads_k = 16;
  p.headdim = p.headdim_v = headdim;
  p.seqlen_q = p.seqlen_k = 1024;
  p.total_q = p.total_k = 2048;
  p.device = {FLARE_DEVICE_CUDA, 0};
  return p;
}

// The features a call may carry, each applied to a problem; the sm90 forward takes each of them, so none
// changes which path runs.
struct Feature {
  const char* name;
  void (*apply)(Problem&);
};
const int32_t kUsed[2] = {100, 200};
const float kSlopes[16] = {};
float lse_buffer[1];
const Feature kFeatures[] = {
    {"plain", [](Problem&) {}},
    {"causal", [](Problem& p) { p.score.window_right = 0; }},
    {"window", [](Problem& p) {
       p.score.window_left = 128;
       p.score.window_right = 64;
     }},
    {"softcap", [](Problem& p) { p.score.softcap = 30.f; }},
    {"alibi", [](Problem& p) { p.score.alibi_slopes = kSlopes; }},
    {"gqa", [](Problem& p) { p.nheads_k = 4; }},
    {"mqa", [](Problem& p) { p.nheads_k = 1; }},
    {"lse", [](Problem& p) { p.lse = lse_buffer; }},
    {"varlen", [](Problem& p) {
       p.varlen = true;
       p.cu_seqlens_q = p.cu_seqlens_k = kUsed;
     }},
    {"seqused_k", [](Problem& p) {  // only varlen calls take it
       p.varlen = true;
       p.cu_seqlens_q = p.cu_seqlens_k = p.seqused_k = kUsed;
     }},
};

TEST(CudaHeuristics, GeneratedHeadDimLists) {
  EXPECT_TRUE(std::is_sorted(std::begin(kSm80HeadDims), std::end(kSm80HeadDims)));
  EXPECT_TRUE(std::is_sorted(std::begin(kSm90HeadDims), std::end(kSm90HeadDims)));
  EXPECT_EQ(kSm80HeadDims[std::size(kSm80HeadDims) - 1], 576) << "the C ABI takes head dims up to 576 / 512";
  // Every call the sm90 path takes has an sm80 kernel too, so forcing sm80 always works.
  for (int d : kSm90HeadDims) {
    EXPECT_TRUE(has(kSm80HeadDims, d)) << d;
    EXPECT_EQ(d % 8, 0) << d;
  }
  constexpr HeadDimSubset odd(kSm80HeadDims, [](int d) { return d % 64 != 0; });
  EXPECT_EQ(std::vector<int>(odd.span().begin(), odd.span().end()), (std::vector<int>{32, 96, 160, 224}));
  constexpr HeadDimSubset none(kSm90HeadDims, [](int) { return false; });
  EXPECT_TRUE(none.span().empty());
}

// Every (device, build, pass, dtype, head dims, feature, request) gets a path whose kernels exist, or a refusal
// that says why; AUTO never refuses.
TEST(CudaHeuristics, EveryCombinationMapsToAPathThatExists) {
  const BuiltKernels* builds[] = {&kFull, &kNoSm90, &kBuilt128};
  int sm90_runs = 0;
  for (const DeviceProps& dev : kDevices) {
    for (const BuiltKernels* built : builds) {
      for (Pass pass : {Pass::kForward, Pass::kBackward}) {
        for (flare_dtype dtype : {FLARE_DTYPE_F16, FLARE_DTYPE_BF16}) {
          for (int64_t headdim = 8; headdim <= 576; headdim += 8) {
            std::vector<int64_t> headdims_v = {std::min<int64_t>(headdim, 512)};
            if (headdim != 128) headdims_v.push_back(128);
            for (int64_t headdim_v : headdims_v) {
              for (const Feature& f : kFeatures) {
                Problem p = forward_call(headdim);
                p.pass = pass;
                p.dtype = dtype;
                p.headdim_v = headdim_v;
                f.apply(p);
                SCOPED_TRACE(testing::Message() << "sm_" << dev.cc_major << dev.cc_minor << " build of "
                                                << built->sm80_tiles.size() << "+" << built->sm90_headdims.size()
                                                << " head dims, " << (pass == Pass::kForward ? "fwd" : "bwd")
                                                << " hdim " << headdim << "/" << headdim_v << " " << f.name);
                const bool sm80_exists = sm80_tile(p, built->sm80_tiles) != 0;
                EXPECT_EQ(sm80_exists, built == &kBuilt128 ? std::max(headdim, headdim_v) <= 128 : true);
                const PathChoice autod = choose_arch_path(p, FLARE_ARCH_PATH_AUTO, dev, *built, kSm90Smem);
                EXPECT_TRUE(autod.unsupported.empty()) << autod.unsupported;
                if (autod.path == ArchPath::kSm90) {
                  ++sm90_runs;
                  EXPECT_EQ(pass, Pass::kForward);
                  EXPECT_TRUE(dev.cc_major == 9 && dev.cc_minor == 0);
                  EXPECT_TRUE(headdim == headdim_v || (headdim == 192 && headdim_v == 128)) << headdim_v;
                  EXPECT_TRUE(has(built->sm90_headdims, headdim));
                  EXPECT_TRUE(autod.fallback.empty());
                  EXPECT_TRUE(sm80_exists) << "forced sm80 must be able to run what sm90 runs";
                } else {
                  EXPECT_FALSE(autod.fallback.empty()) << "a fallback to sm80 says why";
                }
                // Forced sm80: always the sm80 path (whose tile check is apart).
                const PathChoice sm80 = choose_arch_path(p, FLARE_ARCH_PATH_SM80, dev, *built, kSm90Smem);
                EXPECT_EQ(sm80.path, ArchPath::kSm80);
                EXPECT_TRUE(sm80.unsupported.empty());
                // Forced sm90: exactly where AUTO takes sm90; elsewhere refused with AUTO's reason.
                const PathChoice sm90 = choose_arch_path(p, FLARE_ARCH_PATH_SM90, dev, *built, kSm90Smem);
                if (autod.path == ArchPath::kSm90) {
                  EXPECT_EQ(sm90.path, ArchPath::kSm90);
                  EXPECT_TRUE(sm90.unsupported.empty());
                } else {
                  EXPECT_TRUE(contains(sm90.unsupported, autod.fallback.c_str())) << sm90.unsupported;
                  EXPECT_TRUE(contains(sm90.unsupported, "sm90")) << sm90.unsupported;
                }
              }
            }
          }
        }
      }
    }
  }
  // (5 equal head dims + the pair 192 / 128) x 2 dtypes x 10 features in the full build, 1 x 2 x 10 in the
  // 128-only one, on the one sm_90 device.
  EXPECT_EQ(sm90_runs, 6 * 2 * 10 + 1 * 2 * 10);
}

TEST(CudaHeuristics, Sm90TakesWhatItCovers) {
  for (int d : kSm90HeadDims) {
    for (const Feature& f : kFeatures) {
      Problem p = forward_call(d);
      f.apply(p);
      EXPECT_EQ(sm90_rejection(p, kH200, kFull, kSm90Smem), "") << d << " " << f.name;
      if (d == 192) {
        p.headdim_v = 128;  // the one pair of unequal head dims with an sm90 configuration
        EXPECT_EQ(sm90_rejection(p, kH200, kFull, kSm90Smem), "") << "192/128 " << f.name;
      }
    }
  }
}

TEST(CudaHeuristics, FallbacksSayWhy) {
  const auto why = [](Problem p, const DeviceProps& dev = kH200, const BuiltKernels& built = kFull,
                      int smem = kSm90Smem) {
    const PathChoice c = choose_arch_path(p, FLARE_ARCH_PATH_AUTO, dev, built, smem);
    EXPECT_EQ(c.path, ArchPath::kSm80);
    EXPECT_EQ(c.fallback, sm90_rejection(p, dev, built, smem));
    return c.fallback;
  };
  Problem p = forward_call();
  p.dropout_p = 0.1f;
  EXPECT_EQ(why(p), "dropout takes the sm80 path");
  p = forward_call(64);
  p.headdim_v = 128;
  EXPECT_EQ(why(p), "headdim 64 with headdim_v 128: the sm90 forward takes equal head dims, or headdim 192 with "
                    "headdim_v 128");
  p = forward_call(128);
  p.headdim_v = 192;
  EXPECT_EQ(why(p), "headdim 128 with headdim_v 192: the sm90 forward takes equal head dims, or headdim 192 with "
                    "headdim_v 128");
  EXPECT_EQ(why(forward_call(80)), "head dim 80: the sm90 forward of this build has head dims 64, 96, 128, 192, 256 "
                                   "(exactly)");
  EXPECT_EQ(why(forward_call(64), kH200, kBuilt128), "head dim 64: the sm90 forward of this build has head dims 128 "
                                                     "(exactly)");
  p = forward_call();
  p.pass = Pass::kBackward;
  EXPECT_EQ(why(p), "the backward has no sm90 kernels: it runs on the sm80 path");
  p.pass = Pass::kKvCache;
  EXPECT_EQ(why(p), "the KV-cache pass has no sm90 kernels");
  p = forward_call();
  p.dtype = FLARE_DTYPE_F32;
  EXPECT_EQ(why(p), "dtype F32: the sm90 forward takes fp16 or bf16");
  p = forward_call();
  p.device.index = 3;
  EXPECT_TRUE(contains(why(p, kL40), "cuda:3 is sm_89")) << why(p, kL40);
  EXPECT_TRUE(contains(why(p, kB200), "compute capability 9.0 only")) << why(p, kB200);
  EXPECT_TRUE(contains(why(p, kH200, kNoSm90), "FLARE_SM90=ON")) << why(p, kH200, kNoSm90);
  // FLARE_CUDA_SMEM_LIMIT below the sm90 kernel's need: the sm80 path runs (the small-class tests rely on it).
  DeviceProps capped = kH200;
  capped.smem_per_block = 99 * 1024;
  EXPECT_EQ(why(p, capped), "the sm90 forward for head dim 128 needs 204800 bytes of shared memory per block but "
                            "this GPU allows 101376");
}

// A varlen batch of short sequences runs on sm80 under AUTO (measured faster there) and on sm90 when forced; the
// rule reads the mean query tokens per sequence, and dense calls of any length keep the sm90 path.
TEST(CudaHeuristics, ShortVarlenBatchesTakeSm80UnderAuto) {
  Problem p = forward_call();
  p.varlen = true;
  p.cu_seqlens_q = p.cu_seqlens_k = kUsed;
  p.batch = 100;
  p.total_q = p.total_k = 100 * (kSm90VarlenMinMeanTokens - 1);
  const PathChoice autod = choose_arch_path(p, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem);
  EXPECT_EQ(autod.path, ArchPath::kSm80);
  EXPECT_EQ(autod.fallback, sm90_slower(p, kH200));
  EXPECT_TRUE(contains(autod.fallback, "511 query tokens on average, under 512 at head dim 128")) << autod.fallback;
  const PathChoice forced = choose_arch_path(p, FLARE_ARCH_PATH_SM90, kH200, kFull, kSm90Smem);
  EXPECT_EQ(forced.path, ArchPath::kSm90);
  EXPECT_TRUE(forced.unsupported.empty()) << forced.unsupported;
  p.total_q = 100 * kSm90VarlenMinMeanTokens;  // the mean reaches the threshold
  EXPECT_EQ(sm90_slower(p, kH200), "");
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
  p.headdim = p.headdim_v = 64;  // head dim 64 keeps sm80 to longer sequences
  EXPECT_TRUE(contains(sm90_slower(p, kH200), "512 query tokens on average, under 1024 at head dim 64")) << sm90_slower(p, kH200);
  p.total_q = 100 * kSm90VarlenMinMeanTokensHd64;
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
  Problem dense = forward_call();
  dense.seqlen_q = dense.seqlen_k = 64;
  dense.total_q = dense.total_k = 128;
  EXPECT_EQ(sm90_slower(dense, kH200), "");
  EXPECT_EQ(choose_arch_path(dense, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
}

// A forward whose sm90 grid would fill at most a quarter of the SMs over long keys runs on sm80 under AUTO,
// where the keys are split across CTAs (measured: bench/results/gpu-packed-2026-12-06-f297ed9.json).
TEST(CudaHeuristics, SmallSm90GridsOverLongKeysTakeSm80UnderAuto) {
  Problem p = forward_call();
  p.batch = 1;
  p.nheads = 32;
  p.nheads_k = 8;
  p.seqlen_q = 128;  // 32 CTAs of 128 rows: a quarter of 132 SMs at most
  p.seqlen_k = 16384;
  const PathChoice autod = choose_arch_path(p, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem);
  EXPECT_EQ(autod.path, ArchPath::kSm80);
  EXPECT_TRUE(contains(autod.fallback, "32 CTAs")) << autod.fallback;
  EXPECT_EQ(sm80_forward_splits(p, 128, kH200.sm_count, 0) > 1, true) << "the sm80 path splits it";
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_SM90, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
  p.seqlen_q = 129;  // 64 CTAs: the sm90 path again
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
  p.seqlen_q = 64;
  p.seqlen_k = kSm90SmallGridMinKeys - 1;  // too few keys to gain from splits
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
  p.seqlen_k = 16384;
  p.batch = 2;  // 64 CTAs
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
}

TEST(CudaHeuristics, ForcedPaths) {
  Problem p = forward_call();
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_SM90, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_AUTO, kH200, kFull, kSm90Smem).path, ArchPath::kSm90);
  EXPECT_EQ(choose_arch_path(p, FLARE_ARCH_PATH_SM80, kH200, kFull, kSm90Smem).path, ArchPath::kSm80);
  const PathChoice on_a100 = choose_arch_path(p, FLARE_ARCH_PATH_SM90, kA100, kFull, kSm90Smem);
  EXPECT_EQ(on_a100.unsupported,
            "the sm90 path was asked for (arch_path, or FLARE_CUDA_ARCH_PATH=sm90) but cuda:0 is sm_80: the sm90 "
            "kernels (sm_90a code) run on compute capability 9.0 only (H100, H200): ask for auto or sm80 to run "
            "this call");
  p.dropout_p = 0.1f;
  EXPECT_TRUE(contains(choose_arch_path(p, FLARE_ARCH_PATH_SM90, kH200, kFull, kSm90Smem).unsupported,
                       "but dropout takes the sm80 path"));
  p = forward_call();
  p.pass = Pass::kBackward;
  EXPECT_TRUE(contains(choose_arch_path(p, FLARE_ARCH_PATH_SM90, kH200, kFull, kSm90Smem).unsupported,
                       "the backward has no sm90 kernels"));
  EXPECT_EQ(arch_path_name(ArchPath::kSm80), std::string("sm80"));
  EXPECT_EQ(arch_path_name(ArchPath::kSm90), std::string("sm90"));
}

TEST(CudaHeuristics, RequestedPathFromParamsAndEnvironment) {
  const auto request = [](Pass pass, flare_arch_path field, const char* env, bool ok = true) {
    Problem p = forward_call();
    p.pass = pass;
    p.arch_path = field;
    flare_arch_path out = FLARE_ARCH_PATH_SM80;
    EXPECT_EQ(requested_arch_path(p, env, &out), ok) << (env ? env : "(unset)");
    return out;
  };
  // The variable replaces AUTO in the forward...
  EXPECT_EQ(request(Pass::kForward, FLARE_ARCH_PATH_AUTO, nullptr), FLARE_ARCH_PATH_AUTO);
  EXPECT_EQ(request(Pass::kForward, FLARE_ARCH_PATH_AUTO, ""), FLARE_ARCH_PATH_AUTO);
  EXPECT_EQ(request(Pass::kForward, FLARE_ARCH_PATH_AUTO, "auto"), FLARE_ARCH_PATH_AUTO);
  EXPECT_EQ(request(Pass::kForward, FLARE_ARCH_PATH_AUTO, "sm80"), FLARE_ARCH_PATH_SM80);
  EXPECT_EQ(request(Pass::kForward, FLARE_ARCH_PATH_AUTO, "sm90"), FLARE_ARCH_PATH_SM90);
  request(Pass::kForward, FLARE_ARCH_PATH_AUTO, "SM90", false);
  request(Pass::kForward, FLARE_ARCH_PATH_AUTO, "hopper", false);
  // ...never a path the params set...
  EXPECT_EQ(request(Pass::kForward, FLARE_ARCH_PATH_SM80, "sm90"), FLARE_ARCH_PATH_SM80);
  EXPECT_EQ(request(Pass::kForward, FLARE_ARCH_PATH_SM90, "sm80"), FLARE_ARCH_PATH_SM90);
  EXPECT_EQ(request(Pass::kForward, FLARE_ARCH_PATH_SM90, "bogus"), FLARE_ARCH_PATH_SM90);
  // ...and not in the backward, which has one path.
  EXPECT_EQ(request(Pass::kBackward, FLARE_ARCH_PATH_AUTO, "sm90"), FLARE_ARCH_PATH_AUTO);
  EXPECT_EQ(request(Pass::kBackward, FLARE_ARCH_PATH_AUTO, "bogus"), FLARE_ARCH_PATH_AUTO);
  EXPECT_EQ(request(Pass::kBackward, FLARE_ARCH_PATH_SM90, nullptr), FLARE_ARCH_PATH_SM90);
}

TEST(CudaHeuristics, Sm80Tile) {
  Problem p = forward_call(40);
  EXPECT_EQ(sm80_tile(p, kSm80HeadDims), 64);
  p.headdim_v = 136;
  EXPECT_EQ(sm80_tile(p, kSm80HeadDims), 160) << "the wider of headdim and headdim_v";
  EXPECT_EQ(sm80_tile(p, kOnly128), 0) << "no tile >= 136 in a 128-only build";
  p.headdim = p.headdim_v = 32;
  EXPECT_EQ(sm80_tile(p, kOnly128), 128);
  for (int d : kSm80HeadDims) {
    p.headdim = p.headdim_v = d;
    EXPECT_EQ(sm80_tile(p, kSm80HeadDims), d);
  }
  // Wide heads: 264-384 -> 384, up to 512 -> 512, MLA's 576 / 512 -> 576.
  p.headdim = p.headdim_v = 264;
  EXPECT_EQ(sm80_tile(p, kSm80HeadDims), 384);
  p.headdim = 320;
  p.headdim_v = 512;
  EXPECT_EQ(sm80_tile(p, kSm80HeadDims), 512);
  p.headdim = 576;
  EXPECT_EQ(sm80_tile(p, kSm80HeadDims), 576);
  p.headdim = 584;
  EXPECT_EQ(sm80_tile(p, kSm80HeadDims), 0);
}

TEST(CudaHeuristics, WideTilesSliceTheOutput) {
  for (int d : kSm80HeadDims) {
    if (d <= kSm80WideTile) {
      EXPECT_EQ(sm80_forward_slice(d), d);
      EXPECT_EQ(sm80_forward_slices(d, d), 1);
    }
  }
  EXPECT_EQ(sm80_forward_slice(384), 192);
  EXPECT_EQ(sm80_forward_slice(512), 256);
  EXPECT_EQ(sm80_forward_slice(576), 256);
  EXPECT_EQ(sm80_forward_slices(384, 384), 2);
  EXPECT_EQ(sm80_forward_slices(384, 320), 2);
  EXPECT_EQ(sm80_forward_slices(384, 192), 1);
  EXPECT_EQ(sm80_forward_slices(512, 512), 2);
  EXPECT_EQ(sm80_forward_slices(512, 264), 2);
  EXPECT_EQ(sm80_forward_slices(512, 64), 1);
  EXPECT_EQ(sm80_forward_slices(576, 512), 2) << "MLA: two slices of 256";
  EXPECT_EQ(sm80_forward_slices(576, 576), 3);
  // The backward's slices divide the tile evenly (each repeats S and dP; no sliver of a slice).
  EXPECT_EQ(sm80_backward_slice(384), 192);
  EXPECT_EQ(sm80_backward_slice(512), 256);
  EXPECT_EQ(sm80_backward_slice(576), 192) << "three of 192, not 256 + 256 + 64";
  for (int d : kSm80HeadDims) {
    const int w = sm80_backward_slice(d);
    EXPECT_EQ(d % w, 0) << d;
    EXPECT_TRUE(d <= kSm80WideTile ? w == d : w % 64 == 0 && w <= kSm80WideTile) << d;
  }
  // Slices are CTAs: 2 sequences x 16 heads x 2 query tiles x 2 slices = 128 CTAs, under 80% of 2 x 132
  // slots, split; the same call on 64 SMs (128 slots) fills them and keeps one split.
  Problem p = forward_call(512);
  p.batch = 2;
  p.nheads = p.nheads_k = 16;
  p.seqlen_q = 128;
  p.seqlen_k = 8192;
  EXPECT_GT(sm80_forward_splits(p, 64, 132, 0, 2), 1);
  EXPECT_EQ(sm80_forward_splits(p, 64, 64, 0, 2), 1);
  EXPECT_GT(sm80_forward_splits(p, 64, 64, 0, 1), 1) << "without its slices the grid would look half empty";
  EXPECT_EQ(sm80_forward_grid(p, 64, 0, 64, 0, 2).splits, 1);
}

TEST(CudaHeuristics, Sm80SharedMemoryClass) {
  const Sm80SmemBytes fits{90 * 1024, 60 * 1024};
  const Sm80SmemBytes large_only_on_h200{200 * 1024, 90 * 1024};
  const auto cls = [](Pass pass, Sm80SmemBytes b, const DeviceProps& dev, bool all = false) {
    return sm80_smem_class(pass, 128, b, dev, all);
  };
  // sm_86 / sm_89 take the small class even where the large one would fit: their cubins hold only it.
  EXPECT_EQ(cls(Pass::kForward, fits, kRtx3090).cls, SmemClass::kSmall);
  EXPECT_EQ(cls(Pass::kBackward, fits, kL40).cls, SmemClass::kSmall);
  // sm_80 and sm_90 take the large class where it fits, else the small one.
  EXPECT_EQ(cls(Pass::kForward, fits, kA100).cls, SmemClass::kLarge);
  EXPECT_EQ(cls(Pass::kBackward, large_only_on_h200, kA100).cls, SmemClass::kSmall);
  EXPECT_TRUE(cls(Pass::kBackward, large_only_on_h200, kA100).unsupported.empty());
  EXPECT_EQ(cls(Pass::kBackward, large_only_on_h200, kH200).cls, SmemClass::kLarge);
  // Neither fits.
  const SmemChoice too_big = cls(Pass::kForward, Sm80SmemBytes{300 * 1024, 120 * 1024}, kRtx3090);
  EXPECT_EQ(too_big.unsupported, "the forward kernel for head dim tile 128 needs 122880 bytes of shared memory "
                                 "per block but this GPU allows 101376");
  // The small backward on sm_90+ exists only with FLARE_CUDA_ALL_CONFIGS; the forward's small class always.
  DeviceProps capped = kH200;
  capped.smem_per_block = 99 * 1024;
  const SmemChoice bwd = cls(Pass::kBackward, large_only_on_h200, capped);
  EXPECT_EQ(bwd.cls, SmemClass::kSmall);
  EXPECT_TRUE(contains(bwd.unsupported, "the backward kernel for head dim tile 128 needs 204800 bytes of shared "
                                        "memory per block but this GPU allows 101376"))
      << bwd.unsupported;
  EXPECT_TRUE(contains(bwd.unsupported, "FLARE_CUDA_ALL_CONFIGS=ON")) << bwd.unsupported;
  EXPECT_TRUE(cls(Pass::kBackward, large_only_on_h200, capped, true).unsupported.empty());
  EXPECT_TRUE(cls(Pass::kForward, large_only_on_h200, capped).unsupported.empty());
}

TEST(CudaHeuristics, EnvironmentKnobs) {
  EXPECT_EQ(smem_limit(1000, nullptr), 1000);
  EXPECT_EQ(smem_limit(1000, ""), 1000);
  EXPECT_EQ(smem_limit(1000, "600"), 600);
  EXPECT_EQ(smem_limit(1000, "6000"), 1000) << "never above the device's limit";
  EXPECT_EQ(smem_limit(1000, "12k"), 1000) << "malformed: ignored";
  EXPECT_EQ(smem_limit(1000, "-5"), 1000);
  EXPECT_EQ(forced_forward_rows(nullptr), 0);
  EXPECT_EQ(forced_forward_rows("64"), 64);
  EXPECT_EQ(forced_forward_rows("128"), 128);
  EXPECT_EQ(forced_forward_rows("96"), 0);
}

// AttnParams with a mask, softcap or ALiBi as asked, for the sm80 thresholds.
AttnParams attn(int seqlen_q, bool masked, bool shaped, int forward_rows = 0) {
  static const float slope = 0.5f;
  AttnParams a;
  a.seqlen_q = a.seqlen_k = seqlen_q;
  if (masked) a.window_right = 0;
  if (shaped) a.alibi_slopes = &slope;
  a.forward_rows = forward_rows;
  return a;
}

TEST(CudaHeuristics, Sm80ForwardRows) {
  // Wide tiles: always 64 rows (their one kernel's), whatever FLARE_CUDA_FWD_ROWS says.
  for (int tile : {384, 512, 576}) {
    EXPECT_EQ(sm80_forward_rows(tile, attn(8192, false, false)), 64);
    EXPECT_EQ(sm80_forward_rows(tile, attn(8192, true, true, 128)), 64);
  }
  // Head dims <= 64: masked calls up to 512 (1024 with softcap or ALiBi) take 64 rows; unmasked ones never.
  for (int tile : {32, 64}) {
    EXPECT_EQ(sm80_forward_rows(tile, attn(512, true, false)), 64);
    EXPECT_EQ(sm80_forward_rows(tile, attn(513, true, false)), 128);
    EXPECT_EQ(sm80_forward_rows(tile, attn(1024, true, true)), 64);
    EXPECT_EQ(sm80_forward_rows(tile, attn(1025, true, true)), 128);
    EXPECT_EQ(sm80_forward_rows(tile, attn(128, false, false)), 128);
  }
  // 96: masked calls up to 1024.
  EXPECT_EQ(sm80_forward_rows(96, attn(1024, true, false)), 64);
  EXPECT_EQ(sm80_forward_rows(96, attn(1025, true, false)), 128);
  EXPECT_EQ(sm80_forward_rows(96, attn(64, false, true)), 128);
  // 128: always the long shape.
  EXPECT_EQ(sm80_forward_rows(128, attn(64, true, true)), 128);
  // Above 128: without softcap and ALiBi always 64 rows; with them masked up to 8192, unmasked up to 1024.
  for (int tile : {160, 192, 224, 256}) {
    EXPECT_EQ(sm80_forward_rows(tile, attn(1 << 20, false, false)), 64);
    EXPECT_EQ(sm80_forward_rows(tile, attn(8192, true, true)), 64);
    EXPECT_EQ(sm80_forward_rows(tile, attn(8193, true, true)), 128);
    EXPECT_EQ(sm80_forward_rows(tile, attn(1024, false, true)), 64);
    EXPECT_EQ(sm80_forward_rows(tile, attn(1025, false, true)), 128);
  }
  // FLARE_CUDA_FWD_ROWS forces either.
  EXPECT_EQ(sm80_forward_rows(128, attn(64, true, false, 64)), 64);
  EXPECT_EQ(sm80_forward_rows(256, attn(64, false, false, 128)), 128);
  // The other thresholds.
  EXPECT_TRUE(sm80_forward_few_keys(attn(1024, false, false)));
  EXPECT_FALSE(sm80_forward_few_keys(attn(1025, false, false)));
  EXPECT_TRUE(sm80_backward_short(attn(512, false, false)));
  EXPECT_FALSE(sm80_backward_short(attn(513, false, false)));
}

TEST(CudaHeuristics, DeterministicDqSplits) {
  Problem p = forward_call();
  p.pass = Pass::kBackward;
  p.batch = 1;
  p.nheads = 1;
  p.seqlen_k = 8192;
  EXPECT_EQ(sm80_dq_splits(p, 128, 132), 1) << "only deterministic mode splits";
  p.deterministic = true;
  EXPECT_EQ(sm80_dq_splits(p, 128, 132), 8) << "at most 8 buffers";
  p.seqlen_k = 200;
  EXPECT_EQ(sm80_dq_splits(p, 128, 132), 2) << "at most one per key tile";
  p.seqlen_k = 0;
  EXPECT_EQ(sm80_dq_splits(p, 128, 132), 1);
  p.seqlen_k = 8192;
  p.nheads = 64;
  EXPECT_EQ(sm80_dq_splits(p, 128, 132), 5) << "ceil(2 * 132 / 64) CTAs per (batch, head)";
  p.batch = 8;
  EXPECT_EQ(sm80_dq_splits(p, 128, 132), 1) << "the grid fills the GPU twice over without splits";
}

TEST(CudaHeuristics, Sm80BackwardWorkspace) {
  Problem p = forward_call(64);
  p.pass = Pass::kBackward;
  p.batch = 3;
  p.nheads = 4;
  p.nheads_k = 4;
  p.seqlen_q = 100;
  p.seqlen_k = 300;
  const BwdLayout mha = sm80_bwd_layout(p, 64, 128, 132);
  EXPECT_EQ(mha.seqlen_q_rounded, 128);
  EXPECT_EQ(mha.seqlen_k_rounded, 384);
  EXPECT_EQ(mha.q_rows, 3 * 128);
  EXPECT_EQ(mha.k_rows, 3 * 384);
  EXPECT_EQ(mha.splits, 1);
  EXPECT_EQ(mha.dsum, 4u * 4 * 384);
  EXPECT_EQ(mha.dq, 4u * 4 * 384 * 64);
  EXPECT_EQ(mha.dkv, 0u) << "MHA writes dk/dv directly";
  EXPECT_EQ(mha.total(), mha.dsum + mha.dq);
  p.nheads_k = 2;
  p.deterministic = true;
  const BwdLayout gqa = sm80_bwd_layout(p, 64, 128, 132);
  EXPECT_EQ(gqa.splits, 3) << "min(ceil(264 / 12) CTAs, 3 key tiles)";
  EXPECT_EQ(gqa.dq, 3u * 4 * 4 * 384 * 64);
  EXPECT_EQ(gqa.dkv, 2u * 4 * 4 * 1152 * 64) << "per-query-head dk and dv for GQA";
  // Varlen: each sequence padded by a tile, the total rounded to 128; parts 256-byte aligned.
  p.varlen = true;
  p.total_q = 250;
  p.total_k = 77;
  p.nheads = 1;
  p.nheads_k = 1;
  p.deterministic = false;
  const BwdLayout var = sm80_bwd_layout(p, 64, 128, 132);
  EXPECT_EQ(var.q_rows, 640);  // round128(250 + 3 * 128)
  EXPECT_EQ(var.k_rows, 512);  // round128(77 + 3 * 128)
  EXPECT_EQ(var.dsum % 256, 0u);
  EXPECT_EQ(var.dsum, 2560u);
}

// ---- the KV-cache pass (src/cuda/decode) ------------------------------------------------------------------

// A bf16 decode step: batch sequences, 32 query heads over 8 kv heads, hd128, one token, a cache of `cache` keys.
Problem kvcache_call(int64_t batch, int64_t cache, int64_t seqlen_q = 1) {
  Problem p;
  p.pass = Pass::kKvCache;
  p.dtype = FLARE_DTYPE_BF16;
  p.batch = batch;
  p.nheads = 32;
  p.nheads_k = 8;
  p.headdim = p.headdim_v = 128;
  p.seqlen_q = seqlen_q;
  p.seqlen_cache = p.seqlen_k = cache;
  p.device = {FLARE_DEVICE_CUDA, 0};
  return p;
}

TEST(CudaDecode, TileIsTheSmallestBuiltThatHoldsBothHeadDims) {
  Problem p = kvcache_call(1, 1024);
  EXPECT_EQ(decode_tile(p, kDecodeHeadDims), 128);
  p.headdim = 40;
  p.headdim_v = 64;
  EXPECT_EQ(decode_tile(p, kDecodeHeadDims), 64);
  p.headdim_v = 72;
  EXPECT_EQ(decode_tile(p, kDecodeHeadDims), 128);
  p.headdim = 256;
  EXPECT_EQ(decode_tile(p, kDecodeHeadDims), 256);
  p.headdim = 264;
  EXPECT_EQ(decode_tile(p, kDecodeHeadDims), 0) << "no tile above 256";
  constexpr int only128[] = {128};
  p.headdim = p.headdim_v = 192;
  EXPECT_EQ(decode_tile(p, only128), 0) << "a build without the 256 tile";
  for (int64_t d = 8; d <= 256; d += 8) {
    p.headdim = p.headdim_v = d;
    const int t = decode_tile(p, kDecodeHeadDims);
    EXPECT_GE(t, d);
    EXPECT_EQ(t % 64, 0) << "decode tiles are multiples of 64 (their shared-memory rows)";
  }
}

TEST(CudaDecode, RowsPackTheGroupOfEachKvHead) {
  Problem p = kvcache_call(1, 1024, 7);
  EXPECT_EQ(decode_rows(p), 4 * 7);
  EXPECT_EQ(decode_row_chunks(p), 2);  // 28 rows in 16-row CTAs
  p.nheads_k = 1;                      // MQA
  EXPECT_EQ(decode_rows(p), 32 * 7);
  EXPECT_EQ(decode_row_chunks(p), 14);
  p.seqlen_q = 0;
  EXPECT_EQ(decode_row_chunks(p), 1);
}

TEST(CudaDecode, ExplicitSplitsAreHonouredWithinTheKeys) {
  for (int n : {1, 2, 3, 7}) {
    Problem p = kvcache_call(4, 8192);
    p.num_splits = n;
    EXPECT_EQ(decode_splits(p, 132), n);
  }
  Problem p = kvcache_call(1, 64);  // four 16-key tiles
  p.num_splits = 7;
  EXPECT_EQ(decode_splits(p, 132), 4) << "no more splits than key tiles";
  p.seqlen_new = 1;
  EXPECT_EQ(decode_splits(p, 132), 5) << "the appended keys count";
  p = kvcache_call(1, 1 << 20);
  p.num_splits = 100000;
  EXPECT_EQ(decode_splits(p, 132), decode::kMaxSplits);
  p = kvcache_call(1, 0);
  p.num_splits = 3;
  EXPECT_EQ(decode_splits(p, 132), 1) << "an empty cache has one (empty) tile";
}

TEST(CudaDecode, HeuristicFillsTheGpuWithLongEnoughSplits) {
  // Enough (sequence, kv head) CTAs: one split.
  EXPECT_EQ(decode_splits(kvcache_call(128, 2048), 132), 1);
  EXPECT_EQ(decode_splits(kvcache_call(33, 131072), 132), 1) << "264 CTAs fill 132 SMs twice";
  // One sequence of 8 kv heads: 264 / 8 = 33 splits, each 128K / 33 keys long.
  EXPECT_EQ(decode_splits(kvcache_call(1, 131072), 132), 33);
  EXPECT_EQ(decode_splits(kvcache_call(1, 32768), 108), 27);
  // Short caches: no split below kMinKeysPerSplit keys.
  EXPECT_EQ(decode_splits(kvcache_call(1, 256), 132), 1);
  EXPECT_EQ(decode_splits(kvcache_call(1, 1024), 132), 4);
  // Several rows chunks count as CTAs: 8 query tokens x 4 heads = 32 rows, two chunks; 16 x 16 CTAs fill one
  // round of 264, 17 would spill into a second.
  EXPECT_EQ(decode_splits(kvcache_call(1, 131072, 8), 132), 16);
  // Wave quantisation: 8 sequences x 8 kv heads = 64 CTAs take 4 splits (256 CTAs), not 5 (320: two rounds);
  // 100 CTAs (as 25 sequences of 4 kv heads) take 5 (two rounds of 1/5) over 2 (one round of 1/2).
  EXPECT_EQ(decode_splits(kvcache_call(8, 32768), 132), 4);
  Problem four_kv = kvcache_call(25, 32768);
  four_kv.nheads_k = 4;
  four_kv.nheads = 16;
  EXPECT_EQ(decode_splits(four_kv, 132), 5);
  for (int sms : {1, 46, 108, 132, 148}) {
    int previous_by_len = 1;
    for (int64_t cache = 0; cache <= (int64_t{1} << 20); cache = cache == 0 ? 1 : cache * 4) {
      for (int64_t batch : {1, 2, 3, 8, 64, 256}) {
        const Problem p = kvcache_call(batch, cache);
        const int s = decode_splits(p, sms);
        EXPECT_GE(s, 1);
        EXPECT_LE(s, decode::kMaxSplits);
        if (s > 1) {
          EXPECT_GE(cache / s, kMinKeysPerSplit) << "no split below the minimum length";
        }
        if (batch * 8 >= 2 * sms) {
          EXPECT_EQ(s, 1);
        }
        // Never a count whose CTAs would fit one round while a larger one in that round is allowed and
        // faster by more than the rule's 2% (one round: time 1/s plus the fixed cost).
        const int64_t slots = 2 * int64_t{sms};
        const int64_t limit = std::min<int64_t>({decode::kMaxSplits, std::max<int64_t>(1, cache / kMinKeysPerSplit),
                                                 std::max<int64_t>(1, (cache + decode::kTileKeys - 1) / decode::kTileKeys)});
        const int64_t one_round = std::min(limit, slots / (batch * 8));
        if (batch * 8 < slots && one_round >= 2 * s) {
          ADD_FAILURE() << "batch " << batch << " cache " << cache << " sms " << sms << ": " << s
                        << " splits where " << one_round << " fit one round";
        }
      }
      const int s1 = decode_splits(kvcache_call(1, cache), sms);
      EXPECT_GE(s1, previous_by_len) << "a longer cache never takes fewer splits";
      previous_by_len = s1;
    }
  }
}

TEST(CudaDecode, WorkspaceHoldsRotatedQAndSplitPartials) {
  Problem p = kvcache_call(2, 4096, 3);
  p.num_splits = 1;
  EXPECT_EQ(decode_layout(p, 132).total(), 0u) << "no rotary, one split: nothing";
  p.rotary_dim = 64;
  DecodeLayout l = decode_layout(p, 132);
  EXPECT_EQ(l.q_rot, 2u * 3 * 32 * 128 * 2) << "bf16 (batch, seqlen_q, nheads, headdim)";
  EXPECT_EQ(l.part_o + l.part_lse, 0u);
  p.num_splits = 5;
  p.headdim_v = 64;
  l = decode_layout(p, 132);
  EXPECT_EQ(l.splits, 5);
  const size_t parts = 2u * 8 * (4 * 3) * 5;
  EXPECT_EQ(l.part_o, (parts * 64 * 4 + 255) / 256 * 256);
  EXPECT_EQ(l.part_lse, (parts * 4 + 255) / 256 * 256);
  EXPECT_EQ(l.q_rot % 256 + l.part_o % 256 + l.part_lse % 256, 0u) << "each part 256-byte aligned";
  EXPECT_EQ(l.total(), l.q_rot + l.part_o + l.part_lse);
}

TEST(CudaDecode, PackedRowsHoldTheirQueries) {
  for (int seqlen_q = 1; seqlen_q <= 9; ++seqlen_q) {
    for (int group = 1; group <= 5; ++group) {
      const int rows = group * seqlen_q;
      for (int r0 = 0; r0 < rows; ++r0) {
        for (int r1 = r0 + 1; r1 <= rows; ++r1) {
          const decode::QueryRange q = decode::queries_of_rows(r0, r1, seqlen_q);
          int lo = seqlen_q, hi = -1;
          for (int r = r0; r < r1; ++r) {
            lo = std::min(lo, r % seqlen_q);
            hi = std::max(hi, r % seqlen_q);
          }
          // The range may be wider than the rows' queries (a wrap-around run counts all), never narrower.
          EXPECT_LE(q.first, lo);
          EXPECT_GE(q.last, hi);
          EXPECT_GE(q.first, 0);
          EXPECT_LT(q.last, seqlen_q);
          if (r1 - r0 <= seqlen_q && r0 % seqlen_q <= (r1 - 1) % seqlen_q) {
            EXPECT_EQ(q.first, lo);
            EXPECT_EQ(q.last, hi);
          }
        }
      }
    }
  }
}

TEST(CudaDecode, KeysSeenAreTheUnionOfTheRowsWindows) {
  for (int64_t len_k : {0, 1, 5, 40, 77}) {
    for (int64_t seqlen_q : {1, 2, 7}) {
      for (int64_t wl : {-1, 0, 3, 30}) {
        for (int64_t wr : {-1, 0, 2}) {
          const policy::WindowMask mask{seqlen_q, len_k, wl, wr};
          for (int first = 0; first < seqlen_q; ++first) {
            for (int last = first; last < seqlen_q; ++last) {
              const decode::KeySpan span = decode::keys_seen(mask, {first, last});
              int lo = static_cast<int>(len_k), hi = -1;
              for (int i = first; i <= last; ++i) {
                for (int j = 0; j < len_k; ++j) {
                  const int64_t d = mask.diagonal(i);
                  const bool seen = (wl < 0 || j >= d - wl) && (wr < 0 || j <= d + wr);
                  if (seen) {
                    lo = std::min(lo, j);
                    hi = std::max(hi, j);
                  }
                }
              }
              if (hi < 0) {
                EXPECT_EQ(span.size(), 0) << len_k << " " << seqlen_q << " " << wl << " " << wr;
              } else {
                EXPECT_EQ(span.begin, lo);
                EXPECT_EQ(span.end, hi + 1);
              }
            }
          }
        }
      }
    }
  }
}

TEST(CudaDecode, SplitsCoverTheKeysOnceInWholeTiles) {
  for (int begin : {0, 3, 100}) {
    for (int n : {0, 1, 31, 32, 33, 64, 100, 1000, 4097}) {
      for (int splits : {1, 2, 3, 7, 64, 128}) {
        const decode::KeySpan all{begin, begin + n};
        std::vector<int> seen(n, 0);
        int next = begin;
        for (int s = 0; s < splits; ++s) {
          const decode::KeySpan part = decode::split_keys(all, splits, s, decode::kTileKeys);
          if (part.size() == 0) continue;
          EXPECT_EQ(part.begin, next) << "splits are in order, back to back";
          EXPECT_EQ((part.begin - begin) % decode::kTileKeys, 0) << "splits start on a tile";
          EXPECT_LE(part.end, begin + n);
          for (int j = part.begin; j < part.end; ++j) ++seen[j - begin];
          next = part.end;
        }
        EXPECT_EQ(next, begin + n);
        EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }))
            << "every key in exactly one split (begin " << begin << ", n " << n << ", splits " << splits << ")";
      }
    }
  }
}

// What the CTAs of one (sequence, kv head) walk, as the decode kernel composes plan.hpp: per row chunk the keys
// its rows see (queries_of_rows, keys_seen), cut into splits (split_keys), each split's 16-key tiles dealt to
// the warps (tiles_of_warp, first_key_of_tile). Every key a packed row sees must be walked exactly once by
// the CTAs of its chunk, and no walked key may lie outside the sequence.
TEST(CudaDecode, ChunksSplitsAndWarpsWalkEveryVisibleKeyOnce) {
  for (int seqlen_q : {1, 2, 7, 64}) {
    for (int group : {1, 4, 8}) {
      for (int len_k : {0, 1, 15, 16, 17, 100, 1000}) {
        for (auto [wl, wr] : {std::pair{-1, -1}, std::pair{-1, 0}, std::pair{20, 0}, std::pair{5, 3}}) {
          for (int splits : {1, 2, 3, 7}) {
            for (int warps : {2, 4}) {
              const policy::WindowMask mask{seqlen_q, len_k, wl, wr};
              const int rows = group * seqlen_q;
              for (int r0 = 0; r0 < rows; r0 += decode::kRows) {
                const int r1 = std::min(rows, r0 + decode::kRows);
                const decode::KeySpan keys = decode::keys_seen(mask, decode::queries_of_rows(r0, r1, seqlen_q));
                std::vector<int> walked(std::max(len_k, 1), 0);
                for (int s = 0; s < splits; ++s) {
                  const decode::KeySpan mine = decode::split_keys(keys, splits, s, decode::kTileKeys);
                  for (int w = 0; w < warps; ++w) {
                    for (int k = 0; k < decode::tiles_of_warp(mine, w, warps); ++k) {
                      const int n0 = decode::first_key_of_tile(mine, w, warps, k);
                      ASSERT_GE(n0, mine.begin);
                      ASSERT_LT(n0, mine.end) << "a tile starts inside its split";
                      for (int j = n0; j < std::min(n0 + decode::kTileKeys, mine.end); ++j) {
                        ASSERT_GE(j, 0);
                        ASSERT_LT(j, len_k);
                        ++walked[j];
                      }
                    }
                  }
                }
                for (int r = r0; r < r1; ++r) {
                  const policy::KeyRange seen = mask.keys_of(r % seqlen_q);
                  for (int64_t j = std::max<int64_t>(seen.first, 0); j <= seen.last; ++j) {
                    ASSERT_EQ(walked[j], 1) << "row " << r << " key " << j << " (seqlen_q " << seqlen_q << ", group "
                                            << group << ", len_k " << len_k << ", window " << wl << "/" << wr
                                            << ", splits " << splits << ", warps " << warps << ")";
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

// The decode kernel's page-table walk (attention.cuh load_tile): per tile, one table read when the tile's slots
// lie in one block, else slot_of per key. Both give, for every key, the block and row a naive walk gives.
TEST(CudaDecode, PageTableWalkMatchesBruteForce) {
  for (int block_size : {1, 3, 16, 31, 32, 33, 64, 256}) {
    for (int leftpad : {0, 1, 5, 40}) {
      const int len_k = 300;
      const int slots = leftpad + len_k;
      const int blocks = (slots + block_size - 1) / block_size;
      std::vector<int32_t> table(blocks);
      for (int i = 0; i < blocks; ++i) table[i] = (i * 7919 + 13) % 1009;  // scattered, distinct
      for (int splits : {1, 3}) {
        for (int s = 0; s < splits; ++s) {
          const decode::KeySpan mine = decode::split_keys({0, len_k}, splits, s, decode::kTileKeys);
          for (int n0 = mine.begin; n0 < mine.end; n0 += decode::kTileKeys) {
            const int64_t slot0 = int64_t{leftpad} + n0;
            const bool one = decode::slots_in_one_block(slot0, decode::kTileKeys, block_size);
            for (int jj = 0; jj < decode::kTileKeys && n0 + jj < mine.end; ++jj) {
              const int64_t slot = slot0 + jj;
              const decode::Slot got = one ? decode::Slot{table[slot0 / block_size], slot0 % block_size + jj}
                                           : decode::slot_of(table.data(), block_size, slot);
              EXPECT_EQ(got.block, table[slot / block_size]) << block_size << " " << leftpad << " " << slot;
              EXPECT_EQ(got.row, slot % block_size);
            }
          }
        }
      }
      const decode::Slot dense = decode::slot_of(nullptr, block_size, 77);
      EXPECT_EQ(dense.block, -1);
      EXPECT_EQ(dense.row, 77);
    }
  }
}

TEST(CudaDecode, SharedMemoryFitsEverySm80FamilyGpu) {
  for (int d : kDecodeHeadDims) {
    EXPECT_LE(decode::smem_bytes(d, 2), kSmallSmemBytes) << "head dim tile " << d;
    EXPECT_GE(decode::warp_stages_for(d), 2) << "a warp loads one tile while it computes another";
    EXPECT_GE(decode::kv_smem_bytes(d, 2), decode::warps_for(d) * decode::kRows * d * 4)
        << "the warps' fp32 partial outputs fit the stages they reuse";
    EXPECT_EQ(d % 64, 0) << "decode tiles fill whole 64-element swizzle rows";
  }
}

// ---- forwards on the KV-cache kernels (heuristics.hpp: forward_on_decode_kernels, decode_view) ---------------

// A bf16 forward of 32 query heads over 8 kv heads, seqlen_q queries against 4096 keys.
Problem few_row_forward(int64_t seqlen_q) {
  Problem p = forward_call();
  p.nheads = 32;
  p.nheads_k = 8;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = 4096;
  p.total_q = p.batch * seqlen_q;
  p.total_k = p.batch * 4096;
  return p;
}

TEST(CudaPackedForward, FewRowsTakeTheDecodeKernelsUnderAuto) {
  // The shapes of bench/results/gpu-packed-2026-12-06-e025927.json and, for batch 1 over 16K keys, where the
  // alternative is the sm80 forward with split-KV, -f297ed9.json (H100, 132 SMs): batch, query heads / kv heads,
  // head dim, keys, the longest seqlen_q that ran faster on the KV-cache kernels (the next one measured, twice as
  // long, ran faster on the forward kernels or within 8% of them).
  struct Measured {
    int64_t batch, nheads, nheads_k, headdim, seqlen_k, fastest_up_to;
  };
  const Measured measured[] = {
      {1, 32, 8, 128, 2048, 32},  {1, 32, 32, 128, 2048, 32},  {1, 32, 8, 128, 16384, 16},
      {1, 32, 32, 128, 16384, 16}, {8, 32, 8, 128, 16384, 8},   {8, 32, 32, 128, 16384, 16},
      {8, 32, 8, 64, 16384, 8},    {8, 32, 8, 256, 16384, 4},
  };
  for (const Measured& m : measured) {
    for (int64_t sq = 1; sq <= 256; sq *= 2) {
      Problem p = few_row_forward(sq);
      p.seqlen_k = m.seqlen_k;
      p.batch = m.batch;
      p.nheads = m.nheads;
      p.nheads_k = m.nheads_k;
      p.headdim = p.headdim_v = m.headdim;
      EXPECT_EQ(forward_on_decode_kernels(p, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132), sq <= m.fastest_up_to)
          << "batch " << m.batch << " heads " << m.nheads << "/" << m.nheads_k << " d" << m.headdim << " sq " << sq;
      EXPECT_FALSE(forward_on_decode_kernels(p, FLARE_ARCH_PATH_SM80, kDecodeHeadDims, 132)) << "forced paths stay";
      EXPECT_FALSE(forward_on_decode_kernels(p, FLARE_ARCH_PATH_SM90, kDecodeHeadDims, 132)) << "forced paths stay";
    }
  }
  // One 16-row chunk per (sequence, kv head) always packs; a larger GPU leaves a small grid shorter still.
  Problem one = few_row_forward(4);
  one.batch = 4096;
  EXPECT_TRUE(forward_on_decode_kernels(one, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132));
  Problem wide = few_row_forward(64);
  wide.batch = 1;
  wide.seqlen_k = 2048;  // below the small-grid rule's keys: the forward kernels would not split
  EXPECT_FALSE(forward_on_decode_kernels(wide, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132));
  EXPECT_TRUE(forward_on_decode_kernels(wide, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 1000));
  Problem empty = few_row_forward(0);
  EXPECT_FALSE(forward_on_decode_kernels(empty, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132));

  Problem p = few_row_forward(1);
  ASSERT_TRUE(forward_on_decode_kernels(p, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132));
  p.varlen = true;  // a varlen batch of short sequences packs the same way (seqlen_q: the longest)
  p.cu_seqlens_q = p.cu_seqlens_k = kUsed;
  EXPECT_TRUE(forward_on_decode_kernels(p, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132));
  p.dropout_p = 0.1f;
  EXPECT_FALSE(forward_on_decode_kernels(p, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132));
  EXPECT_TRUE(contains(decode_forward_rejection(p, kDecodeHeadDims), "dropout"));
  p.dropout_p = 0.f;
  p.headdim = p.headdim_v = 512;  // wider than every decode tile
  EXPECT_FALSE(forward_on_decode_kernels(p, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132));
  EXPECT_TRUE(contains(decode_forward_rejection(p, kDecodeHeadDims), "no KV-cache kernel"));
  constexpr int only64[] = {64};
  p.headdim = p.headdim_v = 128;
  EXPECT_FALSE(forward_on_decode_kernels(p, FLARE_ARCH_PATH_AUTO, only64, 132)) << "a build without the tile";
  EXPECT_TRUE(decode_forward_rejection(p, kDecodeHeadDims).empty());

  // A paged varlen forward has no other kernels: it takes these whatever the request (backend.cu refuses a
  // forced sm90 and what decode_forward_rejection names before asking).
  const int32_t table[4] = {0, 1, 2, 3};
  Problem paged = few_row_forward(500);
  paged.varlen = true;
  paged.cu_seqlens_q = kUsed;
  paged.block_table = table;
  for (flare_arch_path r : {FLARE_ARCH_PATH_AUTO, FLARE_ARCH_PATH_SM80, FLARE_ARCH_PATH_SM90}) {
    EXPECT_TRUE(forward_on_decode_kernels(paged, r, kDecodeHeadDims, 132));
  }
  for (Pass other : {Pass::kBackward, Pass::kKvCache}) {
    Problem q = few_row_forward(1);
    q.pass = other;
    EXPECT_FALSE(forward_on_decode_kernels(q, FLARE_ARCH_PATH_AUTO, kDecodeHeadDims, 132));
  }
}

TEST(CudaPackedForward, DecodeViewKeepsTheCallsKeys) {
  // Dense: every sequence's seqlen_k keys, no varlen index, no append or rotary.
  Problem p = few_row_forward(3);
  p.rotary_dim = 64;  // never set on a forward; the view clears it anyway
  const Problem d = decode_view(p);
  EXPECT_EQ(d.pass, Pass::kKvCache);
  EXPECT_EQ(d.seqlen_cache, 4096);
  EXPECT_EQ(d.seqlen_new, 0);
  EXPECT_EQ(d.rotary_dim, 0);
  EXPECT_EQ(d.cache_seqlens, nullptr);
  EXPECT_EQ(d.cu_seqlens_q, nullptr);
  EXPECT_EQ(decode_rows(d), 12);
  EXPECT_EQ(decode_layout(d, 132).splits, decode_splits(kvcache_call(2, 4096, 3), 132))
      << "planned as the KV-cache call of the same shape";

  // Varlen: the index tensors travel; seqused_k becomes the key counts.
  Problem v = few_row_forward(3);
  v.varlen = true;
  v.cu_seqlens_q = v.cu_seqlens_k = kUsed;
  EXPECT_EQ(decode_view(v).cu_seqlens_q, kUsed);
  EXPECT_EQ(decode_view(v).cu_seqlens_k, kUsed);
  EXPECT_EQ(decode_view(v).cache_seqlens, nullptr);
  v.seqused_k = kUsed + 1;
  EXPECT_EQ(decode_view(v).cache_seqlens, kUsed + 1);

  // Paged: the key bound is seqlen_k cut to the table's capacity.
  const int32_t table[2] = {0, 1};
  v.block_table = table;
  v.seqlen_cache = 1000;
  EXPECT_EQ(decode_view(v).seqlen_cache, 1000);
  v.seqlen_k = 700;
  EXPECT_EQ(decode_view(v).seqlen_cache, 700);
}

TEST(CudaPackedForward, SequenceOfReadsEveryLayout) {
  KvCacheParams p;
  p.seqlen_q = 5;
  p.seqlen_cache = 90;
  p.k.batch_stride = 1000;
  p.v.batch_stride = 3000;
  p.k.row_stride = 10;
  p.v.row_stride = 30;
  // Dense cache: the call's seqlen_q; cache_len from cache_seqlens, else the capacity; row = cache_batch_idx.
  decode::Sequence s = decode::sequence_of(p, 2);
  EXPECT_EQ(s.q_start, 0);
  EXPECT_EQ(s.seqlen_q, 5);
  EXPECT_EQ(s.len_k, 90);
  EXPECT_EQ(s.k_offset, 2000);
  EXPECT_EQ(s.v_offset, 6000);
  const int32_t lens[3] = {7, 8, 9}, rows[3] = {2, 0, 1}, pads[3] = {1, 2, 3};
  p.cache_seqlens = lens;
  p.cache_batch_idx = rows;
  p.cache_leftpad = pads;
  p.seqlen_new = 4;
  s = decode::sequence_of(p, 2);
  EXPECT_EQ(s.len_k, 9 + 4 - 3);
  EXPECT_EQ(s.leftpad, 3);
  EXPECT_EQ(s.k_offset, 1000);
  // Varlen forward: queries and keys from the cumulative lengths; seqused_k (as cache_seqlens) cuts the keys.
  KvCacheParams v;
  v.k.row_stride = 10;
  v.v.row_stride = 30;
  v.seqlen_q = 6;
  const int32_t cu_q[4] = {0, 6, 6, 9}, cu_k[4] = {0, 40, 41, 100};
  v.cu_seqlens_q = cu_q;
  v.cu_seqlens_k = cu_k;
  for (int b = 0; b < 3; ++b) {
    s = decode::sequence_of(v, b);
    EXPECT_EQ(s.q_start, cu_q[b]);
    EXPECT_EQ(s.seqlen_q, cu_q[b + 1] - cu_q[b]);
    EXPECT_EQ(s.len_k, cu_k[b + 1] - cu_k[b]);
    EXPECT_EQ(s.k_offset, int64_t{cu_k[b]} * 10);
    EXPECT_EQ(s.v_offset, int64_t{cu_k[b]} * 30);
  }
  v.cache_seqlens = lens;
  EXPECT_EQ(decode::sequence_of(v, 1).len_k, 8);
  EXPECT_EQ(decode::sequence_of(v, 1).k_offset, 400) << "seqused_k cuts the count, not the start";
  // Paged: keys from slot 0 of the sequence's table row; no offset.
  const int32_t table[2] = {0, 1};
  v.block_table = table;
  EXPECT_EQ(decode::sequence_of(v, 2).k_offset, 0);
  EXPECT_EQ(decode::sequence_of(v, 2).len_k, 9);
}

// ---- split-KV in the sm80 forward (heuristics.hpp: sm80_forward_splits) --------------------------------------

TEST(CudaForwardSplits, OnlyAGridThatLeavesTheGpuEmptySplits) {
  Problem p = few_row_forward(64);  // 32 heads
  p.batch = 1;
  p.seqlen_k = 16384;
  // 32 CTAs of 64 rows for 264 slots (132 SMs, two CTAs each): 7 splits fill one wave to 85%, within 85% of
  // the best count's waves (the first count that is).
  EXPECT_EQ(sm80_forward_splits(p, 64, 132, 0), 7);
  // Enough CTAs (80% of the slots and more): whole.
  p.batch = 7;  // 224 CTAs
  EXPECT_EQ(sm80_forward_splits(p, 64, 132, 0), 1);
  p.batch = 6;  // 192 CTAs: 73% of the slots
  EXPECT_GT(sm80_forward_splits(p, 64, 132, 0), 1);
  // Never shorter than kMinKeysPerForwardSplit keys a split, never more than decode::kMaxSplits.
  p.batch = 1;
  p.nheads = p.nheads_k = 1;
  for (int64_t keys : {1, 127, 128, 300, 1000, 100000}) {
    p.seqlen_k = keys;
    const int s = sm80_forward_splits(p, 64, 132, 0);
    EXPECT_GE(s, 1);
    EXPECT_LE(s, std::max<int64_t>(1, keys / kMinKeysPerForwardSplit)) << keys;
    EXPECT_LE(s, decode::kMaxSplits);
  }
  // Dropout stays whole, forced or not; a forced count is cut to the keys.
  p.seqlen_k = 1000;
  EXPECT_EQ(sm80_forward_splits(p, 64, 132, 5), 5);
  EXPECT_EQ(sm80_forward_splits(p, 64, 132, 100), 7) << "1000 keys hold 7 splits of 128";
  p.dropout_p = 0.1f;
  EXPECT_EQ(sm80_forward_splits(p, 64, 132, 0), 1);
  EXPECT_EQ(sm80_forward_splits(p, 64, 132, 5), 1);
}

TEST(CudaForwardSplits, EachCountChangesTheTilesPerSplit) {
  // The chosen count is one that changes ceil(tiles / s) (a count that does not only adds empty CTAs' cost).
  for (int64_t keys : {512, 2048, 5000, 16384}) {
    for (int64_t heads : {1, 8, 32}) {
      Problem p = few_row_forward(16);
      p.batch = 1;
      p.nheads = heads;
      p.nheads_k = 1;
      p.seqlen_k = keys;
      const int64_t s = sm80_forward_splits(p, 64, 132, 0);
      const int64_t tiles = (keys + kMinKeysPerForwardSplit - 1) / kMinKeysPerForwardSplit;
      if (s > 1) {
        EXPECT_NE((tiles + s - 1) / s, (tiles + s - 2) / (s - 1)) << keys << " " << heads;
      }
    }
  }
}

TEST(CudaForwardSplits, SplitCallsTake64RowTiles) {
  Problem p = few_row_forward(64);
  p.batch = 1;
  p.seqlen_k = 16384;
  Sm80ForwardGrid g = sm80_forward_grid(p, 128, 0, 132, 0);
  EXPECT_EQ(g.rows, 64);
  EXPECT_EQ(g.forward_rows, 64) << "launched with the 64-row shape";
  EXPECT_EQ(g.splits, sm80_forward_splits(p, 64, 132, 0));
  EXPECT_GT(g.splits, 1);
  // A forced row count wins, and so does a forced split count.
  g = sm80_forward_grid(p, 128, 128, 132, 0);
  EXPECT_EQ(g.rows, 128);
  EXPECT_EQ(g.forward_rows, 128);
  g = sm80_forward_grid(p, 128, 0, 132, 3);
  EXPECT_EQ(g.splits, 3);
  EXPECT_EQ(g.rows, 64);
  // A grid that fills the GPU keeps its shape and splits nothing.
  p.batch = 64;
  g = sm80_forward_grid(p, 128, 0, 132, 0);
  EXPECT_EQ(g.rows, 128);
  EXPECT_EQ(g.forward_rows, 0);
  EXPECT_EQ(g.splits, 1);
  // 64-row tiles already: unchanged.
  p.batch = 1;
  g = sm80_forward_grid(p, 64, 0, 132, 0);
  EXPECT_EQ(g.rows, 64);
  EXPECT_EQ(g.forward_rows, 0);
}

TEST(CudaForwardSplits, KnobAndWorkspace) {
  EXPECT_EQ(forced_forward_splits(nullptr), 0);
  EXPECT_EQ(forced_forward_splits(""), 0);
  EXPECT_EQ(forced_forward_splits("3"), 3);
  EXPECT_EQ(forced_forward_splits("0"), 0);
  EXPECT_EQ(forced_forward_splits("-2"), 0);
  EXPECT_EQ(forced_forward_splits("3x"), 0);
  EXPECT_EQ(forced_forward_splits("100000"), 0);
  Problem p = few_row_forward(10);  // 32 / 8 heads, batch 2, head dim 128
  EXPECT_EQ(sm80_forward_split_layout(p, 1).total(), 0u);
  const FwdSplitLayout l = sm80_forward_split_layout(p, 3);
  EXPECT_EQ(l.part_rows, 4 * 10);
  EXPECT_EQ(l.part_lse, align_up(2 * 8 * 40 * 3 * 4));
  EXPECT_EQ(l.part_o, align_up(2 * 8 * 40 * 3 * 128 * 4));
  EXPECT_EQ(l.part_o % 256, 0u) << "part_lse starts 256-byte aligned";
}

}  // namespace
}  // namespace flare::cuda
