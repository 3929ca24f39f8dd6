// Paged decode attention for CPU, reading K/V in place through the block tables, with
// the read checks of the guard fused into the same loop.
//
// Layouts (one layer; T = the step's new tokens, S = its sequences):
//
//     q, out        (T, n_heads, D)      the cache's dtype (float32 or bfloat16); out
//                                        contiguous, q's tokens may be strided
//     cache         (2, num_blocks, bs, n_kv, D) contiguous; 0 = K, 1 = V
//     tables        (S, max_blocks) int64  the step's padded block tables (meta.block_index)
//     seq_info      (3, S) int32           first token, query length, context length
//     rows          (S_b,) int64           the rows of tables / seq_info this call computes
//
// decode_attention: each row r is a sequence with one new token at flat token
// seq_info[0, r], which attends to the n = context + 1 keys at positions [0, n), key p
// stored at slot tables[r, p / bs] * bs + p % bs. Work items are (row, split), one per
// thread at a time: when the rows are too few to keep every thread busy, each row's key
// range is split into runs of whole blocks (flash-decoding) whose partial results a
// second pass merges. Loop order inside an item: over its logical blocks lb, each read
// in place through tables[r, lb] (no gathered copy; the next block prefetched); per
// block, all bs * n_kv * D K values -> float32 at once (contiguous), then per kv head the
// (G, bs) scores of its G = n_heads / n_kv query heads (grouped-query attention: the G
// heads share every K/V row loaded, nothing is repeated), one online-softmax rescale per
// head, then V -> float32 and accumulated with the probabilities. All arithmetic is
// float32 (bfloat16 widened as it is read, the output rounded once). The inner loops are
// written with gcc vector types of 16 floats (one AVX-512 register; gcc splits them into
// two AVX2 ones where that is all the CPU has, -march=native) or as plain loops gcc
// vectorises. Where the compiler targets AVX512-BF16, bfloat16 caches skip the widening
// pass: scores come from the bf16 K rows by vdpbf16ps (exact products, float32 sums),
// V is widened in registers with every accumulator of a kv head held there (see the
// section "bfloat16 with AVX512-BF16"); at batch 64 over 128-256 keys (30 layers, the
// default model's shapes) that took a step's attention from 32.3 to 26.5 ms on a 2-core
// Zen 4, about 17 ms of which is reading the K/V bytes at the machine's bandwidth.
//
// check_reads: the same checks without attention, for rows the torch path computes:
// tags of positions [0, context + query), checksums of positions [0, context).
//
// Checks (when their tensors are given), through the very block id the K/V are read
// with, never raised here:
//   tags       each position p read must hold expected[r, p] in slot_tags[slot];
//              a mismatch sets tag_faults[r, lb] = 1.
//   checksums  each block read adds each kv head's share of the content checksum of
//              worker/integrity.py to read_sums[r, kv_head, lb]: the slot rows as signed
//              32-bit limbs times limb_keys[K/V, limb], times offset_keys[o], summed
//              mod 2^64; summed over kv heads and layers it is the block checksum. A
//              block's (row, lb) entry is written by one item only, so no atomics.
// A block id outside [0, num_blocks) stops the item and raises after the loop, as
// torch's own gathers would.
//
// kernels/attention.py (plain torch) is the reference the tests compare with.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "pool.h"

namespace {

using bf16_bits = uint16_t;

// Widen n values to float32 (a bfloat16 is the top half of a float32).
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void to_float(const bf16_bits* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(uint32_t(src[i]) << 16);
}

inline void store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void store(bf16_bits* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    c10::BFloat16 b(src[i]);  // round to nearest even, as torch's casts do
    dst[i] = b.x;
  }
}

// exp(x) for x <= 0 in float32, branch-free so that loops over it vectorise:
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (~2 ulp).
inline float exp_nonpos(float x) {
  x = x > -87.0f ? x : -87.0f;
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round: 1.5 * 2^23 trick
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * std::bit_cast<float>((int32_t(n) + 127) << 23);
}

// 16 floats: one AVX-512 register, two AVX2 ones (gcc splits it where needed).
using f32x16 = float __attribute__((vector_size(64)));
constexpr int64_t W = 16;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

// exp_nonpos of 16 lanes at once (the same polynomial, lane by lane).
inline f32x16 exp_nonpos(f32x16 x) {
  using i32x16 = int32_t __attribute__((vector_size(64)));
  const f32x16 lo = f32x16{} - 87.0f;
  x = x > lo ? x : lo;
  const f32x16 n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  const f32x16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  f32x16 p = r * (1.0f / 720) + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
  return p * reinterpret_cast<const f32x16&>(e);
}

