// y[M, O] = x[M, I] · w for QuantSpec's 4-bit draft weights: w[i, o] = lo[o, g] +
// code[o, i] · scale[o, g] over groups g of G consecutive inputs (asymmetric, min/max per
// group, `quant.Int4Matrix`). Codes are stored output-major, two per byte: byte j of a
// group holds input j in its low nibble and input j + G/2 in its high one.
//
// Why a kernel: XLA:CPU widens the codes to a float32 matrix in memory before its dot,
// so a 4-bit MLP read eight times the bytes of its codes, plus a write: QuantSpec with
// the paper's 4-bit MLP ran at 0.41-0.68x the full-precision AR on SmolLM2, where its
// 8-bit drafts (`int8_matmul.cc`) beat it. Here each group's codes (64 bytes for G = 128:
// one cache line) are widened in registers, four channels side by side, and meet x there;
// each channel's codes stay in L1 across the M rows of x.
//
// Per output channel and row, group by group:
//     y = Σ_g scale[o, g] · (Σ_{i in g} x[i] · code[o, i]) + Σ_g lo[o, g] · xsum[g],
// with xsum[g] = Σ_{i in g} x[i] computed once per call: the inner loop is a dot of x with
// small integers, and the group statistics cost two multiplies per group, not per weight.
//
// Work is split by output channels, two chunks per worker, claimed from an atomic counter
// by the caller and XLA's intra-op threads (`workers.h`), as in the int8 kernel.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Codes = ffi::Buffer<ffi::U8, 2>;  // aliases: a comma would split the macro below
using Stats = ffi::Buffer<ffi::F32, 2>;

constexpr int64_t kChunksPerWorker = 2;  // a helper that starts late costs at most one
constexpr int64_t kMinChannels = 64;     // per chunk
constexpr int kChannels = 4;             // output channels read side by side

using specjax::PrefetchAhead;
#if SPECJAX_QUANT_SIMD
using specjax::Simd;
#endif

// Σ_g scale[g] · (x_g · code_g) over the groups of one output channel, without the lo
// term; `half` = G/2 bytes per group. Plain C++: the portable path, and groups too small
// for the vectors (a test's G).
inline float ScaledDotsScalar(const float* x, const uint8_t* codes, const float* scale,
                              int64_t groups, int64_t half) {
  float total = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * 2 * half;
    float dot = 0;
    for (int64_t j = 0; j < half; ++j) {
      const uint8_t b = codes[g * half + j];
      dot += xg[j] * static_cast<float>(b & 0xF) + xg[half + j] * static_cast<float>(b >> 4);
    }
    total += scale[g] * dot;
  }
  return total;
}

