// test_forward.cpp — flare_fwd against the fp64 reference over shapes: odd lengths, seqlen_q != seqlen_k
// both ways, head dims from 1 to 256 (headdim_v != headdim too), batch 1-3, in fp32, fp16, bf16 and fp64.
#include <vector>

#include "attention_harness.hpp"

namespace flare::test {
namespace {

struct Shape {
  int64_t seqlen_q, seqlen_k, headdim, headdim_v;
};

// The reference is O(seqlen_q * seqlen_k * headdim) per head: the 1023-long cases run with batch 1.
const std::vector<Shape> kShapes = {
    {1, 1, 64, 64},       {3, 3, 1, 1},         {17, 17, 8, 8},      {113, 113, 40, 40},   {203, 203, 80, 80},
    {113, 203, 96, 96},   {203, 113, 128, 128}, {1, 1023, 256, 256}, {799, 3, 64, 64},     {3, 799, 128, 64},
    {17, 113, 64, 128},   {113, 17, 40, 8},     {1, 17, 256, 32},    {1023, 1023, 64, 64}, {64, 64, 32, 96},
};

bool large(const Shape& s) { return s.seqlen_q * s.seqlen_k > 200000; }

void run_shapes(flare_dtype dtype, bool causal, Rng& rng) {
  for (const Shape& s : kShapes) {
    const int64_t batch = large(s) ? 1 : rng.integer(1, 3);
    const int64_t nheads = large(s) ? 2 : rng.integer(1, 3);
    AttnCase c = dense_case(dtype, batch, s.seqlen_q, s.seqlen_k, nheads, nheads, s.headdim, s.headdim_v);
    c.causal = causal;
    check_forward(c, rng);
  }
}

TEST(ForwardShapes, Fp32) {
  Rng rng;
  run_shapes(FLARE_DTYPE_F32, false, rng);
}

TEST(ForwardShapes, Fp32Causal) {
  Rng rng;
  run_shapes(FLARE_DTYPE_F32, true, rng);
}

TEST(ForwardShapes, Bf16) {
  Rng rng;
  run_shapes(FLARE_DTYPE_BF16, false, rng);
}

TEST(ForwardShapes, Bf16Causal) {
  Rng rng;
  run_shapes(FLARE_DTYPE_BF16, true, rng);
}

TEST(ForwardShapes, Fp16) {
  Rng rng;
  run_shapes(FLARE_DTYPE_F16, false, rng);
}

TEST(ForwardShapes, Fp16Causal) {
  Rng rng;
  run_shapes(FLARE_DTYPE_F16, true, rng);
}

TEST(ForwardShapes, Fp64) {
  Rng rng;
  for (const Shape& s : kShapes) {
    if (large(s)) continue;  // fp64 is checked for correctness of the fp64 path, not for scale
    AttnCase c = dense_case(FLARE_DTYPE_F64, rng.integer(1, 2), s.seqlen_q, s.seqlen_k, 2, 2, s.headdim, s.headdim_v);
    c.causal = rng.coin();
    check_forward(c, rng);
  }
}

TEST(ForwardShapes, AllHeadDims) {
  // Every supported head dim the kernels are likely to special-case, and a few they are not.
  Rng rng;
  for (int64_t d : {1, 2, 7, 8, 16, 24, 32, 40, 48, 59, 64, 72, 80, 96, 100, 112, 128, 160, 192, 200, 224, 256}) {
    for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
      AttnCase c = dense_case(dtype, 1, 37, 51, 2, 1, d, d);
      c.causal = rng.coin();
      check_forward(c, rng);
    }
  }
}

TEST(ForwardShapes, HeaddimVDiffersFromHeaddim) {
  Rng rng;
  const std::vector<std::pair<int64_t, int64_t>> dims = {{64, 128}, {128, 64}, {40, 8}, {8, 40}, {256, 1},
                                                         {1, 256}, {96, 80}, {192, 128}};
  for (auto [d, dv] : dims) {
    for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_F16, FLARE_DTYPE_BF16}) {
      AttnCase c = dense_case(dtype, 2, 29, 45, 2, 2, d, dv);
      c.causal = rng.coin();
      check_forward(c, rng);
    }
  }
}

TEST(ForwardShapes, ManyHeadsAndBatches) {
  Rng rng;
  check_forward(dense_case(FLARE_DTYPE_F32, 3, 33, 65, 16, 16, 32, 32), rng);
  check_forward(dense_case(FLARE_DTYPE_BF16, 7, 9, 130, 12, 4, 16, 16), rng);
}

TEST(ForwardShapes, ThreadCounts) {
  // More threads than work, one thread, and an odd count: the partition of work must not change results.
  // bf16 too: its engines (AMX, dot products) have their own scratch layouts for shared and private groups.
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16})
    for (int32_t threads : {1, 3, 8}) {
      AttnCase c = dense_case(dtype, 2, 70, 90, 3, 3, 64, 64);
      c.num_threads = threads;
      c.causal = threads == 3;
      check_forward(c, rng);
    }
}

TEST(ForwardShapes, FewVisibleKeysInABlock) {
  // Key blocks a query tile sees at most kDotKeys (4) keys of take dot products for the scores, and P V stops
  // at the last visible key (forward.hpp); bf16 calls whose sequences have at most 4 keys run that engine too.
  // Whole calls of 1-5 keys, a last block of 1-4 keys after whole ones (257-260), causal diagonals and window
  // edges that leave a tile few keys, with softcap, ALiBi and sinks, GQA, head dims off the vector width.
  Rng rng;
  const struct {
    int64_t seqlen_q, seqlen_k, headdim;
  } shapes[] = {{239, 1, 64}, {70, 2, 40}, {799, 3, 64}, {33, 4, 72}, {17, 5, 16}, {5, 257, 64}, {260, 260, 48},
                {3, 258, 128}};
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64}) {
    for (const auto& s : shapes) {
      AttnCase c = dense_case(dtype, rng.integer(1, 2), s.seqlen_q, s.seqlen_k, 4, rng.coin() ? 4 : 2, s.headdim,
                              s.headdim);
      switch (rng.integer(0, 3)) {
        case 0: break;
        case 1: c.causal = true; break;
        case 2: c.window_left = 2, c.window_right = 1; break;
        default: c.softcap = 5.0f, c.alibi = AlibiMode::kPerHead, c.sinks = true; break;
      }
      check_forward(c, rng);
    }
  }
}

}  // namespace
}  // namespace flare::test
