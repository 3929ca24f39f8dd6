// The one-row int8 GEMV of quant_int8.cpp (a single stream's decode step: M = 1), built to
// stream the weights at memory bandwidth. Included by quant_int8.cpp inside its AVX512-VNNI
// section; the numerics are those of the multi-row path there (weights exact, activations
// rounded to int8 per block of 32 with scale max|x| / 127), only the order of the float32
// sums differs.
//
// What makes it cheaper than the multi-row loop (about 5 vector instructions per 32
// weights and weight row instead of 18):
// - 512-bit registers over two 32-weight blocks at once: one vpdpbusd (unsigned weight
//   quant x int8 activation, 4 products per int32 lane) gives 16 lanes, lanes of block 0
//   and of block 1, converted to float32 and multiplied into the accumulator with one FMA
//   by a vector holding each lane's A * dx (A the block's weight scale, dx the activation
//   block's scale), picked by one vpermps from the per-block products;
// - the per-block products A * dx are formed 16 blocks at a time: the 16 blocks' scale
//   words come in with one gather (32-weight types; a super-block's 8 or 16 sub-scales
//   for the K-quants), are converted and multiplied by 16 precomputed dx at once;
// - the offset / min term (w = A * u + Bp) is one scalar per block, Bp * dx * sum(v), and
//   with the activation sums precomputed once per GEMM, 16 blocks' worth is one FMA;
// - each pass runs kRowsPerPass weight rows against one load of each activation vector,
//   and prefetches the rows 2 passes ahead into L2 (_MM_HINT_T1: into L1 it measured
//   slower, the core's L1 misses in flight being the limit; every line of a row touched).
// The activations are laid out to match each type's packing (`interleaved` below), so no
// weight shuffles are needed: for Q5_0/Q5_1 a pair of blocks is stored as
// [x0[0:16], x1[0:16], x0[16:32], x1[16:32]] (the low nibbles of both blocks, then the
// high ones); natural order for Q8_0 and the K-quants.
//
// Q4_0, Q4_1, Q5_0 and Q5_1 (`quad` below; the default model's layers, Gemma 3 Q4_K_M's
// q/k/gate/up) go 4 blocks at a time instead,
// with no gather: one 64-byte load and one masked load cover the 4 blocks (72 or 80
// bytes, file layout), one vpermt2b picks their 64 quant bytes, whose low and high nibbles
// meet the activations stored as [x0..x3 [0:16]], [x0..x3 [16:32]] in two vpdpbusd into
// one int32 vector (4 lanes per block), and one vpermt2w picks the 4 blocks' fp16 scales
// (and mins), spread to the lanes, from the same two registers. About 14 instructions per
// 128 weights and row instead of 20 and a quarter gather; 8 rows per pass (measured faster
// than 4 with the weights coming from memory: more independent streams). Q5_0 / Q5_1 add
// their fifth bits by one masked add of 16 each over the low and the high nibbles; the
// masks come from one vpermt2w that puts block q / 2's 32-bit qh in qword q and one
// vpshufbitqmb per half that picks each lane's bit (AVX512-BITALG; without it the qh words
// go through general registers into the mask registers, about twice the Q5_0 cost). Needs
// AVX512-VBMI (vpermt2b); without it these types take the pair path.
// Q4_0 / Q5_0 start the integer sums from their offset (-8 / -16) times each lane's sum of
// activations (RowX::c4), so no float term for it. Q8_0 (`quad8`, Gemma 3's tied lm_head)
// also goes 4 blocks (136 bytes) per step: three 64-byte loads, two vpermt2b for the quant
// bytes, one vpermt2w for the scales, the sums started from -128 * the lane sums.
#pragma once

#include <array>

