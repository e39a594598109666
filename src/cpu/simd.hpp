// simd.hpp — the vector type of one instruction set and the math the kernels need on it.
//
// Included only by the per-ISA kernel translation units (isa_amx.cpp, isa_avx512bf16.cpp, isa_avx512.cpp,
// isa_avx2.cpp, isa_generic.cpp), each of which defines FLARE_ISA (its namespace) and FLARE_VEC_BYTES (its
// register width) first. Everything lives in flare::cpu::FLARE_ISA so that no inline function compiled with
// one ISA's flags can be picked by the linker for another. GCC vector extensions keep one source for every
// width; with the wider ISAs enabled the compiler emits zmm/ymm instructions, and a*b+c contracts to FMA.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__F16C__) || defined(__AVX512F__)
#  include <immintrin.h>
#endif

#include "flare/flare.h"

namespace flare::cpu::FLARE_ISA {

template <class T>
struct Simd {
  static constexpr int kBytes = FLARE_VEC_BYTES;
  static constexpr int W = kBytes / static_cast<int>(sizeof(T));  // lanes
  typedef T V __attribute__((vector_size(kBytes)));
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef I VI __attribute__((vector_size(kBytes)));
};

template <class T> using vec_t = typename Simd<T>::V;

// Cache-line requests. On x86 they are asm statements: GCC 12 deletes some loops whose body is only
// __builtin_prefetch (seen with three rows' loops in a row, their lengths read from a struct, and with a
// loop of operands around a loop of lines), so a request loop could compile to nothing without a word; an
// asm volatile statement is never removed. kL1: into every level (prefetcht0); kL2: into L2 and below
// (prefetcht1), for data a while ahead that would crowd L1; kWrite: for writing (prefetchw where the
// processor has it, as every one with AVX-512 does; else prefetcht0).
enum class Fetch { kL1, kL2, kWrite };
template <Fetch F = Fetch::kL1>
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  const char& line = *static_cast<const char*>(p);
  if constexpr (F == Fetch::kL1) {
    asm volatile("prefetcht0 %0" : : "m"(line));
  } else if constexpr (F == Fetch::kL2) {
    asm volatile("prefetcht1 %0" : : "m"(line));
  } else {
#  if defined(__PRFCHW__) || defined(__AVX512F__)
    asm volatile("prefetchw %0" : : "m"(line));
#  else
    asm volatile("prefetcht0 %0" : : "m"(line));  // as GCC lowers a write prefetch without PRFCHW
#  endif
  }
#else
  __builtin_prefetch(p, F == Fetch::kWrite ? 1 : 0, F == Fetch::kL2 ? 2 : 3);
#endif
}
// Every line of bytes at p.
template <Fetch F = Fetch::kL1>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) prefetch_line<F>(static_cast<const char*>(p) + b);
}

