// The f32 kernel's [I, O] tile alone, on one core: `bench_f32_tile.py` builds this beside
// specjax/cpu_kernels/f32_matmul.cc with the package's flags and reads its lines.
//
// Usage: f32_tile_harness I O REPS COPIES PAD ROWS...; prints "lanes <floats per vector>",
// "peak <G vector FMAs/s>" (a loop of independent FMAs in registers: what the core can do),
// then per ROWS "rows <ROWS> <µs per matmul>" (median of 7 batches of REPS calls). The calls
// take COPIES matrices in turn (from DRAM once they outgrow the last-level cache), each
// row of each stored PAD floats longer than its O columns.
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

// `RowsIO` over a matrix whose rows are `stride` floats apart (O + PAD).
template <int MB>
struct StridedRows {
  static void Run(const float* x, const float* w, float* part, int64_t I, int64_t O,
                  int64_t stride) {
    std::fill(part, part + MB * O, 0.0f);
    BlockIO<MB>(x, w, part, O, I, stride, 0, I, 0, O);
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) return 2;
  const int64_t I = atol(argv[1]), O = atol(argv[2]);
  const int reps = atoi(argv[3]);
  const int64_t copies = atol(argv[4]), stride = O + atol(argv[5]);
  std::vector<float> w(copies * I * stride), x(kMaxRows * I, 0.5f), part(kMaxRows * O);
  for (int64_t j = 0; j < static_cast<int64_t>(w.size()); ++j) w[j] = float(j % 7) * 0.01f;
  std::printf("lanes %d\npeak %.3f\n", kLanes, PeakVectorFmas());
  for (int a = 6; a < argc; ++a) {
    const int rows = atoi(argv[a]);
    std::vector<double> batches;
    for (int b = 0; b < 7; ++b) {
      const auto t = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        Dispatch<StridedRows>(rows, x.data(), w.data() + (r % copies) * I * stride,
                              part.data(), I, O, stride);
      batches.push_back(Seconds(t) / reps);
    }
    std::sort(batches.begin(), batches.end());
    std::printf("rows %d %.3f\n", rows, batches[3] * 1e6);
  }
}