namespace row1 {

constexpr int kRowsPerPass = 4;  // weight rows per pass (silu: 2 gate + 2 up); reduce4 assumes 4

#if defined(__AVX512VBMI__)
inline constexpr bool quad(int type) { return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1; }
#else
inline constexpr bool quad(int) { return false; }
#endif

// Q8_0 four blocks per step (quads8 below; the tied lm_head of Gemma 3 Q4_K_M files).
#if defined(__AVX512VBMI__)
inline constexpr bool quad8(int type) { return type == Q8_0; }
#else
inline constexpr bool quad8(int) { return false; }
#endif

// Weight rows per pass of `type` (silu: half gate, half up).
inline constexpr int rows_per_pass(int type) { return quad(type) || quad8(type) ? 8 : kRowsPerPass; }
constexpr int kMaxRowsPerPass = 8;

inline bool interleaved(int type) { return !quad(type) && (type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1); }

// The quantized activation row, padded with zeros to a multiple of 16 blocks.
struct RowX {
  std::vector<int8_t> q;     // (nbp * 32) int8, type-dependent order (interleaved(), quad())
  std::vector<float> d;      // (nbp) block scale dx
  std::vector<float> s32;    // (nbp) dx * sum of the block's 32 v
  std::vector<float> d16;    // (2 nbp) dx per 16 weights (Q6_K)
  std::vector<float> s16;    // (2 nbp) 32 * dx * sum of 16 v (Q6_K's offset of 32)
  std::vector<float> dx4;    // (nbp * 4) quad(): per int32 lane of a quad (4 per block), dx
  std::vector<float> sx4;    // (nbp * 4) quad(): dx * sum v of block b in lane 4b, 0 elsewhere
  std::vector<int32_t> c4;   // (nbp * 4) quad() Q4_0 / Q5_0: offset (-8 / -16) * the lane's sum of its 8 v
  std::vector<float> dx8;    // (nbp * 8) quad8(): dx per int32 lane (8 per block)
  std::vector<int32_t> c8;   // (nbp * 8) quad8(): -128 * the lane's sum of its 4 v
};

inline void quantize_row(const uint16_t* x, int64_t k, int type, RowX* out) {
  const int64_t nb = k / 32, nbp = (nb + 15) / 16 * 16;
  out->q.assign(size_t(nbp * 32), 0);
  out->d.assign(size_t(nbp), 0.0f);
  out->s32.assign(size_t(nbp), 0.0f);
  out->d16.assign(size_t(2 * nbp), 0.0f);
  out->s16.assign(size_t(2 * nbp), 0.0f);
  out->dx4.assign(quad(type) ? size_t(4 * nbp) : 0, 0.0f);
  out->sx4.assign(quad(type) ? size_t(4 * nbp) : 0, 0.0f);
  const int offset = quad(type) ? (type == Q4_0 ? -8 : type == Q5_0 ? -16 : 0) : 0;
  out->c4.assign(offset ? size_t(4 * nbp) : 0, 0);
  out->dx8.assign(quad8(type) ? size_t(8 * nbp) : 0, 0.0f);
  out->c8.assign(quad8(type) ? size_t(8 * nbp) : 0, 0);
  const bool inter = interleaved(type), four = quad(type);
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t* src = x + b * 32;
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load32(reinterpret_cast<const uint8_t*>(src))), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load32(reinterpret_cast<const uint8_t*>(src + 16))), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 idv = _mm512_set1_ps(id);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, idv));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, idv));
    const int s0 = _mm512_reduce_add_epi32(qlo), s1 = _mm512_reduce_add_epi32(qhi);
    int8_t* dst0 = out->q.data() + b * 32;
    int8_t* dst1 = dst0 + 16;
    if (inter) {  // pair (2p, 2p + 1): [x0 lo16, x1 lo16, x0 hi16, x1 hi16]
      int8_t* pair = out->q.data() + (b / 2) * 64 + (b % 2) * 16;
      dst0 = pair;
      dst1 = pair + 32;
    } else if (four) {  // quad (4c .. 4c + 3): [x lo16 of each], [x hi16 of each]
      dst0 = out->q.data() + (b / 4) * 128 + (b % 4) * 16;
      dst1 = dst0 + 64;
      for (int l = 0; l < 4; ++l) out->dx4[size_t(4 * b + l)] = d;
      out->sx4[size_t(4 * b)] = d * float(s0 + s1);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst0), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst1), _mm512_cvtsepi32_epi8(qhi));
    if (offset) {  // quad lane 4 (b % 4) + l: v[4l .. 4l + 3] over the low and the high nibbles
      for (int l = 0; l < 4; ++l) {
        const int8_t *lo = dst0 + 4 * l, *hi = dst1 + 4 * l;
        out->c4[size_t(4 * b + l)] = offset * (int32_t(lo[0]) + lo[1] + lo[2] + lo[3] + hi[0] + hi[1] + hi[2] + hi[3]);
      }
    }
    if (quad8(type)) {  // natural order: lane l of block b holds v[4l .. 4l + 3]
      for (int l = 0; l < 8; ++l) {
        const int8_t* v = dst0 + 4 * l;
        out->c8[size_t(8 * b + l)] = -128 * (int32_t(v[0]) + v[1] + v[2] + v[3]);
        out->dx8[size_t(8 * b + l)] = d;
      }
    }
    out->d[size_t(b)] = d;
    out->s32[size_t(b)] = d * float(s0 + s1);
    out->d16[size_t(2 * b)] = out->d16[size_t(2 * b + 1)] = d;
    out->s16[size_t(2 * b)] = 32.0f * d * float(s0);
    out->s16[size_t(2 * b + 1)] = 32.0f * d * float(s1);
  }
}

