// Host-side check of the sm80 kernels' dropout draws, on the CPU (CuTe layouts are host-callable): a Philox
// draw holds the keep bytes of 16 keys of one row, and dropout_bits (cuda/common/scores.cuh) draws once per
// T::kDropoutColumnsPerDraw consecutive columns of a thread's (row, col) view of the score accumulator. For
// every configuration that runs dropout, and every thread, those columns must be one row's and lie in one
// group of 16 keys (the tile starts at a multiple of 16), or the device's mask would differ from the CPU's.
// Checks too that the next larger grouping would break, so that the figure is the largest that holds.
// Exit status 0 when everything holds; each failure is printed.
#include <cstdio>

#include "cuda/sm80/configs.cuh"
#include "cuda/sm80/tile_ops.cuh"

namespace {

using namespace cute;
using flare::cuda::SmemClass;
namespace sm80 = flare::cuda::sm80;

int failures = 0;

// Whether every thread's columns c0 .. c0 + per_draw - 1 of each row (c0 a multiple of per_draw) are one
// row's and one group's of 16 keys, over an M x N score tile of Mma.
template <class Mma, int M, int N>
bool grouped(int per_draw) {
  for (int tid = 0; tid < size(Mma{}); ++tid) {
    auto acc = Mma{}.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    auto rc = make_tensor(acc.data(), sm80::rowcol_layout(acc.layout()));  // the kernels' (row, col) view
    if (size<1>(rc) % per_draw != 0) return false;
    for (int r = 0; r < size<0>(rc); ++r) {
      for (int c0 = 0; c0 < size<1>(rc); c0 += per_draw) {
        for (int e = 1; e < per_draw; ++e) {
          if (get<0>(rc(r, c0 + e)) != get<0>(rc(r, c0)) || get<1>(rc(r, c0 + e)) / 16 != get<1>(rc(r, c0)) / 16) {
            return false;
          }
        }
      }
    }
  }
  return true;
}

template <class Mma, int M, int N>
void check(const char* what, int d, int per_draw) {
  const bool holds = grouped<Mma, M, N>(per_draw);
  const bool larger = per_draw < 16 && grouped<Mma, M, N>(2 * per_draw);
  if (!holds || larger) {
    ++failures;
    std::printf("FAIL %s, head dim %d: %d columns per draw %s\n", what, d, per_draw,
                !holds ? "do not lie in one group" : "is not the largest grouping that holds");
  }
}

template <class E, int d, SmemClass c>
void check_head_dim() {
  // Dropout calls run the forward's short shape with the score transform (launch_forward_as) and the
  // backward with it (launch_backward).
  using Fwd = typename sm80::FwdConfigOf<E, d, sm80::FwdShape::kShort, c>::type;
  static_assert(Fwd::kDropout, "the forward that dropout calls take carries it");
  check<typename Fwd::TiledMma, Fwd::kBlockM, Fwd::kBlockN>("forward", d, Fwd::kDropoutColumnsPerDraw);
  using Bwd = sm80::BwdShapedConfig<E, d, c>;
  check<typename Bwd::MmaSdP, Bwd::kBlockM, Bwd::kBlockN>("backward", d, Bwd::kDropoutColumnsPerDraw);
}

// Wide heads (tiles above 256): the forward alone, its one kernel (64 x 32 score tiles) carrying dropout.
template <class E, int d, SmemClass c>
void check_wide_head_dim() {
  using Fwd = typename sm80::FwdConfigOf<E, d, sm80::FwdShape::kShort, c>::type;
  static_assert(Fwd::kDropout && Fwd::kSlicedV, "the wide forward carries dropout and slices its output");
  check<typename Fwd::TiledMma, Fwd::kBlockM, Fwd::kBlockN>("forward", d, Fwd::kDropoutColumnsPerDraw);
}

template <class E, SmemClass c>
void check_class() {
  check_wide_head_dim<E, 384, c>();
  check_wide_head_dim<E, 512, c>();
  check_wide_head_dim<E, 576, c>();
  check_head_dim<E, 32, c>();
  check_head_dim<E, 64, c>();
  check_head_dim<E, 96, c>();
  check_head_dim<E, 128, c>();
  check_head_dim<E, 160, c>();
  check_head_dim<E, 192, c>();
  check_head_dim<E, 224, c>();
  check_head_dim<E, 256, c>();
}

}  // namespace

int main() {
  check_class<cutlass::bfloat16_t, SmemClass::kLarge>();
  check_class<cutlass::bfloat16_t, SmemClass::kSmall>();
  check_class<cutlass::half_t, SmemClass::kLarge>();
  check_class<cutlass::half_t, SmemClass::kSmall>();
  std::printf("sm80 dropout draw groups: %s\n", failures == 0 ? "every configuration holds" : "FAILED");
  return failures == 0 ? 0 : 1;
}