// The sum of the 16 lanes, as a tree of halvings (4 adds deep, not 15).
inline float hsum(f32x16 v) {
  using f32x8 = float __attribute__((vector_size(32)));
  using f32x4 = float __attribute__((vector_size(16)));
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
                  __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// One online-softmax update of a head over a block: the cnt scores at si become
// exp(score - new max) in place; m and l (running max and sum) are updated; returns the
// factor alpha = exp(old max - new max) the head's accumulator must be scaled by. 16
// scores at a time; si may be read (not written) up to 15 floats past cnt.
inline float softmax_block(float* si, int64_t cnt, float& m, float& l) {
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const f32x16 neg_inf = f32x16{} - std::numeric_limits<float>::infinity();
  f32x16 vmax = neg_inf;
  for (int64_t o = 0; o < cnt; o += W) {
    const f32x16 v = load16(si + o);
    vmax = lane < float(cnt - o) && v > vmax ? v : vmax;
  }
  float mx = m;
  for (int64_t j = 0; j < W; ++j) mx = vmax[j] > mx ? vmax[j] : mx;
  const float alpha = exp_nonpos(m - mx);  // 0 on the first block (m = -inf)
  f32x16 vsum = f32x16{};
  for (int64_t o = 0; o < cnt; o += W) {
    const f32x16 e = exp_nonpos(load16(si + o) - mx);
    const f32x16 kept = lane < float(cnt - o) ? e : f32x16{};
    std::memcpy(si + o, &kept, std::min<int64_t>(W, cnt - o) * sizeof(float));
    vsum += kept;
  }
  m = mx;
  l = l * alpha + hsum(vsum);
  return alpha;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// sc[g, o] = q[g] . k[o] for the block's cnt keys (k row o at k + o * ks): the D products
// of each pair summed in W lanes, the lanes added once per (g, o).
inline void scores(const float* q, const float* k, int64_t ks, float* sc, int64_t G, int64_t D,
                   int64_t bs, int64_t cnt) {
  if (D % W != 0) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t o = 0; o < cnt; ++o) sc[g * bs + o] = dot(q + g * D, k + o * ks, D);
    return;
  }
  for (int64_t o = 0; o < cnt; ++o)
    for (int64_t g = 0; g < G; ++g) {
      const float *qg = q + g * D, *ko = k + o * ks;
      f32x16 lanes = load16(qg) * load16(ko);
      for (int64_t d = W; d < D; d += W) lanes += load16(qg + d) * load16(ko + d);
      sc[g * bs + o] = hsum(lanes);
    }
}

// acc[g] += sum_o p[g, o] * v[o] (v row o at v + o * vs), W columns at a time held in a
// register across the keys.
inline void accumulate(const float* p, const float* v, int64_t vs, float* acc, int64_t G,
                       int64_t D, int64_t bs, int64_t cnt) {
  if (D % W != 0) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t o = 0; o < cnt; ++o)
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p[g * bs + o] * v[o * vs + d];
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* ag = acc + g * D;
    const float* pg = p + g * bs;
    int64_t d = 0;
    for (; d + 4 * W <= D; d += 4 * W) {  // four independent sums hide the FMA latency
      f32x16 a0 = load16(ag + d), a1 = load16(ag + d + W);
      f32x16 a2 = load16(ag + d + 2 * W), a3 = load16(ag + d + 3 * W);
      for (int64_t o = 0; o < cnt; ++o) {
        const float* vo = v + o * vs + d;
        a0 += pg[o] * load16(vo);
        a1 += pg[o] * load16(vo + W);
        a2 += pg[o] * load16(vo + 2 * W);
        a3 += pg[o] * load16(vo + 3 * W);
      }
      store16(ag + d, a0);
      store16(ag + d + W, a1);
      store16(ag + d + 2 * W, a2);
      store16(ag + d + 3 * W, a3);
    }
    for (; d < D; d += W) {
      f32x16 a = load16(ag + d);
      for (int64_t o = 0; o < cnt; ++o) a += pg[o] * load16(v + o * vs + d);
      store16(ag + d, a);
    }
  }
}

// ---- bfloat16 with AVX512-BF16 (Zen 4, Sapphire Rapids and later) ---------------------
// Scores straight from the bf16 K rows with vdpbf16ps (32 bf16 products per instruction,
// summed in float32: a bf16 x bf16 product is exact in float32), 16 keys' lane sums
// reduced together; V widened in registers as it is read, every G x D accumulator of a
// kv head held in registers across the block's keys. Probabilities stay float32.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PW_BF16_KERNEL 1

// One vector from 16: lane j = the sum of v[j]'s 16 lanes (a transposing add tree,
// 45 instructions for 16 sums where 16 separate horizontal sums take about 130).
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d], that lane's share
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: halves of y[2i], then of y[2i + 1]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                       _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

inline __m512bh load_bh(const bf16_bits* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// One K row's dot product with q in 16 float32 lanes (D % 32 == 0).
inline __m512 dot_lanes(const bf16_bits* q, const bf16_bits* k, int64_t D) {
  __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), load_bh(k), load_bh(q));
  for (int64_t d = 32; d < D; d += 32) a = _mm512_dpbf16_ps(a, load_bh(k + d), load_bh(q + d));
  return a;
}

