// Shared pieces of the CPU attention kernels (attention_decode.cpp, attention_fresh.cpp,
// attention_step.cpp): float32 / bfloat16 element helpers, the branch-free exp, the
// online-softmax step and the logit cap on 16-lane vectors, the (row, logical block) read
// checks every kernel runs on what it reads, and the extension's entry points.
//
// Layouts shared by every kernel (one layer; T = the step's new tokens, S = its sequences):
//
//     q, out        (T, n_heads, D)      float32 or bfloat16
//     cache         (2, num_blocks, bs, n_kv, D) contiguous; 0 = K, 1 = V
//     tables        (S, max_blocks) int64  the step's padded block tables (meta.block_index)
//     seq_info      (3, S) int32           first token, query length, context length
//
// Read checks (when their tensors are given), through the very block id the K/V are read
// with, never raised here:
//   tags       each position p of a block read must hold expected[r, p] in
//              slot_tags[slot]; a mismatch sets tag_faults[r, lb] = 1.
//   checksums  each block read adds each kv head's share of the content checksum of
//              worker/integrity.py to read_sums[r, kv_head, lb] (the slot rows as signed
//              32-bit limbs times limb_keys[K/V, limb], times offset_keys[o], mod 2^64;
//              summed over kv heads and layers it is the block checksum), and
//              read_layers[r, lb] counts the layers that added theirs: a sliding-window
//              layer skips the blocks before its window, so only blocks every layer read
//              sum to the block checksum. A block's (row, lb) entries are written by one
//              work item per layer, so no atomics. An entry of -1 in read_layers asks
//              for no sum of that block (standard's scrub wants only its picks summed):
//              it is skipped and stays -1.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "pool.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PW_BF16_KERNEL 1
#endif

namespace pw_attn {

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

// cap * tanh(x / cap) of 16 lanes (Gemma 2's logit soft-capping), branch-free: the odd
// Taylor series to x^13 where |x / cap| < 0.4 (error below 2e-9), else
// (1 - e) / (1 + e) with e = exp(-2 |x / cap|) (a few float32 ulp).
inline f32x16 softcap16(f32x16 x, float cap) {
  const f32x16 t = x / cap;
  const f32x16 t2 = t * t;
  f32x16 p = t2 * (21844.f / 6081075) - 1382.f / 155925;
  p = p * t2 + 62.f / 2835;
  p = p * t2 - 17.f / 315;
  p = p * t2 + 2.f / 15;
  p = p * t2 - 1.f / 3;
  p = (p * t2 + 1.f) * t;
  const f32x16 a = t < 0 ? -t : t;
  const f32x16 e = exp_nonpos(-2.f * a);
  f32x16 big = (1.f - e) / (1.f + e);
  big = t < 0 ? -big : big;
  return (a < 0.4f ? p : big) * cap;
}

// softcap16 of the cnt floats at s, in place; s may be read (not written) up to 15
// floats past cnt.
inline void softcap_row(float* s, int64_t cnt, float cap) {
  for (int64_t o = 0; o < cnt; o += W) {
    const f32x16 v = softcap16(load16(s + o), cap);
    std::memcpy(s + o, &v, std::min<int64_t>(W, cnt - o) * sizeof(float));
  }
}

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
  int32_t* read_layers = nullptr;  // (S, max_blocks), with read_sums
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
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (head_limbs % 8 == 0) {
    // 8 limbs a lane group; each slot's lanes times its offset key, added lane-wise, and
    // one horizontal sum per block (the products distribute: the same sum mod 2^64).
    __m512i tot = _mm512_setzero_si512();
    for (int64_t o = 0; o < n; ++o) {
      const int32_t* k = limbs + (blk * s.bs + o) * row_limbs + h * head_limbs;
      const int32_t* v = k + s.num_blocks * s.bs * row_limbs;
      __m512i acc = _mm512_setzero_si512();
      for (int64_t j = 0; j < head_limbs; j += 8) {
        const __m512i kx = _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + j)));
        const __m512i vx = _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j)));
        acc = _mm512_add_epi64(acc, _mm512_mullo_epi64(kx, _mm512_loadu_si512(kk + j)));
        acc = _mm512_add_epi64(acc, _mm512_mullo_epi64(vx, _mm512_loadu_si512(kv + j)));
      }
      tot = _mm512_add_epi64(tot, _mm512_mullo_epi64(acc, _mm512_set1_epi64(c.offset_keys[o])));
    }
    total = static_cast<uint64_t>(_mm512_reduce_add_epi64(tot));
  } else
