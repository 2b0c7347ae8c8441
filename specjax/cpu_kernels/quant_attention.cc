// Attention over the quantised slots of a QuantSpec KV cache, read from the codes:
// the scores of query rows against the keys, and the probability-weighted sum of the
// values, for slots [0, Q) of one layer (`quant_kv_cache`'s layout; `quant.py` the codes).
//
// Why a kernel: XLA:CPU computes a quantised read as a float32 copy of the whole layer
// (dequantise, then its dot reads the copy): an AR step of SmolLM2 over 1024 slots, 896
// of them quantised, cost 50-54 ms on the 8-bit cache against 35 ms on a float32 one,
// though the codes are a quarter of the bytes; with these kernels 33 ms (Intel Xeon; 38
// before the head dimension became a compile-time constant for H = 64 and 128).
// Here each slot's codes are widened into one row of H floats, in L1, and met by every
// query row at once; slots at or past Q are never read, so a step costs the context, not
// the allocation.
//
// A slot's value in channel h: lo + upper·scale (+ (lower − 7)·scale/15 at 8 bits), the
// codes of channels h < H/2 in the low nibbles of bytes [0, H/2), the others in the high
// ones (`quant.pack`). Keys: lo/scale per channel for each group of G slots. Values:
// per slot for each group of Gv channels. Single-threaded: a SmolLM2 layer at 900 slots
// is ~0.05 ms of work per kernel.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The H floats of one slot: codes up/lw[H/2] (packed), the statistics of channel h at
// lo[h], scale[h]. kH > 0 fixes H at compile time (64, 128: most models), which lets the
// compiler keep a row in registers and drop the aliasing checks; 0 reads `H`.
template <int kH, bool kEight>
inline void Widen(const uint8_t* __restrict up, const uint8_t* __restrict lw,
                  const float* __restrict lo, const float* __restrict scale, int64_t H,
                  float* __restrict row) {
  const int64_t half = (kH > 0 ? kH : H) / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float u0 = static_cast<float>(up[j] & 15), u1 = static_cast<float>(up[j] >> 4);
    float x0 = lo[j] + u0 * scale[j], x1 = lo[j + half] + u1 * scale[j + half];
    if (kEight) {
      x0 += (static_cast<float>(lw[j] & 15) - 7.0f) * (scale[j] / 15.0f);
      x1 += (static_cast<float>(lw[j] >> 4) - 7.0f) * (scale[j + half] / 15.0f);
    }
    row[j] = x0;
    row[j + half] = x1;
  }
}

template <int kH>
inline float Dot(const float* __restrict a, const float* __restrict b, int64_t H) {
  float acc = 0.0f;
  for (int64_t h = 0; h < (kH > 0 ? kH : H); ++h) acc += a[h] * b[h];
  return acc;
}

template <int kH>
inline void Axpy(float w, const float* __restrict x, float* __restrict y, int64_t H) {
  for (int64_t h = 0; h < (kH > 0 ? kH : H); ++h) y[h] += w * x[h];
}

struct Dims {
  int64_t BK, R, S, H;
};

// The variant for H and the precision: fixed H where most models are, else runtime H.
template <template <int, bool> class F, typename... Args>
void ForShape(int64_t H, bool eight, Args... args) {
  const auto run = [&](auto h) {
    constexpr int kH = decltype(h)::value;
    if (eight) F<kH, true>::Run(args...); else F<kH, false>::Run(args...);
  };
  if (H == 64) run(std::integral_constant<int, 64>());
  else if (H == 128) run(std::integral_constant<int, 128>());
  else run(std::integral_constant<int, 0>());
}

// Scores of one kv head: s[r, t] = q[r, :] · key(t) for t < Q.
template <int kH, bool kEight>
struct Scores {
  static void Run(const float* q, const uint8_t* up, const uint8_t* lw, const float* lo,
                  const float* scale, int64_t R, int64_t S, int64_t H, int64_t G, int64_t Q,
                  float* s) {
    alignas(64) float fixed[kH > 0 ? kH : 1];  // a fixed H's row on the stack
    std::vector<float> wide(kH > 0 ? 0 : H);
    float* k = kH > 0 ? fixed : wide.data();
    for (int64_t t = 0; t < Q; ++t) {
      const int64_t g = t / G;
      Widen<kH, kEight>(up + t * H / 2, lw + t * H / 2, lo + g * H, scale + g * H, H, k);
      for (int64_t r = 0; r < R; ++r) s[r * S + t] = Dot<kH>(q + r * H, k, H);
    }
  }
};

