// Attention over the quantised slots of a QuantSpec KV cache, read from the codes: for
// query rows of each kv head, the softmax partial (row max m, l = Σ exp(s − m), the
// exp-weighted values o) over slots [0, Q) of one layer, to merge with the full-precision
// tokens' partial (`quant_kv_cache`'s layout; `quant.py` the codes).
//
// Why a kernel: XLA:CPU computes a quantised read as a float32 copy of the whole layer
// (dequantise, then its dot reads the copy), so a step on the 8-bit cache cost more than
// one on a float32 cache though the codes are a quarter of the bytes; with these kernels
// it costs less (docs/decisions/drafting.md, D5). The head dimension is a compile-time
// constant for H = 64 and 128, which the loops need to be fast.
// Here each slot's codes are widened into one row of H floats, in L1, and met by every
// query row at once; the statistics enter per group (`Scores`, `Values` say how), and
// slots at or past Q are never read, so a step costs the context, not the allocation.
//
// A slot's value in channel h: lo + upper·scale (+ (lower − 7)·scale/15 at 8 bits), the
// codes of channels h < H/2 in the low nibbles of bytes [0, H/2), the others in the high
// ones (`quant.pack`). Keys: lo/scale per channel for each group of G slots. Values:
// per slot for each group of Gv channels.
//
// Work is split into (kv head, ~512 slots) items shared with XLA's threads (`workers.h`)
// once a call has enough of it; an item's scores, softmax terms and value sums stay in
// its own buffer. Scores, softmax terms and value sums are all here: with the softmax
// between two kernels in XLA, it wrote and reread [B, K, R, S] over the allocated slots,
// and steps and verifications were measurably slower (`python -m
// experiments.bench_quant_steps`).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "float_vectors.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::kLanes, specjax::Vec, specjax::Load, specjax::Store, specjax::Splat,
    specjax::ExpNonPositive;

constexpr float kMasked = -1e30f;  // a masked score, as the XLA path writes it

// One slot's codes as H floats in steps of kUnit: u (4 bits), or 15u + l − 7 (8 bits), so
// that the value is lo + (scale·kUnit)·code, with lo and scale per channel (keys) or per
// channel group (values). Channels h < H/2 sit in the low nibbles of bytes [0, H/2), the
// others in the high ones. At 8 bits the two nibbles meet as integers, one conversion a
// channel (u + (l − 7)/15 in floats took two and a multiply-add). kH > 0 fixes H at compile
// time (64, 128: most models), which lets the compiler keep a row in registers and drop
// the aliasing checks; 0 reads `H`.
template <bool kEight>
constexpr float kUnit = kEight ? 1.0f / 15.0f : 1.0f;

