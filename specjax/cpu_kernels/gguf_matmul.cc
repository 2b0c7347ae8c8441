// y[M, O] = x[M, I] · w[O, I]ᵀ where w is a GGUF file's matrix in its own block formats
// (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K: one row of I weights is I / block blocks), and the
// same rows dequantised to float32 (`GgufDequantize`: an embedding lookup, a prefill).
//
// Why: a float32 target reads 4 bytes per weight per step; the file holds 0.56 (Q4_1) to
// 1.06 (Q8_0). llama.cpp, reading the blocks, decoded several times faster than
// specjax's float32 AR on the same cores (docs/decisions/cpu.md, C8).
//
// Exactness: each weight is the float32 gguf-py's `dequantize` gives, computed with its
// expressions in its order — `d * q` (Q4_0, Q5_0, Q8_0, Q6_K's d·scale then ·q),
// `(d * q) + m` (Q4_1), `(d·sc) * q - (dmin·m)` (Q4_K) — each rounded to float32, so
// this source is compiled without contraction (`-ffp-contract=off`: GCC fuses a*b + c
// into an FMA even in ISO C++ mode) and without reassociation. A test compares the
// dequantised rows bit for bit with gguf-py's.
//
// Order: with AVX-512 each 32 weights of a row are dequantised into two vectors and met
// there by up to 9 rows of x (more rows: another pass), each row summing into two vector
// sums in the same order whatever M is (up to 5 rows, two weight rows share each vector of
// x loaded; that changes no row's sums); elsewhere a row of w is dequantised into a buffer
// and dotted with each row of x by one loop. Either way a row's result does not depend on
// M: an AR step's logits equal a verification's row, bit for bit. Output rows are split
// into chunks claimed by the caller and XLA's intra-op threads (`workers.h`), as in
// `int8_matmul.cc`.
//
// Cost: with 4- and 5-bit blocks the kernel is bound by the vector work of dequantising,
// not by memory, so unlike the float32 target's, a verification's five rows cost clearly
// more than one AR step (docs/results/step-costs.md, `forward-*-gguf`). Each row of x adds
// its multiplies and their loads of x: pairing weight rows halves the loads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "half.h"
#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Blocks = ffi::Buffer<ffi::U8, 2>;  // aliases: a comma would split the macro below

constexpr int64_t kMinRows = 16;  // output rows per chunk

// ggml's type numbers (gguf.GGMLQuantizationType) and their blocks: weights, bytes.
enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

struct Format {
  int64_t weights = 0, bytes = 0;  // per block; 0: a type this kernel does not read
};

Format FormatOf(int64_t kind) {
  switch (kind) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ6_K: return {256, 210};
    default: return {};
  }
}

using specjax::Half;

// One block of each type -> its weights, as gguf-py's `dequantize_blocks` computes them.
// Nibble layout of the 32-weight types: byte j holds weight j low, weight j + 16 high.
namespace scalar {

inline void Q4_0Block(const uint8_t* b, float* w) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>((qs[j] & 0xF) - 8);
    w[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
  }
}

inline void Q4_1Block(const uint8_t* b, float* w) {
  const float d = Half(b), m = Half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>(qs[j] & 0xF) + m;
    w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

inline void Q5_0Block(const uint8_t* b, float* w) {
  const float d = Half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);  // bit j: the fifth bit of weight j
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    w[j] = d * static_cast<float>(lo - 16);
    w[j + 16] = d * static_cast<float>(hi - 16);
  }
}

