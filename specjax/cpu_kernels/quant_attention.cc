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
// query row at once; the statistics enter per group (`Scores`, `Values` say how), and
// slots at or past Q are never read, so a step costs the context, not the allocation.
//
// A slot's value in channel h: lo + upper·scale (+ (lower − 7)·scale/15 at 8 bits), the
// codes of channels h < H/2 in the low nibbles of bytes [0, H/2), the others in the high
// ones (`quant.pack`). Keys: lo/scale per channel for each group of G slots. Values:
// per slot for each group of Gv channels.
//
// At 2048 tokens (1920 quantised) SmolLM2's 30 layers took 6.2 ms of key scores and 8.5 of
// value sums per AR step, and 16.1 and 36.0 per verification of 5 tokens, with the
// statistics applied per channel and slot, on one thread (profiled, AMD EPYC). With them
// applied per group, the value sums held in registers and four key scores per pass: 4.5
// and 4.4, and 10.0 and 13.8. Work is now split into (kv head, ~512 slots) items shared
// with XLA's threads (`workers.h`) once a call has enough of it.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One slot's codes as H floats: u (4 bits), or u + (l − 7)/15 (8 bits), where the value
// is lo + scale·code with lo and scale per channel (keys) or per channel group (values).
// Channels h < H/2 sit in the low nibbles of bytes [0, H/2), the others in the high ones.
// kH > 0 fixes H at compile time (64, 128: most models), which lets the compiler keep a
// row in registers and drop the aliasing checks; 0 reads `H`.
template <int kH, bool kEight>
inline void Codes(const uint8_t* __restrict up, const uint8_t* __restrict lw, int64_t H,
                  float* __restrict row) {
  const int64_t half = (kH > 0 ? kH : H) / 2;
  for (int64_t j = 0; j < half; ++j) {
    float c0 = static_cast<float>(up[j] & 15), c1 = static_cast<float>(up[j] >> 4);
    if (kEight) {
      c0 += (static_cast<float>(lw[j] & 15) - 7.0f) * (1.0f / 15.0f);
      c1 += (static_cast<float>(lw[j] >> 4) - 7.0f) * (1.0f / 15.0f);
    }
    row[j] = c0;
    row[j + half] = c1;
  }
}

// Slots [t0, t0 + count) as `Codes`, row after row in `codes` (a block that stays in L1).
template <int kH, bool kEight>
inline void Slots(const uint8_t* up, const uint8_t* lw, int64_t H, int64_t t0, int64_t count,
                  float* codes) {
  for (int64_t i = 0; i < count; ++i)
    Codes<kH, kEight>(up + (t0 + i) * H / 2, lw + (t0 + i) * H / 2, H, codes + i * H);
}

template <int kH>
inline float Dot(const float* __restrict a, const float* __restrict b, int64_t H) {
  float acc = 0.0f;
  for (int64_t h = 0; h < (kH > 0 ? kH : H); ++h) acc += a[h] * b[h];
  return acc;
}

// y[0..n) += w · x[0..n); kN > 0 fixes n.
template <int kN>
inline void Axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t h = 0; h < (kN > 0 ? kN : n); ++h) y[h] += w * x[h];
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

// Scores of one kv head: s[r, t] = q[r, :] · key(t) for t < Q. Keys share lo and scale
// per channel over a group of G slots, so per group and row
//     q · key(t) = Σ_h q[h]·lo[h] + Σ_h (q[h]·scale[h]) · code(t, h):
// the first sum and the products q·scale once per group, and one dot with the codes per
// slot (widening each slot to lo + code·scale, a division by 15 per channel at 8 bits
// included, cost more than the dots did). Slots are widened kBlock at a time into L1, and
// with a fixed H a row meets them four at a time (`FourDots`).
template <int kH, bool kEight>
struct Scores {
  static constexpr int64_t kBlock = 32;

