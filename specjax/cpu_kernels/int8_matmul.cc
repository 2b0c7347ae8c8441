// y[M, O] = (x[M, I] · w[O, I]ᵀ) · scale[O]: float32 activations, int8 weights with one
// float32 scale per output channel (an 8-bit draft's matmuls on a CPU).
//
// Why a kernel: XLA:CPU converts an int8 (or bf16) matrix to float32 in memory before
// its dot, so a weight stored at 8 bits cost an order of magnitude more than at 32
// (docs/decisions/cpu.md, C4). Here each weight row is widened in registers, so the step
// reads one byte per weight.
//
// Each weight row is read front to back, a cache line per iteration into four
// independent sums, and widened with one vpmovsxbd per 8 (AVX2) or 16 (AVX-512) weights:
// GCC's vectoriser widened through int16 (commit 5d9dab8), at twice the cost. Rows are
// contiguous, so a chunk of output channels is one sequential stream, prefetched 4 KiB
// ahead. Reading eight rows side by side instead (eight streams, as until 2026-11-26)
// left the loop well below the bandwidth a plain read reaches from DRAM (C4).
//
// Output channels are split into two chunks per worker that the caller and XLA's
// intra-op threads claim from an atomic counter (`workers.h`). The caller waits only for
// chunks a helper has claimed, never for a helper to start, so a busy pool cannot
// deadlock it. Chunks of 64 channels (as until 2026-11-27) restarted the stream, and its
// prefetch, every few tens of KiB, which made every 8-bit draft step dearer (C4).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Weights = ffi::Buffer<ffi::S8, 2>;  // aliases: a comma would split the macro below
using Scales = ffi::Buffer<ffi::F32, 1>;

constexpr int64_t kMinChannels = 64;     // per chunk
constexpr int kLine = 64;               // weights (bytes) per iteration: one cache line

using specjax::PrefetchAhead;
#if SPECJAX_QUANT_SIMD
using specjax::Simd;
#endif

// x[0..I) · w[0..I) for one int8 weight row: four independent sums hide the FMA latency,
// and the prefetch runs ahead along the stream of rows that follow this one.
#if SPECJAX_QUANT_SIMD
inline float DotRow(const float* x, const int8_t* w, int64_t I) {
  constexpr int kLanes = Simd::kLanes, kSums = 4;
  Simd::F acc[kSums];
  for (int k = 0; k < kSums; ++k) acc[k] = Simd::Zero();
  int64_t i = 0;
  for (; i + kLine <= I; i += kLine) {
    PrefetchAhead(w + i);
#pragma GCC unroll 8
    for (int v = 0; v < kLine / kLanes; ++v)
      acc[v % kSums] = Simd::Fma(Simd::Floats(x + i + v * kLanes),
                                 Simd::Int8s(w + i + v * kLanes), acc[v % kSums]);
  }
  for (; i + kLanes <= I; i += kLanes)
    acc[0] = Simd::Fma(Simd::Floats(x + i), Simd::Int8s(w + i), acc[0]);
  float sum = Simd::Sum(Simd::Add(Simd::Add(acc[0], acc[1]), Simd::Add(acc[2], acc[3])));
  for (; i < I; ++i) sum += x[i] * static_cast<float>(w[i]);
  return sum;
}
#else
inline float DotRow(const float* x, const int8_t* w, int64_t I) {
  constexpr int kLanes = 16;  // sums per row: the vectoriser's lanes
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= I; i += kLanes) {
    if (i % kLine == 0) PrefetchAhead(w + i);
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * static_cast<float>(w[i + j]);
  }
  float sum = 0;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < I; ++i) sum += x[i] * static_cast<float>(w[i]);
  return sum;
}
#endif

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Weights w,
                          Scales scale, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = w.dimensions()[0], I = w.dimensions()[1];
  auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != I || scale.dimensions()[0] != O)
    return ffi::Error::InvalidArgument("int8_matmul: x[..., I], w[O, I], scale[O] expected");
  const int64_t M = x.element_count() / I;
  const float* xs = x.typed_data();
  const int8_t* ws = w.typed_data();
  const float* ss = scale.typed_data();
  float* ys = y->typed_data();
  specjax::ParallelRows(pool, O, I * O, kMinChannels, [=](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t m = 0; m < M; ++m)  // the weight row stays in L1 across rows of x
        ys[m * O + o] = DotRow(xs + m * I, ws + o * I, I) * ss[o];
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Weights>()
                                  .Arg<Scales>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