// sc[g, o] = scale * q[g] . k[o] for the block's cnt keys, 16 keys at a time.
inline void scores_bf16(const bf16_bits* q, const bf16_bits* k, int64_t ks, float* sc, int64_t G,
                        int64_t D, int64_t bs, int64_t cnt, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t o0 = 0; o0 < cnt; o0 += 16) {
      const int64_t m = std::min<int64_t>(16, cnt - o0);
      __m512 v[16];
      for (int64_t o = 0; o < 16; ++o)
        v[o] = o < m ? dot_lanes(q + g * D, k + (o0 + o) * ks, D) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(sc + g * bs + o0, __mmask16((1u << m) - 1),
                            _mm512_mul_ps(reduce16(v), vscale));
    }
}

inline __m512 widen16(const bf16_bits* p) {  // 16 bf16 -> float32 (the top halves)
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// acc[g] += sum_o p[g, o] * v[o] for G heads of D = 16 * NC columns: the G * NC
// accumulators in registers, each V row widened once and used by every head.
template <int G, int NC>
void accumulate_bf16(const float* p, const bf16_bits* v, int64_t vs, float* acc, int64_t bs,
                     int64_t cnt) {
  __m512 a[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(acc + (g * NC + c) * 16);
  for (int64_t o = 0; o < cnt; ++o) {
    __m512 row[NC];
    for (int c = 0; c < NC; ++c) row[c] = widen16(v + o * vs + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * bs + o]);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(pg, row[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (g * NC + c) * 16, a[g][c]);
}

using AccumulateBf16 = void (*)(const float*, const bf16_bits*, int64_t, float*, int64_t, int64_t);

// The instantiation for (G, D), or null where its accumulators would not fit in registers.
inline AccumulateBf16 pick_accumulate_bf16(int64_t G, int64_t D) {
  if (D == 64) {
    switch (G) {
      case 1: return accumulate_bf16<1, 4>;
      case 2: return accumulate_bf16<2, 4>;
      case 3: return accumulate_bf16<3, 4>;
      case 4: return accumulate_bf16<4, 4>;
      case 5: return accumulate_bf16<5, 4>;
      case 6: return accumulate_bf16<6, 4>;
    }
  } else if (D == 128) {
    switch (G) {
      case 1: return accumulate_bf16<1, 8>;
      case 2: return accumulate_bf16<2, 8>;
      case 3: return accumulate_bf16<3, 8>;
    }
  }
  return nullptr;
}
#endif

struct Shape {
  int64_t num_blocks, bs, n_kv, D, G, max_blocks, row_elems;
};

// Optional check tensors, as raw pointers (null when that check is off).
struct Checks {
  const int64_t* slot_tags = nullptr;
  const int64_t* expected = nullptr;  // (S, exp_stride)
  int64_t exp_stride = 0;
  int32_t* tag_faults = nullptr;  // (S, max_blocks)
  int64_t* read_sums = nullptr;   // (S, n_kv, max_blocks)
  const int64_t* limb_keys = nullptr;    // (2, limbs per slot row)
  const int64_t* offset_keys = nullptr;  // (bs,)
};

// Tag compare of block lb of row r, positions [p0, p1).
inline void check_tags(const Checks& c, const Shape& s, int64_t r, int64_t lb, int64_t blk,
                       int64_t p0, int64_t p1) {
  const int64_t* want = c.expected + r * c.exp_stride;
  bool bad = false;
  for (int64_t p = p0; p < p1; ++p) bad |= c.slot_tags[blk * s.bs + p % s.bs] != want[p];
  if (bad) c.tag_faults[r * s.max_blocks + lb] = 1;
}

// Kv head h's share of block blk's checksum over offsets [0, n), added to read_sums.
inline void add_checksum(const Checks& c, const Shape& s, const void* cache, int64_t elem,
                         int64_t r, int64_t h, int64_t lb, int64_t blk, int64_t n) {
  const int64_t row_limbs = s.row_elems * elem / 4, head_limbs = s.D * elem / 4;
  const int32_t* limbs = static_cast<const int32_t*>(cache);
  const uint64_t* kk = reinterpret_cast<const uint64_t*>(c.limb_keys) + h * head_limbs;
  const uint64_t* kv = kk + row_limbs;
  uint64_t total = 0;
  for (int64_t o = 0; o < n; ++o) {
    const int64_t slot = blk * s.bs + o;
    const int32_t* k = limbs + slot * row_limbs + h * head_limbs;
    const int32_t* v = k + s.num_blocks * s.bs * row_limbs;
    uint64_t slot_sum = 0;
    for (int64_t j = 0; j < head_limbs; ++j)  // int64 products wrap: arithmetic mod 2^64
      slot_sum += uint64_t(int64_t(k[j])) * kk[j] + uint64_t(int64_t(v[j])) * kv[j];
    total += slot_sum * uint64_t(c.offset_keys[o]);
  }
  uint64_t* out = reinterpret_cast<uint64_t*>(c.read_sums) + (r * s.n_kv + h) * s.max_blocks + lb;
  *out += total;
}

// Ask for block `blk`'s K and V ahead of their use: blocks sit anywhere in the cache, so
// the hardware prefetcher cannot guess the next one.
template <typename T>
inline void prefetch_block(const T* cache, int64_t blk, const Shape& s, int64_t v_offset) {
  if (blk < 0 || blk >= s.num_blocks) return;
  const char* k = reinterpret_cast<const char*>(cache + blk * s.bs * s.row_elems);
  const char* v = reinterpret_cast<const char*>(cache + blk * s.bs * s.row_elems + v_offset);
  for (int64_t b = 0; b < int64_t(s.bs * s.row_elems * sizeof(T)); b += 64) {
    __builtin_prefetch(k + b);
    __builtin_prefetch(v + b);
  }
}

// One work item: row r's logical blocks [lb0, lb1) of its n keys, every kv head. Leaves
// the unnormalised accumulator acc (n_heads, D), running max m and sum l (n_heads).
// Whole blocks are widened at once (bs * n_kv * D contiguous elements); then each kv
// head's G query heads score and accumulate against its D columns of those rows.
template <typename T>
void attend_item(const T* q, const T* cache, const int64_t* table, const Shape& s, float scale,
                 int64_t n, int64_t lb0, int64_t lb1, float* acc, float* m, float* l,
                 float* buf, std::atomic<int64_t>& bad_block) {
  const int64_t G = s.G, D = s.D, bs = s.bs, H = s.n_kv * G, row = s.row_elems;
  float* qf = buf;          // (H, D) scaled queries
  float* kv = qf + H * D;   // (bs, n_kv, D) one block's K, then its V, in float32
  float* sc = kv + bs * row;  // (H, bs) scores, then probabilities (+ W floats of slack)
#ifdef PW_BF16_KERNEL
  constexpr bool is_bf16 = std::is_same_v<T, bf16_bits>;
  const bool fast_k = is_bf16 && D % 32 == 0;
  const AccumulateBf16 fast_v = is_bf16 ? pick_accumulate_bf16(G, D) : nullptr;
#else
  constexpr bool fast_k = false;
#endif
  to_float(q, qf, H * D);
  for (int64_t i = 0; i < H * D; ++i) qf[i] *= scale;
  std::fill(acc, acc + H * D, 0.f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.f);
  const int64_t v_offset = s.num_blocks * bs * row;
  for (int64_t lb = lb0; lb < lb1; ++lb) {
    const int64_t blk = table[lb];
    if (blk < 0 || blk >= s.num_blocks) {
      bad_block.store(blk);
      return;
    }
    const int64_t cnt = std::min(bs, n - lb * bs);
    const T* k_rows = cache + blk * bs * row;
    if (lb + 1 < lb1) prefetch_block(cache, table[lb + 1], s, v_offset);
    if (fast_k) {
#ifdef PW_BF16_KERNEL
      if constexpr (is_bf16)
        for (int64_t h = 0; h < s.n_kv; ++h)
          scores_bf16(q + h * G * D, k_rows + h * D, row, sc + h * G * bs, G, D, bs, cnt, scale);
#endif
    } else {
      to_float(k_rows, kv, cnt * row);
      for (int64_t h = 0; h < s.n_kv; ++h)
        scores(qf + h * G * D, kv + h * D, row, sc + h * G * bs, G, D, bs, cnt);
    }
    for (int64_t i = 0; i < H; ++i) {  // online softmax, one rescale per head and block
      const float alpha = softmax_block(sc + i * bs, cnt, m[i], l[i]);
      float* ai = acc + i * D;
      for (int64_t d = 0; d < D; ++d) ai[d] *= alpha;
    }
#ifdef PW_BF16_KERNEL
    if constexpr (is_bf16)
      if (fast_v) {
        for (int64_t h = 0; h < s.n_kv; ++h)
          fast_v(sc + h * G * bs, k_rows + v_offset + h * D, row, acc + h * G * D, bs, cnt);
        continue;
      }
#endif
    to_float(k_rows + v_offset, kv, cnt * row);
    for (int64_t h = 0; h < s.n_kv; ++h)
      accumulate(sc + h * G * bs, kv + h * D, row, acc + h * G * D, G, D, bs, cnt);
  }
}

Checks read_checks(const c10::optional<at::Tensor>& slot_tags,
                   const c10::optional<at::Tensor>& expected,
                   const c10::optional<at::Tensor>& tag_faults,
                   const c10::optional<at::Tensor>& read_sums,
                   const c10::optional<at::Tensor>& limb_keys,
                   const c10::optional<at::Tensor>& offset_keys, const Shape& s,
                   int64_t num_seqs, int64_t elem) {
  Checks c;
  if (slot_tags.has_value()) {
    TORCH_CHECK(expected.has_value() && tag_faults.has_value(), "tag checks need all three");
    TORCH_CHECK(slot_tags->is_contiguous() && slot_tags->numel() == s.num_blocks * s.bs);
    TORCH_CHECK(expected->dim() == 2 && expected->stride(1) == 1 &&
                expected->size(0) == num_seqs);
    TORCH_CHECK(tag_faults->is_contiguous() && tag_faults->scalar_type() == at::kInt &&
                tag_faults->size(0) == num_seqs && tag_faults->size(1) == s.max_blocks);
    c.slot_tags = slot_tags->data_ptr<int64_t>();
    c.expected = expected->data_ptr<int64_t>();
    c.exp_stride = expected->stride(0);
    c.tag_faults = tag_faults->data_ptr<int32_t>();
  }
  if (read_sums.has_value()) {
    TORCH_CHECK(limb_keys.has_value() && offset_keys.has_value(), "checksums need keys");
    TORCH_CHECK(read_sums->is_contiguous() && read_sums->size(0) == num_seqs &&
                read_sums->size(1) == s.n_kv && read_sums->size(2) == s.max_blocks);
    TORCH_CHECK(limb_keys->is_contiguous() && offset_keys->numel() == s.bs);
    TORCH_CHECK(s.D * elem % 4 == 0, "checksums read 32-bit limbs of each head's row");
    TORCH_CHECK(limb_keys->numel() == 2 * s.row_elems * elem / 4, "one key per limb, K and V");
    c.read_sums = read_sums->data_ptr<int64_t>();
    c.limb_keys = limb_keys->data_ptr<int64_t>();
    c.offset_keys = offset_keys->data_ptr<int64_t>();
  }
  return c;
}

Shape shape_of(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "cache must be contiguous (2, num_blocks, bs, n_kv, D)");
  TORCH_CHECK(tables.dim() == 2 && tables.is_contiguous() && tables.scalar_type() == at::kLong);
  Shape s;
  s.num_blocks = cache.size(1);
  s.bs = cache.size(2);
  s.n_kv = cache.size(3);
  s.D = cache.size(4);
  s.max_blocks = tables.size(1);
  s.row_elems = s.n_kv * s.D;
  TORCH_CHECK(q.dim() == 3 && q.size(2) == s.D && q.size(1) % s.n_kv == 0);
  s.G = q.size(1) / s.n_kv;
  return s;
}

template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                 const at::Tensor& seq_info, const at::Tensor& rows, double scale,
                 at::Tensor& out, const Checks& checks, const Shape& s, int64_t num_splits) {
  const int64_t num_rows = rows.numel(), D = s.D, bs = s.bs, H = s.n_kv * s.G;
  const int64_t num_seqs = tables.size(0);
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int32_t* info = seq_info.data_ptr<int32_t>();  // (3, S)
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const T* cp = reinterpret_cast<const T*>(cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t elem = cache.element_size(), q_stride = q.stride(0);
  const int64_t per_split = (s.max_blocks + num_splits - 1) / num_splits;
  // Partial results of every (row, split) item: acc (H, D), m (H), l (H).
  const int64_t items = num_rows * num_splits, part = H * D + 2 * H;
  std::vector<float> parts(items * part);
  std::atomic<int64_t> bad_block{0};
  const int64_t buf_len = H * D + bs * s.row_elems + H * bs + W;
  // Items are claimed one at a time (pool.h): rows differ in length, and a thread
  // that starts late (woken from sleep) takes fewer instead of being waited for.
  std::vector<std::vector<float>> bufs(pw::max_threads());
  pw::parallel_items(items, [&](int64_t it, int thread) {
    std::vector<float>& buf = bufs[thread];
    if (buf.empty()) buf.resize(buf_len);
    const int64_t split = it % num_splits, r = row_of[it / num_splits];
    const int64_t n = int64_t(info[2 * num_seqs + r]) + 1;  // context + the new token
    const int64_t lb0 = split * per_split;
    const int64_t lb1 = std::max(lb0, std::min((n + bs - 1) / bs, lb0 + per_split));
    float* acc = parts.data() + it * part;
    const int64_t* table = tp + r * s.max_blocks;
    attend_item<T>(qp + info[r] * q_stride, cp, table, s, float(scale), n, lb0, lb1, acc,
                   acc + H * D, acc + H * D + H, buf.data(), bad_block);
    for (int64_t lb = lb0; lb < lb1 && bad_block.load() == 0; ++lb) {
      const int64_t blk = table[lb], p0 = lb * bs, p1 = std::min(n, p0 + bs);
      if (checks.tag_faults) check_tags(checks, s, r, lb, blk, p0, p1);
      if (checks.read_sums)
        for (int64_t h = 0; h < s.n_kv; ++h)
          add_checksum(checks, s, cp, elem, r, h, lb, blk, p1 - p0);
    }
  });
  TORCH_CHECK(bad_block.load() == 0, "block table entry ", bad_block.load(),
              " out of range [0, ", s.num_blocks, ")");
  // Merge the splits of each (row, head) and normalise: a few hundred floats per row, so
  // threads only for large batches (at batch 64 x 9 heads the merge takes a few
  // microseconds, waking a sleeping thread 30-60).
  pw::parallel_ranges(0, num_rows * H, 8192, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t ri = begin; ri < end; ++ri) {
      const int64_t i = ri / H, head = ri % H;
      const float* first = parts.data() + i * num_splits * part;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < num_splits; ++j) mx = std::max(mx, first[j * part + H * D + head]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t j = 0; j < num_splits; ++j) {
        const float* p = first + j * part;
        const float l = p[H * D + H + head];
        if (l == 0.f) continue;  // an empty split
        const float w = exp_nonpos(p[H * D + head] - mx);
        total += l * w;
        for (int64_t d = 0; d < D; ++d) o[d] += w * p[head * D + d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      store(op + (info[row_of[i]] * H + head) * D, o.data(), D);
    }
  });
}

void decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                      const at::Tensor& seq_info, const at::Tensor& rows, double scale,
                      at::Tensor out, const c10::optional<at::Tensor>& slot_tags,
                      const c10::optional<at::Tensor>& expected,
                      const c10::optional<at::Tensor>& tag_faults,
                      const c10::optional<at::Tensor>& read_sums,
                      const c10::optional<at::Tensor>& limb_keys,
                      const c10::optional<at::Tensor>& offset_keys, int64_t num_splits) {
  const Shape s = shape_of(q, cache, tables);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must be (n_heads, D) dense");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes());
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and cache must share a dtype");
  TORCH_CHECK(seq_info.is_contiguous() && seq_info.scalar_type() == at::kInt &&
              seq_info.size(0) == 3 && seq_info.size(1) == tables.size(0));
  TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == at::kLong);
  TORCH_CHECK(num_splits >= 1);
  const Checks checks = read_checks(slot_tags, expected, tag_faults, read_sums, limb_keys,
                                    offset_keys, s, tables.size(0), cache.element_size());
  if (cache.scalar_type() == at::kFloat) {
    decode_impl<float>(q, cache, tables, seq_info, rows, scale, out, checks, s, num_splits);
  } else {
    TORCH_CHECK(cache.scalar_type() == at::kBFloat16, "cache must be float32 or bfloat16");
    decode_impl<bf16_bits>(q, cache, tables, seq_info, rows, scale, out, checks, s, num_splits);
  }
}

