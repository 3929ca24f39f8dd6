// What the quantized GEMM's files (quant.cpp, quant_tiles.cpp, quant_int8.cpp,
// quant_int8_tiles.cpp) share about GGUF blocks:
//   with_type   the one switch from a runtime ggml type id to a kernel's template argument;
//   decode32    (where __AVX512BF16__, __AVX512BW__, __AVX512VL__) 32 weights of a block (a
//               Q*_0/Q*_1 block, or one 32-weight sub-block s of a K-quant block) to float32
//               with the same arithmetic, operation for operation, as decode32_scalar
//               (quant_scalar.h), then rounded to bf16. Build with -ffp-contract=off;
//   decode_u    (where __AVX512BW__, __AVX512VL__) the int8 kernels' form of the same 32
//               weights: unsigned quants u and per half of 16 w = a u - bias.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "quant_scalar.h"

namespace {

// f(std::integral_constant<int, T>{}) for the kernel type T == type and true; false (f
// not called) for any other type.
template <class F>
inline bool with_type(int type, F&& f) {
  switch (type) {
    case Q4_0: f(std::integral_constant<int, Q4_0>{}); return true;
    case Q4_1: f(std::integral_constant<int, Q4_1>{}); return true;
    case Q5_0: f(std::integral_constant<int, Q5_0>{}); return true;
    case Q5_1: f(std::integral_constant<int, Q5_1>{}); return true;
    case Q8_0: f(std::integral_constant<int, Q8_0>{}); return true;
    case Q4_K: f(std::integral_constant<int, Q4_K>{}); return true;
    case Q5_K: f(std::integral_constant<int, Q5_K>{}); return true;
    case Q6_K: f(std::integral_constant<int, Q6_K>{}); return true;
    default: return false;
  }
}

#if defined(__F16C__)
inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 packed nibble bytes -> 32 bytes: low nibbles first, then high nibbles (k order).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), f = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
}
inline __m256i load_u32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Piece s (32 weights) of block b: the unsigned quants u in k order, and per half of 16
// a[h], bias[h] with w = a u - bias, u in [0, 255]:
//     Q4_0 u = q, a = d, bias = 8d     Q4_1 u = q, a = d, bias = -m    Q8_0 u = q + 128, a = d, bias = 128d
//     Q5_0 u = q, a = d, bias = 16d    Q5_1 u = q, a = d, bias = -m
//     Q4_K / Q5_K  a = d sc, bias = dmin mn    Q6_K  a_h = d sc_h, bias_h = 32 a_h (per 16)
template <int type>
inline __m256i decode_u(const uint8_t* b, int s, float* a, float* bias) {
  const __m256i f = _mm256_set1_epi8(0xF);
  __m256i u;
  float A = 0.0f, B = 0.0f;
  if constexpr (type == Q4_0 || type == Q4_1) {
    u = nibbles32(b + (type == Q4_1 ? 4 : 2));
    A = half_f16c(b);
    B = type == Q4_1 ? -half_f16c(b + 2) : 8.0f * A;
  } else if constexpr (type == Q5_0 || type == Q5_1) {
    constexpr bool one = type == Q5_1;
    uint32_t qh;
    std::memcpy(&qh, b + (one ? 4 : 2), 4);
    u = nibbles32(b + (one ? 8 : 6));
    u = _mm256_mask_blend_epi8(__mmask32(qh), u, _mm256_or_si256(u, _mm256_set1_epi8(16)));
    A = half_f16c(b);
    B = one ? -half_f16c(b + 2) : 16.0f * A;
  } else if constexpr (type == Q8_0) {
    u = _mm256_xor_si256(load_u32(b + 2), _mm256_set1_epi8(char(0x80)));
    A = half_f16c(b);
    B = 128.0f * A;
  } else if constexpr (type == Q4_K || type == Q5_K) {
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    constexpr bool five = type == Q5_K;
    const __m256i qs = load_u32(b + (five ? 48 : 16) + 32 * (s / 2));
    u = (s & 1) ? _mm256_and_si256(_mm256_srli_epi16(qs, 4), f) : _mm256_and_si256(qs, f);
    if constexpr (five) {
      const __mmask32 hi = _mm256_test_epi8_mask(load_u32(b + 16), _mm256_set1_epi8(char(1 << s)));
      u = _mm256_mask_blend_epi8(hi, u, _mm256_or_si256(u, _mm256_set1_epi8(16)));
    }
    A = half_f16c(b) * float(sc);
    B = half_f16c(b + 2) * float(mn);
  } else {  // Q6_K: a scale per 16 weights, offset 32
    const float d = half_f16c(b + 208);
    const int half = s / 4, t = s % 4;
    const __m256i ql = load_u32(b + 64 * half + (t & 1) * 32);
    const __m256i qh = load_u32(b + 128 + 32 * half);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * half);
    const __m256i lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(ql, 4) : ql, f);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3));
    u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    for (int h = 0; h < 2; ++h) {
      a[h] = d * float(sc[2 * t + h]);
      bias[h] = 32.0f * a[h];
    }
    return u;
  }
  a[0] = a[1] = A;
  bias[0] = bias[1] = B;
  return u;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 bcast_half(const uint8_t* p) { return _mm512_set1_ps(half_f16c(p)); }
