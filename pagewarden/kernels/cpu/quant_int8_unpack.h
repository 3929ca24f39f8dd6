// The int8 tiles' weight decode (quant_int8_tiles.cpp) for every kernel type without a
// per-row decode or a transpose: 16 weight rows at once, their quant bytes moved as 32-bit
// words straight into the tile layout, their scales decoded 16 rows per vector.
//
// Tile layout (quant_int8_tiles.cpp): 16 weight rows as (K / 4, 16, 4) uint8, quad kq (k
// = 4 kq .. 4 kq + 3) at q + 64 kq, lane r = row r's 4 unsigned quants u; beside it A and
// B as (K / 16, 16) float32 (a[16 h + r]: the h-th 16 weights of row r, w = A u - B; with
// 32 weights per scale only the even h are written, the micro-kernel reads no other).
//
// words16: the 16 bytes at offset o of each row are four 32-bit words; rows loaded as Z_e
// = rows (e, 4 + e, 8 + e, 12 + e) and two rounds of 32/64-bit unpacks give D_j = word j
// of the 16 rows in row order. A block's quant bytes are whole words of such 16-byte runs,
// so D_j (masked, shifted) is a tile quad; the high bits (Q5_*: qh, Q5_K / Q6_K: qh bytes)
// are words too, or (Q5_0 / Q5_1's 32-bit qh) one gather per block turned into per-byte
// masks. Scales: one 32-bit gather per row and block (d, m; Q4_K / Q5_K's 12 scale bytes
// as three), decoded in 32-bit lanes with ggml's arithmetic (A = d * sc, B = dmin * mn,
// Q6_K B = 32 A): the same u, A and B as quant_decode.h's decode_u, bit for bit.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "quant_scalar.h"

namespace {

// D_j, j = 0..3: word j of the 16 bytes at rows[r] + o, lane r.
inline void words16(const uint8_t* const* rows, int64_t o, __m512i d[4]) {
  auto ld = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + o)); };
  __m512i z[4];
  for (int e = 0; e < 4; ++e) {
    z[e] = _mm512_castsi128_si512(ld(e));
    for (int l = 1; l < 4; ++l) z[e] = _mm512_inserti32x4(z[e], ld(4 * l + e), l);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  d[0] = _mm512_unpacklo_epi64(t0, t2);
  d[1] = _mm512_unpackhi_epi64(t0, t2);
  d[2] = _mm512_unpacklo_epi64(t1, t3);
  d[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Words [0, 4 n) of the 16 n bytes at rows[r] + o.
template <int n>
inline void words(const uint8_t* const* rows, int64_t o, __m512i* d) {
  for (int i = 0; i < n; ++i) words16(rows, o + 16 * i, d + 4 * i);
}

struct Unpack {
  const uint8_t* const* rows;  // 16 weight rows (a short tile repeats its last row)
  __m512i idx;                 // rows[r] - rows[0], for the gathers
  uint8_t* q;
  float* a;
  float* b;

  __m512i gather(int64_t o) const { return _mm512_i32gather_epi32(idx, rows[0] + o, 1); }
  static __m512 half_lo(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
  static __m512 half_hi(__m512i v) { return half_lo(_mm512_srli_epi32(v, 16)); }
  void quad(int64_t kq, __m512i u) const { _mm512_storeu_si512(q + kq * 64, u); }
  void scales(int64_t h, __m512 av, __m512 bv) const {  // the 16 rows' A, B of 16-weight run h
    _mm512_storeu_ps(a + h * 16, av);
    _mm512_storeu_ps(b + h * 16, bv);
  }
};

inline __m512i low4(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0xF)); }
inline __m512i high4(__m512i v) { return low4(_mm512_srli_epi16(v, 4)); }

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: blocks of 32 with d (and m) first.
template <int type>
void unpack_small(const Unpack& t, int64_t k) {
  constexpr int bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 34;
  constexpr int qoff = type == Q4_0 || type == Q8_0 ? 2 : type == Q4_1 || type == Q5_0 ? bytes - 16 : 8;
  constexpr bool five = type == Q5_0 || type == Q5_1, offset = type == Q4_1 || type == Q5_1;
  // Q5_*: byte c of qh (bits 8c..8c+7) spread to every byte of its row's lane; per-byte bit
  // (4 p + e) of quad e's byte.
  alignas(64) int32_t pick[4][16];
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 16; ++i) pick[c][i] = (4 * (i % 4) + c) * 0x01010101;
  for (int64_t blk = 0; blk < k / 32; ++blk) {
    const int64_t at = blk * bytes;
    const __m512i hdr = t.gather(at);
    const __m512 d = Unpack::half_lo(hdr);
    const __m512 bias = offset ? _mm512_sub_ps(_mm512_setzero_ps(), Unpack::half_hi(hdr))
                               : _mm512_mul_ps(_mm512_set1_ps(type == Q4_0 ? 8.0f : five ? 16.0f : 128.0f), d);
    t.scales(2 * blk, d, bias);
    __m512i qh = _mm512_setzero_si512();
    if constexpr (five) qh = t.gather(at + (offset ? 4 : 2));
    for (int part = 0; part < (type == Q8_0 ? 2 : 1); ++part) {
      __m512i dw[4];
      words16(t.rows, at + qoff + 16 * part, dw);
      for (int j = 0; j < 4; ++j) {
        const int64_t kq = 8 * blk + 4 * part + j;
        if constexpr (type == Q8_0) {
          t.quad(kq, _mm512_xor_si512(dw[j], _mm512_set1_epi8(char(0x80))));
          continue;
        }
        __m512i lo = low4(dw[j]), hi = high4(dw[j]);
        if constexpr (five) {  // weights 4 j.. (bits 4 j..) and 16 + 4 j.. (bits 16 + 4 j..)
          const __m512i bits = _mm512_set1_epi32(j % 2 ? int(0x80402010u) : 0x08040201);
          const __m512i blo = _mm512_shuffle_epi8(qh, _mm512_load_si512(pick[j / 2]));
          const __m512i bhi = _mm512_shuffle_epi8(qh, _mm512_load_si512(pick[2 + j / 2]));
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(blo, bits), lo, _mm512_set1_epi8(16));
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(bhi, bits), hi, _mm512_set1_epi8(16));
        }
        t.quad(kq, lo);
        t.quad(kq + 4, hi);
      }
    }
  }
}