// fresh_attention: causal attention of n prompts of Q tokens each over their own K/V
// (bfloat16 with AVX512-BF16 only; kernels/attention.py's _fresh elsewhere).
// q, out (T, n_heads, D) and k, v (T, n_kv, D) rows may be strided (views of the qkv
// projection); prompt s's token t is flat token tokens[s * Q + t] (or s * Q + t).
// Work items are (prompt, kv head). Per item K is packed once into the pair layout
// vdpbf16ps multiplies (two bf16 per 32-bit lane) and V widened once to float32:
//     kp[kt][p][j]  = (K[16 kt + j][2p], K[16 kt + j][2p + 1])   16 keys x D/2 pairs a tile
//     vf[j][d]      = float(V[j][d])                             keys x D columns
// then for each of the kv head's G query heads and each tile of 16 queries, over the key
// tiles up to the diagonal: S (16 x 16) in 16 registers, one per query, summed over the
// D/2 pairs (exact bf16 products, float32 sums, as torch's bf16 GEMM); the diagonal tile
// masked; an online softmax of the 16 rows in float32; O (16 x D, float32) += P V with P
// kept in float32 (torch's bf16 SDPA rounds P to bf16 first; that rounding flipped a
// near-tie of the default model's first answer token); at the end O / l, rounded once.
// The packing is 2 of the item's ~70 passes over its K/V; every loop after it runs on
// registers and L1.
#ifdef PW_BF16_KERNEL
template <int NC>  // NC = D / 16
void fresh_item(const bf16_bits* q, int64_t qs, const bf16_bits* k, int64_t ks,
                const bf16_bits* v, int64_t vs, bf16_bits* out, int64_t os, const int64_t* rows,
                int64_t Q, int64_t G, int64_t h, float scale, uint32_t* kp, float* vf,
                uint32_t* qw, float* o) {
  constexpr int64_t D = NC * 16, P2 = D / 2;
  const int64_t KT = (Q + 15) / 16;
  std::fill(kp, kp + KT * 16 * P2, 0u);
  std::fill(vf + Q * D, vf + KT * 16 * D, 0.f);
  for (int64_t t = 0; t < Q; ++t) {
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(k + rows[t] * ks + h * D);
    for (int64_t p = 0; p < P2; ++p) kp[((t / 16) * P2 + p) * 16 + t % 16] = kr[p];
    to_float(v + rows[t] * vs + h * D, vf + t * D, D);
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    const int64_t head = h * G + g;
    for (int64_t qt = 0; qt < KT; ++qt) {
      const int64_t r = std::min<int64_t>(16, Q - qt * 16);
      std::fill(qw, qw + 16 * P2, 0u);
      for (int64_t i = 0; i < r; ++i)
        std::memcpy(qw + i * P2, q + rows[qt * 16 + i] * qs + head * D, D * sizeof(bf16_bits));
      std::fill(o, o + 16 * D, 0.f);
      alignas(64) float m[16], l[16], alpha[16] = {};
      std::fill(m, m + 16, -std::numeric_limits<float>::infinity());
      std::fill(l, l + 16, 0.f);
      alignas(64) float pf[16][16] = {};
      for (int64_t kt = 0; kt <= qt; ++kt) {
        // The 16 sums stay in registers over the k pairs and are stored once, after: the
        // softmax below indexes rows at run time, which an array of registers cannot be.
        alignas(64) float sc[16][16];
        {
          __m512 acc[16];
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
          for (int64_t p = 0; p < P2; ++p) {
            const __m512bh kv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + (kt * P2 + p) * 16));
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i)
              acc[i] = _mm512_dpbf16_ps(
                  acc[i], kv, reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(qw[i * P2 + p]))));
          }
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) _mm512_store_ps(sc[i], acc[i]);
        }
        // Online softmax of the 16 query rows (rows past r compute on zeros, unused), in
        // three passes of 16 independent rows each, so the rows' dependency chains
        // (max, exp, sum) overlap instead of running one after another.
        __mmask16 keep[16];
        alignas(64) float row_max[16], row_sum[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t valid = kt < qt ? 16 : i + 1;
          keep[i] = __mmask16(valid == 16 ? 0xFFFFu : (1u << valid) - 1);
          const __m512 si = _mm512_mask_blend_ps(
              keep[i], neg_inf, _mm512_mul_ps(_mm512_load_ps(sc[i]), _mm512_set1_ps(scale)));
          _mm512_store_ps(sc[i], si);
          row_max[i] = _mm512_reduce_max_ps(si);
        }
        const f32x16 m_old = load16(m), m_new = load16(row_max) > m_old ? load16(row_max) : m_old;
        store16(alpha, exp_nonpos(m_old - m_new));  // 0 on the first tile (m = -inf)
        store16(m, m_new);
        for (int i = 0; i < 16; ++i) {
          const f32x16 e = exp_nonpos(load16(sc[i]) - m[i]);
          const __m512 pe = _mm512_maskz_mov_ps(keep[i], __m512(e));
          row_sum[i] = _mm512_reduce_add_ps(pe);
          _mm512_store_ps(pf[i], pe);
        }
        store16(l, load16(l) * load16(alpha) + load16(row_sum));
        // O[i] = alpha O[i] + P[i] V in float32, R rows at a time: R * NC = 16
        // independent accumulators hide the FMA latency.
        constexpr int R = 16 / NC;
        const float* vt = vf + kt * 16 * D;
        for (int64_t i0 = 0; i0 < r; i0 += R) {
          __m512 a[R][NC];
          for (int i = 0; i < R; ++i) {
            const __m512 al = _mm512_set1_ps(alpha[i0 + i]);  // rows past r: harmless
            for (int c = 0; c < NC; ++c)
              a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (i0 + i) * D + c * 16), al);
          }
          for (int j = 0; j < 16; ++j) {
            __m512 vv[NC];
            for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(vt + j * D + c * 16);
            for (int i = 0; i < R; ++i) {
              const __m512 pj = _mm512_set1_ps(pf[i0 + i][j]);
              for (int c = 0; c < NC; ++c) a[i][c] = _mm512_fmadd_ps(pj, vv[c], a[i][c]);
            }
          }
          for (int i = 0; i < R; ++i)
            for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + (i0 + i) * D + c * 16, a[i][c]);
        }
      }
      for (int64_t i = 0; i < r; ++i) {
        const float inv = 1.f / l[i];
        for (int64_t d = 0; d < D; ++d) o[i * D + d] *= inv;
        store(out + rows[qt * 16 + i] * os + head * D, o + i * D, D);
      }
    }
  }
}
#endif

