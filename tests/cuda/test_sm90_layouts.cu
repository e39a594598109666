// Host-side checks of the sm90 forward's layouts, on the CPU (CuTe layouts are host-callable): for every head
// dim's configuration, the thread-to-element maps of the tiled wgmma operations cover each tile exactly once,
// the (rows, cols) view of an accumulator keeps a row within one thread quad, the S accumulator read as the
// P·V A operand addresses the same (row, key) elements, every thread's coordinates are thread 0's shifted
// (what the kernel's compile-time coordinate offsets rely on), V's transposed view addresses V's bytes, and
// the shared storage fits the GPU. Exit status 0 when everything holds; each failure is printed.
#include <cstdio>
#include <map>
#include <set>
#include <utility>

#include "cuda/sm90/gmma_views.cuh"
#include "cuda/sm90/kernel_traits.cuh"

namespace {

using namespace cute;
using flare::cuda::sm90::acc_as_a_layout;
using flare::cuda::sm90::acc_rowcol_layout;
using flare::cuda::sm90::FwdTraits;

int failures = 0;

void expect(bool ok, const char* what, int d, int a = -1, int b = -1) {
  if (!ok) {
    ++failures;
    if (failures < 40) std::printf("FAIL hdim %d: %s (%d, %d)\n", d, what, a, b);
  }
}

template <class T>
void check_config() {
  constexpr int d = T::kHeadDim;
  constexpr int dv = T::kHeadDimV;
  constexpr int M = T::kBlockM, N = T::kBlockN;
  typename T::TiledMmaQK mma_qk;
  typename T::TiledMmaPV mma_pv;
  expect(size(mma_qk) == T::kMmaThreads && size(mma_pv) == T::kMmaThreads, "threads per tiled MMA", d);

  // S: every (row, key) of the tile held by exactly one (thread, value); rows within one quad.
  std::map<std::pair<int, int>, int> owner;
  std::map<int, std::set<int>> row_threads;
  auto ref = mma_qk.get_thread_slice(0).partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
  for (int t = 0; t < T::kMmaThreads; ++t) {
    auto c = mma_qk.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    auto rc = make_tensor(c.data(), acc_rowcol_layout(c.layout()));
    const int dr = get<0>(c(0)) - get<0>(ref(0)), dc = get<1>(c(0)) - get<1>(ref(0));
    for (int i = 0; i < size(c); ++i) {
      const int r = get<0>(c(i)), k = get<1>(c(i));
      expect(++owner[{r, k}] == 1, "S element held twice", d, r, k);
      expect(r == get<0>(ref(i)) + dr && k == get<1>(ref(i)) + dc, "not a shift of thread 0", d, t, i);
    }
    for (int r = 0; r < size<0>(rc); ++r) {
      for (int k = 0; k < size<1>(rc); ++k) {
        expect(get<0>(rc(r, k)) == get<0>(rc(r, 0)), "rowcol row mixes rows", d, t, r);
        row_threads[get<0>(rc(r, k))].insert(t);
      }
    }
    // The S accumulator read as the A operand of P·V.
    auto a = mma_pv.get_thread_slice(t).partition_A(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    // Register j of the A fragment (compact, in a's shape) is register as_a(j) of the S fragment (compact, in
    // c's shape: element as_a(j) of c in its linear order).
    auto as_a = acc_as_a_layout(partition_fragment_C(mma_qk, Shape<Int<M>, Int<N>>{}).layout());
    expect(size(a) == size(as_a), "A fragment size", d, int(size(a)), int(size(as_a)));
    for (int j = 0; j < size(a); ++j) {
      const auto sc = c(as_a(j));
      expect(get<0>(a(j)) == get<0>(sc) && get<1>(a(j)) == get<1>(sc), "P element misplaced", d, t, j);
    }
    // O rows are S rows, in the same order.
    auto o = mma_pv.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<M>, Int<dv>>{}));
    auto orc = make_tensor(o.data(), acc_rowcol_layout(o.layout()));
    expect(size<0>(orc) == size<0>(rc), "O and S row counts", d);
    for (int r = 0; r < size<0>(orc); ++r) expect(get<0>(orc(r, 0)) == get<0>(rc(r, 0)), "O row differs", d, t, r);
  }
  expect(int(owner.size()) == M * N, "S elements covered", d, int(owner.size()), M * N);
  for (auto const& [row, threads] : row_threads) {
    const int t0 = *threads.begin();
    bool quad = threads.size() == 4 && t0 % 4 == 0;
    for (int t : threads) quad &= t / 4 == t0 / 4;
    expect(quad, "a row is not held by one thread quad", d, row, int(threads.size()));
  }
  // O: covered once.
  std::set<std::pair<int, int>> o_seen;
  for (int t = 0; t < T::kMmaThreads; ++t) {
    auto o = mma_pv.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<M>, Int<dv>>{}));
    for (int i = 0; i < size(o); ++i) expect(o_seen.insert({get<0>(o(i)), get<1>(o(i))}).second, "O twice", d);
  }
  expect(int(o_seen.size()) == M * dv, "O elements covered", d);

  // V's transposed view: element (c, n, s) of Vt is element (n, c, s) of V.
  typename T::SmemLayoutKV kv;
  typename T::SmemLayoutV v;
  typename T::SmemLayoutVt vt;
  for (int s = 0; s < T::kStages; ++s) {
    for (int n = 0; n < N; ++n) {
      for (int c = 0; c < dv; ++c) expect(vt(c, n, s) == v(n, c, s), "Vt view", d, n, c);
    }
  }
  expect(cosize(typename T::SmemLayoutQ{}) == M * d, "Q buffer is dense", d);
  expect(cosize(typename T::SmemLayoutO{}) == M * dv, "O buffer is dense", d);
  expect(T::kSeparateO || cosize(typename T::SmemLayoutO{}) <= cosize(typename T::SmemLayoutQ{}),
         "O staged in Q's buffer fits it", d);
  expect(cosize(kv) == N * d * T::kStages, "K ring is dense", d);
  expect(cosize(v) == N * dv * T::kStages, "V ring is dense", d);
  // The kernels also hold 1 KB of static shared memory (cuobjdump --dump-resource-usage: SHARED:1024).
  expect(T::kSmemBytes + 1024 <= 227 * 1024, "shared storage exceeds the 227 KB of sm_90", d, T::kSmemBytes);
  expect(T::kTile.producer_regs * 128 + T::kTile.consumer_regs * T::kMmaThreads <= 65536, "register split", d);
  std::printf("hdim %3d/%3d: tile %dx%d, %d consumer warpgroups, %d stages, %d bytes of shared memory%s\n", d, dv,
              M, N, T::kMmaWarpgroups, T::kStages, T::kSmemBytes, T::kSeparateO ? ", O apart" : "");
}

}  // namespace

int main() {
  check_config<FwdTraits<cutlass::bfloat16_t, 64>>();
  check_config<FwdTraits<cutlass::bfloat16_t, 96>>();
  check_config<FwdTraits<cutlass::bfloat16_t, 128>>();
  check_config<FwdTraits<cutlass::half_t, 192>>();
  check_config<FwdTraits<cutlass::half_t, 256>>();
  check_config<FwdTraits<cutlass::bfloat16_t, 192, 128>>();
  if (failures) std::printf("%d failures\n", failures);
  else std::printf("all sm90 layout checks hold\n");
  return failures ? 1 : 0;
}
