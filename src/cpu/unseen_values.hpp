// unseen_values.hpp — keeps NaN and infinity in V away from the rows that cannot see their key.
//
// O += P V multiplies a whole block of keys for every row of a tile; a masked key has P = 0, but 0 x NaN is
// NaN, so one non-finite value at a causal- or window-masked key would reach every row sharing its block.
// (Keys past a sequence's end — beyond cache_seqlens, varlen padding, a page's unused slots — are never
// read: packs zero-fill them.) So each packed block of V is screened once: the keys whose row holds a NaN
// or infinity are flagged and those values become 0 in the pack, and after a block's O += P V each row adds
// back the non-finite values of the flagged keys it sees. A visible NaN or infinity reaches its row as
// IEEE arithmetic would carry it; nothing reaches a row that cannot see it. Finite values (all of them, in
// practice) cost one scan of the packed block, and the per-row step runs only for flagged blocks.
#pragma once

#include <cmath>
#include <cstring>

#include "cpu/cpu_backend.hpp"
#include "cpu/sequences.hpp"

namespace flare::cpu::FLARE_ISA {

// The exponent field of one element (dtype's storage), and whether it is all ones (NaN or infinity).
// The masked exponent never exceeds kExponent, so "some element's is all ones" is "the largest is": a max
// reduction, which compilers vectorise (no early exit, no boolean accumulator).
template <class Bits, Bits kExponent>
inline bool any_exponent_all_ones(const void* x, int64_t n) {
  const auto* bits = static_cast<const Bits*>(x);
  Bits most = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Bits e = static_cast<Bits>(bits[i] & kExponent);
    most = e > most ? e : most;
  }
  return most == kExponent;
}
inline bool any_nonfinite(const void* x, flare_dtype dtype, int64_t n) {
  switch (dtype) {
    case FLARE_DTYPE_F64: return any_exponent_all_ones<uint64_t, 0x7ff0000000000000ull>(x, n);
    case FLARE_DTYPE_F32: return any_exponent_all_ones<uint32_t, 0x7f800000u>(x, n);
    case FLARE_DTYPE_F16: return any_exponent_all_ones<uint16_t, 0x7c00>(x, n);
    case FLARE_DTYPE_BF16: return any_exponent_all_ones<uint16_t, 0x7f80>(x, n);
    default: return false;
  }
}
template <class Bits, Bits kExponent>
inline void zero_exponent_all_ones(void* x, int64_t n) {
  auto* bits = static_cast<Bits*>(x);
  for (int64_t i = 0; i < n; ++i)
    if ((bits[i] & kExponent) == kExponent) bits[i] = 0;
}
inline void zero_nonfinite(void* x, flare_dtype dtype, int64_t n) {
  switch (dtype) {
    case FLARE_DTYPE_F64: return zero_exponent_all_ones<uint64_t, 0x7ff0000000000000ull>(x, n);
    case FLARE_DTYPE_F32: return zero_exponent_all_ones<uint32_t, 0x7f800000u>(x, n);
    case FLARE_DTYPE_F16: return zero_exponent_all_ones<uint16_t, 0x7c00>(x, n);
    case FLARE_DTYPE_BF16: return zero_exponent_all_ones<uint16_t, 0x7f80>(x, n);
    default: return;
  }
}

// Screens the packed values of keys [j0, j0 + nkeys) (only those below seqlen_k were read), which lie in
// pieces of `packed_dtype` elements in the engine's layout: pieces(f) calls f(start, count) for each.
// flags[jj] is set for key j0 + jj when its V row holds a NaN or infinity, and those values are zeroed in
// the pack.
template <class Pieces>
inline void screen_value_pieces(const Problem& p, const RowPtr& vrows, int64_t seqlen_k, int64_t j0, int64_t nkeys,
                                flare_dtype packed_dtype, uint8_t* flags, Pieces pieces) {
  std::memset(flags, 0, nkeys);
  bool any = false;
  pieces([&](void* x, int64_t n) { any = any || any_nonfinite(x, packed_dtype, n); });
  if (!any) return;
  for (int64_t jj = 0; jj < nkeys && j0 + jj < seqlen_k; ++jj)
    flags[jj] = any_nonfinite(vrows.row(j0 + jj), p.dtype, p.headdim_v);
  pieces([&](void* x, int64_t n) { zero_nonfinite(x, packed_dtype, n); });
}
// Flags the keys [j0, j0 + nkeys) whose K row holds a NaN or infinity (flags[jj] for key j0 + jj; keys past
// seqlen_k are never flagged), for an engine that zeroes those values in its pack of K as the B operand of
// dQ += dS K. Returns whether any key was flagged.
inline bool flag_nonfinite_keys(const Problem& p, const RowPtr& krows, int64_t seqlen_k, int64_t j0, int64_t nkeys,
                                uint8_t* flags) {
  bool any = false;
  for (int64_t jj = 0; jj < nkeys; ++jj) {
    flags[jj] = j0 + jj < seqlen_k && any_nonfinite(krows.row(j0 + jj), p.dtype, p.headdim);
    any |= flags[jj] != 0;
  }
  return any;
}