bool has_fresh_attention(int64_t head_dim) {
#ifdef PW_BF16_KERNEL
  return head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

void fresh_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out,
                     const c10::optional<at::Tensor>& tokens, int64_t num_prompts,
                     int64_t query_len, double scale) {
  const int64_t D = q.size(2), n_kv = k.size(1);
  TORCH_CHECK(has_fresh_attention(D), "fresh_attention needs AVX512-BF16 and head dim 64 or 128");
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&q, &k, &v, &out})
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == at::kBFloat16 && x->stride(2) == 1 &&
                    x->stride(1) == D && x->size(2) == D,
                "fresh_attention: bf16 (T, heads, D) rows with dense heads");
  TORCH_CHECK(q.size(1) % n_kv == 0 && v.size(1) == n_kv && out.sizes() == q.sizes());
  const int64_t T = num_prompts * query_len;
  std::vector<int64_t> rows(T);
  if (tokens.has_value()) {
    TORCH_CHECK(tokens->is_contiguous() && tokens->scalar_type() == at::kLong &&
                tokens->numel() == T);
    std::memcpy(rows.data(), tokens->data_ptr<int64_t>(), T * sizeof(int64_t));
  } else {
    for (int64_t t = 0; t < T; ++t) rows[t] = t;
  }
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(rows[t] >= 0 && rows[t] < q.size(0) && rows[t] < k.size(0), "token out of range");
#ifdef PW_BF16_KERNEL
  const int64_t G = q.size(1) / n_kv, KT = (query_len + 15) / 16;
  const auto* qp = reinterpret_cast<const bf16_bits*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const bf16_bits*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const bf16_bits*>(v.data_ptr());
  auto* op = reinterpret_cast<bf16_bits*>(out.data_ptr());
  struct Scratch {
    std::vector<uint32_t> kbuf, qbuf;
    std::vector<float> vbuf, obuf;
  };
  std::vector<Scratch> scratch(pw::max_threads());
  pw::parallel_items(num_prompts * n_kv, [&](int64_t it, int thread) {
    auto& [kbuf, qbuf, vbuf, obuf] = scratch[thread];
    if (kbuf.empty()) {
      kbuf.resize(KT * 16 * D / 2);
      qbuf.resize(16 * D / 2);
      vbuf.resize(KT * 16 * D);
      obuf.resize(16 * D);
    }
    const int64_t s = it / n_kv, h = it % n_kv;
    const int64_t* r = rows.data() + s * query_len;
    auto run = D == 64 ? fresh_item<4> : fresh_item<8>;
    run(qp, q.stride(0), kp, k.stride(0), vp, v.stride(0), op, out.stride(0), r, query_len, G,
        h, float(scale), kbuf.data(), vbuf.data(), qbuf.data(), obuf.data());
  });
