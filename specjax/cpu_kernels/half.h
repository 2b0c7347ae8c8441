// IEEE half -> float, exactly (every half is a float): the scales of GGUF blocks
// (`gguf_matmul.cc`, `q4_0_int8_matmul.cc`). F16C converts in one instruction; without it
// (the plain build) the bits are rebuilt by hand, subnormal halves included.
#ifndef SPECJAX_CPU_KERNELS_HALF_H_
#define SPECJAX_CPU_KERNELS_HALF_H_

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace specjax {

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normal as a float
    int shift = 0;
    uint32_t m = man;
    while (!(m & 0x400)) m <<= 1, ++shift;
    bits = sign | ((113 - shift) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

}  // namespace specjax

#endif  // SPECJAX_CPU_KERNELS_HALF_H_
