// dropout_mask.cpp — flare_dropout_mask: the keep mask of one sequence, from common/philox.hpp's scalar
// stream (the kernels draw the same words with vectors; the tests hold the two against each other).
#include <cstdint>

#include "api/checks.hpp"
#include "api/validate.hpp"
#include "common/philox.hpp"

namespace flare::detail {

flare_status dropout_mask(float dropout_p, uint64_t seed, uint64_t offset, int64_t sequence, int64_t nheads,
                          int64_t seqlen_q, int64_t seqlen_k, uint8_t* mask) {
  return run_checks([&] {
    check_dropout_p(dropout_p);
    if (sequence < 0) reject(cat("sequence is ", sequence, ": it must be >= 0"));
    if (nheads < 1) reject(cat("nheads is ", nheads, ": it must be >= 1"));
    if (seqlen_q < 0 || seqlen_k < 0) {
      reject(cat("seqlen_q/seqlen_k are ", seqlen_q, "/", seqlen_k, ": they must be >= 0"));
    }
    require_int32(nheads, "nheads");
    require_int32(seqlen_q, "seqlen_q");
    require_int32(seqlen_k, "seqlen_k");
    int64_t elements = 0;  // nheads * seqlen_q < 2^62: only the last product can overflow
    if (__builtin_mul_overflow(nheads * seqlen_q, seqlen_k, &elements)) {
      reject(cat("the mask of ", nheads, " x ", seqlen_q, " x ", seqlen_k, " elements overflows int64"));
    }
    if (mask == nullptr && elements > 0) reject("mask is null: pass (nheads, seqlen_q, seqlen_k) bytes to write");
    const philox::DropoutKey key = philox::dropout_key(seed, offset);
    const uint32_t threshold = philox::dropout_threshold(dropout_p);
    for (int64_t h = 0; h < nheads; ++h) {
      const auto stream = static_cast<uint32_t>(sequence * nheads + h);
      for (int64_t i = 0; i < seqlen_q; ++i) {
        uint8_t* row = mask + (h * seqlen_q + i) * seqlen_k;
        for (int64_t j = 0; j < seqlen_k; j += 16) {
          const philox::Words w =
              philox::dropout_words(key, stream, static_cast<uint32_t>(i), static_cast<uint32_t>(j / 16));
          for (int64_t x = j; x < seqlen_k && x < j + 16; ++x) {
            row[x] = philox::dropout_byte(w, static_cast<uint32_t>(x - j)) >= threshold ? 1 : 0;
          }
        }
      }
    }
  });
}

}  // namespace flare::detail