template <int kH, bool kEight>
inline void Codes(const uint8_t* __restrict up, const uint8_t* __restrict lw, int64_t H,
                  float* __restrict row) {
  const int64_t half = (kH > 0 ? kH : H) / 2;
  for (int64_t j = 0; j < half; ++j) {
    int32_t c0 = up[j] & 15, c1 = up[j] >> 4;
    if (kEight) {
      c0 = 15 * c0 + (lw[j] & 15) - 7;
      c1 = 15 * c1 + (lw[j] >> 4) - 7;
    }
    row[j] = static_cast<float>(c0);
    row[j + half] = static_cast<float>(c1);
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

// B batch rows, K kv heads, R query rows of a kv head, S allocated slots, H head dim.
struct Dims {
  int64_t B, K, R, S, H;
  int64_t BK() const { return B * K; }
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

// One layer's codes and statistics (`quant.Hier`), for keys or values.
struct Codebook {
  const uint8_t *up, *lw;
  const float *lo, *scale;
};

// Scores of one kv head: s[r, t − begin] = q[r, :] · key(t) for slots t in [begin, Q), rows
// `stride` apart. Keys share lo and scale per channel over a group of G slots, so per group
// and row
//     q · key(t) = Σ_h q[h]·lo[h] + Σ_h (q[h]·scale[h]) · code(t, h):
// the first sum and the products q·scale once per group, and one dot with the codes per
// slot (widening each slot to lo + code·scale, a division by 15 per channel at 8 bits
// included, cost more than the dots did). Slots are widened kBlock at a time into L1, and
// with a fixed H a row meets them four at a time (`FourDots`).
template <int kH, bool kEight>
struct Scores {
  static constexpr int64_t kBlock = 32;

  static void Run(const float* q, const Codebook& keys, int64_t R, int64_t H, int64_t G,
                  int64_t begin, int64_t Q, float* s, int64_t stride) {  // begin % G == 0
    const int64_t n = kH > 0 ? kH : H;
    std::vector<float> scaled(R * n), base(R), codes(kBlock * n);
    for (int64_t start = begin; start < Q; start += G) {
      const float* lo_g = keys.lo + start / G * n;
      const float* scale_g = keys.scale + start / G * n;
      for (int64_t r = 0; r < R; ++r) {
        base[r] = Dot<kH>(q + r * n, lo_g, n);
        for (int64_t h = 0; h < n; ++h)
          scaled[r * n + h] = q[r * n + h] * (scale_g[h] * kUnit<kEight>);
      }
      const int64_t end = std::min(Q, start + G);
      for (int64_t t0 = start; t0 < end; t0 += kBlock) {
        const int64_t count = std::min(kBlock, end - t0);
        Slots<kH, kEight>(keys.up, keys.lw, n, t0, count, codes.data());
        for (int64_t r = 0; r < R; ++r) {
          const float* row = scaled.data() + r * n;
          float* out = s + r * stride + (t0 - begin);
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

// Values of one kv head: o[r, :] += Σ_{t in [begin, Q)} p[r, t − begin] · value(t), rows of
// p `stride` apart. A slot's values share lo and scale per group of H/groups channels, so
// per row and group
//     Σ_t p[t]·value(t, h) = Σ_t (p[t]·scale[t]) · code(t, h) + Σ_t p[t]·lo[t]:
// one multiply-add per channel and slot, and the lo sums added once at the end. Slots are
// widened kBlock at a time into L1; with one group per slot and a fixed H (SmolLM2,
// Qwen2.5) a row's sums then stay in registers across the block, where adding each slot
// into o in memory bounded a verification's 15 rows by their stores.
template <int kH, bool kEight>
struct Values {
  static constexpr int64_t kBlock = 32;  // slots: 32 · 128 floats = 16 KiB at most

  static void Run(const float* p, int64_t stride, const Codebook& values, int64_t R,
                  int64_t H, int64_t groups, int64_t begin, int64_t Q, float* o) {
    const int64_t n = kH > 0 ? kH : H, per = n / groups;
    std::vector<float> codes(kBlock * n), lo_sums(R * groups, 0.0f);
    for (int64_t t0 = begin; t0 < Q; t0 += kBlock) {
      const int64_t count = std::min(kBlock, Q - t0);
      Slots<kH, kEight>(values.up, values.lw, n, t0, count, codes.data());
      for (int64_t r = 0; r < R; ++r) {
        const float* pr = p + r * stride + (t0 - begin);
        if (kH > 0 && groups == 1) {
          BlockSums(pr, values.lo + t0, values.scale + t0, codes.data(), count, lo_sums[r],
                    o + r * n);
          continue;
        }
        for (int64_t i = 0; i < count; ++i)
          for (int64_t c = 0; c < groups; ++c) {
            const int64_t tc = (t0 + i) * groups + c;
            lo_sums[r * groups + c] += pr[i] * values.lo[tc];
            Axpy<0>(pr[i] * (values.scale[tc] * kUnit<kEight>), codes.data() + i * n + c * per,
                    o + r * n + c * per, per);
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
      const float w = p[i] * (scale[i] * kUnit<kEight>);
      for (int64_t h = 0; h < n; ++h) acc[h] += w * codes[i * n + h];
    }
    for (int64_t h = 0; h < n; ++h) out[h] += acc[h];
  }
};

// Rows of scores [R, stride] over `count` slots from slot `begin`, turned in place into
// their softmax terms: each row's scores times `scale`, masked (−1e30) past the window of
// its position at[r], its max m[r], p = exp(s − m) (0 where masked: `ExpNonPositive` takes
// −1e30 − m to 0) and l[r] = Σ p. A row with no visible slot gets m = −1e30, p = l = 0, so
// it weighs nothing in a merge. Columns [count, stride) must hold −1e30 already.
inline void SoftmaxTerms(float* s, int64_t R, int64_t count, int64_t stride, int64_t begin,
                         const int32_t* at, float scale, int64_t window, float* m, float* l) {
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * stride;
    const int64_t first = window > 0 ? std::clamp<int64_t>(at[r] - window + 1 - begin, 0, count)
                                     : 0;  // slots before it are out of the window
    float top = kMasked;
    for (int64_t i = 0; i < count; ++i) {
      row[i] = i < first ? kMasked : row[i] * scale;
      top = std::max(top, row[i]);
    }
    m[r] = top;
    Vec sum = Splat(0.0f);
    for (int64_t i = 0; i < stride; i += kLanes) {
      const Vec p = top == kMasked ? Splat(0.0f) : ExpNonPositive(Load(row + i) - Splat(top));
      Store(row + i, p);
      sum += p;
    }
    float total = 0.0f;
    for (int j = 0; j < kLanes; ++j) total += sum[j];
    l[r] = total;
  }
}

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
  return specjax::ThreadsFor(Q * d.BK() * d.R * d.H, pool_threads);
}

// What one item computes: scores over its span, softmax terms, value sums, into its own
// partial (o [R, H], m and l [R]); a span that no row's sliding window reaches, nothing.
template <int kH, bool kEight>
struct SpanPartial {
  static void Run(const float* q, const int32_t* at, const Codebook* keys,
                  const Codebook* values, const Dims* d, int64_t G, int64_t value_groups,
                  int64_t begin, int64_t end, float scale, int64_t window, float* o, float* m,
                  float* l) {
    const auto unseen = [&](int32_t p) { return p - window >= end - 1; };
    if (window > 0 && std::all_of(at, at + d->R, unseen)) {  // outside every row's window
      std::fill(m, m + d->R, kMasked);
      std::fill(l, l + d->R, 0.0f);
      return;
    }
    const int64_t count = end - begin, stride = (count + kLanes - 1) / kLanes * kLanes;
    std::vector<float> s(d->R * std::max<int64_t>(stride, 1), kMasked);
    Scores<kH, kEight>::Run(q, *keys, d->R, d->H, G, begin, end, s.data(), stride);
    SoftmaxTerms(s.data(), d->R, count, stride, begin, at, scale, window, m, l);
    Values<kH, kEight>::Run(s.data(), stride, *values, d->R, d->H, value_groups, begin, end,
                            o);
  }
};

// The softmax partial of every kv head over the slots [0, length) of a quantised layer.
// Items are (kv head, span of slots), each with its own partial; a head's partials are
// merged in span order afterwards, so the result does not depend on which thread ran which
// item.
class PartialWork : public specjax::Job {
 public:
  struct Layer {
    const float* q;
    const int32_t* at;  // [B, R]: the rows' positions
    Codebook keys, values;
    int64_t G, value_groups;  // slots per key group; value groups per slot
  };

  PartialWork(const Dims& d, const HeadSpans& spans, bool eight, float scale, int64_t window,
              const Layer& layer)
      : Job(spans.items()), d(d), spans(spans), eight(eight), scale(scale), window(window),
        layer(layer), o(spans.items() * d.R * d.H, 0.0f), m(spans.items() * d.R),
        l(spans.items() * d.R) {}

  // One partial per head: o [BK, R, H], m and l [BK, R], the spans' merged (log-sum-exp).
  void Merge(float* out_o, float* out_m, float* out_l) const {
    const int64_t per = spans.per_head(), R = d.R, H = d.H;
    for (int64_t bk = 0; bk < d.BK(); ++bk)
      for (int64_t r = 0; r < R; ++r) {
        float top = kMasked;
        for (int64_t c = bk * per; c < (bk + 1) * per; ++c) top = std::max(top, m[c * R + r]);
        float total = 0.0f, *acc = out_o + (bk * R + r) * H;
        std::fill(acc, acc + H, 0.0f);
        for (int64_t c = bk * per; c < (bk + 1) * per; ++c) {
          const float w = std::exp(m[c * R + r] - top);
          total += w * l[c * R + r];
          for (int64_t h = 0; h < H; ++h) acc[h] += w * o[(c * R + r) * H + h];
        }
        out_m[bk * R + r] = top;
        out_l[bk * R + r] = total;
      }
  }

 protected:
  void Chunk(int64_t c) override {
    const int64_t bk = spans.head(c), b = bk / d.K;
    const Codebook keys = At(layer.keys, bk, d.S / layer.G * d.H);
    const Codebook values = At(layer.values, bk, d.S * layer.value_groups);
    ForShape<SpanPartial>(d.H, eight, layer.q + bk * d.R * d.H, layer.at + b * d.R, &keys,
                          &values, &d, layer.G, layer.value_groups, spans.begin(c),
                          spans.end(c), scale, window, o.data() + c * d.R * d.H,
                          m.data() + c * d.R, l.data() + c * d.R);
  }

 private:
  // Head bk's codes ([S, H/2] each) and its `stats` statistics.
  Codebook At(const Codebook& all, int64_t bk, int64_t stats) const {
    const int64_t codes = bk * d.S * d.H / 2;
    return {all.up + codes, all.lw + codes, all.lo + bk * stats, all.scale + bk * stats};
  }

  const Dims d;
  const HeadSpans spans;
  const bool eight;
  const float scale;
  const int64_t window;
  const Layer layer;
  std::vector<float> o, m, l;  // [items, R, H], [items, R], [items, R]
};

ffi::Error Partials(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> q_pos,
                    ffi::Buffer<ffi::S32> length, ffi::Buffer<ffi::U8> k_upper,
                    ffi::Buffer<ffi::U8> k_lower, ffi::Buffer<ffi::F32> k_lo,
                    ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::U8> v_upper,
                    ffi::Buffer<ffi::U8> v_lower, ffi::Buffer<ffi::F32> v_lo,
                    ffi::Buffer<ffi::F32> v_scale, ffi::ResultBuffer<ffi::F32> o,
                    ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l, int64_t bits,
                    float scale, int64_t window) {
  auto qd = q.dimensions(), cd = k_upper.dimensions(), kd = k_lo.dimensions(),
       vd = v_lo.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || kd.size() != 4 || vd.size() != 4 ||
      cd[0] != qd[0] || cd[1] != qd[1] || cd[3] * 2 != qd[3] || kd[3] != qd[3] ||
      kd[2] == 0 || cd[2] % kd[2] || vd[2] != cd[2] || vd[3] == 0 || qd[3] % vd[3] ||
      static_cast<int64_t>(q_pos.element_count()) != qd[0] * qd[2])
    return ffi::Error::InvalidArgument(
        "quant_attention: q[B, K, R, H], q_pos[B, R], codes[B, K, S, H/2], key lo/scale "
        "[B, K, S/G, H], value lo/scale [B, K, S, H/Gv] expected");
  const Dims d{qd[0], qd[1], qd[2], cd[2], qd[3]};
  const int64_t G = d.S / kd[2], Q = std::clamp<int64_t>(length.typed_data()[0], 0, d.S);
  const PartialWork::Layer layer{
      q.typed_data(), q_pos.typed_data(),
      {k_upper.typed_data(), k_lower.typed_data(), k_lo.typed_data(), k_scale.typed_data()},
      {v_upper.typed_data(), v_lower.typed_data(), v_lo.typed_data(), v_scale.typed_data()},
      G, vd[3]};
  auto work = std::make_shared<PartialWork>(d, HeadSpans{d.BK(), SpanFor(G), Q}, bits == 8,
                                            scale, window, layer);
  specjax::RunOnPool(pool, work, ThreadsFor(d, Q, pool.num_threads()));
  work->Merge(o->typed_data(), m->typed_data(), l->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantPartials, Partials,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // length
                                  .Arg<ffi::Buffer<ffi::U8>>()   // keys: upper codes
                                  .Arg<ffi::Buffer<ffi::U8>>()   // lower codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lo
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::U8>>()   // values: upper codes
                                  .Arg<ffi::Buffer<ffi::U8>>()   // lower codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lo
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Attr<int64_t>("bits")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
