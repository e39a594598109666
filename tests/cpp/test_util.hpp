// test_util.hpp — what every C++ test shares: seeded randomness, fp16/bf16 storage, strided host tensors
// that become flare_tensor views, NaN poisoning of outputs, and error measures.
//
// Seeds: every test draws a fresh seed from std::random_device and prints it; FLARE_TEST_SEED=<n> in the
// environment replays a failing run. The seed is also attached to every failure message.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flare/flare.h"

namespace flare::test {

// ---------------------------------------------------------------------------------------------------
// Randomness
// ---------------------------------------------------------------------------------------------------

inline uint32_t fresh_seed() {
  if (const char* env = std::getenv("FLARE_TEST_SEED"); env != nullptr && *env != '\0')
    return static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
  std::random_device device;
  return device();
}

inline std::string seed_message(uint32_t seed) {
  return "seed " + std::to_string(seed) + " (replay with FLARE_TEST_SEED=" + std::to_string(seed) + ")";
}

// One per test. Prints its seed and adds it to every failure message while it lives.
class Rng {
 public:
  Rng() : seed_(fresh_seed()), engine_(seed_), trace_(__FILE__, __LINE__, seed_message(seed_)) {
    std::printf("[   seed   ] FLARE_TEST_SEED=%u\n", seed_);
    testing::Test::RecordProperty("seed", std::to_string(seed_));
  }
  // A stream replayed from a known seed (two calls that must see the same numbers); prints nothing.
  explicit Rng(uint32_t seed) : seed_(seed), engine_(seed_), trace_(__FILE__, __LINE__, seed_message(seed_)) {}
  uint32_t seed() const { return seed_; }
  double normal() { return normal_(engine_); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(engine_); }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(engine_); }
  bool coin() { return integer(0, 1) == 1; }
  std::mt19937& engine() { return engine_; }

 private:
  uint32_t seed_;
  std::mt19937 engine_;
  std::normal_distribution<double> normal_{0.0, 1.0};
  testing::ScopedTrace trace_;
};

// ---------------------------------------------------------------------------------------------------
// Floating-point formats (round-to-nearest-even, written out rather than borrowed from the hardware)
// ---------------------------------------------------------------------------------------------------

// Rounds x to the nearest value of a binary format with fraction_bits stored fraction bits and normal
// exponents min_exponent..max_exponent (subnormals below), ties to even; overflow gives ±inf.
inline double round_to_format(double x, int fraction_bits, int min_exponent, int max_exponent) {
  if (!std::isfinite(x) || x == 0.0) return x;
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -fraction_bits), max_exponent);
  uint64_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  const int exponent = static_cast<int>((u >> 52) & 0x7FF) - 1023;
  if (exponent >= min_exponent && exponent <= max_exponent) {
    // A normal result: round the 52-bit fraction to fraction_bits on the integer bits (a carry out of the
    // fraction correctly bumps the exponent).
    const int drop = 52 - fraction_bits;
    const uint64_t lsb = (u >> drop) & 1;
    u += ((uint64_t{1} << (drop - 1)) - 1) + lsb;
    u &= ~((uint64_t{1} << drop) - 1);
    double r = 0.0;
    std::memcpy(&r, &u, sizeof(r));
    return std::fabs(r) > max_finite ? std::copysign(std::numeric_limits<double>::infinity(), x) : r;
  }
  // Subnormal in the target format (or out of its range): scale to units of the last place and round.
  int e = 0;
  std::frexp(x, &e);                 // |x| = m 2^e, m in [0.5, 1): the leading bit has weight 2^(e-1)
  const int quantum = std::max(e - 1, min_exponent) - fraction_bits;  // exponent of one unit in the last place
  const double scaled = std::ldexp(x, -quantum);                       // exact: a power-of-two scaling
  double units = std::floor(scaled);
  const double rest = scaled - units;
  if (rest > 0.5 || (rest == 0.5 && std::fmod(units, 2.0) != 0.0)) units += 1.0;
  const double r = std::ldexp(units, quantum);
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

inline double round_f16(double x) { return round_to_format(x, 10, -14, 15); }
inline double round_bf16(double x) { return round_to_format(x, 7, -126, 127); }
inline double round_f32(double x) { return round_to_format(x, 23, -126, 127); }

// Bits of x, which must already be an fp16 value (round_f16(x) == x) or NaN.
inline uint16_t f16_bits(double x) {
  if (std::isnan(x)) return 0x7E00;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (std::isinf(a)) return sign | 0x7C00;
  if (a == 0.0) return sign;
  int e = 0;
  std::frexp(a, &e);
  const int lead = e - 1;
  if (lead < -14) return sign | static_cast<uint16_t>(std::ldexp(a, 24));  // subnormal: units of 2^-24
  const auto fraction = static_cast<uint16_t>(std::ldexp(a, 10 - lead) - 1024.0);
  return sign | static_cast<uint16_t>((lead + 15) << 10) | fraction;
}