inline void Q8_0Block(const uint8_t* b, float* w) {
  const float d = Half(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(qs[j]) * d;
}

// Q4_K: 8 sub-blocks of 32 weights, each with a 6-bit scale and minimum packed in 12 bytes
// (gguf-py's `Q4_K.get_scale_min`); sub-block 2k reads the low nibbles of qs[32k, 32k+32),
// 2k + 1 the high ones.
inline void Q4_KBlock(const uint8_t* b, float* w) {
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* qs = b + 16;
  for (int k = 0; k < 8; ++k) {
    const int sc = k < 4 ? s[k] & 0x3F : (s[k + 4] & 0xF) | ((s[k - 4] >> 2) & 0x30);
    const int mn = k < 4 ? s[k + 4] & 0x3F : (s[k + 4] >> 4) | ((s[k] >> 2) & 0x30);
    const float scale = d * static_cast<float>(sc), offset = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * (k / 2);
    const int shift = 4 * (k % 2);
    for (int j = 0; j < 32; ++j)
      w[32 * k + j] = scale * static_cast<float>((q[j] >> shift) & 0xF) - offset;
  }
}

// Q6_K: 256 weights in two halves of 128; weight 128h + 32s + j (s < 4, j < 32) takes its
// low four bits from ql[64h + 32(s % 2) + j] (high nibble when s ≥ 2) and its top two
// from qh[32h + j] >> 2s; one int8 scale per 16 weights, times the block's d.
inline void Q6_KBlock(const uint8_t* b, float* w) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = Half(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s) {
      const float scale_lo = d * static_cast<float>(scales[8 * h + 2 * s]);
      const float scale_hi = d * static_cast<float>(scales[8 * h + 2 * s + 1]);
      for (int j = 0; j < 32; ++j) {
        const int low = (ql[64 * h + 32 * (s % 2) + j] >> (4 * (s / 2))) & 0xF;
        const int high = (qh[32 * h + j] >> (2 * s)) & 3;
        const float q = static_cast<float>((low | (high << 4)) - 32);
        w[128 * h + 32 * s + j] = (j < 16 ? scale_lo : scale_hi) * q;
      }
    }
}

}  // namespace scalar

#if defined(__AVX512F__)
// The same blocks 32 weights (a slice) at a time, as two vectors of 16: bytes widened to
// int32 lanes, the codes cut out with shifts and masks, and their weights computed with
// gguf-py's float32 expressions. GCC did not vectorise the scalar forms above (a Q4_1 row
// cost 1.6 cycles a weight on two cores, against 0.2 for the whole float32 matmul).
//
// Each type is a struct: `Header(block)`, what its slices share (a value table, scales),
// and `Get(block, header, s)`, slice s of `kSlices`. The loops below keep their sums in
// local arrays: sums kept in a struct that the block functions wrote through (an earlier
// form) were spilled to the stack in the library GCC built, one sum reloaded and stored
// every block, and the kernel ran at half the speed of the same code built in a test
// harness.
namespace avx512 {

struct Pair {
  __m512 lo, hi;  // weights [0, 16) and [16, 32) of a slice
};

inline __m512i Bytes(const uint8_t* p) {  // 16 unsigned bytes as int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i Low(__m512i b) { return _mm512_and_si512(b, _mm512_set1_epi32(0xF)); }
inline __m512i High(__m512i b) { return _mm512_srli_epi32(b, 4); }
inline __m512 Float(__m512i v) { return _mm512_cvtepi32_ps(v); }

// The four- and five-bit types take a slice's weights from a table of its 16 (32) possible
// values, computed once per block with gguf-py's expression, so each is the same float:
// vpermps picks a lane by the low four bits of its index (the bits above are ignored, so a
// byte's low nibble needs no mask) and replaces a conversion, a multiply and an add per
// 16 weights. Q8_0's 256 levels and Q6_K's 64 per 16 weights are cheaper to convert.
inline __m512 Iota(float from) {
  return _mm512_add_ps(_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                       _mm512_set1_ps(from));
}
inline __m512 Pick(__m512 table, __m512i index) { return _mm512_permutexvar_ps(index, table); }

struct Q4_0 {
  static constexpr int kWeights = 32, kBytes = 18, kSlices = 1;
  using Head = __m512;  // d · (q − 8) for q < 16
  static Head Header(const uint8_t* b) { return _mm512_mul_ps(_mm512_set1_ps(Half(b)), Iota(-8)); }
  static Pair Get(const uint8_t* b, Head table, int) {
    const __m512i q = Bytes(b + 2);
    return {Pick(table, q), Pick(table, High(q))};
  }
};

struct Q4_1 {
  static constexpr int kWeights = 32, kBytes = 20, kSlices = 1;
  using Head = __m512;  // (d · q) + m for q < 16
  static Head Header(const uint8_t* b) {
    return _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(Half(b)), Iota(0)),
                         _mm512_set1_ps(Half(b + 2)));
  }
  static Pair Get(const uint8_t* b, Head table, int) {
    const __m512i q = Bytes(b + 4);
    return {Pick(table, q), Pick(table, High(q))};
  }
};

