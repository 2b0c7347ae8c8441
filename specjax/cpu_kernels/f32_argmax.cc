// Per row of logits[..., V] (float32): the index of its first maximum, or of its first NaN
// when it has one (`jnp.argmax`'s answer), and, with `probability`, its largest softmax
// probability 1 / Σ exp(l - max) (NaN where the maximum is not finite, as the XLA
// expression gives). The greedy choice of every step: the AR step's token, the
// verification's targets, a draft's token and its confidence.
//
// Why a kernel: XLA:CPU spends two reductions on an argmax and two more on the top
// probability, each split over its threads, where one pass over a row already in the
// caches is an order of magnitude quicker (docs/decisions/cpu.md, C5).
#include <cmath>
#include <cstdint>
#include <limits>

#include "float_vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::kLanes, specjax::Vec, specjax::IVec, specjax::Load, specjax::Splat,
    specjax::ExpNonPositive;

constexpr float kInf = std::numeric_limits<float>::infinity();

// The first maximum of row[0, V), or the first NaN; `nan` says which. Each lane keeps its
// largest value and where it first saw it (a strict > keeps the first), and whether it saw
// a NaN; the lanes then agree on the largest value's smallest index.
int64_t FirstMax(const float* row, int64_t V, bool& nan) {
  Vec best = Splat(-kInf);
  IVec at{}, index{};
  for (int j = 0; j < kLanes; ++j) index[j] = j;
  IVec seen_nan{};
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    const Vec v = Load(row + i);
    const IVec greater = v > best;
    best = greater ? v : best;
    at = greater ? index : at;
    seen_nan |= v != v;
    index += kLanes;
  }
  float top = -kInf;
  int64_t first = 0;
  for (int j = 0; j < kLanes; ++j)
    if (best[j] > top || (best[j] == top && at[j] < first)) top = best[j], first = at[j];
  bool any_nan = false;
  for (int j = 0; j < kLanes; ++j) any_nan |= seen_nan[j] != 0;
  for (; i < V; ++i) {  // the tail: later indices, so only a larger value moves the answer
    any_nan |= std::isnan(row[i]);
    if (row[i] > top) top = row[i], first = i;
  }
  nan = any_nan;
  if (!any_nan) return first;
  for (int64_t k = 0; k < V; ++k)
    if (std::isnan(row[k])) return k;
  return first;  // not reached
}

// 1 / Σ exp(row - top) for a finite top, the row's maximum.
float TopProbability(const float* row, int64_t V, float top) {
  Vec sum{};
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes)
    sum += ExpNonPositive(Load(row + i) - Splat(top));
  float s = 0;
  for (int j = 0; j < kLanes; ++j) s += sum[j];
  for (; i < V; ++i) s += ExpNonPositive(Splat(row[i] - top))[0];
  return 1.0f / s;
}

ffi::Error Argmax(ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> ids,
                  ffi::ResultBuffer<ffi::F32> probability, bool with_probability) {
  auto dims = logits.dimensions();
  if (dims.size() == 0 || dims[dims.size() - 1] == 0)
    return ffi::Error::InvalidArgument("f32_argmax: logits[..., V] with V > 0");
  const int64_t V = dims[dims.size() - 1], R = logits.element_count() / V;
  const float* l = logits.typed_data();
  for (int64_t r = 0; r < R; ++r) {
    bool nan = false;
    const float* row = l + r * V;
    const int64_t i = FirstMax(row, V, nan);
    ids->typed_data()[r] = static_cast<int32_t>(i);
    if (with_probability)
      probability->typed_data()[r] = nan || std::isinf(row[i])
                                         ? std::numeric_limits<float>::quiet_NaN()
                                         : TopProbability(row, V, row[i]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(F32Argmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("probability"));