inline double from_f16_bits(uint16_t bits) {
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1F;
  const int fraction = bits & 0x3FF;
  if (exponent == 0x1F)
    return fraction ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(fraction, -24);
  return sign * std::ldexp(1024 + fraction, exponent - 25);
}

// bf16 is the top half of an fp32; x must already be a bf16 value (round_bf16(x) == x) or NaN.
inline uint16_t bf16_bits(double x) {
  if (std::isnan(x)) return 0x7FC0;
  const float f = static_cast<float>(x);  // exact for a bf16 value
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

inline double from_bf16_bits(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f = 0.0f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline size_t dtype_size(flare_dtype dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F32: return 4;
    case FLARE_DTYPE_F16: return 2;
    case FLARE_DTYPE_BF16: return 2;
    case FLARE_DTYPE_F64: return 8;
    case FLARE_DTYPE_I32: return 4;
    case FLARE_DTYPE_E4M3: return 1;
  }
  return 0;
}

inline const char* dtype_name(flare_dtype dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F32: return "fp32";
    case FLARE_DTYPE_F16: return "fp16";
    case FLARE_DTYPE_BF16: return "bf16";
    case FLARE_DTYPE_F64: return "fp64";
    case FLARE_DTYPE_I32: return "int32";
    case FLARE_DTYPE_E4M3: return "e4m3";
  }
  return "?";
}

// The value x becomes when stored in dtype.
inline double round_to(flare_dtype dtype, double x) {
  switch (dtype) {
    case FLARE_DTYPE_F32: return round_f32(x);
    case FLARE_DTYPE_F16: return round_f16(x);
    case FLARE_DTYPE_BF16: return round_bf16(x);
    default: return x;
  }
}

// The rounding a "same-dtype naive" computation applies to its intermediates (nullptr for exact dtypes).
using RoundFn = double (*)(double);
inline RoundFn rounding_of(flare_dtype dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F16: return &round_f16;
    case FLARE_DTYPE_BF16: return &round_bf16;
    case FLARE_DTYPE_F32: return &round_f32;
    default: return nullptr;
  }
}

inline bool is_low_precision(flare_dtype dtype) { return dtype == FLARE_DTYPE_F16 || dtype == FLARE_DTYPE_BF16; }

// Half a unit in the last place relative to 1 (the unit roundoff) of a floating dtype.
inline double unit_roundoff(flare_dtype dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F16: return std::ldexp(1.0, -11);
    case FLARE_DTYPE_BF16: return std::ldexp(1.0, -8);
    case FLARE_DTYPE_F32: return std::ldexp(1.0, -24);
    case FLARE_DTYPE_F64: return std::ldexp(1.0, -53);
    default: return 0.0;
  }
}

// ---------------------------------------------------------------------------------------------------
// Host tensors
// ---------------------------------------------------------------------------------------------------

// A strided tensor over a shared, 64-byte-aligned buffer. Several tensors may view one buffer (e.g. q, k
// and v inside a packed qkv buffer). Strides are in elements, as in flare_tensor.
class HostTensor {
 public:
  HostTensor() = default;

  // A fresh contiguous tensor (zeroed).
  static HostTensor contiguous(flare_dtype dtype, std::vector<int64_t> shape) {
    std::vector<int64_t> strides(shape.size(), 1);
    for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
    return with_strides(dtype, std::move(shape), std::move(strides));
  }