struct Q5_0 {
  static constexpr int kWeights = 32, kBytes = 22, kSlices = 1;
  struct Head {
    __m512 below, above;  // d · (q − 16) for q < 16, and for 16 ≤ q < 32
  };
  static Head Header(const uint8_t* b) {
    const __m512 d = _mm512_set1_ps(Half(b));
    return {_mm512_mul_ps(d, Iota(-16)), _mm512_mul_ps(d, Iota(0))};
  }
  static Pair Get(const uint8_t* b, const Head& t, int) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m512i q = Bytes(b + 6), sixteen = _mm512_set1_epi32(16);
    // the fifth bit selects the upper table (index bit 4 of vpermt2ps)
    const __m512i lo = _mm512_mask_or_epi32(Low(q), static_cast<__mmask16>(qh), Low(q), sixteen);
    const __m512i hi =
        _mm512_mask_or_epi32(High(q), static_cast<__mmask16>(qh >> 16), High(q), sixteen);
    return {_mm512_permutex2var_ps(t.below, lo, t.above),
            _mm512_permutex2var_ps(t.below, hi, t.above)};
  }
};

struct Q8_0 {
  static constexpr int kWeights = 32, kBytes = 34, kSlices = 1;
  using Head = __m512;  // d
  static Head Header(const uint8_t* b) { return _mm512_set1_ps(Half(b)); }
  static Pair Get(const uint8_t* b, Head d, int) {
    auto half = [&](int h) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * h));
      return _mm512_mul_ps(Float(_mm512_cvtepi8_epi32(q)), d);
    };
    return {half(0), half(1)};
  }
};

// Q4_K: slice k has a 6-bit scale and minimum (gguf-py's `Q4_K.get_scale_min`) and reads
// the low nibbles of qs[32(k/2), +32) when k is even, the high ones when odd. The header
// unpacks all 8 scales and minima at once, in 16 lanes, to d·sc and dmin·m in memory, so a
// slice broadcasts them with a load: unpacked per slice in scalar code, with an int-to-
// float conversion and a broadcast from a register each, Q4_K streamed at 8.6 G weights/s
// a core at T = 1, against Q4_0's 13.
struct Q4_K {
  static constexpr int kWeights = 256, kBytes = 144, kSlices = 8;
  struct Head {
    alignas(64) float scale[16];  // d · sc for slices 0-7, then dmin · m for slices 0-7
  };
  static Head Header(const uint8_t* b) {
    // the 12 scale bytes s (and 4 of qs after them, never used); lane k < 8 is slice k's
    // scale, lane 8 + k its minimum: for k < 4, sc = s[k] & 63 and m = s[k + 4] & 63; for
    // k >= 4, sc = (s[k + 4] & 15) | (s[k - 4] >> 6) << 4, m = s[k + 4] >> 4 | (s[k] >> 6) << 4
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i low_at = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m128i high_at = _mm_setr_epi8(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
    const __m512i low = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(s, low_at));
    const __m512i high = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(s, high_at));
    const __m512i low_shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i low_mask =
        _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    const __m512i high_mask =  // bits 6-7 of the high byte, as bits 4-5: (byte >> 2) & 0x30
        _mm512_setr_epi32(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48);
    const __m512i codes =
        _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(low, low_shift), low_mask),
                        _mm512_and_si512(_mm512_srli_epi32(high, 2), high_mask));
    const __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(Half(b)),
                                          _mm512_set1_ps(Half(b + 2)));
    Head head;
    _mm512_store_ps(head.scale, _mm512_mul_ps(d, Float(codes)));
    // Opaque to the compiler from here: a slice then broadcasts its two values from
    // memory (a load, folded into the multiply and subtract that build its table), where
    // GCC, knowing them in a register, would broadcast each by a lane permute on the
    // shuffle port the unpacking needs.
    __asm__("" : "+m"(head));
    return head;
  }
  static Pair Get(const uint8_t* b, const Head& h, int k) {
    const __m512 table =  // (d·sc) · q − (dmin·m)
        _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(h.scale[k]), Iota(0)),
                      _mm512_set1_ps(h.scale[8 + k]));
    const uint8_t* qs = b + 16 + 32 * (k / 2);
    const __m512i q0 = Bytes(qs), q1 = Bytes(qs + 16);
    return k % 2 ? Pair{Pick(table, High(q0)), Pick(table, High(q1))}
                 : Pair{Pick(table, q0), Pick(table, q1)};
  }
};