template <class T>
inline vec_t<T> vload(const T* p) {
  vec_t<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <class T>
inline void vstore(T* p, vec_t<T> v) {
  std::memcpy(p, &v, sizeof(v));
}
template <class T>
inline vec_t<T> vset(T x) {
  return x - vec_t<T>{};  // x - (+0) is exactly x, so this folds to a plain broadcast
}
template <class V>
inline V vmax(V a, V b) {
  return a > b ? a : b;
}
template <class V>
inline V vmin(V a, V b) {
  return a < b ? a : b;
}
// The same selects for float lanes as single instructions: (v)maxps/(v)minps return their second operand
// when the comparison is false (NaN, equal zeros), which is exactly a > b ? a : b. GCC emits a compare and
// a blend for the generic form, two instructions on the softmax's busiest ports. (AVX-512: the masked forms
// with a full mask, as GCC 12 warns on the unmasked ones' undefined pass-through operand.)
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
inline vec_t<float> vmax(vec_t<float> a, vec_t<float> b) {
  const __m512 x = static_cast<__m512>(a);
  return static_cast<vec_t<float>>(_mm512_mask_max_ps(x, 0xffff, x, static_cast<__m512>(b)));
}
inline vec_t<float> vmin(vec_t<float> a, vec_t<float> b) {
  const __m512 x = static_cast<__m512>(a);
  return static_cast<vec_t<float>>(_mm512_mask_min_ps(x, 0xffff, x, static_cast<__m512>(b)));
}
#elif defined(__AVX2__) && FLARE_VEC_BYTES == 32
inline vec_t<float> vmax(vec_t<float> a, vec_t<float> b) {
  return static_cast<vec_t<float>>(_mm256_max_ps(static_cast<__m256>(a), static_cast<__m256>(b)));
}
inline vec_t<float> vmin(vec_t<float> a, vec_t<float> b) {
  return static_cast<vec_t<float>>(_mm256_min_ps(static_cast<__m256>(a), static_cast<__m256>(b)));
}
#endif
template <class T>
inline vec_t<T> viota() {
  vec_t<T> v;
  for (int i = 0; i < Simd<T>::W; ++i) v[i] = static_cast<T>(i);
  return v;
}
// Horizontal sum and max by halving: log2(W) vector steps instead of W - 1 dependent scalar ones. The
// halves are register shuffles: splitting through memcpy made GCC keep the reduced vector — and with it a
// loop's running max or sum — in a stack slot, a store-to-load round trip on every step of the loop.
template <class V, class Op, size_t... I>
inline auto combine_halves(V v, Op op, std::index_sequence<I...>) {
  return op(__builtin_shufflevector(v, v, I...), __builtin_shufflevector(v, v, (I + sizeof...(I))...));
}
template <class V, class Op>
inline auto reduce_lanes(V v, Op op) {
  using T = std::remove_cvref_t<decltype(v[0])>;
  constexpr size_t n = sizeof(V) / sizeof(T);
  if constexpr (n == 1) {
    return v[0];
  } else {
    return reduce_lanes(combine_halves(v, op, std::make_index_sequence<n / 2>{}), op);
  }
}
template <class V>
inline auto hsum(V v) {
  return reduce_lanes(v, [](auto a, auto b) { return a + b; });
}
template <class V>
inline auto hmax(V v) {
  return reduce_lanes(v, [](auto a, auto b) { return a > b ? a : b; });
}

// Whether no lane of v exceeds bound: one compare into a mask register on AVX-512 (the reduction of hmax
// costs eight shuffles and maxima), hmax elsewhere.
template <class V, class T>
inline bool all_at_most(V v, T bound) {
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
  if constexpr (std::is_same_v<T, float>)
    return _mm512_cmp_ps_mask(static_cast<__m512>(v), _mm512_set1_ps(bound), _CMP_GT_OQ) == 0;
#endif
  return hmax(v) <= bound;
}

template <class T> inline T smin(T a, T b) { return a < b ? a : b; }
template <class T> inline T smax(T a, T b) { return a > b ? a : b; }

inline constexpr float kNegInf = -__builtin_inff();

// exp(x) for float lanes: x = n*ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial (relative error
// < 2e-7), times 2^n. Lanes below the fp32 normal range (and -inf) give exactly 0.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;  // ln 2 split so that n * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpMaxArg = 88.3762626647949f;
constexpr float kExpMinArg = -87.3365447505531f;  // exp(kExpMinArg) is the smallest normal float

template <class V>
inline V exp_reduced_poly(V r) {  // exp(r) for |r| <= ln2/2
  V p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
// AVX-512: round with vrndscaleps and rebuild 2^n with vscalefps, which also zeroes the underflow lanes.
// Only the top needs clamping: lanes below kExpMinArg (-inf included, whose r is NaN) are zeroed by the
// final mask whatever the polynomial gave. (Masked intrinsic forms with explicit pass-through: GCC 12 warns
// on the unmasked ones' undefined operand.)
inline vec_t<float> vexp(vec_t<float> x) {
  using V = vec_t<float>;
  const V xc = vmin(x, vset(kExpMaxArg));
  const __m512 t = static_cast<__m512>(xc * kLog2e);
  const V n = static_cast<V>(_mm512_mask_roundscale_ps(t, 0xffff, t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const V p = exp_reduced_poly((xc - n * kLn2Hi) - n * kLn2Lo);
  const __mmask16 in_range = _mm512_cmp_ps_mask(static_cast<__m512>(x), _mm512_set1_ps(kExpMinArg), _CMP_GE_OQ);
  return static_cast<V>(_mm512_maskz_scalef_ps(in_range, static_cast<__m512>(p), static_cast<__m512>(n)));
}

// 2^t for float lanes: t = n + f with n = round(t), |f| <= 1/2, and 2^f by a degree-5 polynomial fitted to
// 2^f's relative error on [-1/2, 1/2] (1 + f (c1 + f (c2 + ...)), so 2^0 is exactly 1): 9.2e-8 in exact
// arithmetic, 1.9e-7 evaluated in fp32, below the degree-6 Taylor polynomial's 2.4e-7 with one multiply-add
// fewer. A softmax that forms t = s * (scale log2 e) - m log2 e with one FMA also saves vexp's multiply by
// log2 e and its two-step ln 2 reduction, on every score. Lanes below 2^-126 (and -inf) give exactly 0.
inline vec_t<float> vexp2(vec_t<float> t) {
  using V = vec_t<float>;
  constexpr float kCoef[5] = {0.693147004f, 0.240222424f, 0.0555073395f, 0.00967149995f, 0.00132647005f};
  const __m512 tc = static_cast<__m512>(vmin(t, vset(128.0f)));  // 2^128 overflows, as exp would
  const V n = static_cast<V>(_mm512_mask_roundscale_ps(tc, 0xffff, tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const V f = static_cast<V>(tc) - n;
  V p = vset(kCoef[4]);
#pragma GCC unroll 8
  for (int k = 3; k >= 0; --k) p = p * f + kCoef[k];
  p = p * f + 1.0f;
  const __mmask16 in_range = _mm512_cmp_ps_mask(static_cast<__m512>(t), _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  return static_cast<V>(_mm512_maskz_scalef_ps(in_range, static_cast<__m512>(p), static_cast<__m512>(n)));
}
#else
inline vec_t<float> vexp(vec_t<float> x) {
  using V = vec_t<float>;
  using VI = typename Simd<float>::VI;
  const V xc = vmin(vmax(x, vset(kExpMinArg)), vset(kExpMaxArg));
  const V n = __builtin_convertvector(__builtin_convertvector(xc * kLog2e + (xc >= 0 ? 0.5f : -0.5f), VI), V);
  const V r = (xc - n * kLn2Hi) - n * kLn2Lo;
  const V p = exp_reduced_poly(r);
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const V y = p * scale;
  return x < kExpMinArg ? V{} : y;
}
#endif

// Double lanes: computed per lane with the C library (fp64 is the checking dtype, not a speed path).
inline vec_t<double> vexp(vec_t<double> x) {
  for (int i = 0; i < Simd<double>::W; ++i) x[i] = __builtin_exp(x[i]);
  return x;
}

// How a row's exponentials exp(scale * s - m) are formed, to the compute type's accuracy: for float lanes on
// AVX-512 as 2^(s * scale log2 e - m log2 e) (vexp2, three instructions fewer per vector than vexp), else
// vexp.
struct RowExpFull {
  template <class V, class T>
  static V apply(V x, T scale, T m) {
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
    if constexpr (std::is_same_v<T, float>) return vexp2(x * (scale * kLog2e) - m * kLog2e);
#endif
    return vexp(x * scale - m);
  }
};

// expm1 accurate for small |x| (a Taylor series to x^9 for |x| < 0.5, exp(x) - 1 elsewhere).
inline vec_t<float> vexpm1(vec_t<float> x) {
  using V = vec_t<float>;
  V p = vset(1.0f / 362880.0f);
  p = p * x + 1.0f / 40320.0f;
  p = p * x + 1.0f / 5040.0f;
  p = p * x + 1.0f / 720.0f;
  p = p * x + 1.0f / 120.0f;
  p = p * x + 1.0f / 24.0f;
  p = p * x + 1.0f / 6.0f;
  p = p * x + 0.5f;
  p = p * x + 1.0f;
  const V small = p * x;
  const V ax = x < 0 ? -x : x;
  return ax < 0.5f ? small : vexp(x) - 1.0f;
}
inline vec_t<double> vexpm1(vec_t<double> x) {
  for (int i = 0; i < Simd<double>::W; ++i) x[i] = __builtin_expm1(x[i]);
  return x;
}

// tanh(x) = sign(x) * -e / (2 + e), e = expm1(-2|x|): no cancellation near 0, saturates to ±1.
template <class T>
inline vec_t<T> vtanh(vec_t<T> x) {
  using V = vec_t<T>;
  const V ax = x < 0 ? -x : x;
  const V e = vexpm1(ax * T(-2));
  const V t = -e / (e + T(2));
  return x < 0 ? -t : t;
}

// ---- storage conversions (rows of q/k/v/out in their dtype <-> compute type T) ----------------------

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t float_to_f16(float f) {
#if defined(__F16C__)
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t absb = bits & 0x7fffffffu;
  if (absb > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (absb >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (absb < 0x38800000u) {  // below the smallest normal half: round into a subnormal
    float af;
    std::memcpy(&af, &absb, 4);
    const float scaled = af * 16777216.0f;  // 2^24: units of the smallest subnormal
    const float rounded = __builtin_nearbyintf(scaled);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  uint32_t v = absb - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
#endif
}

// The flare dtype of a compute type (fp32 or fp64).
template <class T>
constexpr flare_dtype dtype_of() {
  return std::is_same_v<T, double> ? FLARE_DTYPE_F64 : FLARE_DTYPE_F32;
}

// dst[c] = src[c] * mul for c < n, converting from the storage dtype.
template <class T>
inline void load_row(const void* src, flare_dtype dtype, T* dst, int64_t n, T mul) {
  switch (dtype) {
    case FLARE_DTYPE_F32: {
      const float* s = static_cast<const float*>(src);
      for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(s[c]) * mul;
      break;
    }
    case FLARE_DTYPE_F64: {
      const double* s = static_cast<const double*>(src);
      for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(s[c]) * mul;
      break;
    }
    case FLARE_DTYPE_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(bf16_to_float(s[c])) * mul;
      break;
    }
    case FLARE_DTYPE_F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int64_t c = 0;
#if defined(__F16C__)
      for (; c + 8 <= n; c += 8) {
        const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c)));
        if constexpr (std::is_same_v<T, float>) {
          _mm256_storeu_ps(dst + c, _mm256_mul_ps(x, _mm256_set1_ps(mul)));
        } else {
          float tmp[8];
          _mm256_storeu_ps(tmp, x);
          for (int i = 0; i < 8; ++i) dst[c + i] = static_cast<T>(tmp[i]) * mul;
        }
      }
#endif
      for (; c < n; ++c) dst[c] = static_cast<T>(f16_to_float(s[c])) * mul;
      break;
    }
    default:
      break;
  }
}

// dst[c] = src[c] * mul for c < n, converting to the storage dtype (round to nearest even).
template <class T>
inline void store_row(const T* src, T mul, void* dst, flare_dtype dtype, int64_t n) {
  switch (dtype) {
    case FLARE_DTYPE_F32: {
      float* d = static_cast<float*>(dst);
      for (int64_t c = 0; c < n; ++c) d[c] = static_cast<float>(src[c] * mul);
      break;
    }
    case FLARE_DTYPE_F64: {
      double* d = static_cast<double*>(dst);
      for (int64_t c = 0; c < n; ++c) d[c] = static_cast<double>(src[c] * mul);
      break;
    }
    case FLARE_DTYPE_BF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t c = 0; c < n; ++c) d[c] = float_to_bf16(static_cast<float>(src[c] * mul));
      break;
    }
    case FLARE_DTYPE_F16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      int64_t c = 0;
#if defined(__F16C__)
      for (; c + 8 <= n; c += 8) {  // the same rounding as float_to_f16, eight at a time
        float tmp[8];
        for (int i = 0; i < 8; ++i) tmp[i] = static_cast<float>(src[c + i] * mul);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + c),
                         _mm256_cvtps_ph(_mm256_loadu_ps(tmp), _MM_FROUND_TO_NEAREST_INT));
      }
#endif
      for (; c < n; ++c) d[c] = float_to_f16(static_cast<float>(src[c] * mul));
      break;
    }
    default:
      break;
  }
}

inline int64_t dtype_size(flare_dtype dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F64: return 8;
    case FLARE_DTYPE_F16:
    case FLARE_DTYPE_BF16: return 2;
    default: return 4;
  }
}

}  // namespace flare::cpu::FLARE_ISA