  // A fresh tensor with the given strides over a buffer just large enough (zeroed).
  static HostTensor with_strides(flare_dtype dtype, std::vector<int64_t> shape, std::vector<int64_t> strides) {
    int64_t extent = 1;  // one past the furthest element
    bool empty = false;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 0) empty = true;
      extent += (shape[d] - 1) * strides[d];
    }
    if (empty) extent = 1;
    HostTensor t;
    t.dtype_ = dtype;
    t.buffer_elems_ = extent;
    t.buffer_ = allocate(static_cast<size_t>(extent) * dtype_size(dtype));
    t.shape_ = std::move(shape);
    t.strides_ = std::move(strides);
    return t;
  }

  // A fresh non-contiguous tensor: the non-last dimensions are laid out in a random order with a few
  // padding elements after each, the last dimension stays contiguous.
  template <class Rng>
  static HostTensor scattered(flare_dtype dtype, std::vector<int64_t> shape, Rng& rng) {
    const int rank = static_cast<int>(shape.size());
    std::vector<int> order;  // memory order of the non-last dims, innermost first
    for (int d = rank - 2; d >= 0; --d) order.push_back(d);
    std::shuffle(order.begin(), order.end(), rng.engine());
    std::vector<int64_t> strides(rank, 1);
    int64_t step = shape[rank - 1] + rng.integer(1, 3);
    for (int d : order) {
      strides[d] = step;
      step = step * std::max<int64_t>(shape[d], 1) + rng.integer(1, 3);
    }
    return with_strides(dtype, std::move(shape), std::move(strides));
  }

  // A view of another tensor's buffer.
  static HostTensor view_of(const HostTensor& base, int64_t offset, std::vector<int64_t> shape,
                            std::vector<int64_t> strides) {
    HostTensor t = base;
    t.offset_ = base.offset_ + offset;
    t.shape_ = std::move(shape);
    t.strides_ = std::move(strides);
    return t;
  }

  flare_dtype dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  bool present() const { return buffer_ != nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return n;
  }
  void* data() const { return static_cast<unsigned char*>(buffer_.get()) + offset_ * dtype_size(dtype_); }

  flare_tensor view() const {
    flare_tensor t{};
    if (!present()) return t;  // absent
    t.data = data();
    t.dtype = dtype_;
    t.device = flare_device{FLARE_DEVICE_CPU, 0};
    t.rank = rank();
    for (int d = 0; d < rank(); ++d) {
      t.shape[d] = shape_[d];
      t.strides[d] = strides_[d];
    }
    return t;
  }

  // Element at a row-major linear index of the view.
  double get(int64_t linear) const { return load(buffer_offset(linear)); }
  void set(int64_t linear, double x) { store(buffer_offset(linear), x); }

  // The whole view in row-major order.
  std::vector<double> values() const {
    std::vector<double> out(numel());
    for_each_offset([&](int64_t i, int64_t off) { out[i] = load(off); });
    return out;
  }
  // Writes x (row-major) into the view, rounding to the dtype; returns what was stored.
  std::vector<double> assign(const std::vector<double>& x) {
    std::vector<double> stored(x.size());
    for_each_offset([&](int64_t i, int64_t off) {
      store(off, x[i]);
      stored[i] = load(off);
    });
    return stored;
  }
  template <class Rng>
  std::vector<double> fill_normal(Rng& rng, double stddev = 1.0) {
    std::vector<double> x(numel());
    for (double& e : x) e = stddev * rng.normal();
    return assign(x);
  }

  // NaN into every element of the whole buffer (the view and whatever lies between its elements).
  void poison_buffer() {
    for (int64_t e = 0; e < buffer_elems_; ++e) store(e - offset_, std::numeric_limits<double>::quiet_NaN());
  }
  int64_t nan_in_view() const {
    int64_t n = 0;
    for_each_offset([&](int64_t, int64_t off) { n += std::isnan(load(off)) ? 1 : 0; });
    return n;
  }
  int64_t nan_in_buffer() const {
    int64_t n = 0;
    for (int64_t e = 0; e < buffer_elems_; ++e) n += std::isnan(load(e - offset_)) ? 1 : 0;
    return n;
  }
  int64_t buffer_elems() const { return buffer_elems_; }

 private:
  static std::shared_ptr<void> allocate(size_t bytes) {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    std::memset(p, 0, rounded);
    return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }

  // Calls f(linear index, element offset) for every element of the view in row-major order.
  template <class F>
  void for_each_offset(F f) const {
    const int64_t n = numel();
    if (n == 0) return;
    std::vector<int64_t> index(rank(), 0);
    int64_t off = 0;
    for (int64_t i = 0; i < n; ++i) {
      f(i, off);
      for (int d = rank() - 1; d >= 0; --d) {  // odometer step
        off += strides_[d];
        if (++index[d] < shape_[d]) break;
        off -= index[d] * strides_[d];
        index[d] = 0;
      }
    }
  }

  // Element offset (from data()) of a row-major linear index.
  int64_t buffer_offset(int64_t linear) const {
    int64_t off = 0;
    for (int d = rank() - 1; d >= 0; --d) {
      off += (linear % shape_[d]) * strides_[d];
      linear /= shape_[d];
    }
    return off;
  }

  double load(int64_t off) const {
    const unsigned char* base = static_cast<const unsigned char*>(data());
    switch (dtype_) {
      case FLARE_DTYPE_F32: { float f; std::memcpy(&f, base + off * 4, 4); return f; }
      case FLARE_DTYPE_F64: { double f; std::memcpy(&f, base + off * 8, 8); return f; }
      case FLARE_DTYPE_F16: { uint16_t b; std::memcpy(&b, base + off * 2, 2); return from_f16_bits(b); }
      case FLARE_DTYPE_BF16: { uint16_t b; std::memcpy(&b, base + off * 2, 2); return from_bf16_bits(b); }
      case FLARE_DTYPE_I32: { int32_t i; std::memcpy(&i, base + off * 4, 4); return i; }
      default: return std::numeric_limits<double>::quiet_NaN();
    }
  }
  void store(int64_t off, double x) {
    unsigned char* base = static_cast<unsigned char*>(data());
    switch (dtype_) {
      case FLARE_DTYPE_F32: { float f = static_cast<float>(x); std::memcpy(base + off * 4, &f, 4); break; }
      case FLARE_DTYPE_F64: std::memcpy(base + off * 8, &x, 8); break;
      case FLARE_DTYPE_F16: { uint16_t b = f16_bits(round_f16(x)); std::memcpy(base + off * 2, &b, 2); break; }
      case FLARE_DTYPE_BF16: { uint16_t b = bf16_bits(round_bf16(x)); std::memcpy(base + off * 2, &b, 2); break; }
      case FLARE_DTYPE_I32: {
        int32_t i = std::isnan(x) ? -1 : static_cast<int32_t>(x);  // NaN poison becomes -1 for indices
        std::memcpy(base + off * 4, &i, 4);
        break;
      }
      default: break;
    }
  }

  flare_dtype dtype_ = FLARE_DTYPE_F32;
  std::shared_ptr<void> buffer_;
  int64_t buffer_elems_ = 0;
  int64_t offset_ = 0;
  std::vector<int64_t> shape_, strides_;
};