inline __m512 cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The 32 weights of piece s of block b as float32: lo = weights 0..15, hi = 16..31. The
// same arithmetic, operation for operation, as decode32_scalar.
template <int type>
inline void decode32(const uint8_t* b, int s, __m512& lo, __m512& hi) {
  const __m512i f = _mm512_set1_epi32(0xF);
  switch (type) {
    case Q4_0: {
      const __m512 d = bcast_half(b), eight = _mm512_set1_ps(8.0f);
      const __m512i v = bytes16(b + 2);
      lo = _mm512_mul_ps(_mm512_sub_ps(cvt(_mm512_and_si512(v, f)), eight), d);
      hi = _mm512_mul_ps(_mm512_sub_ps(cvt(_mm512_srli_epi32(v, 4)), eight), d);
      return;
    }
    case Q4_1: {
      const __m512 d = bcast_half(b), m = bcast_half(b + 2);
      const __m512i v = bytes16(b + 4);
      lo = _mm512_add_ps(_mm512_mul_ps(cvt(_mm512_and_si512(v, f)), d), m);
      hi = _mm512_add_ps(_mm512_mul_ps(cvt(_mm512_srli_epi32(v, 4)), d), m);
      return;
    }
    case Q5_0:
    case Q5_1: {
      const bool one = type == Q5_1;
      const __m512 d = bcast_half(b);
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const __m512i v = bytes16(b + (one ? 8 : 6)), sixteen = _mm512_set1_epi32(16);
      __m512i a = _mm512_and_si512(v, f), c = _mm512_srli_epi32(v, 4);
      a = _mm512_mask_or_epi32(a, __mmask16(qh & 0xFFFF), a, sixteen);
      c = _mm512_mask_or_epi32(c, __mmask16(qh >> 16), c, sixteen);
      if (one) {
        const __m512 m = bcast_half(b + 2);
        lo = _mm512_add_ps(_mm512_mul_ps(cvt(a), d), m);
        hi = _mm512_add_ps(_mm512_mul_ps(cvt(c), d), m);
      } else {
        lo = _mm512_mul_ps(cvt(_mm512_sub_epi32(a, sixteen)), d);
        hi = _mm512_mul_ps(cvt(_mm512_sub_epi32(c, sixteen)), d);
      }
      return;
    }
    case Q8_0: {
      const __m512 d = bcast_half(b);
      lo = _mm512_mul_ps(cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), d);
      hi = _mm512_mul_ps(cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), d);
      return;
    }
    case Q4_K:
    case Q5_K: {
      int sc, mn;
      scale_min_k4(s, b + 4, &sc, &mn);
      const __m512 d1 = _mm512_set1_ps(half_f16c(b) * float(sc));
      const __m512 m1 = _mm512_set1_ps(half_f16c(b + 2) * float(mn));
      const bool five = type == Q5_K;
      const uint8_t* qs = b + (five ? 48 : 16) + 32 * (s / 2);
      __m512i a = bytes16(qs), c = bytes16(qs + 16);
      if (s & 1) {
        a = _mm512_srli_epi32(a, 4);
        c = _mm512_srli_epi32(c, 4);
      } else {
        a = _mm512_and_si512(a, f);
        c = _mm512_and_si512(c, f);
      }
      if (five) {
        const __m512i one = _mm512_set1_epi32(1);
        const __m512i ha = _mm512_and_si512(_mm512_srli_epi32(bytes16(b + 16), s), one);
        const __m512i hc = _mm512_and_si512(_mm512_srli_epi32(bytes16(b + 32), s), one);
        a = _mm512_or_si512(a, _mm512_slli_epi32(ha, 4));
        c = _mm512_or_si512(c, _mm512_slli_epi32(hc, 4));
      }
      lo = _mm512_sub_ps(_mm512_mul_ps(d1, cvt(a)), m1);
      hi = _mm512_sub_ps(_mm512_mul_ps(d1, cvt(c)), m1);
      return;
    }
    case Q6_K: {
      const float d = half_f16c(b + 208);
      const int half = s / 4, t = s % 4;
      const uint8_t* ql = b + 64 * half + (t & 1) * 32;
      const uint8_t* qh = b + 128 + 32 * half;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * half);
      const int lshift = t >= 2 ? 4 : 0, hshift = 2 * t;
      const __m512i three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
      __m512i a = _mm512_and_si512(_mm512_srli_epi32(bytes16(ql), lshift), f);
      __m512i c = _mm512_and_si512(_mm512_srli_epi32(bytes16(ql + 16), lshift), f);
      a = _mm512_or_si512(a, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bytes16(qh), hshift), three), 4));
      c = _mm512_or_si512(c, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bytes16(qh + 16), hshift), three), 4));
      lo = _mm512_mul_ps(_mm512_set1_ps(d * float(sc[2 * t])), cvt(_mm512_sub_epi32(a, bias)));
      hi = _mm512_mul_ps(_mm512_set1_ps(d * float(sc[2 * t + 1])), cvt(_mm512_sub_epi32(c, bias)));
      return;
    }
    default: return;
  }
}

template <int type>
inline __m512bh decode32_bf16(const uint8_t* b, int s) {
  __m512 lo, hi;
  decode32<type>(b, s, lo, hi);
  return _mm512_cvtne2ps_pbh(hi, lo);  // element j < 16 from lo, 16 + j from hi
}
#endif

}  // namespace
