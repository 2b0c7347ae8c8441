// Float vectors of the widest ISA the build targets, through GCC's vector extensions, and
// exp in them, for the kernels that compute a softmax's exponentials (`f32_attention.cc`,
// `f32_argmax.cc`, `quant_attention.cc`): libm's expf is scalar, and GCC vectorises it
// only under -ffast-math, which the build avoids (see COMPILE_FLAGS in __init__.py).
#ifndef SPECJAX_CPU_KERNELS_FLOAT_VECTORS_H_
#define SPECJAX_CPU_KERNELS_FLOAT_VECTORS_H_

#include <cstdint>

namespace specjax {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
constexpr int kLanes = kVecBytes / 4;  // floats per vector

typedef float Vec __attribute__((vector_size(kVecBytes)));
typedef int32_t IVec __attribute__((vector_size(kVecBytes)));
typedef float VecU __attribute__((vector_size(kVecBytes), aligned(4)));  // unaligned access
inline Vec Load(const float* p) { return *reinterpret_cast<const VecU*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }
inline Vec Splat(float x) { return Vec{} + x; }

// exp(x) for x ≤ 0, lane by lane: 2^n · e^r with n = round(x / ln 2) and |r| ≤ ln 2 / 2, e^r
// by the polynomial of Cephes' expf; 0 below −87, where e^x leaves float's normal range
// (−inf included). Against double-precision exp: within 1.4 ulp over [−20, 0], 4.5 near
// −87 (every float above −1, every 16th below). A NaN lane gives an unspecified value:
// callers test for NaN themselves.
inline Vec ExpNonPositive(Vec x) {
  const IVec under = x < Splat(-87.0f);
  x = under ? Splat(0.0f) : x;
  const Vec z = x * Splat(1.44269504088896341f) + Splat(0.5f);
  IVec n = __builtin_convertvector(z, IVec);            // truncates toward zero
  n -= (__builtin_convertvector(n, Vec) > z) ? 1 : 0;  // floor (the mask is -1 or 0)
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * Splat(0.693359375f) - nf * Splat(-2.12194440e-4f);
  Vec p = Splat(1.9875691500e-4f);
  p = p * r + Splat(1.3981999507e-3f);
  p = p * r + Splat(8.3334519073e-3f);
  p = p * r + Splat(4.1665795894e-2f);
  p = p * r + Splat(1.6666665459e-1f);
  p = p * r + Splat(5.0000001201e-1f);
  const Vec e = p * r * r + r + Splat(1.0f);
  const Vec scale = reinterpret_cast<Vec>((n + 127) << 23);  // 2^n
  return under ? Splat(0.0f) : e * scale;
}

}  // namespace specjax

#endif  // SPECJAX_CPU_KERNELS_FLOAT_VECTORS_H_