#else
  (void)scale;
#endif
}

// Tags of positions [0, context + query) and checksums of positions [0, context) of the
// given rows, read through `tables` as decode_attention reads them (rows the torch path
// attends for).
void check_reads(const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& seq_info,
                 const at::Tensor& rows, const c10::optional<at::Tensor>& slot_tags,
                 const c10::optional<at::Tensor>& expected,
                 const c10::optional<at::Tensor>& tag_faults,
                 const c10::optional<at::Tensor>& read_sums,
                 const c10::optional<at::Tensor>& limb_keys,
                 const c10::optional<at::Tensor>& offset_keys) {
  const Shape s = shape_of(cache.new_empty({0, cache.size(3), cache.size(4)}), cache, tables);
  const int64_t num_seqs = tables.size(0);
  const Checks c = read_checks(slot_tags, expected, tag_faults, read_sums, limb_keys,
                               offset_keys, s, num_seqs, cache.element_size());
  const int32_t* info = seq_info.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t elem = cache.element_size(), bs = s.bs;
  std::atomic<int64_t> bad_block{0};
  pw::parallel_items(rows.numel() * s.n_kv, [&](int64_t it, int) {
    const int64_t r = row_of[it / s.n_kv], h = it % s.n_kv;
    const int64_t ctx = info[2 * num_seqs + r], n = ctx + info[num_seqs + r];
    for (int64_t lb = 0; lb * bs < n; ++lb) {
      const int64_t blk = tp[r * s.max_blocks + lb], p0 = lb * bs;
      if (blk < 0 || blk >= s.num_blocks) {
        bad_block.store(blk);
        return;
      }
      if (c.tag_faults && h == 0) check_tags(c, s, r, lb, blk, p0, std::min(n, p0 + bs));
      if (c.read_sums && p0 < ctx)
        add_checksum(c, s, cache.data_ptr(), elem, r, h, lb, blk, std::min(ctx, p0 + bs) - p0);
    }
  });
  TORCH_CHECK(bad_block.load() == 0, "block table entry ", bad_block.load(),
              " out of range [0, ", s.num_blocks, ")");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_pool", &pw::set_pool, "hand work items to the pool behind a cpu_pool capsule");
  m.def("decode_attention", &decode_attention, "paged decode attention with fused read checks");
  m.def("check_reads", &check_reads, "the read checks of rows attended by the torch path");
  m.def("fresh_attention", &fresh_attention, "causal attention of fresh bf16 prompts");
  m.def("has_fresh_attention", &has_fresh_attention, "whether fresh_attention runs here");
}
