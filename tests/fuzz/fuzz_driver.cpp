// fuzz_driver.cpp — main() for fuzz_c_abi.cpp where libFuzzer is not available (GCC): replays the files
// and directories given (the regression seeds), then, with -max_total_time=S or -runs=N, feeds the target
// random inputs from a seeded generator (-seed=N; 0 or absent: from the clock), printing the seed so a
// failure can be replayed. Flags are libFuzzer's spelling, so one script drives either build.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

void run_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

}  // namespace

int main(int argc, char** argv) {
  long long runs = 0, seconds = 0;
  uint64_t seed = 0;
  size_t replayed = 0;
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strncmp(a, "-runs=", 6) == 0) runs = std::atoll(a + 6);
    else if (std::strncmp(a, "-max_total_time=", 16) == 0) seconds = std::atoll(a + 16);
    else if (std::strncmp(a, "-seed=", 6) == 0) seed = std::strtoull(a + 6, nullptr, 10);
    else if (a[0] == '-') std::fprintf(stderr, "fuzz_driver: ignoring %s\n", a);
    else inputs.emplace_back(a);
  }
  for (const auto& in : inputs) {
    if (std::filesystem::is_directory(in)) {
      for (const auto& entry : std::filesystem::directory_iterator(in))
        if (entry.is_regular_file()) run_file(entry.path()), ++replayed;
    } else {
      run_file(in), ++replayed;
    }
  }
  std::printf("fuzz_driver: replayed %zu inputs\n", replayed);
  if (runs == 0 && seconds == 0) return 0;
  if (seed == 0) seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::printf("fuzz_driver: random inputs from -seed=%llu\n", static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  std::mt19937_64 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  std::vector<uint8_t> buf;
  long long done = 0;
  for (; runs == 0 || done < runs; ++done) {
    if (seconds > 0 && std::chrono::steady_clock::now() - start >= std::chrono::seconds(seconds)) break;
    buf.resize(rng() % 96);
    for (auto& b : buf) b = static_cast<uint8_t>(rng());
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
  }
  std::printf("fuzz_driver: %lld random inputs, no failure\n", done);
  return 0;
}