// Rows [i0, i0 + rows) of head h after a block product over keys [j0, j0 + cols) whose flagged keys (flags[jj]
// for key j0 + jj) had their non-finite values zeroed in the pack: each row r adds weight(r, jj) times the
// non-finite values of `operand`'s flagged rows it sees to its accumulator, add(r, c, value) adding value to
// element c of row r, as the product would have with them in place.
template <class Acc, class Weight, class Add>
inline void add_seen_nonfinite(const Problem& p, const Sequence& seq, int64_t h, const detail::Operand& operand,
                               int64_t dim, const uint8_t* flags, int64_t j0, int64_t cols, int64_t i0, int64_t rows,
                               Weight weight, Add add) {
  bool any = false;
  for (int64_t c = 0; c < cols; ++c) any |= flags[c] != 0;
  if (!any) return;
  const RowPtr key_row = key_rows(p, operand, seq, h / (p.nheads / p.nheads_k));
  const policy::WindowMask mask = seq.mask(p);
  double x[kMaxHeaddim];  // dim is headdim or headdim_v: at most kMaxHeaddim (cpu_backend.hpp)
  for (int64_t r = 0; r < rows; ++r) {
    const policy::KeyRange keys = mask.keys_of(i0 + r);
    const int64_t first = smax(smax<int64_t>(keys.first, 0), j0);
    const int64_t last = smin(smin<int64_t>(keys.last, seq.seqlen_k - 1), j0 + cols - 1);
    for (int64_t j = first; j <= last; ++j) {
      if (!flags[j - j0]) continue;
      load_row<double>(key_row.row(j), p.dtype, x, dim, 1.0);
      const Acc w = weight(r, j - j0);
      for (int64_t c = 0; c < dim; ++c)
        if (!std::isfinite(x[c])) add(r, c, w * static_cast<Acc>(x[c]));
    }
  }
}

// The forward: after O += P V, each row adds the non-finite V values of the flagged keys it sees (weight 1).
template <class Acc>
inline void add_seen_nonfinite_values(const Problem& p, const Sequence& seq, int64_t h, const uint8_t* flags,
                                      int64_t j0, int64_t cols, int64_t i0, int64_t rows, Acc* o, int64_t ldo) {
  add_seen_nonfinite<Acc>(p, seq, h, p.v, p.headdim_v, flags, j0, cols, i0, rows,
                          [](int64_t, int64_t) { return Acc{1}; },
                          [o, ldo](int64_t r, int64_t c, Acc x) { o[r * ldo + c] += x; });
}

// The backward (backward.hpp): after dQ += dS K, each row adds dS(r, j) times the non-finite K values of the
// flagged keys it sees (dS row r at ds + r * ldds). The bf16 engines call add_seen_nonfinite directly, with
// their keys-major dSᵀ and their own dQ layouts.
template <class T>
inline void add_seen_nonfinite_keys(const Problem& p, const Sequence& seq, int64_t h, const uint8_t* flags, int64_t j0,
                                    int64_t cols, int64_t i0, int64_t rows, const T* ds, int64_t ldds, T* dq,
                                    int64_t lddq) {
  add_seen_nonfinite<T>(p, seq, h, p.k, p.headdim, flags, j0, cols, i0, rows,
                        [&](int64_t r, int64_t jj) { return ds[r * ldds + jj]; },
                        [dq, lddq](int64_t r, int64_t c, T x) { dq[r * lddq + c] += x; });
}

}  // namespace flare::cpu::FLARE_ISA