  static void Run(const float* q, const uint8_t* up, const uint8_t* lw, const float* lo,
                  const float* scale, int64_t R, int64_t S, int64_t H, int64_t G,
                  int64_t begin, int64_t Q, float* s) {  // slots [begin, Q), begin % G == 0
    const int64_t n = kH > 0 ? kH : H;
    std::vector<float> scaled(R * n), base(R), codes(kBlock * n);
    for (int64_t start = begin; start < Q; start += G) {
      const float* lo_g = lo + start / G * n;
      const float* scale_g = scale + start / G * n;
      for (int64_t r = 0; r < R; ++r) {
        base[r] = Dot<kH>(q + r * n, lo_g, n);
        for (int64_t h = 0; h < n; ++h) scaled[r * n + h] = q[r * n + h] * scale_g[h];
      }
      const int64_t end = std::min(Q, start + G);
      for (int64_t t0 = start; t0 < end; t0 += kBlock) {
        const int64_t count = std::min(kBlock, end - t0);
        Slots<kH, kEight>(up, lw, n, t0, count, codes.data());
        for (int64_t r = 0; r < R; ++r) {
          const float* row = scaled.data() + r * n;
          float* out = s + r * S + t0;
          int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
          if constexpr (kH > 0)
            for (; i + 4 <= count; i += 4) FourDots(row, codes.data() + i * n, base[r], out + i);
#endif
          for (; i < count; ++i) out[i] = base[r] + Dot<kH>(row, codes.data() + i * n, n);
        }
      }
    }
  }

#if defined(__AVX2__) && defined(__FMA__)
  // out[k] = base + row · codes[k] for four slots' widened codes (kH apart): each vector
  // of `row` loaded once for the four, and the four sums folded together by three hadds
  // instead of four horizontal sums.
  static void FourDots(const float* row, const float* codes, float base, float* out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t h = 0; h < kH; h += 8) {
      const __m256 x = _mm256_loadu_ps(row + h);
      for (int k = 0; k < 4; ++k)
        acc[k] = _mm256_fmadd_ps(x, _mm256_loadu_ps(codes + k * kH + h), acc[k]);
    }
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]),
                                        _mm256_hadd_ps(acc[2], acc[3]));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs),
                                   _mm256_extractf128_ps(pairs, 1));
    _mm_storeu_ps(out, _mm_add_ps(sums, _mm_set1_ps(base)));
  }
#endif
};

// Values of one kv head: o[r, :] = Σ_{t < Q} p[r, t] · value(t). A slot's values share lo
// and scale per group of H/groups channels, so per row and group
//     Σ_t p[t]·value(t, h) = Σ_t (p[t]·scale[t]) · code(t, h) + Σ_t p[t]·lo[t]:
// one multiply-add per channel and slot, and the lo sums added once at the end. Slots are
// widened kBlock at a time into L1; with one group per slot and a fixed H (SmolLM2,
// Qwen2.5) a row's sums then stay in registers across the block, where adding each slot
// into o in memory bounded a verification's 15 rows by their stores.
template <int kH, bool kEight>
struct Values {
  static constexpr int64_t kBlock = 32;  // slots: 32 · 128 floats = 16 KiB at most