// The 8 6-bit scales (bytes 0-7) and 8 mins (8-15) of a Q4_K / Q5_K super-block from its
// 12 scale bytes q (q[0:12] of `s`), in registers: scale j < 4 is q[j] & 63, min j < 4
// q[j + 4] & 63; scale j >= 4 is (q[j + 4] & 15) | (q[j - 4] >> 6) << 4, min j >= 4
// (q[j + 4] >> 4) | (q[j] >> 6) << 4.
inline __m128i k_scales_mins(__m128i s) {
  const __m128i a = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i low = _mm_mask_blend_epi8(__mmask16(0xF000), a, _mm_srli_epi16(a, 4));  // mins 4-7: high nibble
  const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30));  // (q >> 6) << 4
  return _mm_or_si128(_mm_and_si128(low, keep), high);
}

// out[j] = the sum of acc[j]'s 16 lanes, j < 4, in one transposing reduction.
inline void reduce4(const __m512* acc, float* out) {
  __m256 r[4];
  for (int j = 0; j < 4; ++j) r[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1));
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

inline __m512 dot16(__m512i u, __m512i v) { return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, v)); }

// The unsigned quants of blocks b0, b1 (32-weight types) as one 512-bit vector, in the
// activation order of quantize_row.
template <int type>
inline __m512i pair_quants(const uint8_t* b0, const uint8_t* b1) {
  const __m512i f = _mm512_set1_epi8(0xF);
  if constexpr (type == Q8_0) {
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(load32(b0 + 2)), load32(b1 + 2), 1);
    return _mm512_xor_si512(z, _mm512_set1_epi8(char(0x80)));
  } else {
    constexpr int at = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
    const __m256i r = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(b0 + at)), load16(b1 + at), 1);
    __m512i u = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r), _mm256_srli_epi16(r, 4), 1), f);
    if constexpr (type == Q5_0 || type == Q5_1) {
      uint32_t h0, h1;
      std::memcpy(&h0, b0 + at - 4, 4);
      std::memcpy(&h1, b1 + at - 4, 4);
      const uint64_t m = uint64_t(h0 & 0xFFFF) | uint64_t(h1 & 0xFFFF) << 16 | uint64_t(h0 >> 16) << 32 |
                         uint64_t(h1 >> 16) << 48;
      u = _mm512_mask_add_epi8(u, __mmask64(m), u, _mm512_set1_epi8(16));
    }
    return u;
  }
}

