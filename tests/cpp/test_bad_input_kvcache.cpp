// test_bad_input_kvcache.cpp — every class of bad input to flare_fwd_kvcache (dense and paged caches,
// append, rotary, left padding) is rejected with the right status, a message naming the argument, and not
// one byte of the outputs or of the cache written. Each test breaks one rule of a valid KvCase.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "bad_input_cases.hpp"

namespace flare::badinput {
namespace {

constexpr flare_status kInvalid = FLARE_INVALID_ARGUMENT;

// Runs `check(case)` for a dense and a paged cache.
template <class Check>
void for_dense_and_paged(Check check, bool rotary = false) {
  for (bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged cache" : "dense cache");
    KvCase c(paged, rotary);
    check(c);
  }
}

TEST(BadInputKvCache, ValidCasesRun) {
  for (bool paged : {false, true}) {
    for (bool rotary : {false, true}) {
      KvCase c(paged, rotary);
      EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
      KvCase causal(paged, rotary);
      causal.params.attn.causal = 1;
      EXPECT_EQ(causal.run(), FLARE_OK) << flare_last_error();
    }
  }
}

TEST(BadInputKvCache, StructSizeAndAbsentTensors) {
  KvCase c;
  c.params.struct_size = 16;
  expect_rejected(c, call_kvcache, kInvalid, {"struct_size is 16"});
  KvCase d;
  d.params.k_cache = flare_tensor{};
  expect_rejected(d, call_kvcache, kInvalid, {"k_cache is absent"});
  KvCase e;
  e.params.v_new = flare_tensor{};
  expect_rejected(e, call_kvcache, kInvalid, {"k_new is given but v_new is absent"});
  size_t bytes = 0;
  KvCase f;
  f.params.q.rank = 0;
  EXPECT_EQ(flare_kvcache_workspace_size(&f.params, &bytes), kInvalid);
  EXPECT_NE(std::string(flare_last_error()).find("q is absent"), std::string::npos) << flare_last_error();
}

TEST(BadInputKvCache, NullData) {
  for_dense_and_paged([](KvCase& c) {
    c.params.k_cache.data = nullptr;
    expect_rejected(c, call_kvcache, kInvalid, {"k_cache.data is null"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.cache_seqlens.data = nullptr;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_seqlens.data is null"});
  });
}

TEST(BadInputKvCache, WrongRank) {
  for_dense_and_paged([](KvCase& c) {
    drop_dim(c.params.k_cache, 0);
    expect_rejected(c, call_kvcache, kInvalid, {"k_cache has rank 3"});
  });
  for_dense_and_paged([](KvCase& c) {
    drop_dim(c.params.q, 0);
    expect_rejected(c, call_kvcache, kInvalid, {"q has rank 3"});
  });
  for_dense_and_paged([](KvCase& c) {
    drop_dim(c.params.k_new, 0);
    expect_rejected(c, call_kvcache, kInvalid, {"k_new has rank 3"});
  });
}

TEST(BadInputKvCache, ShapeMismatch) {
  for_dense_and_paged([](KvCase& c) {
    c.params.v_cache.shape[1] -= 1;
    expect_rejected(c, call_kvcache, kInvalid, {"v_cache has shape"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.k_new.shape[3] = 8;  // headdim of q is 16
    expect_rejected(c, call_kvcache, kInvalid, {"k_new has shape"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.v_new.shape[1] = 1;  // k_new has 2 rows
    expect_rejected(c, call_kvcache, kInvalid, {"v_new has shape"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.out.shape[1] = 1;
    expect_rejected(c, call_kvcache, kInvalid, {"out has shape"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.softmax_lse.shape[1] = 2;
    expect_rejected(c, call_kvcache, kInvalid, {"softmax_lse has shape"});
  });
  for_dense_and_paged([](KvCase& c) {
    Tensor three = Tensor::ints({1, 2, 3});
    c.params.cache_seqlens = three.view;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_seqlens has shape (3)"});
  });
  for_dense_and_paged(
      [](KvCase& c) {
        c.params.rotary_sin.shape[0] -= 1;
        expect_rejected(c, call_kvcache, kInvalid, {"rotary_sin has shape"});
      },
      /*rotary=*/true);
  KvCase dense;  // a dense cache with fewer rows than sequences and no cache_batch_idx
  dense.params.k_cache.shape[0] = 1;
  dense.params.v_cache.shape[0] = 1;
  expect_rejected(dense, call_kvcache, kInvalid, {"k_cache has 1 rows", "batch 2"});
  KvCase paged(true);
  paged.params.block_table.shape[0] = 1;
  expect_rejected(paged, call_kvcache, kInvalid, {"block_table has shape (1, 3)"});
}

TEST(BadInputKvCache, HeadsAndHeadDim) {
  for_dense_and_paged([](KvCase& c) {
    for (flare_tensor* t : {&c.params.k_cache, &c.params.v_cache, &c.params.k_new, &c.params.v_new}) {
      t->shape[2] = 3;
    }
    expect_rejected(c, call_kvcache, kInvalid, {"k_cache has 3 heads but q has 4"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.q.shape[3] = 577;
    expect_rejected(c, call_kvcache, kInvalid, {"q.shape[3] (headdim) is 577", "1..576"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.v_cache.shape[3] = 513;
    expect_rejected(c, call_kvcache, kInvalid, {"v_cache.shape[3] (headdim_v) is 513", "1..512"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.v_cache.shape[3] = 0;
    expect_rejected(c, call_kvcache, kInvalid, {"(headdim_v) is 0"});
  });
}

TEST(BadInputKvCache, Dtypes) {
  for_dense_and_paged([](KvCase& c) {
    c.params.k_cache.dtype = FLARE_DTYPE_F16;
    expect_rejected(c, call_kvcache, kInvalid, {"k_cache.dtype is F16"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.cache_seqlens.dtype = FLARE_DTYPE_F32;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_seqlens.dtype is F32", "int32"});
  });
  KvCase paged(true);
  paged.params.block_table.dtype = FLARE_DTYPE_F32;
  expect_rejected(paged, call_kvcache, kInvalid, {"block_table.dtype is F32"});
  for_dense_and_paged(
      [](KvCase& c) {
        c.params.rotary_cos.dtype = FLARE_DTYPE_BF16;
        c.params.rotary_sin.dtype = FLARE_DTYPE_BF16;
        expect_rejected(c, call_kvcache, kInvalid, {"rotary_cos.dtype is BF16"});
      },
      true);
  for_dense_and_paged([](KvCase& c) {
    for (flare_tensor* t :
         {&c.params.q, &c.params.k_cache, &c.params.v_cache, &c.params.k_new, &c.params.v_new}) {
      t->dtype = FLARE_DTYPE_E4M3;
    }
    c.params.out.dtype = FLARE_DTYPE_BF16;
    expect_rejected(c, call_kvcache, FLARE_UNSUPPORTED, {"q.dtype is E4M3"});
  });
}

TEST(BadInputKvCache, Devices) {
  for_dense_and_paged([](KvCase& c) {
    c.params.cache_seqlens.device = kCuda0;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_seqlens is on cuda:0"});
  });
  KvCase paged(true);
  paged.params.block_table.device = kCuda0;
  expect_rejected(paged, call_kvcache, kInvalid, {"block_table is on cuda:0"});
  for_dense_and_paged(
      [](KvCase& c) {
        move_all({&c.params.q, &c.params.k_cache, &c.params.v_cache, &c.params.k_new, &c.params.v_new,
                  &c.params.out, &c.params.softmax_lse, &c.params.cache_seqlens, &c.params.block_table,
                  &c.params.rotary_cos, &c.params.rotary_sin},
                 kCuda0);
        expect_rejected(c, call_kvcache, FLARE_UNSUPPORTED, {"CUDA"});
        size_t bytes = 0;
        EXPECT_EQ(flare_kvcache_workspace_size(&c.params, &bytes), FLARE_UNSUPPORTED);
      },
      true);
}

// The CUDA KV-cache kernels take head dims up to 256: a wider q / k_cache (or v_cache) on a CUDA device is
// UNSUPPORTED at validation, in any build, naming the head dim and the CPU as where it runs.
TEST(BadInputKvCache, WideHeadDimsOnCuda) {
  for (bool value_side : {false, true}) {
    for_dense_and_paged([value_side](KvCase& c) {
      move_all({&c.params.q, &c.params.k_cache, &c.params.v_cache, &c.params.k_new, &c.params.v_new,
                &c.params.out, &c.params.softmax_lse, &c.params.cache_seqlens, &c.params.block_table,
                &c.params.rotary_cos, &c.params.rotary_sin},
               kCuda0);
      if (value_side) {  // headdim_v 320: v_cache, v_new and out
        for (flare_tensor* t : {&c.params.v_cache, &c.params.v_new, &c.params.out}) t->shape[3] = 320;
      } else {  // headdim 320: q, k_cache and k_new
        for (flare_tensor* t : {&c.params.q, &c.params.k_cache, &c.params.k_new}) t->shape[3] = 320;
      }
      expect_rejected(c, call_kvcache, FLARE_UNSUPPORTED,
                      {value_side ? "(headdim_v) is 320 on cuda:0" : "(headdim) is 320 on cuda:0",
                       "the CUDA KV-cache kernels take head dims up to 256", "run on the CPU"});
    });
  }
}

TEST(BadInputKvCache, StridesAndOverlap) {
  for_dense_and_paged([](KvCase& c) {
    c.params.k_cache.strides[3] = 2;
    expect_rejected(c, call_kvcache, kInvalid, {"k_cache.strides[3] is 2", "stride 1"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.v_cache.strides[1] = -c.params.v_cache.strides[1];
    expect_rejected(c, call_kvcache, kInvalid, {"v_cache.strides[1] is -"});
  });
  // The cache is written when keys are appended, so it must not overlap itself then.
  for_dense_and_paged([](KvCase& c) {
    c.params.v_cache.strides[1] = 0;
    expect_rejected(c, call_kvcache, kInvalid, {"v_cache has shape", "overlap"});
  });
  KvCase readonly;  // without k_new the cache is only read: a broadcast (stride 0) cache is fine
  readonly.params.k_new = flare_tensor{};
  readonly.params.v_new = flare_tensor{};
  readonly.params.k_cache.strides[0] = 0;
  EXPECT_EQ(readonly.run(), FLARE_OK) << flare_last_error();
}

TEST(BadInputKvCache, CacheSeqlensOutOfRange) {
  for_dense_and_paged([](KvCase& c) {
    c.cache_seqlens.i32()[0] = -1;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_seqlens[0] is -1", ">= 0"});
  });
  KvCase dense;  // 11 cached + 2 new > 12
  dense.cache_seqlens.i32()[1] = 11;
  expect_rejected(dense, call_kvcache, kInvalid, {"cache_seqlens[1] is 11", "room"});
  KvCase full;  // absent cache_seqlens: every sequence holds seqlen_cache keys, so nothing fits
  full.params.cache_seqlens = flare_tensor{};
  expect_rejected(full, call_kvcache, kInvalid, {"absent", "room"});
  full.params.k_new = flare_tensor{};
  full.params.v_new = flare_tensor{};
  EXPECT_EQ(full.run(), FLARE_OK) << "a full cache without appending is fine: " << flare_last_error();
}

TEST(BadInputKvCache, BlockTableTooFewColumns) {
  KvCase c(true);  // 3 columns of 4 keys; 11 cached + 2 new = 13
  c.cache_seqlens.i32()[1] = 11;
  expect_rejected(c, call_kvcache, kInvalid, {"cache_seqlens[1] is 11", "block_table has 3 columns"});
}

TEST(BadInputKvCache, BlockTableEntries) {
  {
    KvCase c(true);
    c.block_table.i32()[5] = 7;  // sequence 1, column 2: 7 blocks exist
    expect_rejected(c, call_kvcache, kInvalid, {"block_table[1][2] is 7", "num_blocks"});
  }
  {
    KvCase c(true);
    c.block_table.i32()[1] = -1;
    expect_rejected(c, call_kvcache, kInvalid, {"block_table[0][1] is -1"});
  }
  {
    KvCase c(true);  // sequence 0 uses 2 blocks (7 keys): its third entry is never read
    c.block_table.i32()[2] = -1;
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  }
  {
    KvCase c(true);  // blocks before the left padding are not read either
    Tensor leftpad = Tensor::ints({4, 0});
    c.params.cache_leftpad = leftpad.view;
    c.block_table.i32()[0] = 99;
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  }
}

// Sequence 0 appends keys 5, 6 into block_table[0][1] rows 1, 2; sequence 1 appends keys 9, 10 into
// block_table[1][2] rows 1, 2 (KvCase's paged layout).
TEST(BadInputKvCache, PagedAppendsShareASlot) {
  {
    KvCase c(true);
    c.block_table.i32()[5] = c.block_table.i32()[1];  // both append into block 0, rows 1..2
    expect_rejected(c, call_kvcache, kInvalid,
                    {"block_table[0][1] and block_table[1][2] both name block 0", "rows 1..2", "slot of its own"});
  }
  {
    KvCase c(true);  // runs that overlap in one row
    c.cache_seqlens.i32()[1] = 8;  // sequence 1 appends keys 8, 9: block_table[1][2] rows 0, 1
    c.block_table.i32()[5] = c.block_table.i32()[1];
    expect_rejected(c, call_kvcache, kInvalid, {"both name block 0", "rows 0..1", "1..2"});
  }
  {
    KvCase c(true);  // rows 3 and 0..1 of one block: no slot shared, so sharing the block is fine
    c.cache_seqlens.i32()[0] = 2;  // sequence 0 appends keys 2, 3: block_table[0][0] rows 2, 3
    c.cache_seqlens.i32()[1] = 8;  // sequence 1 appends keys 8, 9: block_table[1][2] rows 0, 1
    c.block_table.i32()[5] = c.block_table.i32()[0];
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  }
  {
    KvCase c(true);  // a block both read (a shared prefix) without appending into it twice is fine
    c.block_table.i32()[3] = c.block_table.i32()[0];
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
    c.params.k_new = flare_tensor{};  // nothing appended: any sharing is fine
    c.params.v_new = flare_tensor{};
    c.block_table.i32()[5] = c.block_table.i32()[1];
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  }
}

TEST(BadInputKvCache, CacheBatchIdx) {
  {
    KvCase c;
    Tensor idx = Tensor::ints({0, 3});  // the cache has 3 rows
    c.params.cache_batch_idx = idx.view;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_batch_idx[1] is 3", "k_cache has 3 rows"});
    idx.i32()[1] = -2;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_batch_idx[1] is -2"});
    idx.i32()[1] = 0;  // both sequences appending into row 0
    expect_rejected(c, call_kvcache, kInvalid, {"cache_batch_idx holds 0 twice"});
    idx.i32()[0] = 2;
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  }
  {
    KvCase c;  // sharing a row is fine when nothing is appended
    Tensor idx = Tensor::ints({1, 1});
    c.params.cache_batch_idx = idx.view;
    c.params.k_new = flare_tensor{};
    c.params.v_new = flare_tensor{};
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  }
  {
    KvCase c(true);
    Tensor idx = Tensor::ints({0, 1});
    c.params.cache_batch_idx = idx.view;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_batch_idx is given", "paged"});
  }
}

TEST(BadInputKvCache, CacheLeftpad) {
  for_dense_and_paged([](KvCase& c) {
    Tensor leftpad = Tensor::ints({0, -1});
    c.params.cache_leftpad = leftpad.view;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_leftpad[1] is -1"});
    leftpad.i32()[1] = c.cache_seqlens.i32()[1] + 1;
    expect_rejected(c, call_kvcache, kInvalid, {"cache_leftpad[1]", "0..cache_seqlens"});
    leftpad.i32()[1] = c.cache_seqlens.i32()[1];  // no cached keys left: only the appended ones
    EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  });
}

TEST(BadInputKvCache, Rotary) {
  for_dense_and_paged(
      [](KvCase& c) {
        c.params.rotary_sin = flare_tensor{};
        expect_rejected(c, call_kvcache, kInvalid, {"rotary_cos is given but rotary_sin is absent"});
      },
      true);
  for_dense_and_paged(
      [](KvCase& c) {
        c.params.rotary_cos.shape[1] = 9;
        c.params.rotary_sin.shape[1] = 9;
        expect_rejected(c, call_kvcache, kInvalid, {"rotary_dim is 18", "headdim is 16"});
      },
      true);
  for_dense_and_paged(
      [](KvCase& c) {
        drop_dim(c.params.rotary_cos, 0);
        expect_rejected(c, call_kvcache, kInvalid, {"rotary_cos has rank 1"});
      },
      true);
  for_dense_and_paged(
      [](KvCase& c) {
        c.params.rotary_sin.strides[0] = 2 * c.params.rotary_cos.strides[0];
        expect_rejected(c, call_kvcache, kInvalid, {"rotary_sin.strides[0]", "row stride"});
      },
      true);
  for_dense_and_paged(
      [](KvCase& c) {
        c.params.rotary_interleaved = 2;
        expect_rejected(c, call_kvcache, kInvalid, {"rotary_interleaved is 2"});
      },
      true);
}

TEST(BadInputKvCache, RotaryRowsTooFew) {
  // Dense: cache_seqlens {4, 6}, 2 new keys, 3 queries. Sequence 1 appends at positions 6, 7: 8 rows.
  KvCase c(false, true);
  c.params.rotary_cos.shape[0] = 7;
  c.params.rotary_sin.shape[0] = 7;
  expect_rejected(c, call_kvcache, kInvalid, {"rotary_cos has 7 rows", "sequence 1", "up to 7"});
  // Positions are cache slots, as in FlashAttention: left padding does not lower the need.
  Tensor leftpad = Tensor::ints({0, 3});
  c.params.cache_leftpad = leftpad.view;
  expect_rejected(c, call_kvcache, kInvalid, {"rotary_cos has 7 rows", "sequence 1", "up to 7"});
  c.params.rotary_cos.shape[0] = 8;
  c.params.rotary_sin.shape[0] = 8;
  EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
  // Causal queries are rotated at their own slots: sequence 1's last query sits at 6 + 2 = 8.
  c.params.attn.causal = 1;
  expect_rejected(c, call_kvcache, kInvalid, {"rotary_cos has 8 rows", "sequence 1", "up to 8"});
  c.params.rotary_cos.shape[0] = 9;
  c.params.rotary_sin.shape[0] = 9;
  EXPECT_EQ(c.run(), FLARE_OK) << flare_last_error();
}

TEST(BadInputKvCache, Options) {
  for_dense_and_paged([](KvCase& c) {
    c.params.attn.window_left = -4;
    expect_rejected(c, call_kvcache, kInvalid, {"attn.window_left is -4"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.attn.softcap = std::numeric_limits<float>::infinity();
    expect_rejected(c, call_kvcache, kInvalid, {"attn.softcap is inf"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.attn.softmax_scale = std::nanf("");
    expect_rejected(c, call_kvcache, kInvalid, {"attn.softmax_scale is"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.attn.causal = 7;
    expect_rejected(c, call_kvcache, kInvalid, {"attn.causal is 7"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.num_splits = -1;
    expect_rejected(c, call_kvcache, kInvalid, {"num_splits is -1"});
  });
  for_dense_and_paged([](KvCase& c) {
    Tensor slopes(FLARE_DTYPE_F32, {KvCase::kHeads + 1});
    c.params.attn.alibi_slopes = slopes.view;
    expect_rejected(c, call_kvcache, kInvalid, {"attn.alibi_slopes has shape (5)"});
  });
  for_dense_and_paged([](KvCase& c) {
    c.params.exec.num_threads = -8;
    expect_rejected(c, call_kvcache, kInvalid, {"exec.num_threads is -8"});
  });
}

TEST(BadInputKvCache, Int32Overflow) {
  {
    KvCase c(true);  // 2^31 columns of 4 keys: positions past int32
    c.params.block_table.shape[1] = int64_t{1} << 31;
    c.params.block_table.strides[0] = 0;
    expect_rejected(c, call_kvcache, kInvalid, {"capacity", "int32"});
  }
  {
    KvCase c;
    for (flare_tensor* t : {&c.params.k_cache, &c.params.v_cache}) {
      t->shape[1] = int64_t{1} << 32;
      t->strides[1] = 0;
      t->strides[0] = 0;
    }
    expect_rejected(c, call_kvcache, kInvalid, {"k_cache.shape[1] (seqlen_cache)", "int32"});
  }
}

TEST(BadInputKvCache, WorkspaceTooSmall) {
  for_dense_and_paged([](KvCase& c) {
    size_t needed = 0;
    ASSERT_EQ(flare_kvcache_workspace_size(&c.params, &needed), FLARE_OK) << flare_last_error();
    if (needed == 0) return;
    std::vector<uint8_t> workspace(needed);
    c.params.exec.workspace = workspace.data();
    c.params.exec.workspace_size = needed - 1;
    const std::string want = std::to_string(needed) + " bytes";
    expect_rejected(c, call_kvcache, FLARE_OUT_OF_MEMORY, {"exec.workspace_size", want.c_str()});
  });
}

}  // namespace
}  // namespace flare::badinput
