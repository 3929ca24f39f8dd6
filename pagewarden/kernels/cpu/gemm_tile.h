// What gemm.cpp (the bf16 GEMM of --quantization none) and quant_tiles.cpp (the many-row
// bf16-decode path of the quantized GEMM) share: the epilogues' exp / SiLU / GELU-tanh, the
// register-blocked vdpbf16ps micro-kernel over packed (K / 2, 16, 2) bf16 tiles, and a
// 16 x 16 32-bit transpose and the quantized tiles' epilogue (quant_tiles.cpp,
// quant_int8_tiles.cpp). Include only where __AVX512BW__ and __AVX512VL__ are defined;
// dot_tiles needs __AVX512BF16__ as well.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// exp(x) for x <= 0 on 16 lanes: x = n ln2 + r, exp(r) by its degree-6 Taylor polynomial.
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// The gated epilogues: none, silu(gate) * up, gelu_tanh(gate) * up.
enum Act : int64_t { kNone = 0, kSilu = 1, kGeluTanh = 2 };

// g * sigmoid(s) * u = g * u / (1 + exp(-s)), with exp taken of -|s| only (no overflow).
// SiLU: s = g. GELU-tanh: 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3).
template <Act A>
inline __m512 gated(__m512 g, __m512 u) {
  __m512 s = g;
  if constexpr (A == kGeluTanh) {
    const __m512 g2 = _mm512_mul_ps(g, g);
    const __m512 inner = _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g2, _mm512_set1_ps(1.0f));
    s = _mm512_mul_ps(_mm512_mul_ps(g, inner), _mm512_set1_ps(1.5957691216057308f));
  }
  const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(s)));
  const __mmask16 neg = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(g, neg, g, e);  // s >= 0: g;  s < 0: g e^s
  return _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

// acc[i][j] = row i of x (xr[i], bf16 bits) . packed tile j (at w + j * pairs * 32), over
// all `pairs` k pairs: the MR x NR micro-kernel of gemm.cpp (C 64-byte loads of W, R
// broadcasts of a 32-bit x pair and R x C vdpbf16ps per k pair).
template <int R, int C>
inline void dot_tiles(const uint16_t* const* xr, const uint16_t* w, int64_t pairs, __m512 (&acc)[R][C]) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[C];
    for (int j = 0; j < C; ++j)
      b[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + (j * pairs + p) * 32));
    for (int i = 0; i < R; ++i) {
      int32_t pair;  // x[m, 2p] and x[m, 2p + 1] (a 4-byte load; rows need no alignment)
      std::memcpy(&pair, xr[i] + 2 * p, sizeof pair);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, b[j]);
    }
  }
}

// v rounded to bf16, nearest even (vcvtneps2bf16 where the build has AVX512-BF16).
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);  // NaN stays a (quiet) NaN
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// The lines of bytes [p, p + n) towards L1 (write: prefetchw, with intent to store).
// Inline asm, not _mm_prefetch: GCC 12 at -O3 deletes a loop of nothing but prefetch
// builtins as one without effects (-ffinite-loops).
template <bool write>
inline void prefetch_span(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  const int64_t lead = int64_t(reinterpret_cast<uintptr_t>(c) & 63);
  for (int64_t o = -lead; o < n; o += 64) {
    if constexpr (write)
      asm volatile("prefetchw %0" : : "m"(c[o]));
    else
      asm volatile("prefetcht0 %0" : : "m"(c[o]));
  }
}

// What tiles_epilogue<R, C>(p, ., m0, col0) will read (the residual) and write (the
// outputs), asked for before the micro-kernel's k loop: at prefill sizes (thousands of
// rows) both are megabytes, out of L2, and the epilogue's masked loads otherwise wait on
// their misses one after the other (perf: ~10% of an o_proj call at 2048 rows); issued
// first, the misses overlap the k loop's thousands of cycles.
template <int R, int C, class P>
inline void prefetch_epilogue(const P& p, int64_t m0, int64_t col0) {
  constexpr int TW = 16;
  const int64_t cols = std::min<int64_t>(int64_t(p.silu ? C / 2 : C) * TW, p.n_out - col0);
  if (cols <= 0) return;
  for (int i = 0; i < R; ++i) {
    const int64_t row = m0 + i;
    if (p.res) prefetch_span<false>(p.res + row * p.ldres + col0, cols * 2);
    if (p.out_f32)
      prefetch_span<true>(p.out_f32 + row * p.n_out + col0, cols * 4);
    else
      prefetch_span<true>(p.out + row * p.n_out + col0, cols * 2);
  }
}

// Writes rows [m0, m0 + R) of a group of C column tiles whose first output column is col0
// (quant_tiles.cpp, quant_int8_tiles.cpp): p.silu: the tiles alternate gate, up and out =
// silu(gate) * up (p.gelu: gelu_tanh(gate) * up); + p.res (bf16, row stride ldres) where set; bf16 p.out or float32
// p.out_f32, (M, n_out) contiguous.
template <int R, int C, class P>
inline void tiles_epilogue(const P& p, const __m512 (&acc)[R][C], int64_t m0, int64_t col0) {
  constexpr int TW = 16;
  for (int i = 0; i < R; ++i) {
    const int64_t row = m0 + i;
    const int step = p.silu ? 2 : 1;
    for (int j = 0; j + step - 1 < C; j += step) {
      const int64_t col = col0 + j / step * TW;
      const __mmask16 mask = p.n_out - col >= TW ? 0xFFFF : (1u << (p.n_out - col)) - 1;
      __m512 v = acc[i][j];
      if (p.silu) v = p.gelu ? gated<kGeluTanh>(v, acc[i][j + 1]) : gated<kSilu>(v, acc[i][j + 1]);
      if (p.res) {
        const __m256i r = _mm256_maskz_loadu_epi16(mask, p.res + row * p.ldres + col);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
      }
      if (p.out_f32)
        _mm512_mask_storeu_ps(p.out_f32 + row * p.n_out + col, mask, v);
      else
        _mm256_mask_storeu_epi16(p.out + row * p.n_out + col, mask, to_bf16(v));
    }
  }
}

// r[j] lane i <- r[i] lane j, for 16 x 16 32-bit lanes.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

}  // namespace