#endif
  {
    for (int64_t o = 0; o < n; ++o) {
      const int64_t slot = blk * s.bs + o;
      const int32_t* k = limbs + slot * row_limbs + h * head_limbs;
      const int32_t* v = k + s.num_blocks * s.bs * row_limbs;
      uint64_t slot_sum = 0;
      for (int64_t j = 0; j < head_limbs; ++j)  // int64 products wrap: arithmetic mod 2^64
        slot_sum += uint64_t(int64_t(k[j])) * kk[j] + uint64_t(int64_t(v[j])) * kv[j];
      total += slot_sum * uint64_t(c.offset_keys[o]);
    }
  }
  uint64_t* out = reinterpret_cast<uint64_t*>(c.read_sums) + (r * s.n_kv + h) * s.max_blocks + lb;
  *out += total;
}

// Whether row r's block lb is to be summed (read_layers not -1). Relaxed atomics: in
// check_reads the kv head 0 item counts the layer while the other heads' items ask.
inline bool wants_sum(const Checks& c, const Shape& s, int64_t r, int64_t lb) {
  return __atomic_load_n(c.read_layers + r * s.max_blocks + lb, __ATOMIC_RELAXED) >= 0;
}

// One more layer added its checksum shares of row r's block lb (all kv heads).
inline void count_layer(const Checks& c, const Shape& s, int64_t r, int64_t lb) {
  __atomic_fetch_add(c.read_layers + r * s.max_blocks + lb, 1, __ATOMIC_RELAXED);
}

inline Checks read_checks(const c10::optional<at::Tensor>& slot_tags,
                   const c10::optional<at::Tensor>& expected,
                   const c10::optional<at::Tensor>& tag_faults,
                   const c10::optional<at::Tensor>& read_sums,
                   const c10::optional<at::Tensor>& read_layers,
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
    TORCH_CHECK(read_layers.has_value() && read_layers->is_contiguous() &&
                    read_layers->scalar_type() == at::kInt && read_layers->size(0) == num_seqs &&
                    read_layers->size(1) == s.max_blocks,
                "checksums count the layers that read each block: read_layers (S, max_blocks)");
    c.read_sums = read_sums->data_ptr<int64_t>();
    c.read_layers = read_layers->data_ptr<int32_t>();
    c.limb_keys = limb_keys->data_ptr<int64_t>();
    c.offset_keys = offset_keys->data_ptr<int64_t>();
  }
  return c;
}

inline Shape shape_of(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables) {
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

// The extension's entry points (attention_module.cpp binds them).
void decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                      const at::Tensor& seq_info, const at::Tensor& rows, double scale,
                      at::Tensor out, const c10::optional<at::Tensor>& slot_tags,
                      const c10::optional<at::Tensor>& expected,
                      const c10::optional<at::Tensor>& tag_faults,
                      const c10::optional<at::Tensor>& read_sums,
                      const c10::optional<at::Tensor>& read_layers,
                      const c10::optional<at::Tensor>& limb_keys,
                      const c10::optional<at::Tensor>& offset_keys, int64_t num_splits,
                      c10::optional<int64_t> sliding_window, c10::optional<double> softcap);
void check_reads(const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& seq_info,
                 const at::Tensor& rows, const c10::optional<at::Tensor>& slot_tags,
                 const c10::optional<at::Tensor>& expected,
                 const c10::optional<at::Tensor>& tag_faults,
                 const c10::optional<at::Tensor>& read_sums,
                 const c10::optional<at::Tensor>& read_layers,
                 const c10::optional<at::Tensor>& limb_keys,
                 const c10::optional<at::Tensor>& offset_keys,
                 c10::optional<int64_t> sliding_window);
void write_kv(at::Tensor cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& new_tags,
              const c10::optional<at::Tensor>& slot_tags);
at::Tensor rope_write_decode(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor cache, const at::Tensor& slot_mapping,
                             const c10::optional<at::Tensor>& new_tags,
                             const c10::optional<at::Tensor>& slot_tags, const at::Tensor& tables,
                             const at::Tensor& seq_info, const at::Tensor& rows, double scale,
                             const c10::optional<at::Tensor>& read_tags,
                             const c10::optional<at::Tensor>& expected,
                             const c10::optional<at::Tensor>& tag_faults,
                             const c10::optional<at::Tensor>& read_sums,
                             const c10::optional<at::Tensor>& read_layers,
                             const c10::optional<at::Tensor>& limb_keys,
                             const c10::optional<at::Tensor>& offset_keys, int64_t num_splits,
                             c10::optional<int64_t> sliding_window, c10::optional<double> softcap);
bool has_fresh_attention(int64_t head_dim);
void fresh_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out,
                     const c10::optional<at::Tensor>& tokens, int64_t num_prompts,
                     int64_t query_len, double scale, c10::optional<int64_t> sliding_window,
                     c10::optional<double> softcap);

}  // namespace pw_attn
