// The vector operations of the quantised-weight matmuls: float vectors of the widest ISA
// the build targets and the widening of int8 codes to floats in registers
// (`int8_matmul.cc`), and the prefetch along a stream of weight rows (`int4_matmul.cc`
// too, whose integer dot products take AVX2's own intrinsics). SPECJAX_QUANT_SIMD is 1
// where `Simd` exists (AVX-512, or AVX2 with FMA); elsewhere the kernel takes its plain
// C++ loop.
#ifndef SPECJAX_CPU_KERNELS_SIMD_H_
#define SPECJAX_CPU_KERNELS_SIMD_H_

#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace specjax {

constexpr int kPrefetchAhead = 4096;  // bytes ahead along the stream of weight rows
constexpr int kPrefetchL2 = 2;        // prefetcht1, as in f32_matmul.cc

// Prefetch the line `kPrefetchAhead` bytes past p. Near the end of the matrix that is past
// the buffer: a prefetch never faults, and the address is formed as an integer, so no
// out-of-bounds pointer is.
inline void PrefetchAhead(const void* p) {
  __builtin_prefetch(
      reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + kPrefetchAhead), 0,
      kPrefetchL2);
}

#if defined(__AVX512F__)
#define SPECJAX_QUANT_SIMD 1
struct Simd {
  static constexpr int kLanes = 16;  // float32 lanes of one 512-bit vector
  using F = __m512;
  static F Zero() { return _mm512_setzero_ps(); }
  static F Floats(const float* p) { return _mm512_loadu_ps(p); }
  // 16 int8 weights as floats, one vpmovsxbd: GCC's vectoriser widens int8 through int16
  // (two shuffles and an extract on the one shuffle port), which bound the int8 loop
  // before memory did.
  static F Int8s(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a·b + c
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static float Sum(F v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECJAX_QUANT_SIMD 1
// The same at 8 lanes. For int8 the vectoriser's path widened through int16, at about
// twice the cost of one vpmovsxbd per 8 weights (docs/decisions/cpu.md, C2).
struct Simd {
  static constexpr int kLanes = 8;  // float32 lanes of one 256-bit vector
  using F = __m256;
  static F Zero() { return _mm256_setzero_ps(); }
  static F Floats(const float* p) { return _mm256_loadu_ps(p); }
  static F Int8s(const int8_t* p) {  // 8 int8 weights as floats
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a·b + c
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static float Sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

}  // namespace specjax

#endif  // SPECJAX_CPU_KERNELS_SIMD_H_