// Values of one kv head: o[r, :] += Σ_{t < Q} p[r, t] · value(t).
template <int kH, bool kEight>
struct Values {
  static void Run(const float* p, const uint8_t* up, const uint8_t* lw, const float* lo,
                  const float* scale, int64_t R, int64_t S, int64_t H, int64_t groups,
                  int64_t Q, float* o) {
    const int64_t per = H / groups;
    std::vector<float> row(H), slot_lo(H), slot_scale(H);  // a slot's stats per channel
    for (int64_t t = 0; t < Q; ++t) {
      for (int64_t c = 0; c < groups; ++c) {
        std::fill(slot_lo.begin() + c * per, slot_lo.begin() + (c + 1) * per,
                  lo[t * groups + c]);
        std::fill(slot_scale.begin() + c * per, slot_scale.begin() + (c + 1) * per,
                  scale[t * groups + c]);
      }
      Widen<kH, kEight>(up + t * H / 2, lw + t * H / 2, slot_lo.data(), slot_scale.data(), H,
                        row.data());
      for (int64_t r = 0; r < R; ++r) Axpy<kH>(p[r * S + t], row.data(), o + r * H, H);
    }
  }
};

// scores[bk, r, t] = q[bk, r, :] · key(t) for t < length; 0 for the other slots.
ffi::Error KeyScores(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> length,
                     ffi::Buffer<ffi::U8> upper, ffi::Buffer<ffi::U8> lower,
                     ffi::Buffer<ffi::F32> lo, ffi::Buffer<ffi::F32> scale,
                     ffi::ResultBuffer<ffi::F32> out, int64_t bits) {
  auto qd = q.dimensions(), cd = upper.dimensions(), sd = lo.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || sd.size() != 4 || cd[3] * 2 != qd[3] ||
      sd[3] != qd[3] || cd[2] % sd[2])
    return ffi::Error::InvalidArgument("quant_key_scores: q[B, K, R, H], codes[B, K, S, H/2], "
                                       "lo/scale[B, K, S/G, H] expected");
  const Dims d{qd[0] * qd[1], qd[2], cd[2], qd[3]};
  const int64_t G = d.S / sd[2], Q = std::clamp<int64_t>(length.typed_data()[0], 0, d.S);
  for (int64_t bk = 0; bk < d.BK; ++bk) {
    float* s = out->typed_data() + bk * d.R * d.S;
    ForShape<Scores>(d.H, bits == 8, q.typed_data() + bk * d.R * d.H,
                     upper.typed_data() + bk * d.S * d.H / 2,
                     lower.typed_data() + bk * d.S * d.H / 2,
                     lo.typed_data() + bk * sd[2] * d.H, scale.typed_data() + bk * sd[2] * d.H,
                     d.R, d.S, d.H, G, Q, s);
    for (int64_t r = 0; r < d.R; ++r) std::fill(s + r * d.S + Q, s + (r + 1) * d.S, 0.0f);
  }
  return ffi::Error::Success();
}

// out[bk, r, :] = Σ_{t < length} p[bk, r, t] · value(t).
ffi::Error ValueSums(ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::S32> length,
                     ffi::Buffer<ffi::U8> upper, ffi::Buffer<ffi::U8> lower,
                     ffi::Buffer<ffi::F32> lo, ffi::Buffer<ffi::F32> scale,
                     ffi::ResultBuffer<ffi::F32> out, int64_t bits) {
  auto pd = p.dimensions(), cd = upper.dimensions(), sd = lo.dimensions();
  if (pd.size() != 4 || cd.size() != 4 || sd.size() != 4 || pd[3] != cd[2] ||
      sd[2] != cd[2] || (cd[3] * 2) % sd[3])
    return ffi::Error::InvalidArgument("quant_value_sums: p[B, K, R, S], codes[B, K, S, H/2], "
                                       "lo/scale[B, K, S, H/Gv] expected");
  const Dims d{pd[0] * pd[1], pd[2], cd[2], cd[3] * 2};
  const int64_t groups = sd[3], Q = std::clamp<int64_t>(length.typed_data()[0], 0, d.S);
  float* op = out->typed_data();
  std::fill(op, op + d.BK * d.R * d.H, 0.0f);
  for (int64_t bk = 0; bk < d.BK; ++bk)
    ForShape<Values>(d.H, bits == 8, p.typed_data() + bk * d.R * d.S,
                     upper.typed_data() + bk * d.S * d.H / 2,
                     lower.typed_data() + bk * d.S * d.H / 2,
                     lo.typed_data() + bk * d.S * groups, scale.typed_data() + bk * d.S * groups,
                     d.R, d.S, d.H, groups, Q, op + bk * d.R * d.H);
  return ffi::Error::Success();
}

}  // namespace

#define SPECJAX_QUANT_ATTENTION(name, impl)                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                  \
                                ffi::Ffi::Bind()             \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::U8>>()  \
                                    .Arg<ffi::Buffer<ffi::U8>>()  \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<int64_t>("bits"));

SPECJAX_QUANT_ATTENTION(QuantKeyScores, KeyScores)
SPECJAX_QUANT_ATTENTION(QuantValueSums, ValueSums)
