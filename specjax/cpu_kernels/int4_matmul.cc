// y[M, O] = x[M, I] · w for QuantSpec's 4-bit draft weights: w[i, o] = lo[o, g] +
// code[o, i] · scale[o, g] over groups g of G consecutive inputs (asymmetric, min/max per
// group, `quant.Int4Matrix`). Codes are stored output-major, two per byte: byte j of a
// group holds input j in its low nibble and input j + G/2 in its high one.
//
// Why a kernel: XLA:CPU widens the codes to a float32 matrix in memory before its dot,
// so a 4-bit MLP read eight times the bytes of its codes, plus a write: QuantSpec with
// the paper's 4-bit MLP ran at 0.41-0.68x the full-precision AR on SmolLM2, where its
// 8-bit drafts (`int8_matmul.cc`) beat it.
//
// Why integer activations: widening every code to a float (vpmovzxbd, vcvtdq2ps and an
// FMA per 8 codes) bounded the first form of this kernel by its instructions, well below
// what a loop that only reads the codes reaches. So each group of G inputs of a row
// is first put on a grid of int16 levels of its own unit, max|x_g| / 32767
// (`quant.activation_grid`, which XLA's path applies too), and vpmaddwd multiplies and
// pairs 16 codes with their levels per instruction. A group's sum Σ code · level is then
// an exact int32 on every instruction set. The grid's step is 2^-16 of the group's
// largest input: finer than the float16 activations the paper's W4A16 draft reads.
//
// Per output channel and row, with q the levels and unit[g] their step:
//     y = Σ_g unit[g] · (scale[o, g] · Σ_{i in g} code[o, i] · q[i] + lo[o, g] · Σ_{i in g} q[i])
// Four channels' codes are read side by side, each level vector loaded meeting all four,
// and each channel's codes stay in L1 across the M rows of x.
//
// Work is split by output channels, two chunks per worker, claimed from an atomic counter
// by the caller and XLA's intra-op threads (`workers.h`), as in the int8 kernel.
#include <algorithm>
#include <atomic>
#include <cmath>
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

constexpr int64_t kMinChannels = 64;     // per chunk
constexpr int kChannels = 4;             // output channels read side by side
constexpr float kLevels = 32767.0f;      // int16 levels on each side of zero
constexpr float kUnitPerAmax = 1.0f / kLevels;  // a unit per max|x|: `quant.UNIT_PER_AMAX`

using specjax::PrefetchAhead;

// Σ code · level over one group of one channel; `half` = G/2 bytes. Plain C++: the
// portable path, and groups too small for the vectors (a test's G).
inline int32_t GroupDotScalar(const int16_t* q, const uint8_t* codes, int64_t half) {
  int32_t dot = 0;
  for (int64_t j = 0; j < half; ++j)
    dot += q[j] * (codes[j] & 0xF) + q[half + j] * (codes[j] >> 4);
  return dot;
}

#if defined(__AVX2__)
constexpr int64_t kVectorBytes = 16;  // code bytes per step: 16 low and 16 high codes

inline int32_t Sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// The group dots of R channels side by side (codes `stride` bytes apart). Each step widens
// 16 bytes to 16-bit lanes (vpmovzxbw); a mask gives the low codes and a shift the high
// ones, and vpmaddwd meets each with its 16 levels. Lanes stay far from overflow: a
// group of 128 sums to at most 128 · 15 · 32767 < 2^26.
template <int R>
inline void GroupDots(const int16_t* q, const uint8_t* codes, int64_t stride, int64_t half,
                      int32_t* dot) {
  const __m256i mask = _mm256_set1_epi16(0x0F);
  __m256i acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    PrefetchAhead(codes + r * stride);
    acc[r] = _mm256_setzero_si256();
  }
  for (int64_t j = 0; j < half; j += kVectorBytes) {
    const __m256i low_q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j));
    const __m256i high_q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + half + j));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i bytes = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * stride + j)));
      const __m256i low = _mm256_madd_epi16(_mm256_and_si256(bytes, mask), low_q);
      const __m256i high = _mm256_madd_epi16(_mm256_srli_epi16(bytes, 4), high_q);
      acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(low, high));
    }
  }
  for (int r = 0; r < R; ++r) dot[r] = Sum(acc[r]);
}
#endif