// Q4_K / Q5_K: super-blocks of 256, 8 sub-blocks of 32 with 6-bit scales and mins.
template <int type>
void unpack_k4(const Unpack& t, int64_t k) {
  constexpr bool five = type == Q5_K;
  constexpr int bytes = five ? 176 : 144, qoff = five ? 48 : 16;
  const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(0xF), m2 = _mm512_set1_epi32(3);
  for (int64_t sbk = 0; sbk < k / 256; ++sbk) {
    const int64_t at = sbk * bytes;
    const __m512i hdr = t.gather(at), s0 = t.gather(at + 4), s1 = t.gather(at + 8), s2 = t.gather(at + 12);
    const __m512 d = Unpack::half_lo(hdr), dmin = Unpack::half_hi(hdr);
    for (int s = 0; s < 8; ++s) {  // ggml's get_scale_min_k4 on 16 rows
      const int sh = 8 * (s % 4);
      __m512i sc, mn;
      if (s < 4) {
        sc = _mm512_and_si512(_mm512_srli_epi32(s0, sh), m6);
        mn = _mm512_and_si512(_mm512_srli_epi32(s1, sh), m6);
      } else {
        const __m512i top_sc = _mm512_and_si512(_mm512_srli_epi32(s0, sh + 6), m2);
        const __m512i top_mn = _mm512_and_si512(_mm512_srli_epi32(s1, sh + 6), m2);
        sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, sh), m4), _mm512_slli_epi32(top_sc, 4));
        mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, sh + 4), m4), _mm512_slli_epi32(top_mn, 4));
      }
      t.scales(2 * (8 * sbk + s), _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
    }
    __m512i qh[8];
    if constexpr (five) words<2>(t.rows, at + 16, qh);  // qh word j: bit s of weights 4 j..
    for (int p = 0; p < 4; ++p) {                       // sub-blocks 2 p (low nibbles), 2 p + 1
      __m512i dw[8];
      words<2>(t.rows, at + qoff + 32 * p, dw);
      for (int j = 0; j < 8; ++j) {
        __m512i lo = low4(dw[j]), hi = high4(dw[j]);
        if constexpr (five) {
          const __m512i sixteen = _mm512_set1_epi8(16);
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh[j], _mm512_set1_epi8(char(1 << (2 * p)))), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh[j], _mm512_set1_epi8(char(1 << (2 * p + 1)))), hi, sixteen);
        }
        t.quad(8 * (8 * sbk + 2 * p) + j, lo);
        t.quad(8 * (8 * sbk + 2 * p + 1) + j, hi);
      }
    }
  }
}

// Q6_K: super-blocks of 256 (ql 128, qh 64, 16 int8 scales, d at 208), a scale per 16.
inline void unpack_q6k(const Unpack& t, int64_t k) {
  for (int64_t sbk = 0; sbk < k / 256; ++sbk) {
    const int64_t at = sbk * 210;
    const __m512 d = Unpack::half_hi(t.gather(at + 206));  // bytes 206..209: never past the row
    __m512i sc[4];
    words16(t.rows, at + 192, sc);  // byte e of word w: scale 4 w + e
    for (int i = 0; i < 16; ++i) {
      const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(sc[i / 4], 24 - 8 * (i % 4)), 24);
      const __m512 av = _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));
      t.scales(16 * sbk + i, av, _mm512_mul_ps(_mm512_set1_ps(32.0f), av));
    }
    for (int half = 0; half < 2; ++half) {  // sub-blocks 4 half + s, s = 0..3
      __m512i ql[16], qh[8];
      words<4>(t.rows, at + 64 * half, ql);
      words<2>(t.rows, at + 128 + 32 * half, qh);
      for (int s = 0; s < 4; ++s)
        for (int j = 0; j < 8; ++j) {
          const __m512i l = s >= 2 ? high4(ql[(s & 1) * 8 + j]) : low4(ql[(s & 1) * 8 + j]);
          const __m512i h = _mm512_and_si512(_mm512_srli_epi16(qh[j], 2 * s), _mm512_set1_epi8(3));
          t.quad(8 * (8 * sbk + 4 * half + s) + j, _mm512_or_si512(l, _mm512_slli_epi16(h, 4)));
        }
    }
  }
}

// The tile of weight rows rows[0, 16) (k weights each) into q, a, b.
template <int type>
void unpack_tile(const uint8_t* const* rows, int64_t k, uint8_t* q, float* a, float* b) {
  alignas(64) int32_t off[16];
  for (int r = 0; r < 16; ++r) off[r] = int32_t(rows[r] - rows[0]);
  const Unpack t{rows, _mm512_load_si512(off), q, a, b};
  if constexpr (type == Q4_K || type == Q5_K)
    unpack_k4<type>(t, k);
  else if constexpr (type == Q6_K)
    unpack_q6k(t, k);
  else
    unpack_small<type>(t, k);
}

}  // namespace
