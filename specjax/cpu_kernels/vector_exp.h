// exp in vector registers for the kernels that need a softmax's exponentials
// (`f32_attention.cc`, `f32_argmax.cc`): libm's expf is scalar, and GCC vectorises it only
// under -ffast-math, which the build avoids (see COMPILE_FLAGS in __init__.py).
#ifndef SPECJAX_CPU_KERNELS_VECTOR_EXP_H_
#define SPECJAX_CPU_KERNELS_VECTOR_EXP_H_

namespace specjax {

// exp(x) for x ≤ 0, lane by lane: 2^n · e^r with n = round(x / ln 2) and |r| ≤ ln 2 / 2, e^r
// by the polynomial of Cephes' expf; 0 below −87, where e^x leaves float's normal range
// (−inf included). Against double-precision exp: within 1.4 ulp over [−20, 0], 4.5 near
// −87 (every float above −1, every 16th below). `Vec` and `IVec` are GCC vector types of
// float and int32 with the same lanes. A NaN lane gives an unspecified value: callers
// test for NaN themselves.
template <typename Vec, typename IVec>
inline Vec ExpNonPositive(Vec x) {
  const auto splat = [](float c) { return Vec{} + c; };
  const IVec under = x < splat(-87.0f);
  x = under ? splat(0.0f) : x;
  const Vec z = x * splat(1.44269504088896341f) + splat(0.5f);
  IVec n = __builtin_convertvector(z, IVec);            // truncates toward zero
  n -= (__builtin_convertvector(n, Vec) > z) ? 1 : 0;  // floor (the mask is -1 or 0)
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  Vec p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const Vec e = p * r * r + r + splat(1.0f);
  const Vec scale = reinterpret_cast<Vec>((n + 127) << 23);  // 2^n
  return under ? splat(0.0f) : e * scale;
}

}  // namespace specjax

#endif  // SPECJAX_CPU_KERNELS_VECTOR_EXP_H_
