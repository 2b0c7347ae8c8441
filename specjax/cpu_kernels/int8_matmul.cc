// y[M, O] = (x[M, I] · w[O, I]ᵀ) · scale[O]: float32 activations, int8 weights with one
// float32 scale per output channel (an 8-bit draft's matmuls on a CPU).
//
// Why a kernel: XLA:CPU converts an int8 (or bf16) matrix to float32 in memory before
// its dot, so a weight stored at 8 bits cost 13x more than at 32 (LM head of SmolLM2,
// T = 1: 31 ms against 2.3 ms, jax 0.10.2). Here each weight row is widened in
// registers, so the step reads one byte per weight.
//
// Output channels are split into chunks that the caller and XLA's intra-op threads
// claim from an atomic counter. The caller waits only for chunks a helper has claimed,
// never for a helper to start, so a busy pool cannot deadlock it.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Weights = ffi::Buffer<ffi::S8, 2>;  // aliases: a comma would split the macro below
using Scales = ffi::Buffer<ffi::F32, 1>;

constexpr int64_t kChannelsPerChunk = 64;
constexpr int kLanes = 16;  // independent accumulators: one 512-bit vector of float32

// Row m of x against weight row w (I entries), written for the vectoriser: int8 widened
// in registers, FMA into 16 partial sums (built with -fassociative-math so it may).
inline float RowDot(const float* x, const int8_t* w, int64_t I) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= I; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * static_cast<float>(w[i + j]);
  float sum = 0;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < I; ++i) sum += x[i] * static_cast<float>(w[i]);
  return sum;
}

struct Work {
  const float* x;
  const int8_t* w;
  const float* scale;
  float* y;
  int64_t M, I, O, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t end = std::min(O, (c + 1) * kChannelsPerChunk);
      for (int64_t o = c * kChannelsPerChunk; o < end; ++o)
        for (int64_t m = 0; m < M; ++m)  // the weight row stays in L1 across rows of x
          y[m * O + o] = RowDot(x + m * I, w + o * I, I) * scale[o];
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Weights w,
                          Scales scale,
                          ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = w.dimensions()[0], I = w.dimensions()[1];
  auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != I || scale.dimensions()[0] != O)
    return ffi::Error::InvalidArgument("int8_matmul: x[..., I], w[O, I], scale[O] expected");
  auto work = std::make_shared<Work>();  // shared: a late helper may outlive this call
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->scale = scale.typed_data();
  work->y = y->typed_data();
  work->M = x.element_count() / I;
  work->I = I;
  work->O = O;
  work->chunks = (O + kChannelsPerChunk - 1) / kChannelsPerChunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
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
