// test_varlen.cpp — flare_fwd_varlen against the fp64 reference: ragged lengths (zero-length sequences on
// either side included), seqused_k, every masking option with per-sequence alignment, strided and packed
// layouts, and the max_seqlen hints.
#include <vector>

#include "attention_harness.hpp"

namespace flare::test {
namespace {

const flare_dtype kAllDtypes[] = {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64};

TEST(ForwardVarlen, RaggedLengths) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes) {
    // A zero-length sequence in the middle, a single token, and q/k lengths that disagree both ways.
    check_forward(varlen_case(dtype, {5, 0, 113, 1, 17}, {7, 3, 203, 1, 9}, 2, 2, 64, 64), rng);
    // Queries with no keys at all: out = 0, lse = -inf.
    check_forward(varlen_case(dtype, {4, 9, 3}, {0, 11, 0}, 3, 1, 32, 32), rng);
  }
}

TEST(ForwardVarlen, MasksAlignPerSequence) {
  Rng rng;
  const std::vector<int64_t> sq = {33, 1, 80, 0, 12}, sk = {20, 57, 80, 5, 40};
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    AttnCase c = varlen_case(dtype, sq, sk, 4, 2, 40, 40);
    c.causal = true;
    check_forward(c, rng);
    c.causal = false;
    c.window_left = 6;
    c.window_right = 2;
    check_forward(c, rng);
    c.window_left = -1;
    c.window_right = 0;
    c.alibi = AlibiMode::kPerBatchHead;
    check_forward(c, rng);
    c.causal = true;
    c.window_left = 10;
    c.window_right = -1;
    c.softcap = 6.0f;
    c.alibi = AlibiMode::kPerHead;
    check_forward(c, rng);
  }
}

TEST(ForwardVarlen, SequsedK) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes) {
    AttnCase c = varlen_case(dtype, {13, 6, 25, 4}, {20, 40, 25, 9}, 2, 1, 32, 64);
    c.seqused_k = {13, 0, 25, 1};  // a sequence that uses none of its keys, one that uses all
    c.causal = dtype != FLARE_DTYPE_F16;
    check_forward(c, rng);
  }
}

TEST(ForwardVarlen, StridedAndPacked) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes) {
    AttnCase c = varlen_case(dtype, {21, 0, 64, 7}, {21, 0, 64, 7}, 6, 2, 64, 64);
    c.layout = Layout::kPackedQkv;
    c.causal = true;
    check_forward(c, rng);
    c = varlen_case(dtype, {9, 31, 2}, {45, 3, 2}, 2, 2, 48, 16);
    c.layout = Layout::kScattered;
    c.window_left = 4;
    check_forward(c, rng);
  }
}

TEST(ForwardVarlen, MaxSeqlenHints) {
  Rng rng;
  for (bool give : {false, true}) {
    AttnCase c = varlen_case(FLARE_DTYPE_F32, {100, 3, 57}, {1, 130, 57}, 2, 2, 64, 64);
    c.give_max_seqlen = give;
    c.causal = true;
    check_forward(c, rng);
  }
}

TEST(ForwardVarlen, LongSequenceAmongShortOnes) {
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    AttnCase c = varlen_case(dtype, {2, 1023, 1}, {5, 1023, 700}, 2, 1, 64, 64);
    c.causal = true;
    check_forward(c, rng);
  }
}

TEST(ForwardVarlen, RandomCombinations) {
  Rng rng;
  for (int n = 0; n < 16; ++n) {
    AttnCase c = random_varlen_case(rng, 5, 90);
    c.give_max_seqlen = rng.coin();
    check_forward(c, rng);
  }
}

}  // namespace
}  // namespace flare::test
