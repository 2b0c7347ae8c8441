// y[M, O] = (x[M, I] · w[O, I]ᵀ) · scale[O]: float32 activations, int8 weights with one
// float32 scale per output channel (an 8-bit draft's matmuls on a CPU).
//
// Why a kernel: XLA:CPU converts an int8 (or bf16) matrix to float32 in memory before
// its dot, so a weight stored at 8 bits cost 13x more than at 32 (LM head of SmolLM2,
// T = 1: 31 ms against 2.3 ms, jax 0.10.2). Here each weight row is widened in
// registers, so the step reads one byte per weight.
//
// Eight weight rows are read at a time (eight independent sums; the next eight
// prefetched), each widened with one vpmovsxbd per 16 weights where AVX-512 is there.
// That halved the cost of one row at a time widened by GCC's vectoriser (commit
// 5d9dab8): SmolLM2's matrices at T = 1 now take 8.4 ms, against 28.4 ms for XLA's float32
// dot (`experiments/bench_cpu_kernels.py`, Intel Xeon, 2 cores).
//
// Output channels are split into chunks that the caller and XLA's intra-op threads
// claim from an atomic counter (`workers.h`). The caller waits only for chunks a helper
// has claimed, never for a helper to start, so a busy pool cannot deadlock it.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Weights = ffi::Buffer<ffi::S8, 2>;  // aliases: a comma would split the macro below
using Scales = ffi::Buffer<ffi::F32, 1>;

constexpr int64_t kChannelsPerChunk = 64;
constexpr int kRowsPerPass = 8;  // weight rows at a time: independent sums in flight
constexpr int kPrefetchL2 = 2;   // prefetcht1, as in f32_matmul.cc

#if defined(__AVX512F__)
#define SPECJAX_INT8_SIMD 1
// One vpmovsxbd per 16 weights: GCC's vectoriser widens int8 through int16 (two shuffles
// and an extract on the one shuffle port), which bound the loop before memory did.
struct Simd {
  static constexpr int kLanes = 16;  // float32 lanes of one 512-bit vector
  using F = __m512;
  static F Zero() { return _mm512_setzero_ps(); }
  static F Floats(const float* p) { return _mm512_loadu_ps(p); }
  static F Widened(const int8_t* p) {  // 16 int8 weights as floats
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a·b + c
  static float Sum(F v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECJAX_INT8_SIMD 1
// The same at 8 weights per vpmovsxbd. The vectoriser's path, on an AMD EPYC (AVX2), made
// an 8-bit draft of SmolLM2 with every sub-layer on cost 0.66 AR steps; this one 0.56.
struct Simd {
  static constexpr int kLanes = 8;  // float32 lanes of one 256-bit vector
  using F = __m256;
  static F Zero() { return _mm256_setzero_ps(); }
  static F Floats(const float* p) { return _mm256_loadu_ps(p); }
  static F Widened(const int8_t* p) {  // 8 int8 weights as floats
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a·b + c
  static float Sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

// Row x against R consecutive weight rows w[0..R) (I entries each) into out[0..R), the
// int8 weights widened in registers. R independent sums keep the FMA ports busy where one
// row's single chain waited on each FMA's latency; the next R rows (`next`) are prefetched.
#if SPECJAX_INT8_SIMD
template <int R>
inline void DotRows(const float* x, const int8_t* w, const int8_t* next, int64_t I,
                    float* out) {
  constexpr int kLanes = Simd::kLanes;
  Simd::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Simd::Zero();
  int64_t i = 0;
  for (; i + kLanes <= I; i += kLanes) {
    if (i % 64 == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(next + r * I + i, 0, kPrefetchL2);
    const Simd::F xv = Simd::Floats(x + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = Simd::Fma(xv, Simd::Widened(w + r * I + i), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float sum = Simd::Sum(acc[r]);
    for (int64_t k = i; k < I; ++k) sum += x[k] * static_cast<float>(w[r * I + k]);
    out[r] = sum;
  }
}
#else
template <int R>
inline void DotRows(const float* x, const int8_t* w, const int8_t* next, int64_t I,
                    float* out) {
  constexpr int kLanes = 16;  // sums per row: the vectoriser's lanes
  float acc[R][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= I; i += kLanes) {
    if (i % 64 == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(next + r * I + i, 0, kPrefetchL2);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kLanes; ++j)
        acc[r][j] += x[i + j] * static_cast<float>(w[r * I + i + j]);
  }
  for (int r = 0; r < R; ++r) {
    float sum = 0;
    for (int j = 0; j < kLanes; ++j) sum += acc[r][j];
    for (int64_t k = i; k < I; ++k) sum += x[k] * static_cast<float>(w[r * I + k]);
    out[r] = sum;
  }
}
#endif

class Work : public specjax::Job {
 public:
  Work(const float* x, const int8_t* w, const float* scale, float* y, int64_t M, int64_t I,
       int64_t O)
      : Job((O + kChannelsPerChunk - 1) / kChannelsPerChunk), x(x), w(w), scale(scale),
        y(y), M(M), I(I), O(O) {}

 protected:
  void Chunk(int64_t c) override {
    const int64_t end = std::min(O, (c + 1) * kChannelsPerChunk);
    float out[kRowsPerPass];
    for (int64_t o = c * kChannelsPerChunk; o < end; o += kRowsPerPass) {
      const int64_t rows = std::min<int64_t>(kRowsPerPass, end - o);
      const int8_t* ahead = w + std::min(o + kRowsPerPass, O - rows) * I;
      for (int64_t m = 0; m < M; ++m) {  // the weight rows stay in L1 across rows of x
        if (rows == kRowsPerPass)
          DotRows<kRowsPerPass>(x + m * I, w + o * I, ahead, I, out);
        else
          for (int64_t r = 0; r < rows; ++r)
            DotRows<1>(x + m * I, w + (o + r) * I, ahead, I, out + r);
        for (int64_t r = 0; r < rows; ++r) y[m * O + o + r] = out[r] * scale[o + r];
      }
    }
  }

 private:
  const float* x;
  const int8_t* w;
  const float* scale;
  float* y;
  const int64_t M, I, O;
};

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Weights w,
                          Scales scale, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = w.dimensions()[0], I = w.dimensions()[1];
  auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != I || scale.dimensions()[0] != O)
    return ffi::Error::InvalidArgument("int8_matmul: x[..., I], w[O, I], scale[O] expected");
  auto work = std::make_shared<Work>(x.typed_data(), w.typed_data(), scale.typed_data(),
                                     y->typed_data(), x.element_count() / I, I, O);
  specjax::RunOnPool(pool, work, specjax::ThreadsFor(I * O, pool.num_threads()));
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