// out[j] = x . row j, for the rows_per_pass(type) rows of `rows`; `ahead`: bytes from a
// row to the same offset of the next pass's row (prefetched).
template <int type>
struct RowGemv {
  const RowX& x;
  int64_t k;
  int block_bytes;

  // 32-weight types: 16 blocks per group, their scale words gathered.
  void small(const uint8_t* const* rows, int64_t ahead, float* out) const {
    constexpr int C = kRowsPerPass;
    const int64_t nb = k / 32;
    __m512 acc[C];
    for (int j = 0; j < C; ++j) acc[j] = _mm512_setzero_ps();
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i offs = _mm512_mullo_epi32(lane, _mm512_set1_epi32(block_bytes));
    // lane -> block of the pair: interleaved (lanes 4-7, 12-15: block 1) or halves
    const __m512i pick = interleaved(type) ? _mm512_and_si512(_mm512_srli_epi32(lane, 2), _mm512_set1_epi32(1))
                                           : _mm512_srli_epi32(lane, 3);
    constexpr float kBias = type == Q4_0 ? -8.0f : type == Q5_0 ? -16.0f : type == Q8_0 ? -128.0f : 0.0f;
    for (int64_t g = 0; g < nb; g += 16) {
      const int cnt = int(std::min<int64_t>(16, nb - g));
      const __mmask16 valid = __mmask16((1u << cnt) - 1);
      const __m512 dx = _mm512_loadu_ps(x.d.data() + g), sx = _mm512_loadu_ps(x.s32.data() + g);
      __m512 s[C];
      for (int j = 0; j < C; ++j) {
        const uint8_t* base = rows[j] + g * block_bytes;
        const __m512i raw =  // a short last group: an 8-lane gather costs about half
            cnt <= 8 ? _mm512_castsi256_si512(_mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), __mmask8(valid),
                                                                            _mm512_castsi512_si256(offs), base, 1))
                     : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offs, base, 1);
        const __m512 a = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
        s[j] = _mm512_mul_ps(a, dx);
        if constexpr (type == Q4_1 || type == Q5_1) {  // w = d u + m
          const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(raw, 16)));
          acc[j] = _mm512_fmadd_ps(m, sx, acc[j]);
        } else {  // w = d u + kBias d
          acc[j] = _mm512_fmadd_ps(a, _mm512_mul_ps(sx, _mm512_set1_ps(kBias)), acc[j]);
        }
      }
      for (int p = 0; 2 * p < cnt; ++p) {
        const int64_t b0 = g + 2 * p, b1 = 2 * p + 1 < cnt ? b0 + 1 : b0;  // a lone block: v is 0 there
        const __m512i v = _mm512_loadu_si512(x.q.data() + b0 * 32);
        const __m512i idx = _mm512_add_epi32(pick, _mm512_set1_epi32(2 * p));
        for (int j = 0; j < C; ++j) {
          const uint8_t* r = rows[j];
          _mm_prefetch(reinterpret_cast<const char*>(r + ahead + b0 * block_bytes), _MM_HINT_T1);
          if constexpr (type == Q8_0) _mm_prefetch(reinterpret_cast<const char*>(r + ahead + b0 * block_bytes + 64), _MM_HINT_T1);
          const __m512i u = pair_quants<type>(r + b0 * block_bytes, r + b1 * block_bytes);
          acc[j] = _mm512_fmadd_ps(dot16(u, v), _mm512_permutexvar_ps(idx, s[j]), acc[j]);
        }
      }
    }
    reduce4(acc, out);
  }

  // Q4_0 / Q4_1 / Q5_0 / Q5_1 (quad()): 4 blocks per step, rows_per_pass(type) rows.
  void quads(const uint8_t* const* rows, int64_t ahead, float* out) const {
    constexpr bool five = type == Q5_0 || type == Q5_1, with_min = type == Q4_1 || type == Q5_1;
    constexpr int C = rows_per_pass(type);
    constexpr int bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : 24;
    constexpr int at = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;  // quant bytes
    constexpr int qh_at = type == Q5_0 ? 2 : 4;  // Q5_*: the 32 high bits
    // bytes 0-63: vpermt2b (quants); 64-127: vpermt2w (words 0-15: d per lane, 16-31: m per
    // lane, or for Q5_0 words 16-19 / 20-23: the low / high qh word of blocks 0-3); 128-191:
    // vpermt2w, Q5_1's qh words (0-3 low, 4-7 high); 192-255: vpermt2w, block q / 2's qh
    // (32 bits) in the low half of qword q (the bit shuffle's layout, kSel below)
    static constexpr auto kIdx = [] {
      std::array<uint8_t, 256> t{};
      for (int i = 0; i < 64; ++i) t[i] = uint8_t(bb * (i / 16) + at + i % 16);  // quant byte i % 16 of block i / 16
      for (int i = 0; i < 16; ++i) {
        t[64 + 2 * i] = uint8_t(bb / 2 * (i / 4));      // word: lane i's block's d
        t[96 + 2 * i] = uint8_t(bb / 2 * (i / 4) + 1);  // its m (Q4_1, Q5_1)
      }
      if (five) {
        const int base = type == Q5_0 ? 96 : 128;
        for (int b = 0; b < 4; ++b) {
          t[base + 2 * b] = uint8_t((bb * b + qh_at) / 2);
          t[base + 8 + 2 * b] = uint8_t((bb * b + qh_at) / 2 + 1);
        }
        for (int q = 0; q < 8; ++q) {
          t[192 + 8 * q] = uint8_t((bb * (q / 2) + qh_at) / 2);
          t[192 + 8 * q + 2] = uint8_t((bb * (q / 2) + qh_at) / 2 + 1);
        }
      }
      return t;
    }();
    // the bit shuffle's selectors: byte i of the low nibbles (block i / 16, weight i % 16)
    // takes bit i % 16 of its qword's qh, of the high nibbles bit 16 + i % 16
    static constexpr auto kSel = [] {
      std::array<uint8_t, 128> t{};
      for (int i = 0; i < 64; ++i) t[i] = uint8_t(i % 16), t[64 + i] = uint8_t(16 + i % 16);
      return t;
    }();
    const __m512i ibits = _mm512_loadu_si512(kIdx.data() + 192);
    const __m512i sel_lo = _mm512_loadu_si512(kSel.data()), sel_hi = _mm512_loadu_si512(kSel.data() + 64);
    const __m512i iq = _mm512_loadu_si512(kIdx.data()), idm = _mm512_loadu_si512(kIdx.data() + 64);
    const __m512i ihq = _mm512_loadu_si512(kIdx.data() + 128);
    const __m512i f = _mm512_set1_epi8(0xF), sixteen = _mm512_set1_epi8(16);
    const int64_t nb = k / 32, full = nb / 4;
    __m512 acc[C];
    for (int j = 0; j < C; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < (nb + 3) / 4; ++c) {
      const int64_t off = c * 4 * bb;
      const int bytes = c < full ? 4 * bb : int(nb - 4 * c) * bb;  // a short last quad
      const __mmask64 ma = bytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1;
      const __mmask64 mb = bytes <= 64 ? 0 : (__mmask64(1) << (bytes - 64)) - 1;  // never past the row
      const __m512i xlo = _mm512_loadu_si512(x.q.data() + c * 128), xhi = _mm512_loadu_si512(x.q.data() + c * 128 + 64);
      const __m512 dx = _mm512_loadu_ps(x.dx4.data() + c * 16);
      const __m512 sx = _mm512_loadu_ps(x.sx4.data() + c * 16);
      // w = d u + m (sums from 0), or d (u + offset): the sums start from offset * sum v
      const __m512i start = with_min ? _mm512_setzero_si512() : _mm512_loadu_si512(x.c4.data() + c * 16);
      for (int j = 0; j < C; ++j) {
        const uint8_t* r = rows[j] + off;
        _mm_prefetch(reinterpret_cast<const char*>(r + ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(r + ahead + 64), _MM_HINT_T1);
        const __m512i a = c < full ? _mm512_loadu_si512(r) : _mm512_maskz_loadu_epi8(ma, r);
        const __m512i b = _mm512_maskz_loadu_epi8(mb, r + 64);
        const __m512i q = _mm512_permutex2var_epi8(a, iq, b);
        __m512i lo = _mm512_and_si512(q, f), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), f);
        const __m512i dm = _mm512_permutex2var_epi16(a, idm, b);  // words 0-15: d per lane, 16-31: m
#if defined(__AVX512BITALG__)
        if constexpr (five) {  // the fifth bits: one vpshufbitqmb per half picks each lane's bit of qh
          const __m512i h = _mm512_permutex2var_epi16(a, ibits, b);
          lo = _mm512_mask_add_epi8(lo, _mm512_bitshuffle_epi64_mask(h, sel_lo), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _mm512_bitshuffle_epi64_mask(h, sel_hi), hi, sixteen);
        }
#else
        if constexpr (five) {  // the fifth bits: qh's low word over lo, its high word over hi
          const __m128i h = type == Q5_0 ? _mm512_extracti32x4_epi32(dm, 2)
                                         : _mm512_castsi512_si128(_mm512_permutex2var_epi16(a, ihq, b));
          lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(uint64_t(_mm_cvtsi128_si64(h))), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(uint64_t(_mm_extract_epi64(h, 1))), hi, sixteen);
        }
#endif
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, xlo), hi, xhi);
        const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, dx), acc[j]);
        if constexpr (with_min) acc[j] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)), sx, acc[j]);
      }
    }
    for (int j = 0; j < C; j += 4) reduce4(acc + j, out + j);
  }

  // Q8_0 (quad8()): 4 blocks (136 bytes) per step from three 64-byte loads (at 0, 64 and
  // 72: never past the quad), no gather. Two vpermt2b pick blocks 0-1 and 2-3's quant
  // bytes (xor 0x80: u = q + 128), one vpermt2w the 4 fp16 scales spread to the lanes; the
  // integer sums start from -128 * the lane's sum of v (RowX::c8), so each int32 lane is
  // sum q v exactly and one FMA per two blocks applies d * dx.
  void quads8(const uint8_t* const* rows, int64_t ahead, float* out) const {
    constexpr int C = rows_per_pass(type);
    static constexpr auto kIdx = [] {
      std::array<uint8_t, 192> t{};
      for (int i = 0; i < 64; ++i) {
        t[i] = uint8_t(i + 2 + (i >= 32 ? 2 : 0));          // [A | B]: bytes 2-33, 36-67
        const int a = i < 32 ? 70 + i : 72 + i;              // bytes 70-101, 104-135
        t[64 + i] = uint8_t(a < 72 ? a - 64 : 64 + a - 72);  // [B (64-127) | C (72-135)]
      }
      for (int i = 0; i < 32; ++i) t[128 + 2 * i] = uint8_t(17 * (i / 8));  // words 0, 17, 34, 51
      return t;
    }();
    const __m512i i01 = _mm512_loadu_si512(kIdx.data()), i23 = _mm512_loadu_si512(kIdx.data() + 64);
    const __m512i idd = _mm512_loadu_si512(kIdx.data() + 128), flip = _mm512_set1_epi8(char(0x80));
    const int64_t nb = k / 32, full = nb / 4;
    __m512 acc[C];
    for (int j = 0; j < C; ++j) acc[j] = _mm512_setzero_ps();
    const auto mask = [](int n) { return n >= 64 ? ~__mmask64(0) : n <= 0 ? __mmask64(0) : (__mmask64(1) << n) - 1; };
    for (int64_t c = 0; c < (nb + 3) / 4; ++c) {
      const int64_t off = c * 136;
      const int bytes = c < full ? 136 : int(nb - 4 * c) * 34;  // a short last quad
      const __mmask64 ma = mask(bytes), mb = mask(bytes - 64), mc = mask(bytes - 72);
      const __m512i v01 = _mm512_loadu_si512(x.q.data() + c * 128), v23 = _mm512_loadu_si512(x.q.data() + c * 128 + 64);
      const __m512i c01 = _mm512_loadu_si512(x.c8.data() + c * 32), c23 = _mm512_loadu_si512(x.c8.data() + c * 32 + 16);
      const __m512 dx01 = _mm512_loadu_ps(x.dx8.data() + c * 32), dx23 = _mm512_loadu_ps(x.dx8.data() + c * 32 + 16);
      for (int j = 0; j < C; ++j) {
        const uint8_t* r = rows[j] + off;
        _mm_prefetch(reinterpret_cast<const char*>(r + ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(r + ahead + 64), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(r + ahead + 135), _MM_HINT_T1);
        const bool whole = c < full;
        const __m512i a = whole ? _mm512_loadu_si512(r) : _mm512_maskz_loadu_epi8(ma, r);
        const __m512i b = whole ? _mm512_loadu_si512(r + 64) : _mm512_maskz_loadu_epi8(mb, r + 64);
        const __m512i e = whole ? _mm512_loadu_si512(r + 72) : _mm512_maskz_loadu_epi8(mc, r + 72);
        const __m512i q01 = _mm512_xor_si512(_mm512_permutex2var_epi8(a, i01, b), flip);
        const __m512i q23 = _mm512_xor_si512(_mm512_permutex2var_epi8(b, i23, e), flip);
        const __m512i dd = _mm512_permutex2var_epi16(a, idd, b);
        const __m512 d01 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(dd)), dx01);
        const __m512 d23 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(dd, 1)), dx23);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c01, q01, v01)), d01, acc[j]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c23, q23, v23)), d23, acc[j]);
      }
    }
    for (int j = 0; j < C; j += 4) reduce4(acc + j, out + j);
  }

  // Q4_K / Q5_K: per super-block 8 sub-blocks of 32, 6-bit scales and mins (unpacked in
  // registers, k_scales_mins).
  void k45(const uint8_t* const* rows, int64_t ahead, float* out) const {
    constexpr int C = kRowsPerPass;
    constexpr bool five = type == Q5_K;
    const __m512i f = _mm512_set1_epi8(0xF);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pick = _mm512_srli_epi32(lane, 3);
    const __m512i dm_pick = _mm512_srli_epi32(lane, 3);  // lanes 0-7: d, 8-15: dmin
    __m512 acc[C];
    for (int j = 0; j < C; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const int64_t off = sb * block_bytes;
      // lanes 0-7: dx of the 8 sub-blocks, 8-15: dx * sum v
      const __m512 xs = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(x.d.data() + sb * 8)),
                                           _mm256_loadu_ps(x.s32.data() + sb * 8), 1);
      __m512 s[C];
      __m512i hbits[C];
      for (int j = 0; j < C; ++j) {
        const uint8_t* b = rows[j] + off;
        _mm_prefetch(reinterpret_cast<const char*>(b + ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(b + ahead + block_bytes - 1), _MM_HINT_T1);
        const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k_scales_mins(load16(b + 4))));
        uint32_t dm;
        std::memcpy(&dm, b, 4);
        const __m512 dd = _mm512_permutexvar_ps(dm_pick, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(int(dm)))));
        const __m512 prod = _mm512_mul_ps(_mm512_mul_ps(sm, dd), xs);  // 0-7: A dx, 8-15: B dx sum v
        acc[j] = _mm512_mask_sub_ps(acc[j], 0xFF00, acc[j], prod);
        s[j] = prod;
        if constexpr (five) hbits[j] = _mm512_broadcast_i64x4(load32(b + 16));
      }
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(x.q.data() + sb * 256 + p * 64);
        const __m512i idx = _mm512_add_epi32(pick, _mm512_set1_epi32(2 * p));
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * p))), _mm256_set1_epi8(char(2 << (2 * p))), 1);
        for (int j = 0; j < C; ++j) {
          const uint8_t* q = rows[j] + off + (five ? 48 : 16) + 32 * p;
          _mm_prefetch(reinterpret_cast<const char*>(q + ahead), _MM_HINT_T1);
          const __m256i r = load32(q);
          __m512i u = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r), _mm256_srli_epi16(r, 4), 1), f);
          if constexpr (five) u = _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(hbits[j], bit), u, _mm512_set1_epi8(16));
          acc[j] = _mm512_fmadd_ps(dot16(u, v), _mm512_permutexvar_ps(idx, s[j]), acc[j]);
        }
      }
    }
    reduce4(acc, out);
  }

  // Q6_K: 16 scales per super-block (one per 16 weights), offset 32.
  void k6(const uint8_t* const* rows, int64_t ahead, float* out) const {
    constexpr int C = kRowsPerPass;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pick = _mm512_srli_epi32(lane, 2);
    const __m512i lo4 = _mm512_set1_epi8(0x0F), b03 = _mm512_set1_epi8(0x03), b30 = _mm512_set1_epi8(0x30);
    __m512 acc[C];
    for (int j = 0; j < C; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const int64_t off = sb * block_bytes;
      const __m512 dx = _mm512_loadu_ps(x.d16.data() + sb * 16), sx = _mm512_loadu_ps(x.s16.data() + sb * 16);
      __m512 s[C];
      for (int j = 0; j < C; ++j) {
        const uint8_t* b = rows[j] + off;
        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(b + 192))), _mm512_set1_ps(f16(b + 208)));
        acc[j] = _mm512_fnmadd_ps(a, sx, acc[j]);  // w = A (u - 32)
        s[j] = _mm512_mul_ps(a, dx);
      }
      for (int n = 0; n < 2; ++n) {
        const __m512i v01 = _mm512_loadu_si512(x.q.data() + sb * 256 + n * 128);
        const __m512i v23 = _mm512_loadu_si512(x.q.data() + sb * 256 + n * 128 + 64);
        const __m512i idx01 = _mm512_add_epi32(pick, _mm512_set1_epi32(8 * n));
        const __m512i idx23 = _mm512_add_epi32(pick, _mm512_set1_epi32(8 * n + 4));
        for (int j = 0; j < C; ++j) {
          const uint8_t* b = rows[j] + off;
          _mm_prefetch(reinterpret_cast<const char*>(b + ahead + 64 * n), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(b + ahead + 128 + 64 * n), _MM_HINT_T1);
          if (n == 1) _mm_prefetch(reinterpret_cast<const char*>(b + ahead + 209), _MM_HINT_T1);
          const __m512i ql = _mm512_loadu_si512(b + 64 * n);
          const __m256i qh = load32(b + 128 + 32 * n);
          const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
          // (ql & 0xF) | ((h & 3) << 4); ((ql >> 4) & 0xF) | (h & 0x30)
          const __m512i u01 = _mm512_ternarylogic_epi32(ql, lo4, _mm512_slli_epi16(_mm512_and_si512(h, b03), 4), 0xEA);
          const __m512i u23 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), lo4, _mm512_and_si512(h, b30), 0xEA);
          acc[j] = _mm512_fmadd_ps(dot16(u01, v01), _mm512_permutexvar_ps(idx01, s[j]), acc[j]);
          acc[j] = _mm512_fmadd_ps(dot16(u23, v23), _mm512_permutexvar_ps(idx23, s[j]), acc[j]);
        }
      }
    }
    reduce4(acc, out);
  }

  void pass(const uint8_t* const* rows, int64_t ahead, float* out) const {
    if constexpr (type == Q4_K || type == Q5_K)
      k45(rows, ahead, out);
    else if constexpr (type == Q6_K)
      k6(rows, ahead, out);
    else if constexpr (quad(type))
      quads(rows, ahead, out);
    else if constexpr (quad8(type))
      quads8(rows, ahead, out);
    else
      small(rows, ahead, out);
  }
};

}  // namespace row1
