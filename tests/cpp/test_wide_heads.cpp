// test_wide_heads.cpp — head dims past 256 on the CPU backend (up to headdim 576, headdim_v 512; see
// cpu_backend.hpp): flare_fwd, flare_fwd_varlen and flare_bwd against the fp64 reference at 320, 384, 512, the
// MLA shape 576/512, and headdim_v != headdim both ways, with causal masks, windows and odd lengths, in fp32,
// bf16, fp16 and fp64; dropout and sinks on the wide tile shapes of the fp32 engines (forward.hpp, backward.hpp:
// 128-key blocks forward, 64-key blocks one at a time backward). Lengths stay short: the reference costs seqlen_q x seqlen_k x headdim per head. The
// KV-cache and decode paths at these widths are in test_kvcache.cpp, paged varlen in test_paged_and_merge.cpp.
#include <utility>
#include <vector>

#include "attention_harness.hpp"

namespace flare::test {
namespace {

constexpr double kFp32Tol = 1e-5;

struct Wide {
  int64_t headdim, headdim_v;
};

// Square widths, the MLA shape, and each side of headdim != headdim_v against a narrow other side.
const std::vector<Wide> kWide = {{320, 320}, {384, 384}, {512, 512}, {576, 512}, {512, 128}, {128, 512}, {576, 40},
                                 {33, 512}};

// Masks per case, in turn: none, causal, a sliding window (both sides), causal with a left window.
void set_mask(AttnCase& c, int which) {
  switch (which % 4) {
    case 1: c.causal = true; break;
    case 2: c.window_left = 19; c.window_right = 7; break;
    case 3: c.causal = true; c.window_left = 30; break;
    default: break;
  }
}

TEST(WideHeads, Forward) {
  Rng rng;
  int which = 0;
  for (const Wide& w : kWide) {
    for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16}) {
      // Odd lengths both ways, and more than one 256-key block of the fp32 engine.
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{37, 53}, {67, 301}}) {
        AttnCase c = dense_case(dtype, sk > 256 ? 1 : 2, sq, sk, 2, 1, w.headdim, w.headdim_v);
        set_mask(c, which++);
        check_forward(c, rng, kFp32Tol);
      }
    }
  }
}

TEST(WideHeads, ForwardFp64) {
  Rng rng;
  int which = 0;
  for (const Wide& w : kWide) {
    AttnCase c = dense_case(FLARE_DTYPE_F64, 2, 29, 45, 2, 2, w.headdim, w.headdim_v);
    set_mask(c, which++);
    check_forward(c, rng);
  }
}

TEST(WideHeads, ForwardThreadsAndFeatures) {
  // Shared and private groups (the team splits one group's key packs) and the score shapes: softcap, ALiBi,
  // GQA, strided layouts.
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    for (int32_t threads : {1, 3}) {
      AttnCase c = dense_case(dtype, 1, 70, 90, 4, 2, 576, 512);
      c.num_threads = threads;
      c.causal = threads == 3;
      c.softcap = 12.0f;
      c.alibi = AlibiMode::kPerHead;
      c.layout = Layout::kScattered;
      check_forward(c, rng, kFp32Tol);
    }
  }
}

TEST(WideHeads, ForwardVarlen) {
  Rng rng;
  for (const Wide& w : {Wide{512, 512}, Wide{576, 512}, Wide{384, 96}}) {
    for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F64}) {
      AttnCase c = varlen_case(dtype, {5, 0, 41, 1}, {33, 7, 59, 0}, 4, 2, w.headdim, w.headdim_v);
      c.seqused_k = {30, 7, 44, 0};
      c.causal = dtype != FLARE_DTYPE_BF16;
      if (dtype == FLARE_DTYPE_BF16) c.window_left = 11;
      check_forward(c, rng, kFp32Tol);
    }
  }
}

TEST(WideHeads, Backward) {
  Rng rng;
  int which = 0;
  for (const Wide& w : kWide) {
    for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64}) {
      // 31 x 77: odd lengths, a partial 64-query tile and keys past one 64-key block of the bf16 engines.
      AttnCase c = dense_case(dtype, 1, 31, 77, 2, 1, w.headdim, w.headdim_v);
      set_mask(c, which++);
      check_backward(c, rng, kFp32Tol);
    }
  }
}

TEST(WideHeads, BackwardVarlenSharedGroup) {
  // One kv head, three threads: the team shares the group's packs and sums dQ over private buffers.
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    AttnCase c = varlen_case(dtype, {3, 45, 0}, {17, 70, 9}, 2, 1, 576, 512);
    c.num_threads = 3;
    c.causal = true;
    c.softcap = 9.0f;
    check_backward(c, rng, kFp32Tol);
  }
}

TEST(WideHeads, DropoutAndSinks) {
  // The fp32 engines' wide tiles with dropout's per-block keep factors and the sinks folded into the lse:
  // several key blocks (128 forward, 64 backward) and query tiles, odd lengths, masks, private groups
  // (two threads, four groups) and a shared one (three threads, one group).
  Rng rng;
  int which = 0;
  for (const Wide& w : {Wide{320, 320}, Wide{512, 512}, Wide{576, 512}}) {
    for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_F64}) {
      for (int32_t threads : {2, 3}) {
        AttnCase c = dense_case(dtype, threads == 2 ? 2 : 1, 131, 283, 2, threads == 2 ? 2 : 1, w.headdim,
                                w.headdim_v);
        c.num_threads = threads;
        set_mask(c, which++);
        c.dropout_p = 0.2f;
        c.sinks = true;
        check_forward(c, rng, kFp32Tol);
        check_backward(c, rng, kFp32Tol);
      }
    }
  }
}

TEST(WideHeads, BackwardManyTilesVarlen) {
  // Query tiles and 64-key blocks past a handful each, under causal and window masks, so that the one-block
  // steps of the wide backward meet partial tiles at both ends and blocks no query sees.
  Rng rng;
  for (const Wide& w : {Wide{384, 384}, Wide{512, 256}}) {
    AttnCase c = varlen_case(FLARE_DTYPE_F32, {150, 1, 97}, {150, 70, 200}, 2, 2, w.headdim, w.headdim_v);
    c.seqused_k = {130, 70, 141};
    c.causal = true;
    c.window_left = w.headdim == 384 ? 60 : -1;
    check_backward(c, rng, kFp32Tol);
  }
}

}  // namespace
}  // namespace flare::test