#if SPECJAX_QUANT_SIMD
// The same for R output channels side by side (codes `stride` bytes apart): each x vector
// loaded meets R channels' codes, and 2R independent sums hide the FMA latency. SmolLM2's
// 30 gate/up matrices took 3.6 ms a step one channel at a time (7 GB/s of codes: the
// widening, not DRAM, bounds this loop), 2.9 ms four at a time (Intel Xeon, 2 cores).
template <int R>
inline void ScaledDots(const float* x, const uint8_t* codes, int64_t stride,
                       const float* scale, int64_t groups, int64_t half, float* out) {
  constexpr int kLanes = Simd::kLanes;
  if (half % kLanes) {
    for (int r = 0; r < R; ++r)
      out[r] = ScaledDotsScalar(x, codes + r * stride, scale + r * groups, groups, half);
    return;
  }
  Simd::F total[R];
  for (int r = 0; r < R; ++r) total[r] = Simd::Zero();
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * 2 * half;
    const uint8_t* cg = codes + g * half;
    Simd::F low_sum[R], high_sum[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      PrefetchAhead(cg + r * stride);
      low_sum[r] = high_sum[r] = Simd::Zero();
    }
    for (int64_t j = 0; j < half; j += kLanes) {
      const Simd::F xl = Simd::Floats(xg + j), xh = Simd::Floats(xg + half + j);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        Simd::F low, high;
        Simd::Nibbles(cg + r * stride + j, low, high);
        low_sum[r] = Simd::Fma(xl, low, low_sum[r]);
        high_sum[r] = Simd::Fma(xh, high, high_sum[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      total[r] = Simd::Fma(Simd::Add(low_sum[r], high_sum[r]),
                           Simd::Broadcast(scale[r * groups + g]), total[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = Simd::Sum(total[r]);
}
#else
template <int R>
inline void ScaledDots(const float* x, const uint8_t* codes, int64_t stride,
                       const float* scale, int64_t groups, int64_t half, float* out) {
  for (int r = 0; r < R; ++r)
    out[r] = ScaledDotsScalar(x, codes + r * stride, scale + r * groups, groups, half);
}
#endif

class Work : public specjax::Job {
 public:
  Work(const float* x, const uint8_t* codes, const float* lo, const float* scale, float* y,
       int64_t M, int64_t I, int64_t O, int64_t groups, int64_t chunk)
      : Job((O + chunk - 1) / chunk), x(x), codes(codes), lo(lo), scale(scale), y(y), M(M),
        I(I), O(O), groups(groups), chunk(chunk), xsum(M * groups, 0.0f) {
    const int64_t G = I / groups;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < G; ++i) xsum[m * groups + g] += x[m * I + g * G + i];
  }

 protected:
  void Chunk(int64_t c) override {
    const int64_t end = std::min(O, (c + 1) * chunk);
    int64_t o = c * chunk;
    for (; o + kChannels <= end; o += kChannels) Channels<kChannels>(o);
    for (; o < end; ++o) Channels<1>(o);
  }

  // Output channels [o, o + R) for every row of x: their codes stay in L1 across the rows.
  template <int R>
  void Channels(int64_t o) {
    const int64_t half = I / groups / 2;
    for (int64_t m = 0; m < M; ++m) {
      float out[R];
      ScaledDots<R>(x + m * I, codes + o * (I / 2), I / 2, scale + o * groups, groups, half,
                    out);
      for (int r = 0; r < R; ++r) {
        float offset = 0;  // Σ_g lo · xsum
        for (int64_t g = 0; g < groups; ++g)
          offset += lo[(o + r) * groups + g] * xsum[m * groups + g];
        y[m * O + o + r] = out[r] + offset;
      }
    }
  }

 private:
  const float* x;
  const uint8_t* codes;
  const float* lo;
  const float* scale;
  float* y;
  const int64_t M, I, O, groups;
  const int64_t chunk;       // output channels per chunk
  std::vector<float> xsum;  // [M, groups]: each group's sum of x, for the lo term
};

ffi::Error Int4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Codes codes,
                          Stats lo, Stats scale, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = codes.dimensions()[0], I = 2 * codes.dimensions()[1];
  const int64_t groups = lo.dimensions()[1];
  auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != I || lo.dimensions()[0] != O ||
      scale.dimensions()[0] != O || scale.dimensions()[1] != groups || groups == 0 ||
      I % (2 * groups))
    return ffi::Error::InvalidArgument(
        "int4_matmul: x[..., I], codes[O, I/2], lo and scale [O, I/G] expected");
  const int64_t threads = specjax::ThreadsFor(O * I / 2, pool.num_threads());
  const int64_t pieces = kChunksPerWorker * threads;
  const int64_t chunk = std::max(kMinChannels, (O + pieces - 1) / pieces);
  auto work = std::make_shared<Work>(x.typed_data(), codes.typed_data(), lo.typed_data(),
                                     scale.typed_data(), y->typed_data(),
                                     x.element_count() / I, I, O, groups, chunk);
  specjax::RunOnPool(pool, work, threads);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int4Matmul, Int4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Codes>()
                                  .Arg<Stats>()
                                  .Arg<Stats>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
