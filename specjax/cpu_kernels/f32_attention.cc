// Attention of a few query tokens (an AR or draft step, a verification of γ + 1 tokens)
// over one float32 KV cache segment and, optionally, the tokens' own keys and values after
// it, unnormalised for the log-sum-exp merge of segments: for each query row, the max m
// of its masked scores, l = Σ exp(s − m) and acc = Σ exp(s − m)·v, over the cache's slots
// [0, bound) and then the tokens' rows.
//
// Why a kernel: XLA:CPU gives a decode step's attention two YNNPACK dots and a softmax
// fusion per layer, plus copies that put the query heads of a kv head into rows and back.
// On a small model they were a tenth of the AR step and more of a verification
// (docs/decisions/cpu.md, C5). Here a kv head's keys and values are read once for
// all its query rows, straight from the cache's [B, K, S, H] layout and the projection's
// [B, T, N, H] one, and slots past `bound` (the filled part) are never read.
//
// Same bits at any T. The cache's slots [0, bound) and the tokens' rows are read as one
// sequence of slots j (the tokens' row i is slot bound + i), and what a row computes for
// slot j does not depend on T or on the bound: every key's score takes the same
// instructions (a short last group of keys repeats its last key rather than taking
// another path), the slots are cut into parts at fixed multiples of kSpan, and a part's
// sums run over whole vectors of slots, those past its end masked. So an AR step at
// position p (the cache filled to p, its token as the one row after it) and a
// verification's row at p (the cache filled to p − t, its tokens after it) sum the same
// terms in the same order: their logits are equal bit for bit, and greedy SSD cannot part
// from greedy AR on a near tie. As two segments merged apart, they differed in the last
// bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
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

constexpr int kBlock = 32;   // slots per block: a block of keys or values (8 KiB at H = 64)
constexpr int kSpan = 128;   // slots per part: the unit of work a thread takes
constexpr int kKeys = 4;     // keys a row's scores take at a time
constexpr int kSumVecs = 8;  // vectors of a row's value sums held in registers
constexpr float kMasked = -1e30f;  // a masked score, as the XLA path writes it
static_assert(kSpan % kBlock == 0 && kBlock % kKeys == 0 && kBlock % 16 == 0);