// Q6_K: weight 128h + 32s + j (h < 2, s < 4, j < 32) takes its low four bits from
// ql[64h + 32(s % 2) + j] (the high nibble when s ≥ 2) and its top two from
// qh[32h + j] >> 2s; one int8 scale per 16 weights, times d. The header assembles all 256
// six-bit codes with byte-wide operations, 64 at a time, so a slice only widens 16 bytes
// per vector: rebuilt for every slice from ql and qh, Q6_K ran at 6 G weights/s a core,
// under half of Q4_1's rate.
struct Q6_K {
  static constexpr int kWeights = 256, kBytes = 210, kSlices = 8;
  struct Head {
    alignas(64) uint8_t q[256];  // codes 0..63, in weight order
    alignas(64) float scale[16];  // d · scales[i], for weights [16i, 16i + 16)
  };
  static Head Header(const uint8_t* b) {
    Head head;
    const __m512i nibble = _mm512_set1_epi8(0xF), two_bits = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      for (int t = 0; t < 2; ++t) {  // weights 128h + 64t + [0, 64): s = 2t and 2t + 1
        const __m512i low = _mm512_and_si512(_mm512_srli_epi16(ql, 4 * t), nibble);
        // 16-bit lanes shifted by 2s (s = 2t for the first 32 bytes, 2t + 1 after): a
        // byte's two low bits are its own, whatever its neighbour shifts in above them
        const __m512i shift = _mm512_mask_blend_epi16(0xFFFF0000, _mm512_set1_epi16(4 * t),
                                                      _mm512_set1_epi16(4 * t + 2));
        const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), two_bits);
        _mm512_store_si512(head.q + 128 * h + 64 * t,
                           _mm512_or_si512(low, _mm512_slli_epi16(high, 4)));
      }
    }
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    _mm512_store_ps(head.scale, _mm512_mul_ps(_mm512_set1_ps(Half(b + 208)),
                                              Float(_mm512_cvtepi8_epi32(scales))));
    __asm__("" : "+m"(head));  // read back from memory: see Q4_K's header
    return head;
  }
  static Pair Get(const uint8_t*, const Head& head, int k) {
    auto half = [&](int j) {  // weights [16j, 16j + 16) of slice k
      const __m512i q = _mm512_sub_epi32(Bytes(head.q + 32 * k + 16 * j), _mm512_set1_epi32(32));
      return _mm512_mul_ps(_mm512_set1_ps(head.scale[2 * k + j]), Float(q));
    };
    return {half(0), half(1)};
  }
};