// Σ code · level over one group for R channels, by vectors where the group fills them.
template <int R>
inline void GroupDotsAny(const int16_t* q, const uint8_t* codes, int64_t stride,
                         int64_t half, int32_t* dot) {
#if defined(__AVX2__)
  if (half % kVectorBytes == 0) return GroupDots<R>(q, codes, stride, half, dot);
#endif
  for (int r = 0; r < R; ++r) dot[r] = GroupDotScalar(q, codes + r * stride, half);
}

// One call: x quantised group by group (once, by the caller), then output channels
// [begin, end) at a time (`Rows`, run on the pool's threads).
class Matmul {
 public:
  Matmul(const float* x, const uint8_t* codes, const float* lo, const float* scale, float* y,
         int64_t M, int64_t I, int64_t O, int64_t groups)
      : codes(codes), lo(lo), scale(scale), y(y), M(M), I(I), O(O), groups(groups), q(M * I),
        unit(M * groups), q_sum(M * groups) {
    const int64_t G = I / groups;
    for (int64_t row_group = 0; row_group < M * groups; ++row_group)
      Quantize(x + row_group * G, G, q.data() + row_group * G, unit[row_group],
               q_sum[row_group]);
  }

  void Rows(int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + kChannels <= end; o += kChannels) Channels<kChannels>(o);
    for (; o < end; ++o) Channels<1>(o);
  }

 private:
  // One group of G inputs on its int16 grid: levels round(x / unit), half to even, as
  // `quant.activation_grid` rounds them. An all-zero group has unit 0 and levels 0.
  static void Quantize(const float* x, int64_t G, int16_t* q, float& unit, int32_t& q_sum) {
    float amax = 0;
    for (int64_t i = 0; i < G; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float inverse = amax > 0 ? kLevels / amax : 0.0f;
    unit = amax * kUnitPerAmax;  // as `quant.activation_grid`: a product, not a quotient
    q_sum = 0;
    for (int64_t i = 0; i < G; ++i) {
      q[i] = static_cast<int16_t>(std::nearbyint(x[i] * inverse));
      q_sum += q[i];
    }
  }

  // Output channels [o, o + R) for every row of x: their codes stay in L1 across the rows.
  template <int R>
  void Channels(int64_t o) {
    const int64_t G = I / groups, half = G / 2;
    for (int64_t m = 0; m < M; ++m) {
      float total[R] = {};
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t mg = m * groups + g;
        int32_t dot[R];
        GroupDotsAny<R>(q.data() + m * I + g * G, codes + o * (I / 2) + g * half, I / 2,
                        half, dot);
        for (int r = 0; r < R; ++r) {
          const int64_t og = (o + r) * groups + g;
          total[r] += unit[mg] * (scale[og] * static_cast<float>(dot[r]) +
                                  lo[og] * static_cast<float>(q_sum[mg]));
        }
      }
      for (int r = 0; r < R; ++r) y[m * O + o + r] = total[r];
    }
  }

  const uint8_t* codes;
  const float* lo;
  const float* scale;
  float* y;
  const int64_t M, I, O, groups;
  std::vector<int16_t> q;       // [M, I]: x's levels
  std::vector<float> unit;      // [M, groups]: each group's step
  std::vector<int32_t> q_sum;   // [M, groups]: Σ levels, for the lo term
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
  Matmul matmul(x.typed_data(), codes.typed_data(), lo.typed_data(), scale.typed_data(),
                y->typed_data(), x.element_count() / I, I, O, groups);
  specjax::ParallelRows(pool, O, O * I / 2, kMinChannels,
                        [&matmul](int64_t begin, int64_t end) { matmul.Rows(begin, end); });
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
