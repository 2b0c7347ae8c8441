// Attention over the quantised slots of a QuantSpec KV cache, read from the codes:
// the scores of query rows against the keys, and the probability-weighted sum of the
// values, for slots [0, Q) of one layer (`quant_kv_cache`'s layout; `quant.py` the codes).
//
// Why a kernel: XLA:CPU computes a quantised read as a float32 copy of the whole layer
// (dequantise, then its dot reads the copy): an AR step of SmolLM2 over 1024 slots, 896
// of them quantised, cost 50-54 ms on the 8-bit cache against 35 ms on a float32 one,
// though the codes are a quarter of the bytes; with these kernels 38 ms (Intel Xeon).
// Here each slot's codes are widened into one row of H floats, in L1, and met by every
// query row at once; slots at or past Q are never read, so a step costs the context, not
// the allocation.
//
// A slot's value in channel h: lo + upper·scale (+ (lower − 7)·scale/15 at 8 bits), the
// codes of channels h < H/2 in the low nibbles of bytes [0, H/2), the others in the high
// ones (`quant.pack`). Keys: lo/scale per channel for each group of G slots. Values:
// per slot for each group of Gv channels. Single-threaded: a layer is ~0.1 ms of work.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The H floats of one slot: codes up/lw[H/2] (packed), the statistics of channel h at
// lo[h], scale[h].
inline void Widen(const uint8_t* up, const uint8_t* lw, const float* lo, const float* scale,
                  int64_t H, bool eight, float* row) {
  const int64_t half = H / 2;
  for (int nib = 0; nib < 2; ++nib) {
    const int shift = 4 * nib;
    const float* l = lo + nib * half;
    const float* s = scale + nib * half;
    float* x = row + nib * half;
    for (int64_t j = 0; j < half; ++j)
      x[j] = l[j] + static_cast<float>((up[j] >> shift) & 15) * s[j];
    if (eight)
      for (int64_t j = 0; j < half; ++j)
        x[j] += (static_cast<float>((lw[j] >> shift) & 15) - 7.0f) * (s[j] / 15.0f);
  }
}

struct Dims {
  int64_t BK, R, S, H;
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
  const float* qp = q.typed_data();
  float* sp = out->typed_data();
  std::vector<float> row(d.H);
  for (int64_t bk = 0; bk < d.BK; ++bk) {
    const uint8_t* up = upper.typed_data() + bk * d.S * d.H / 2;
    const uint8_t* lw = lower.typed_data() + bk * d.S * d.H / 2;
    const float* lop = lo.typed_data() + bk * sd[2] * d.H;
    const float* scp = scale.typed_data() + bk * sd[2] * d.H;
    float* s = sp + bk * d.R * d.S;
    for (int64_t t = 0; t < Q; ++t) {
      const int64_t g = t / G;
      Widen(up + t * d.H / 2, lw + t * d.H / 2, lop + g * d.H, scp + g * d.H, d.H, bits == 8,
            row.data());
      for (int64_t r = 0; r < d.R; ++r) {
        const float* qr = qp + (bk * d.R + r) * d.H;
        float acc = 0.0f;
        for (int64_t h = 0; h < d.H; ++h) acc += qr[h] * row[h];
        s[r * d.S + t] = acc;
      }
    }
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
  const int64_t groups = sd[3], per = d.H / groups;
  const int64_t Q = std::clamp<int64_t>(length.typed_data()[0], 0, d.S);
  std::vector<float> row(d.H), slot_lo(d.H), slot_scale(d.H);  // a slot's stats per channel
  float* op = out->typed_data();
  std::fill(op, op + d.BK * d.R * d.H, 0.0f);
  for (int64_t bk = 0; bk < d.BK; ++bk) {
    const uint8_t* up = upper.typed_data() + bk * d.S * d.H / 2;
    const uint8_t* lw = lower.typed_data() + bk * d.S * d.H / 2;
    const float* lop = lo.typed_data() + bk * d.S * groups;
    const float* scp = scale.typed_data() + bk * d.S * groups;
    const float* pp = p.typed_data() + bk * d.R * d.S;
    float* o = op + bk * d.R * d.H;
    for (int64_t t = 0; t < Q; ++t) {
      for (int64_t c = 0; c < groups; ++c) {
        std::fill(slot_lo.begin() + c * per, slot_lo.begin() + (c + 1) * per, lop[t * groups + c]);
        std::fill(slot_scale.begin() + c * per, slot_scale.begin() + (c + 1) * per,
                  scp[t * groups + c]);
      }
      Widen(up + t * d.H / 2, lw + t * d.H / 2, slot_lo.data(), slot_scale.data(), d.H,
            bits == 8, row.data());
      for (int64_t r = 0; r < d.R; ++r) {
        const float w = pp[r * d.S + t];
        float* orow = o + r * d.H;
        for (int64_t h = 0; h < d.H; ++h) orow[h] += w * row[h];
      }
    }
  }
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