inline float Sum(Vec v) {
  float s = 0;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// The lane sums of four vectors: with AVX2, three horizontal adds and one add of halves
// for the four, where a lane sum alone takes five shuffles and adds; with AVX-512, each
// vector's two halves added first, then the same. One key's sum takes the same tree
// whichever of the four it is, so a score's bits still do not depend on T. A scalar loop
// over lanes made the sums most of the score loop (measured slower at one token and at
// five, variants alternated in one process).
static_assert(kKeys == 4, "Sums4 reduces one score's sums per key");
inline void Sums4(const Vec* v, float* out) {
#if defined(__AVX512F__)
  __m256 halves[kKeys];  // the upper half through a 64-bit extract: AVX-512F's own
  for (int i = 0; i < kKeys; ++i)
    halves[i] = _mm256_add_ps(
        _mm512_castps512_ps256(v[i]),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves[0], halves[1]),
                                  _mm256_hadd_ps(halves[2], halves[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#elif defined(__AVX2__)
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  for (int i = 0; i < 4; ++i) out[i] = Sum(v[i]);
#endif
}

// B batch, T query tokens, N query heads, K kv heads, S cache slots, H head dim, and U
// rows of the tokens' own keys and values (0: the cache alone).
struct Dims {
  int64_t B, T, N, K, S, H, U;
  int64_t G() const { return N / K; }
  int64_t R() const { return T * G(); }  // query rows of a kv head: row t·G + g
};

// One kv head of one batch row: its query rows, its keys and values as one sequence of
// slots, and which slots each token sees (`Visibility`).
struct Head {
  const float* q;        // row (t, g) at q + (t·N + g)·H: the head's G query heads
  const float* k;        // the cache's [S, H]: slots [0, bound)
  const float* v;
  const float* own_k;    // the tokens' [U, H]: slots [bound, bound + U)
  const float* own_v;
  int64_t bound, H;
  const bool* visible;   // [T, n]: slot j is visible to token t
  const bool* whole;     // [T, blocks]: block j / kBlock is visible whole to token t
  int64_t n, blocks;     // the slots and their blocks: the strides of the two

  const float* Key(int64_t j) const { return j < bound ? k + j * H : own_k + (j - bound) * H; }
  const float* Value(int64_t j) const {
    return j < bound ? v + j * H : own_v + (j - bound) * H;
  }
};

// Which of the slots [0, n) each query token of a batch row sees, and which blocks of
// kBlock slots it sees whole: one pass per call, where each kv head and part of the
// slots once redid it for its own blocks (a measurable share of the kernel's time).
struct Visibility {
  Visibility(const int32_t* qpos, const int32_t* kpos, const bool* valid,
             const int32_t* own_pos, const bool* own_valid, const Dims& d, int64_t bound,
             int64_t window)
      : n(bound + d.U), blocks((n + kBlock - 1) / kBlock), visible(new bool[d.B * d.T * n]),
        whole(new bool[d.B * d.T * blocks]) {
    std::vector<int32_t> pos(n);
    std::vector<char> ok(n);
    for (int64_t b = 0; b < d.B; ++b) {
      std::copy(kpos + b * d.S, kpos + b * d.S + bound, pos.begin());
      std::copy(own_pos + b * d.U, own_pos + (b + 1) * d.U, pos.begin() + bound);
      std::copy(valid + b * d.S, valid + b * d.S + bound, ok.begin());
      std::copy(own_valid + b * d.U, own_valid + (b + 1) * d.U, ok.begin() + bound);
      for (int64_t t = 0; t < d.T; ++t) {
        const int32_t at = qpos[b * d.T + t];
        bool* row = visible.get() + (b * d.T + t) * n;
        for (int64_t j = 0; j < n; ++j)  // no branches: the compiler vectorises this
          row[j] = ok[j] & (pos[j] <= at) & ((window <= 0) | (at - pos[j] < window));
        for (int64_t c = 0; c < blocks; ++c)
          whole[(b * d.T + t) * blocks + c] =
              std::all_of(row + c * kBlock, row + std::min(n, (c + 1) * kBlock),
                          [](bool x) { return x; });
      }
    }
  }

  int64_t n, blocks;
  std::unique_ptr<bool[]> visible, whole;
};

// Row r of R's share of the cache lines of [next, next + bytes): the block after the one
// the rows are reading, fetched while they compute, so that the first row to reach it
// finds it in L1. Row 0 otherwise met every line of a block from L2 or L3 as it read it
// (measured faster this way at one token and at five, interleaved runs).
inline void PrefetchShare(const float* next, int64_t bytes, int64_t r, int64_t R) {
  const int64_t lines = bytes / 64;
  const char* p = reinterpret_cast<const char*>(next);
  for (int64_t i = r * lines / R; i < (r + 1) * lines / R; ++i) __builtin_prefetch(p + i * 64);
}

// A kv head's partial over slots [lo, hi), row r at m[r], l[r] and acc[r·H].
struct Partial {
  float* m;
  float* l;
  float* acc;
};

// Rows r = t·G + g of one kv head over slots [lo, hi): scores, their max, exp and sums,
// through a buffer of R × (hi − lo) scores.
template <int kH>
void Attend(const Head& a, const Dims& d, int64_t lo, int64_t hi, float scale,
            const Partial& out, std::vector<float>& buf) {
  const int64_t H = kH > 0 ? kH : d.H, G = d.G(), R = d.R(), n = hi - lo;
  const int64_t stride = (n + 15) / 16 * 16, whole_vecs = (n + kLanes - 1) / kLanes * kLanes;
  buf.resize(R * stride);
  float* const scores = buf.data();
  const auto row_q = [&](int64_t r) { return a.q + ((r / G) * d.N + r % G) * H; };
  // The cache's slots of [j1, j1 + kBlock) ∩ [lo, hi), as `PrefetchShare` takes them (the
  // tokens' own rows are few and were just written); after the last block of keys, the
  // first of values.
  const auto cached_bytes = [&](int64_t j1) {
    return std::max<int64_t>(0, std::min({hi, j1 + kBlock, a.bound}) - j1) * H * 4;
  };

  // Scores s[r, j] = q_r · k_j · scale, kMasked where the slot is not visible to row r.
  // Four keys at a time: four independent sums, where one key's FMAs in a chain waited
  // on each other's latency.
  for (int64_t j0 = lo; j0 < hi; j0 += kBlock) {
    const int64_t j1 = std::min(hi, j0 + kBlock), after = cached_bytes(j1);
    const float* next = after > 0 ? a.Key(j1) : a.Value(lo);
    const int64_t next_size = after > 0 ? after : cached_bytes(lo);
    for (int64_t r = 0; r < R; ++r) {
      PrefetchShare(next, next_size, r, R);
      const float* qr = row_q(r);
      const bool* ok = a.visible + (r / G) * a.n;  // a token's G rows share their mask
      const bool seen = a.whole[(r / G) * a.blocks + j0 / kBlock];
      float* s = scores + r * stride - lo;
      for (int64_t j = j0; j < j1; j += kKeys) {
        const float* key[kKeys];
        for (int i = 0; i < kKeys; ++i) key[i] = a.Key(std::min(j + i, j1 - 1));
        Vec sum[kKeys] = {};
        for (int64_t h = 0; h < H; h += kLanes) {
          const Vec x = Load(qr + h);
#pragma GCC unroll 4
          for (int i = 0; i < kKeys; ++i) sum[i] += x * Load(key[i] + h);
        }
        float dots[kKeys];
        Sums4(sum, dots);
        if (j + kKeys > j1) {  // the block's last few keys: the rest were repeats
          for (int64_t i = 0; i < j1 - j; ++i) s[j + i] = ok[j + i] ? dots[i] * scale : kMasked;
        } else if (seen) {
          // A block every key of which the row sees (all but a causal edge) reads no
          // mask (measurably cheaper at five tokens).
#pragma GCC unroll 4
          for (int i = 0; i < kKeys; ++i) s[j + i] = dots[i] * scale;
        } else {
#pragma GCC unroll 4
          for (int i = 0; i < kKeys; ++i) s[j + i] = ok[j + i] ? dots[i] * scale : kMasked;
        }
      }
    }
  }
  // Per row: m, then p = exp(s − m) in place (0 where masked), l = Σ p, over whole vectors
  // of slots (those past hi masked): slot j's term always lands in lane (j − lo) % kLanes.
  for (int64_t r = 0; r < R; ++r) {
    float* s = scores + r * stride;
    std::fill(s + n, s + whole_vecs, kMasked);
    Vec mv = Splat(kMasked);
    for (int64_t j = 0; j < whole_vecs; j += kLanes) {
      const Vec x = Load(s + j);
      mv = x > mv ? x : mv;
    }
    float m = kMasked;
    for (int i = 0; i < kLanes; ++i) m = std::max(m, mv[i]);
    out.m[r] = m;
    if (m == kMasked) {  // nothing visible: l and acc are 0 (the XLA path's where)
      std::fill(s, s + n, 0.0f);
      out.l[r] = 0.0f;
      continue;
    }
    Vec lsum = Splat(0.0f);
    for (int64_t j = 0; j < whole_vecs; j += kLanes) {
      const Vec p = ExpNonPositive(Load(s + j) - Splat(m));
      Store(s + j, p);
      lsum += p;
    }
    out.l[r] = Sum(lsum);
  }
  // acc_r = Σ_j p[r, j] · v_j: a block of values (in L1) against every row in turn, up to
  // kSumVecs vectors of a row's sums in registers, each its own chain of FMAs.
  std::fill(out.acc, out.acc + R * H, 0.0f);
  for (int64_t j0 = lo; j0 < hi; j0 += kBlock) {
    const int64_t j1 = std::min(hi, j0 + kBlock), after = cached_bytes(j1);
    for (int64_t r = 0; r < R; ++r) {
      if (after > 0) PrefetchShare(a.Value(j1), after, r, R);
      const float* p = scores + r * stride - lo;
      float* acc = out.acc + r * H;
      for (int64_t h0 = 0; h0 < H; h0 += kSumVecs * kLanes) {
        const int vecs = static_cast<int>(std::min<int64_t>(kSumVecs, (H - h0) / kLanes));
        Vec sum[kSumVecs];
        for (int c = 0; c < vecs; ++c) sum[c] = Load(acc + h0 + c * kLanes);
        for (int64_t j = j0; j < j1; ++j) {
          const Vec pj = Splat(p[j]);
          const float* vj = a.Value(j) + h0;
#pragma GCC unroll 8
          for (int c = 0; c < vecs; ++c) sum[c] += pj * Load(vj + c * kLanes);
        }
        for (int c = 0; c < vecs; ++c) Store(acc + h0 + c * kLanes, sum[c]);
      }
    }
  }
}

// The work of one call: chunk c is kv head (b, h)'s part c % parts of the slots (kSpan
// slots from c % parts · kSpan), whose partial goes to its own scratch; `Reduce` merges a
// head's parts into the outputs.
class Work : public specjax::Job {
 public:
  Work(const float* q, const float* k, const float* v, const float* own_k, const float* own_v,
       Dims d, int64_t bound, float scale, Visibility seen)
      : Job(d.B * d.K * ((seen.n + kSpan - 1) / kSpan)), q(q), k(k), v(v), own_k(own_k),
        own_v(own_v), d(d), bound(bound), parts((seen.n + kSpan - 1) / kSpan), scale(scale),
        seen(std::move(seen)), scratch(new float[d.B * d.K * parts * d.R() * (d.H + 2)]) {}

  // out m/l[B, T, N], acc[B, T, N, H]: each head's parts merged as the XLA path merges
  // segments (rescaled to their common max; a part a row sees nothing of adds zeros).
  void Reduce(float* m, float* l, float* acc) const {
    const int64_t G = d.G(), R = d.R(), H = d.H;
    for (int64_t bh = 0; bh < d.B * d.K; ++bh) {
      const int64_t b = bh / d.K, h = bh % d.K;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t o = (b * d.T + r / G) * d.N + h * G + r % G;  // [b, t, h·G + g]
        float top = kMasked;
        for (int64_t p = 0; p < parts; ++p) top = std::max(top, Of(bh * parts + p).m[r]);
        float total = 0.0f, *y = acc + o * H;
        std::fill(y, y + H, 0.0f);
        for (int64_t p = 0; p < parts; ++p) {
          const Partial part = Of(bh * parts + p);
          const float w = std::exp(part.m[r] - top);  // 1 exactly for the part at the top
          total += w * part.l[r];
          for (int64_t c = 0; c < H; ++c) y[c] += w * part.acc[r * H + c];
        }
        m[o] = top;
        l[o] = total;
      }
    }
  }

 protected:
  void Chunk(int64_t c) override {
    thread_local std::vector<float> buf;
    const int64_t bh = c / parts, b = bh / d.K, h = bh % d.K;
    const int64_t lo = (c % parts) * kSpan, hi = std::min(seen.n, lo + kSpan);
    const Head a{q + (b * d.T * d.N + h * d.G()) * d.H, k + bh * d.S * d.H,
                 v + bh * d.S * d.H, own_k + bh * d.U * d.H, own_v + bh * d.U * d.H,
                 bound, d.H, seen.visible.get() + b * d.T * seen.n,
                 seen.whole.get() + b * d.T * seen.blocks, seen.n, seen.blocks};
    if (d.H == 64) Attend<64>(a, d, lo, hi, scale, Of(c), buf);
    else if (d.H == 128) Attend<128>(a, d, lo, hi, scale, Of(c), buf);
    else Attend<0>(a, d, lo, hi, scale, Of(c), buf);
  }

 private:
  Partial Of(int64_t c) const {
    float* base = scratch.get() + c * d.R() * (d.H + 2);
    return {base, base + d.R(), base + 2 * d.R()};
  }

  const float *q, *k, *v, *own_k, *own_v;
  const Dims d;
  const int64_t bound, parts;
  const float scale;
  const Visibility seen;
  const std::unique_ptr<float[]> scratch;  // chunks × (m[R], l[R], acc[R, H])
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> qpos,
                     ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::S32> kpos, ffi::Buffer<ffi::PRED> valid,
                     ffi::Buffer<ffi::S32> bound, ffi::Buffer<ffi::F32> own_k,
                     ffi::Buffer<ffi::F32> own_v, ffi::Buffer<ffi::S32> own_pos,
                     ffi::Buffer<ffi::PRED> own_valid, ffi::ResultBuffer<ffi::F32> m,
                     ffi::ResultBuffer<ffi::F32> l, ffi::ResultBuffer<ffi::F32> acc,
                     float scale, int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), ud = own_k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || ud.size() != 4 || qd[0] != kd[0] ||
      qd[3] != kd[3] || kd[1] == 0 || qd[2] % kd[1] || qd[3] % kLanes || ud[0] != kd[0] ||
      ud[1] != kd[1] || ud[3] != kd[3])
    return ffi::Error::InvalidArgument(
        "f32_attention: q[B, T, N, H], k/v[B, K, S, H] and the tokens' own k/v[B, K, U, H] "
        "with K | N and H a multiple of the vector width expected");
  const Dims d{qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], ud[2]};
  const int64_t n = std::clamp<int64_t>(bound.typed_data()[0], 0, d.S);
  Visibility seen(qpos.typed_data(), kpos.typed_data(), valid.typed_data(),
                  own_pos.typed_data(), own_valid.typed_data(), d, n, window);
  // The keys and values read decide the threads; the parts (kSpan slots of every head)
  // are claimed by whichever thread is free.
  const int64_t threads =
      specjax::ThreadsFor(2 * d.B * d.K * seen.n * d.H * 4, pool.num_threads());
  auto work = std::make_shared<Work>(q.typed_data(), k.typed_data(), v.typed_data(),
                                     own_k.typed_data(), own_v.typed_data(), d, n, scale,
                                     std::move(seen));
  specjax::RunOnPool(pool, work, threads);
  work->Reduce(m->typed_data(), l->typed_data(), acc->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(F32Attention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q positions
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // key positions
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid
                                  .Arg<ffi::Buffer<ffi::S32>>()   // bound
                                  .Arg<ffi::Buffer<ffi::F32>>()   // the tokens' own k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // and v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // their positions
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // their validity
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>()   // l
                                  .Ret<ffi::Buffer<ffi::F32>>()   // acc
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
