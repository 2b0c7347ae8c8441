// The f32 kernel's [I, O] tile alone, on one core: `bench_f32_tile.py` builds this beside
// specjax/cpu_kernels/f32_matmul.cc with the package's flags and reads its lines.
//
// Usage: f32_tile_harness I O REPS COPIES PAD ROWS...; prints "lanes <floats per vector>",
// "peak <G vector FMAs/s>" (a loop of independent FMAs in registers: what the core can do),
// then per ROWS "mix <ROWS> <G vector FMAs/s>" (the tile's loads and FMAs alone, from L1:
// `TileMix`) and "rows <ROWS> <µs per matmul>" (median of 7 batches of REPS calls). The
// calls take COPIES matrices in turn (from DRAM once they outgrow the last-level cache),
// each row of each stored PAD floats longer than its O columns.
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
// Each FMA adds into its own chain's register, as the tile's do: written as a[k]·b + c
// (until 2026-11-29), every FMA also needed a copy of c to overwrite, and the loop ran at
// 3.2-5.6 G/s where the five-row tile's mix reached 5.7-6.3.
double PeakVectorFmas() {
  Vec a[12], b, c;
  for (int j = 0; j < kLanes; ++j) b[j] = 0.999f, c[j] = 1e-4f;
  for (int k = 0; k < 12; ++k) a[k] = c * float(k);
  constexpr long kIters = 50'000'000;
  const auto t = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) a[k] = Fma(b, c, a[k]);
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

// The tile's instruction mix for MB rows of x, and nothing else: per weight row, V vector
// loads and MB broadcasts feeding MB·V FMAs into sums that stay in registers, every operand
// from a 4 KiB block of weights in L1, no sums stored. Against `PeakVectorFmas` it prices
// the loads that feed the FMAs; against the `rows` lines, what DRAM, the stores of the
// sums and the loop's bookkeeping add.
template <int MB>
struct TileMix {
  static void Run(double* gvfma) {
    constexpr int kRows = 8, V = FitRegisters(MB, kIOWidth / kLanes);
    constexpr int kBlock = kRows * V * kLanes;  // floats of one group's weights
    constexpr int kBlocks = 1024 / kBlock;      // cycled through: 4 KiB in all
    alignas(64) static float w[kBlocks * kBlock];
    static float xs[kRows][MB];
    for (int j = 0; j < kBlocks * kBlock; ++j) w[j] = 1e-3f * float(j % 5);
    for (int r = 0; r < kRows; ++r)
      for (int m = 0; m < MB; ++m) xs[r][m] = 1e-3f * float(r + m);
    Vec a[MB][V] = {};
    const long groups = 200'000'000 / (kRows * MB * V);
    const auto t = std::chrono::steady_clock::now();
    for (long n = 0; n < groups; ++n) {
      const float* wg = w + (n % kBlocks) * kBlock;
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        Vec wv[V];
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) wv[v] = Load(wg + (r * V + v) * kLanes);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const Vec xb = Broadcast(&xs[r][m]);
#pragma GCC unroll 4
          for (int v = 0; v < V; ++v) a[m][v] = Fma(xb, wv[v], a[m][v]);
        }
      }
    }
    const double s = Seconds(t);
    float sink = 0;
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < V; ++v) sink += a[m][v][0];
    if (sink == 12345.f) std::puts("");  // keeps the loop alive
    *gvfma = double(groups) * kRows * MB * V / s / 1e9;
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
  // The best of three: the first loop can run before the core has reached its clock.
  const double peak = std::max({PeakVectorFmas(), PeakVectorFmas(), PeakVectorFmas()});
  std::printf("lanes %d\npeak %.3f\n", kLanes, peak);
  for (int a = 6; a < argc; ++a) {
    const int rows = atoi(argv[a]);
    double mix = 0;
    Dispatch<TileMix>(rows, &mix);
    std::printf("mix %d %.3f\n", rows, mix);
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
