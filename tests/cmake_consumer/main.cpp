// A user of the installed library: the C ABI (version, one tiny forward checked against a hand
// computation) and the C++ API (the same call through flare.hpp). Exits non-zero on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "flare/flare.h"
#include "flare/flare.hpp"

namespace {

// One query against two keys, headdim 4: out = softmax(q·k / 2) v, computed by hand in double.
constexpr int kDim = 4;
const float q[kDim] = {0.5f, -1.0f, 0.25f, 2.0f};
const float k[2 * kDim] = {1.0f, 0.0f, -0.5f, 0.5f, -1.0f, 1.0f, 0.0f, 0.25f};
const float v[2 * kDim] = {1.0f, 2.0f, 3.0f, 4.0f, -4.0f, -3.0f, -2.0f, -1.0f};

bool close_to_hand(const float* out, const char* how) {
  double s[2];
  for (int j = 0; j < 2; ++j) {
    s[j] = 0.0;
    for (int c = 0; c < kDim; ++c) s[j] += double(q[c]) * k[j * kDim + c];
    s[j] *= 0.5;  // 1/sqrt(headdim)
  }
  const double m = std::fmax(s[0], s[1]);
  const double p0 = std::exp(s[0] - m), p1 = std::exp(s[1] - m);
  for (int c = 0; c < kDim; ++c) {
    const double want = (p0 * v[c] + p1 * v[kDim + c]) / (p0 + p1);
    if (std::fabs(out[c] - want) > 1e-5) {
      std::fprintf(stderr, "%s: out[%d] = %.7f, expected %.7f\n", how, c, out[c], want);
      return false;
    }
  }
  return true;
}

}  // namespace

int main() {
  const std::string version = std::to_string(FLARE_VERSION_MAJOR) + "." +
                              std::to_string(FLARE_VERSION_MINOR) + "." + std::to_string(FLARE_VERSION_PATCH);
  if (version != flare_version()) {
    std::fprintf(stderr, "flare_version() is %s but the header says %s\n", flare_version(), version.c_str());
    return 1;
  }

  const flare_device cpu = {FLARE_DEVICE_CPU, 0};
  const int64_t q_shape[4] = {1, 1, 1, kDim}, k_shape[4] = {1, 2, 1, kDim};
  float out[kDim] = {0};
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  p.q = flare_tensor_contiguous(const_cast<float*>(q), FLARE_DTYPE_F32, cpu, 4, q_shape);
  p.k = flare_tensor_contiguous(const_cast<float*>(k), FLARE_DTYPE_F32, cpu, 4, k_shape);
  p.v = flare_tensor_contiguous(const_cast<float*>(v), FLARE_DTYPE_F32, cpu, 4, k_shape);
  p.out = flare_tensor_contiguous(out, FLARE_DTYPE_F32, cpu, 4, q_shape);
  if (flare_fwd(&p) != FLARE_OK) {
    std::fprintf(stderr, "flare_fwd failed: %s\n", flare_last_error());
    return 1;
  }
  if (!close_to_hand(out, "C ABI")) return 1;

  float out_cpp[kDim] = {0};
  try {
    using flare::TensorView;
    flare::forward(TensorView::contiguous(q, {1, 1, 1, kDim}), TensorView::contiguous(k, {1, 2, 1, kDim}),
                   TensorView::contiguous(v, {1, 2, 1, kDim}),
                   TensorView::contiguous(out_cpp, {1, 1, 1, kDim}));
  } catch (const flare::Error& e) {
    std::fprintf(stderr, "flare::forward threw: %s\n", e.what());
    return 1;
  }
  if (std::memcmp(out, out_cpp, sizeof out) != 0) {
    std::fprintf(stderr, "the C++ API's result differs from the C ABI's\n");
    return 1;
  }
  std::printf("flare %s (%s) works from an installed package\n", flare_version(), flare_cpu_isa());
  return 0;
}