  static void Run(const float* p, const uint8_t* up, const uint8_t* lw, const float* lo,
                  const float* scale, int64_t R, int64_t S, int64_t H, int64_t groups,
                  int64_t begin, int64_t Q, float* o) {  // slots [begin, Q), added to o
    const int64_t n = kH > 0 ? kH : H, per = n / groups;
    std::vector<float> codes(kBlock * n), lo_sums(R * groups, 0.0f);
    for (int64_t t0 = begin; t0 < Q; t0 += kBlock) {
      const int64_t count = std::min(kBlock, Q - t0);
      Slots<kH, kEight>(up, lw, n, t0, count, codes.data());
      for (int64_t r = 0; r < R; ++r) {
        const float* pr = p + r * S + t0;
        if (kH > 0 && groups == 1) {
          BlockSums(pr, lo + t0, scale + t0, codes.data(), count, lo_sums[r], o + r * n);
          continue;
        }
        for (int64_t i = 0; i < count; ++i)
          for (int64_t c = 0; c < groups; ++c) {
            const int64_t tc = (t0 + i) * groups + c;
            lo_sums[r * groups + c] += pr[i] * lo[tc];
            Axpy<0>(pr[i] * scale[tc], codes.data() + i * n + c * per, o + r * n + c * per,
                    per);
          }
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < n; ++h) o[r * n + h] += lo_sums[r * groups + h / per];
  }

  // One row over `count` widened slots, one statistic per slot: the kH sums in a local
  // array the compiler keeps in registers.
  static void BlockSums(const float* __restrict p, const float* __restrict lo,
                        const float* __restrict scale, const float* __restrict codes,
                        int64_t count, float& lo_sum, float* __restrict out) {
    constexpr int64_t n = kH > 0 ? kH : 1;
    float acc[n] = {};
    for (int64_t i = 0; i < count; ++i) {
      lo_sum += p[i] * lo[i];
      const float w = p[i] * scale[i];
      for (int64_t h = 0; h < n; ++h) acc[h] += w * codes[i * n + h];
    }
    for (int64_t h = 0; h < n; ++h) out[h] += acc[h];
  }
};

// Slots per work item: a whole number of key groups, ~512 slots (a SmolLM2 layer at 2048
// tokens is 12 items over its 3 kv heads).
int64_t SpanFor(int64_t G) { return G * std::max<int64_t>(1, 512 / G); }

// Work items over (kv head, span of slots [0, Q)): how many, and what item c covers. A
// head has at least one item, which for Q = 0 covers no slot.
struct HeadSpans {
  int64_t heads, span, Q;
  int64_t per_head() const { return std::max<int64_t>(1, (Q + span - 1) / span); }
  int64_t items() const { return heads * per_head(); }
  int64_t head(int64_t c) const { return c / per_head(); }
  int64_t begin(int64_t c) const { return c % per_head() * span; }
  int64_t end(int64_t c) const { return std::min(Q, begin(c) + span); }
};

// The threads for a call: below ~256 Ki multiply-adds (Q · kv heads · rows · H) the caller
// works alone, as a decode step's short context is.
int64_t ThreadsFor(const Dims& d, int64_t Q, int64_t pool_threads) {
  return specjax::ThreadsFor(Q * d.BK * d.R * d.H, pool_threads);
}

// scores[bk, r, t] = q[bk, r, :] · key(t) for t < length; 0 for the other slots. Items are
// (kv head, span of slots), each writing its own scores.
class ScoreWork : public specjax::Job {
 public:
  ScoreWork(const Dims& d, int64_t G, int64_t groups, const HeadSpans& spans, bool eight,
            const float* q, const uint8_t* up, const uint8_t* lw, const float* lo,
            const float* scale, float* s)
      : Job(spans.items()), d(d), G(G), groups(groups), spans(spans), eight(eight), q(q),
        up(up), lw(lw), lo(lo), scale(scale), s(s) {}

 protected:
  void Chunk(int64_t c) override {
    const int64_t bk = spans.head(c), Q = spans.Q;
    float* out = s + bk * d.R * d.S;
    ForShape<Scores>(d.H, eight, q + bk * d.R * d.H, up + bk * d.S * d.H / 2,
                     lw + bk * d.S * d.H / 2, lo + bk * groups * d.H,
                     scale + bk * groups * d.H, d.R, d.S, d.H, G, spans.begin(c),
                     spans.end(c), out);
    if (spans.end(c) == Q)  // the last span zeroes the slots past Q
      for (int64_t r = 0; r < d.R; ++r) std::fill(out + r * d.S + Q, out + (r + 1) * d.S, 0.0f);
  }