// R rows of x (stride I) times one weight row of type T, the weights met in registers:
// weights [16g, 16g + 16) go to sum g % 2 of each row whatever R is, so a row's result
// does not depend on the rows beside it.
template <typename T, int R>
void DotRows(const uint8_t* row, const float* x, int64_t I, float* y, int64_t stride) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; i += T::kWeights, row += T::kBytes) {
    specjax::PrefetchAhead(row);
    const auto head = T::Header(row);
#pragma GCC unroll 8
    for (int s = 0; s < T::kSlices; ++s) {  // unrolled: a Q4_K slice pair widens its bytes once
      const Pair w = T::Get(row, head, s);
      const float* xs = x + i + 32 * s;
#pragma GCC unroll 9
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + r * I), w.lo, lo[r]);
        hi[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + r * I + 16), w.hi, hi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * stride] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
}

// Two weight rows at a time against R rows of x: each x vector loaded serves both, so a
// verification's loads per multiply halve. Row a's sums see the same products in the same
// order as DotRows would give it (bit for bit: the pairing changes no row's result).
template <typename T, int R>
void DotRowPair(const uint8_t* a, const uint8_t* b, const float* x, int64_t I, float* y,
                int64_t stride) {
  __m512 alo[R], ahi[R], blo[R], bhi[R];
  for (int r = 0; r < R; ++r) alo[r] = ahi[r] = blo[r] = bhi[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; i += T::kWeights, a += T::kBytes, b += T::kBytes) {
    specjax::PrefetchAhead(a);
    specjax::PrefetchAhead(b);
    const auto ha = T::Header(a);
    const auto hb = T::Header(b);
#pragma GCC unroll 8
    for (int s = 0; s < T::kSlices; ++s) {
      const Pair wa = T::Get(a, ha, s), wb = T::Get(b, hb, s);
      const float* xs = x + i + 32 * s;
#pragma GCC unroll 9
      for (int r = 0; r < R; ++r) {
        const __m512 lo = _mm512_loadu_ps(xs + r * I), hi = _mm512_loadu_ps(xs + r * I + 16);
        alo[r] = _mm512_fmadd_ps(lo, wa.lo, alo[r]);
        ahi[r] = _mm512_fmadd_ps(hi, wa.hi, ahi[r]);
        blo[r] = _mm512_fmadd_ps(lo, wb.lo, blo[r]);
        bhi[r] = _mm512_fmadd_ps(hi, wb.hi, bhi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r * stride] = _mm512_reduce_add_ps(_mm512_add_ps(alo[r], ahi[r]));
    y[r * stride + 1] = _mm512_reduce_add_ps(_mm512_add_ps(blo[r], bhi[r]));
  }
}

// Rows of x per pass over a weight row: 18 sums in registers, so a verification of γ ≤ 8
// drafts unpacks each weight once (with 8, γ = 8 took a second pass for its ninth row).
// A pair of weight rows holds 4R sums: pairs take tiles of up to kPairTile rows.
constexpr int64_t kTile = 9;
constexpr int64_t kPairTile = 5;

template <typename T, int R>
void Tile(const uint8_t* row, int64_t row_bytes, bool pair, const float* x, int64_t I,
          float* y, int64_t O) {
  if constexpr (R <= kPairTile) {
    if (pair) return DotRowPair<T, R>(row, row + row_bytes, x, I, y, O);
  }
  DotRows<T, R>(row, x, I, y, O);
  if (pair) DotRows<T, R>(row + row_bytes, x, I, y + 1, O);
}

// y[m·O + j] = x[m] · (weight row j) for m < M and j < 1 + pair.
template <typename T>
void MatmulRowsOf(const uint8_t* row, int64_t row_bytes, bool pair, const float* x, int64_t M,
                  int64_t I, float* y, int64_t O) {
  for (int64_t m = 0; m < M;) {
    const float* xm = x + m * I;
    float* ym = y + m * O;
    const int64_t n = std::min(kTile, M - m);  // past kPairTile, a pair runs row by row
    switch (n) {
      case 1: Tile<T, 1>(row, row_bytes, pair, xm, I, ym, O); break;
      case 2: Tile<T, 2>(row, row_bytes, pair, xm, I, ym, O); break;
      case 3: Tile<T, 3>(row, row_bytes, pair, xm, I, ym, O); break;
      case 4: Tile<T, 4>(row, row_bytes, pair, xm, I, ym, O); break;
      case 5: Tile<T, 5>(row, row_bytes, pair, xm, I, ym, O); break;
      case 6: Tile<T, 6>(row, row_bytes, pair, xm, I, ym, O); break;
      case 7: Tile<T, 7>(row, row_bytes, pair, xm, I, ym, O); break;
      case 8: Tile<T, 8>(row, row_bytes, pair, xm, I, ym, O); break;
      default: Tile<T, 9>(row, row_bytes, pair, xm, I, ym, O); break;
    }
    m += n;
  }
}

template <typename T>
void DequantRowOf(const uint8_t* row, int64_t I, float* w) {
  for (int64_t i = 0; i < I; i += T::kWeights, row += T::kBytes) {
    const auto head = T::Header(row);
    for (int s = 0; s < T::kSlices; ++s, w += 32) {
      const Pair p = T::Get(row, head, s);
      _mm512_storeu_ps(w, p.lo);
      _mm512_storeu_ps(w + 16, p.hi);
    }
  }
}

// Calls `f(T{})` with the struct of ggml type `kind`.
template <typename F>
void WithType(int64_t kind, F&& f) {
  switch (kind) {
    case kQ4_0: f(Q4_0{}); break;
    case kQ4_1: f(Q4_1{}); break;
    case kQ5_0: f(Q5_0{}); break;
    case kQ8_0: f(Q8_0{}); break;
    case kQ4_K: f(Q4_K{}); break;
    case kQ6_K: f(Q6_K{}); break;
  }
}

void DequantRow(int64_t kind, const uint8_t* row, int64_t I, float* w) {
  WithType(kind, [&](auto t) { DequantRowOf<decltype(t)>(row, I, w); });
}

// y[m·O + j] = x[m] · (weight row j) for m < M, j < 1 + pair; `scratch` is unused here.
void MatmulRows(int64_t kind, const uint8_t* row, int64_t row_bytes, bool pair, const float* x,
                int64_t M, int64_t I, float* y, int64_t O, float* /*scratch*/) {
  WithType(kind, [&](auto t) { MatmulRowsOf<decltype(t)>(row, row_bytes, pair, x, M, I, y, O); });
}

}  // namespace avx512
using avx512::DequantRow, avx512::MatmulRows;

#else  // no AVX-512: the scalar blocks into a buffer, then one dot per row of x

// A row of I weights (I / f.weights blocks) -> w[I].
void DequantRow(int64_t kind, const uint8_t* row, int64_t I, float* w) {
  const Format f = FormatOf(kind);
  for (int64_t i = 0; i < I; i += f.weights, row += f.bytes, w += f.weights) {
    specjax::PrefetchAhead(row);
    switch (kind) {
      case kQ4_0: scalar::Q4_0Block(row, w); break;
      case kQ4_1: scalar::Q4_1Block(row, w); break;
      case kQ5_0: scalar::Q5_0Block(row, w); break;
      case kQ8_0: scalar::Q8_0Block(row, w); break;
      case kQ4_K: scalar::Q4_KBlock(row, w); break;
      case kQ6_K: scalar::Q6_KBlock(row, w); break;
    }
  }
}

// x[0..I) · w[0..I), I a multiple of 32, in one fixed order: four vector sums.
#if SPECJAX_QUANT_SIMD
inline float Dot(const float* x, const float* w, int64_t I) {
  using specjax::Simd;
  constexpr int kLanes = Simd::kLanes;
  Simd::F acc[4] = {Simd::Zero(), Simd::Zero(), Simd::Zero(), Simd::Zero()};
  int64_t i = 0;
  for (; i + 4 * kLanes <= I; i += 4 * kLanes)
    for (int k = 0; k < 4; ++k)
      acc[k] = Simd::Fma(Simd::Floats(x + i + k * kLanes), Simd::Floats(w + i + k * kLanes),
                         acc[k]);
  for (int k = 0; i < I; i += kLanes, ++k)
    acc[k] = Simd::Fma(Simd::Floats(x + i), Simd::Floats(w + i), acc[k]);
  return Simd::Sum(Simd::Add(Simd::Add(acc[0], acc[1]), Simd::Add(acc[2], acc[3])));
}
#else
inline float Dot(const float* x, const float* w, int64_t I) {
  float acc[32] = {};
  for (int64_t i = 0; i < I; i += 32)
    for (int j = 0; j < 32; ++j) acc[j] += x[i + j] * w[i + j];
  float sum = 0;
  for (int j = 0; j < 32; ++j) sum += acc[j];
  return sum;
}
#endif

void MatmulRows(int64_t kind, const uint8_t* row, int64_t row_bytes, bool pair, const float* x,
                int64_t M, int64_t I, float* y, int64_t O, float* scratch) {
  for (int64_t j = 0; j <= pair; ++j, row += row_bytes, ++y) {
    DequantRow(kind, row, I, scratch);
    for (int64_t m = 0; m < M; ++m) y[m * O] = Dot(x + m * I, scratch, I);
  }
}
#endif

// I, the weights of a row of `row_bytes`, or 0 for a type or a length this kernel cannot read.
int64_t Inputs(int64_t kind, int64_t row_bytes) {
  const Format f = FormatOf(kind);
  return f.bytes == 0 || row_bytes % f.bytes ? 0 : row_bytes / f.bytes * f.weights;
}

const char kBadBlocks[] =
    "gguf_matmul: blocks must be rows of whole blocks of a supported ggml type (Q4_0, Q4_1, "
    "Q5_0, Q8_0, Q4_K, Q6_K)";

// Each output row of `w` dequantised, then either dotted with the M rows of x (y[M, O]) or
// copied out (x null: y[O, I]), row chunks shared over the pool.
void Run(ffi::ThreadPool& pool, int64_t kind, const Blocks& w, const float* x, float* y,
         int64_t M, int64_t I) {
  const int64_t O = w.dimensions()[0], row_bytes = w.dimensions()[1];
  const uint8_t* blocks = w.typed_data();
  specjax::ParallelRows(pool, O, O * row_bytes, kMinRows, [=](int64_t begin, int64_t end) {
    if (x == nullptr) {
      for (int64_t o = begin; o < end; ++o)
        DequantRow(kind, blocks + o * row_bytes, I, y + o * I);
      return;
    }
    std::vector<float> scratch(I);
    for (int64_t o = begin; o < end; o += 2)
      MatmulRows(kind, blocks + o * row_bytes, row_bytes, o + 1 < end, x, M, I, y + o, O,
                 scratch.data());
  });
}

ffi::Error GgufMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Blocks w,
                          ffi::ResultBuffer<ffi::F32> y, int64_t kind) {
  const int64_t I = Inputs(kind, w.dimensions()[1]);
  if (I == 0) return ffi::Error::InvalidArgument(kBadBlocks);
  auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != I)
    return ffi::Error::InvalidArgument("gguf_matmul: x[..., I] and blocks of I weights a row");
  Run(pool, kind, w, x.typed_data(), y->typed_data(), x.element_count() / I, I);
  return ffi::Error::Success();
}

ffi::Error GgufDequantizeImpl(ffi::ThreadPool pool, Blocks w, ffi::ResultBuffer<ffi::F32> y,
                              int64_t kind) {
  const int64_t I = Inputs(kind, w.dimensions()[1]);
  if (I == 0) return ffi::Error::InvalidArgument(kBadBlocks);
  Run(pool, kind, w, nullptr, y->typed_data(), 0, I);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgufMatmul, GgufMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Blocks>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgufDequantize, GgufDequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Blocks>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kind"));
