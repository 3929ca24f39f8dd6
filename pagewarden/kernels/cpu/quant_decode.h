// The AVX512 decoders of GGUF blocks (quant.cpp, quant_tiles.cpp): 32 weights of a block
// (a Q*_0/Q*_1 block, or one 32-weight sub-block s of a K-quant block) to float32 with the
// same arithmetic, operation for operation, as decode32_scalar (quant_scalar.h), then
// rounded to bf16. Build with -ffp-contract=off. Included after quant_scalar.h, only where
// __AVX512BF16__ / __AVX512BW__ / __AVX512VL__ are defined.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_scalar.h"

namespace {

inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
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

}  // namespace