 private:
  const Dims d;
  const int64_t G, groups;
  const HeadSpans spans;
  const bool eight;
  const float* q;
  const uint8_t *up, *lw;
  const float *lo, *scale;
  float* s;
};

ffi::Error KeyScores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> length,
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
  auto work = std::make_shared<ScoreWork>(
      d, G, sd[2], HeadSpans{d.BK, SpanFor(G), Q}, bits == 8, q.typed_data(),
      upper.typed_data(), lower.typed_data(), lo.typed_data(), scale.typed_data(),
      out->typed_data());
  specjax::RunOnPool(pool, work, ThreadsFor(d, Q, pool.num_threads()));
  return ffi::Error::Success();
}

// out[bk, r, :] = Σ_{t < length} p[bk, r, t] · value(t). Items are (kv head, span of
// slots); each sums into its own [R, H] part, and the parts of a head are added in span
// order afterwards, so the result does not depend on which thread ran which item.
class ValueWork : public specjax::Job {
 public:
  ValueWork(const Dims& d, int64_t groups, const HeadSpans& spans, bool eight,
            const float* p, const uint8_t* up, const uint8_t* lw, const float* lo,
            const float* scale)
      : Job(spans.items()), d(d), groups(groups), spans(spans), eight(eight), p(p), up(up),
        lw(lw), lo(lo), scale(scale), parts(spans.items() * d.R * d.H, 0.0f) {}

  // out[bk] = Σ over its spans, in order.
  void Sum(float* out) const {
    const int64_t size = d.R * d.H;
    std::fill(out, out + d.BK * size, 0.0f);
    for (int64_t c = 0; c < spans.items(); ++c)
      for (int64_t i = 0; i < size; ++i) out[spans.head(c) * size + i] += parts[c * size + i];
  }

 protected:
  void Chunk(int64_t c) override {
    const int64_t bk = spans.head(c);
    ForShape<Values>(d.H, eight, p + bk * d.R * d.S, up + bk * d.S * d.H / 2,
                     lw + bk * d.S * d.H / 2, lo + bk * d.S * groups,
                     scale + bk * d.S * groups, d.R, d.S, d.H, groups, spans.begin(c),
                     spans.end(c), parts.data() + c * d.R * d.H);
  }

 private:
  const Dims d;
  const int64_t groups;
  const HeadSpans spans;
  const bool eight;
  const float* p;
  const uint8_t *up, *lw;
  const float *lo, *scale;
  std::vector<float> parts;  // [items, R, H]
};

ffi::Error ValueSums(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::S32> length,
                     ffi::Buffer<ffi::U8> upper, ffi::Buffer<ffi::U8> lower,
                     ffi::Buffer<ffi::F32> lo, ffi::Buffer<ffi::F32> scale,
                     ffi::ResultBuffer<ffi::F32> out, int64_t bits) {
  auto pd = p.dimensions(), cd = upper.dimensions(), sd = lo.dimensions();
  if (pd.size() != 4 || cd.size() != 4 || sd.size() != 4 || pd[3] != cd[2] ||
      sd[2] != cd[2] || (cd[3] * 2) % sd[3])
    return ffi::Error::InvalidArgument("quant_value_sums: p[B, K, R, S], codes[B, K, S, H/2], "
                                       "lo/scale[B, K, S, H/Gv] expected");
  const Dims d{pd[0] * pd[1], pd[2], cd[2], cd[3] * 2};
  const int64_t Q = std::clamp<int64_t>(length.typed_data()[0], 0, d.S);
  auto work = std::make_shared<ValueWork>(d, sd[3], HeadSpans{d.BK, SpanFor(1), Q}, bits == 8,
                                          p.typed_data(), upper.typed_data(),
                                          lower.typed_data(), lo.typed_data(),
                                          scale.typed_data());
  specjax::RunOnPool(pool, work, ThreadsFor(d, Q, pool.num_threads()));
  work->Sum(out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

#define SPECJAX_QUANT_ATTENTION(name, impl)                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                  \
                                ffi::Ffi::Bind()             \
                                    .Ctx<ffi::ThreadPool>()  \
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
