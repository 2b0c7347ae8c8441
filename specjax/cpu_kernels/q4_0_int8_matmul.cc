// y[M, O] = x[M, I] · w[O, I]ᵀ for a draft's Q4_0 copies (`4bit`), with x quantised to
// 8 bits per block of 32 inputs and each block's products summed as integers.
//
// Why: `gguf_matmul` computes every weight as the float gguf-py gives, because a target's
// logits must be its file's; that unpacking is vector work, and on Q4_0 it ran at 25-27 G
// weights/s on two cores, under the memory's rate. A draft's numbers need only be close:
// verification reads the target's weights, so the output is unchanged. Here a block costs
// a few byte-wide operations and one AVX-512 VNNI instruction (vpdpbusd: 64 byte products
// summed into 16 int32 lanes) for every row of x, llama.cpp's approach to Q4_0 × Q8_0
// (ggml-cpu's `ggml_vec_dot_q4_0_q8_0`; the code here is our own).
//
// Numbers: x's block b of 32 inputs becomes codes c = rint(x · (1 / d_x)) with
// d_x = max|x| / 127, as ggml's Q8_0 does (round to nearest even here). A weight is
// d_w · (n − 8), n its nibble, so the block's product is d_w · d_x · Σ (n − 8) · c: the
// sum is an exact integer (vpdpbusd multiplies the unsigned nibble by the signed code;
// −8 · Σ c, precomputed per four codes, starts the sum). Each row's result depends on its
// own x only, never on M. Without VNNI a scalar loop gives the same integers; the Python
// side then keeps float inputs (`q4_0_int8_fast`), as the loop is the slower path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "half.h"
#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512DQ__)
#define SPECJAX_Q4_0_VNNI 1
#else
#define SPECJAX_Q4_0_VNNI 0
#endif

namespace {

using Blocks = ffi::Buffer<ffi::U8, 2>;

constexpr int64_t kBlock = 32, kBlockBytes = 18;  // Q4_0: a half-float d, 16 bytes of nibbles
constexpr int64_t kMinRows = 16;
constexpr int kTile = 4;  // rows of x per pass over a weight row

using specjax::Half;

// One row of x, quantised: for each block b, 32 codes, d_x (eight times, one per int32
// lane of the vector loop's sums) and −8 · Σ of each 4 codes (vpdpbusd's int32 lanes sum
// 4 byte products). Blocks are padded with zero blocks to a multiple of 4, as the vector
// loop reads four at a time.
struct QuantRow {
  std::vector<int8_t> codes;      // [blocks · 32]
  std::vector<float> scale;       // [blocks · 8]: d_x
  std::vector<int32_t> offset;    // [blocks · 8]: −8 · (c[4i] + … + c[4i + 3])
};

constexpr int64_t kPad = 4;  // blocks per step of the vector loop

// d_x and the codes of one block of 32 inputs (the vector loop's rounding, rint, is the
// same as the scalar loop's nearbyint: both round to nearest even).
inline float QuantizeBlock(const float* x, int8_t* codes) {
#if SPECJAX_Q4_0_VNNI
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m512 scale = _mm512_set1_ps(id);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes),
                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, scale))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16),
                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, scale))));
  return d;
#else
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < kBlock; ++j)
    codes[j] = static_cast<int8_t>(std::clamp(std::nearbyint(x[j] * id), -128.0f, 127.0f));
  return d;
#endif
}

void Quantize(const float* x, int64_t I, QuantRow& q) {
  const int64_t blocks = (I / kBlock + kPad - 1) / kPad * kPad;
  q.codes.assign(blocks * kBlock, 0);
  q.scale.assign(blocks * 8, 0.0f);
  q.offset.assign(blocks * 8, 0);
  for (int64_t b = 0; b < I / kBlock; ++b) {
    const float d = QuantizeBlock(x + b * kBlock, q.codes.data() + b * kBlock);
    for (int j = 0; j < kBlock; ++j) q.offset[b * 8 + j / 4] -= 8 * q.codes[b * kBlock + j];
    std::fill_n(q.scale.data() + b * 8, 8, d);
  }
}

// The sum over blocks of d_w · d_x · Σ (n − 8) · c, for one weight row and R rows of x, in
// an order that does not depend on R.
#if SPECJAX_Q4_0_VNNI
// Two blocks a and b per 512-bit vector: lanes 0-3 sum a's weights 0-15, lanes 4-7 its
// 16-31, lanes 8-15 the same of b; the codes of x are stored in that order already.
inline __m512i Nibbles(const uint8_t* a, const uint8_t* b) {
  const __m256i ab = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + 2),
                                         reinterpret_cast<const __m128i*>(a + 2));
  // [a, a, b, b] in 128-bit lanes, then the second copy of each shifted down to its high
  // nibbles (a mask of 16-bit words: words 8-15 and 24-31)
  const __m512i twice = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                                 _mm512_castsi256_si512(ab));
  const __m512i shifted = _mm512_mask_srli_epi16(twice, 0xFF00FF00u, twice, 4);
  return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
}

// The weights' scales d_w of blocks a and b, each in eight lanes.
inline __m512 Scales(const uint8_t* a, const uint8_t* b) {
  return _mm512_insertf32x8(_mm512_set1_ps(Half(a)), _mm256_set1_ps(Half(b)), 1);
}