inline HostTensor int32_tensor(const std::vector<int64_t>& values) {
  HostTensor t = HostTensor::contiguous(FLARE_DTYPE_I32, {static_cast<int64_t>(values.size())});
  for (size_t i = 0; i < values.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(values[i]));
  return t;
}

// ---------------------------------------------------------------------------------------------------
// Outputs: poisoning and error measures
// ---------------------------------------------------------------------------------------------------

// Every element of the view was written (no NaN left) and nothing between its elements was (the padding
// still holds the poison). Call after poison_buffer() and the flare call.
inline void expect_fully_overwritten(const HostTensor& t, const char* name) {
  EXPECT_EQ(t.nan_in_view(), 0) << name << ": elements not written (still NaN) or NaN produced";
  const int64_t gap = t.buffer_elems() - t.numel();
  EXPECT_EQ(t.nan_in_buffer() - t.nan_in_view(), gap) << name << ": wrote outside its view (into padding)";
}

struct ErrorStats {
  double max_error = 0.0;  // max |got - ref| over finite pairs; +inf on NaN or a mismatched infinity
  double max_ref = 0.0;    // max |ref| over finite entries
  int64_t worst = -1;      // index of max_error
  int64_t bad = 0;         // NaN in got, or infinities that disagree
};

inline ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref) {
  ErrorStats s;
  const size_t n = std::min(got.size(), ref.size());
  if (got.size() != ref.size()) s.bad = 1, s.max_error = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < n; ++i) {
    const double g = got[i], r = ref[i];
    if (std::isfinite(r)) s.max_ref = std::max(s.max_ref, std::fabs(r));
    double e = 0.0;
    if (std::isnan(g) || std::isnan(r)) {
      e = std::numeric_limits<double>::infinity();
      ++s.bad;
    } else if (std::isinf(g) || std::isinf(r)) {
      if (g != r) {
        e = std::numeric_limits<double>::infinity();
        ++s.bad;
      }
    } else {
      e = std::fabs(g - r);
    }
    if (s.worst < 0 || e > s.max_error) {
      s.max_error = e;
      s.worst = static_cast<int64_t>(i);
    }
  }
  return s;
}

inline std::string describe(const ErrorStats& s, const std::vector<double>& got, const std::vector<double>& ref) {
  std::string m = "max error " + std::to_string(s.max_error) + " (max |ref| " + std::to_string(s.max_ref) + ")";
  if (s.worst >= 0 && static_cast<size_t>(s.worst) < got.size())
    m += " at flat index " + std::to_string(s.worst) + ": got " + std::to_string(got[s.worst]) + ", ref " +
         std::to_string(ref[s.worst]);
  if (s.bad) m += "; " + std::to_string(s.bad) + " NaN/inf mismatches";
  return m;
}

// A flare call that must succeed; the failure message carries flare's own.
#define FLARE_ASSERT_OK(call)                                                                         \
  do {                                                                                                \
    const flare_status flare_status_ = (call);                                                        \
    ASSERT_EQ(flare_status_, FLARE_OK) << #call << " -> " << flare_status_string(flare_status_) << ": " \
                                       << flare_last_error();                                         \
  } while (0)

}  // namespace flare::test
