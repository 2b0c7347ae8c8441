// The f32 kernel's [I, O] tile alone, on one core: `bench_f32_tile.py` builds this beside
// specjax/cpu_kernels/f32_matmul.cc with the package's flags and reads its lines.
//
// Usage: f32_tile_harness I O REPS ROWS...; prints "lanes <floats per vector>", "peak <G
// vector FMAs/s>" (a loop of independent FMAs in registers: what the core can do), then per
// ROWS
// "rows <ROWS> <µs per matmul>" (median of 7 batches of REPS calls).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "f32_matmul.cc"

namespace {

double Seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Twelve independent chains hide the FMA latency on every x86 and aarch64 core we know.
double PeakVectorFmas() {
  Vec a[12], b, c;
  for (int j = 0; j < kLanes; ++j) b[j] = 0.999f, c[j] = 1e-4f;
  for (int k = 0; k < 12; ++k) a[k] = c * float(k);
  constexpr long kIters = 50'000'000;
  const auto t = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) a[k] = Fma(a[k], b, c);
  }
  const double s = Seconds(t);
  float sink = 0;
  for (int k = 0; k < 12; ++k) sink += a[k][0];
  if (sink == 12345.f) std::puts("");  // keeps the loop alive
  return kIters * 12 / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) return 2;
  const int64_t I = atol(argv[1]), O = atol(argv[2]);
  const int reps = atoi(argv[3]);
  std::vector<float> w(I * O), x(kMaxRows * I, 0.5f), part(kMaxRows * O);
  for (int64_t j = 0; j < I * O; ++j) w[j] = float(j % 7) * 0.01f;
  std::printf("lanes %d\npeak %.3f\n", kLanes, PeakVectorFmas());
  for (int a = 4; a < argc; ++a) {
    const int rows = atoi(argv[a]);
    std::vector<double> batches;
    for (int b = 0; b < 7; ++b) {
      const auto t = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        Dispatch<RowsIO>(rows, x.data(), w.data(), part.data(), I, O, int64_t{0}, I);
      batches.push_back(Seconds(t) / reps);
    }
    std::sort(batches.begin(), batches.end());
    std::printf("rows %d %.3f\n", rows, batches[3] * 1e6);
  }
}