// Row r's sums of blocks a and b (the pair at block index `at`) into acc.
template <int R>
inline void Pair(const __m512i w, const __m512 dw, const int8_t* const* codes,
                 const int32_t* const* offset, const float* const* scale, int64_t at,
                 __m512* acc) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_loadu_si512(offset[r] + 8 * at), w,
                                             _mm512_loadu_si512(codes[r] + kBlock * at));
    const __m512 dx = _mm512_loadu_ps(scale[r] + 8 * at);
    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), dx), dw, acc[r]);
  }
}

template <int R>
void DotRows(const uint8_t* row, const QuantRow* const* x, int64_t I, float* y,
             int64_t stride) {
  const int8_t* codes[R];
  const int32_t* offset[R];
  const float* scale[R];
  __m512 even[R], odd[R];  // two sums a row, so consecutive pairs' FMAs do not wait
  for (int r = 0; r < R; ++r) {
    codes[r] = x[r]->codes.data();
    offset[r] = x[r]->offset.data();
    scale[r] = x[r]->scale.data();
    even[r] = odd[r] = _mm512_setzero_ps();
  }
  const int64_t blocks = I / kBlock;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    const uint8_t* a = row + b * kBlockBytes;
    specjax::PrefetchAhead(a);  // 72 bytes a step: two lines, so none is missed
    specjax::PrefetchAhead(a + 64);
    const uint8_t* c = a + 2 * kBlockBytes;
    Pair<R>(Nibbles(a, a + kBlockBytes), Scales(a, a + kBlockBytes), codes, offset, scale, b,
            even);
    Pair<R>(Nibbles(c, c + kBlockBytes), Scales(c, c + kBlockBytes), codes, offset, scale,
            b + 2, odd);
  }
  for (; b < blocks; b += 2) {  // the last 1-3 blocks; x's padding blocks are zeros
    static const uint8_t kZero[kBlockBytes] = {};
    const uint8_t* a = row + b * kBlockBytes;
    const uint8_t* next = b + 1 < blocks ? a + kBlockBytes : kZero;
    Pair<R>(Nibbles(a, next), Scales(a, next), codes, offset, scale, b, even);
  }
  for (int r = 0; r < R; ++r) y[r * stride] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}
#else
template <int R>
void DotRows(const uint8_t* row, const QuantRow* const* x, int64_t I, float* y,
             int64_t stride) {
  float acc[R] = {};
  for (int64_t b = 0; b < I / kBlock; ++b, row += kBlockBytes) {
    const float dw = Half(row);
    const uint8_t* qs = row + 2;
    for (int r = 0; r < R; ++r) {
      const int8_t* c = x[r]->codes.data() + b * kBlock;
      int32_t sum = 0;
      for (int j = 0; j < 16; ++j)
        sum += ((qs[j] & 0xF) - 8) * c[j] + ((qs[j] >> 4) - 8) * c[j + 16];
      acc[r] += static_cast<float>(sum) * (dw * x[r]->scale[8 * b]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * stride] = acc[r];
}
#endif

// y[m·O] = x[m] · (weight row) for m < M.
void MatmulRow(const uint8_t* row, const std::vector<QuantRow>& x, int64_t I, float* y,
               int64_t O) {
  const int64_t M = static_cast<int64_t>(x.size());
  for (int64_t m = 0; m < M; m += kTile) {
    const QuantRow* rows[kTile];
    const int64_t n = std::min<int64_t>(kTile, M - m);
    for (int64_t r = 0; r < n; ++r) rows[r] = &x[m + r];
    switch (n) {
      case 1: DotRows<1>(row, rows, I, y + m * O, O); break;
      case 2: DotRows<2>(row, rows, I, y + m * O, O); break;
      case 3: DotRows<3>(row, rows, I, y + m * O, O); break;
      default: DotRows<4>(row, rows, I, y + m * O, O); break;
    }
  }
}

ffi::Error Q4_0Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Blocks w,
                              ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = w.dimensions()[0], row_bytes = w.dimensions()[1];
  if (row_bytes % kBlockBytes)
    return ffi::Error::InvalidArgument("q4_0_int8_matmul: blocks must be rows of Q4_0 blocks");
  const int64_t I = row_bytes / kBlockBytes * kBlock;
  auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != I)
    return ffi::Error::InvalidArgument("q4_0_int8_matmul: x[..., I] and blocks of I weights a row");
  const int64_t M = x.element_count() / I;
  std::vector<QuantRow> rows(M);  // quantised by the caller: M·I is small beside O·I
  for (int64_t m = 0; m < M; ++m) Quantize(x.typed_data() + m * I, I, rows[m]);
  const uint8_t* blocks = w.typed_data();
  float* ys = y->typed_data();
  specjax::ParallelRows(pool, O, O * row_bytes, kMinRows, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) MatmulRow(blocks + o * row_bytes, rows, I, ys + o, O);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q4_0Int8Matmul, Q4_0Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Blocks>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 1 where the VNNI loop was compiled in: the draft takes this kernel only then.
extern "C" int Q4_0Int8Fast() { return SPECJAX_Q4_0_VNNI; }
