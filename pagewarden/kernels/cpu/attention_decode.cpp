// Paged decode attention for CPU, reading K/V in place through the block tables, with
// the read checks of attention_common.h fused into the same loop; and check_reads, the
// same checks without attention, for the rows the torch path computes.
//
// Layouts (attention_common.h): q, out (T, n_heads, D) in the cache's dtype (float32 or
// bfloat16; out contiguous, q's tokens may be strided); cache (2, num_blocks, bs, n_kv,
// D); tables (S, max_blocks) int64; seq_info (3, S) int32; rows (S_b,) int64, the rows
// of tables / seq_info a call computes.
//
// decode_attention: each row r is a sequence with one new token at flat token
// seq_info[0, r], which attends to its keys at positions [first, n), n = context + 1,
// first = 0 or, with a sliding window of W keys, max(0, n - W); key p is stored at slot
// tables[r, p / bs] * bs + p % bs. Blocks before block first / bs are never read, and the
// keys of that block before `first` are skipped, not masked. Work items are (row,
// split), one per thread at a time: when the rows are too few to keep every thread busy,
// each row's key range is split into runs of whole blocks (flash-decoding) whose partial
// results a second pass merges. Loop order inside an item: over its logical blocks lb,
// each read in place through tables[r, lb] (no gathered copy; the next block
// prefetched); per block, all bs * n_kv * D K values -> float32 at once (contiguous),
// then per kv head the (G, bs) scores of its G = n_heads / n_kv query heads (grouped-query
// attention: the G heads share every K/V row loaded, nothing is repeated), capped to
// softcap * tanh(score / softcap) when a cap is given, one online-softmax rescale per
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
// Checks: every block an item reads is checked whole (tags of its positions up to n,
// checksum shares, one count in read_layers), through the block id it was read with.
// check_reads does the same for rows of any query length: tags of positions up to
// context + query, checksums of the context, of the blocks from the one holding the
// first query's first key (all of them without a window).
//
// A block id outside [0, num_blocks) stops the item and raises after the loop, as
// torch's own gathers would. kernels/attention.py (plain torch) is the reference the
// tests compare with.

#include "attention_common.h"

namespace pw_attn {
namespace {


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
#ifdef PW_BF16_KERNEL

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

// acc[g] += sum_o p[g, o] * v[o] for G heads of D = 16 * NC * CH columns, in CH column
// chunks of 16 * NC: a chunk's G * NC accumulators in registers, each V row's chunk
// widened once and used by every head.
template <int G, int NC, int CH = 1>
void accumulate_bf16(const float* p, const bf16_bits* v, int64_t vs, float* acc, int64_t bs,
                     int64_t cnt) {
  constexpr int64_t D = 16 * NC * CH;
  for (int64_t c0 = 0; c0 < D; c0 += 16 * NC) {
    __m512 a[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + c0 + c * 16);
    for (int64_t o = 0; o < cnt; ++o) {
      __m512 row[NC];
      for (int c = 0; c < NC; ++c) row[c] = widen16(v + o * vs + c0 + c * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * bs + o]);
        for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(pg, row[c], a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * D + c0 + c * 16, a[g][c]);
  }
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
  } else if (D == 256) {  // Gemma: four chunks of 64 columns
    switch (G) {
      case 1: return accumulate_bf16<1, 8, 2>;
      case 2: return accumulate_bf16<2, 4, 4>;
      case 3: return accumulate_bf16<3, 4, 4>;
      case 4: return accumulate_bf16<4, 4, 4>;
      case 5: return accumulate_bf16<5, 4, 4>;
      case 6: return accumulate_bf16<6, 4, 4>;
    }
  }
  return nullptr;
}
#endif

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

// One work item: row r's logical blocks [lb0, lb1) of its keys [first, n), every kv
// head (first > 0 for a sliding window: the keys of block lb0 before it are skipped, not
// masked). Leaves the unnormalised accumulator acc (n_heads, D), running max m and sum l
// (n_heads). Whole blocks are widened at once (bs * n_kv * D contiguous elements); then
// each kv head's G query heads score and accumulate against its D columns of those rows.
// cap > 0: scores become cap * tanh(score / cap) before the softmax.
template <typename T>
void attend_item(const T* q, const T* cache, const int64_t* table, const Shape& s, float scale,
                 float cap, int64_t first, int64_t n, int64_t lb0, int64_t lb1, float* acc,
                 float* m, float* l, float* buf, std::atomic<int64_t>& bad_block) {
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
    const int64_t skip = std::max<int64_t>(0, first - lb * bs);  // keys before the window
    const int64_t cnt = std::min(bs, n - lb * bs) - skip;
    const T* k_rows = cache + (blk * bs + skip) * row;
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
    if (cap > 0.f)
      for (int64_t i = 0; i < H; ++i) softcap_row(sc + i * bs, cnt, cap);
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


template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                 const at::Tensor& seq_info, const at::Tensor& rows, double scale,
                 at::Tensor& out, const Checks& checks, const Shape& s, int64_t num_splits,
                 int64_t window, float cap) {
  const int64_t num_rows = rows.numel(), D = s.D, bs = s.bs, H = s.n_kv * s.G;
  const int64_t num_seqs = tables.size(0);
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int32_t* info = seq_info.data_ptr<int32_t>();  // (3, S)
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const T* cp = reinterpret_cast<const T*>(cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t elem = cache.element_size(), q_stride = q.stride(0);
  // Blocks a row may read: all of its table, or at most the blocks a window of `window`
  // keys can touch (not aligned to a block: one more than it fills).
  const int64_t span = window > 0 ? std::min(s.max_blocks, (window + bs - 2) / bs + 1)
                                  : s.max_blocks;
  const int64_t per_split = (span + num_splits - 1) / num_splits;
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
    const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;  // first key
    const int64_t lb0 = first / bs + split * per_split;
    const int64_t lb1 = std::max(lb0, std::min((n + bs - 1) / bs, lb0 + per_split));
    float* acc = parts.data() + it * part;
    const int64_t* table = tp + r * s.max_blocks;
    attend_item<T>(qp + info[r] * q_stride, cp, table, s, float(scale), cap, first, n, lb0, lb1,
                   acc, acc + H * D, acc + H * D + H, buf.data(), bad_block);
    // Every block read is checked whole (its keys before the window too).
    for (int64_t lb = lb0; lb < lb1 && bad_block.load() == 0; ++lb) {
      const int64_t blk = table[lb], p0 = lb * bs, p1 = std::min(n, p0 + bs);
      if (checks.tag_faults) check_tags(checks, s, r, lb, blk, p0, p1);
      if (checks.read_sums && wants_sum(checks, s, r, lb)) {
        for (int64_t h = 0; h < s.n_kv; ++h)
          add_checksum(checks, s, cp, elem, r, h, lb, blk, p1 - p0);
        count_layer(checks, s, r, lb);
      }
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

}  // namespace

void decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                      const at::Tensor& seq_info, const at::Tensor& rows, double scale,
                      at::Tensor out, const c10::optional<at::Tensor>& slot_tags,
                      const c10::optional<at::Tensor>& expected,
                      const c10::optional<at::Tensor>& tag_faults,
                      const c10::optional<at::Tensor>& read_sums,
                      const c10::optional<at::Tensor>& read_layers,
                      const c10::optional<at::Tensor>& limb_keys,
                      const c10::optional<at::Tensor>& offset_keys, int64_t num_splits,
                      c10::optional<int64_t> sliding_window, c10::optional<double> softcap) {
  const Shape s = shape_of(q, cache, tables);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must be (n_heads, D) dense");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes());
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and cache must share a dtype");
  TORCH_CHECK(seq_info.is_contiguous() && seq_info.scalar_type() == at::kInt &&
              seq_info.size(0) == 3 && seq_info.size(1) == tables.size(0));
  TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == at::kLong);
  TORCH_CHECK(num_splits >= 1);
  TORCH_CHECK(!sliding_window || *sliding_window >= 1, "sliding_window must be >= 1");
  TORCH_CHECK(!softcap || *softcap > 0, "softcap must be > 0");
  const int64_t window = sliding_window.value_or(0);  // 0: every key
  const float cap = float(softcap.value_or(0.0));    // 0: no cap
  const Checks checks = read_checks(slot_tags, expected, tag_faults, read_sums, read_layers,
                                    limb_keys, offset_keys, s, tables.size(0), cache.element_size());
  if (cache.scalar_type() == at::kFloat) {
    decode_impl<float>(q, cache, tables, seq_info, rows, scale, out, checks, s, num_splits,
                       window, cap);
  } else {
    TORCH_CHECK(cache.scalar_type() == at::kBFloat16, "cache must be float32 or bfloat16");
    decode_impl<bf16_bits>(q, cache, tables, seq_info, rows, scale, out, checks, s, num_splits,
                           window, cap);
  }
}

// Tags of positions [first, context + query) and checksums of positions [first, context)
// of the given rows, whole blocks, read through `tables` as decode_attention reads them
// (rows the torch path attends for): first = 0, or for a sliding window the start of the
// block holding the first query's first key (the torch path reads from that block on).
void check_reads(const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& seq_info,
                 const at::Tensor& rows, const c10::optional<at::Tensor>& slot_tags,
                 const c10::optional<at::Tensor>& expected,
                 const c10::optional<at::Tensor>& tag_faults,
                 const c10::optional<at::Tensor>& read_sums,
                 const c10::optional<at::Tensor>& read_layers,
                 const c10::optional<at::Tensor>& limb_keys,
                 const c10::optional<at::Tensor>& offset_keys,
                 c10::optional<int64_t> sliding_window) {
  const Shape s = shape_of(cache.new_empty({0, cache.size(3), cache.size(4)}), cache, tables);
  const int64_t num_seqs = tables.size(0);
  const Checks c = read_checks(slot_tags, expected, tag_faults, read_sums, read_layers,
                               limb_keys, offset_keys, s, num_seqs, cache.element_size());
  TORCH_CHECK(!sliding_window || *sliding_window >= 1, "sliding_window must be >= 1");
  const int64_t window = sliding_window.value_or(0);  // 0: every key
  const int32_t* info = seq_info.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t elem = cache.element_size(), bs = s.bs;
  std::atomic<int64_t> bad_block{0};
  pw::parallel_items(rows.numel() * s.n_kv, [&](int64_t it, int) {
    const int64_t r = row_of[it / s.n_kv], h = it % s.n_kv;
    const int64_t ctx = info[2 * num_seqs + r], n = ctx + info[num_seqs + r];
    const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window + 1) : 0;
    for (int64_t lb = first / bs; lb * bs < n; ++lb) {
      const int64_t blk = tp[r * s.max_blocks + lb], p0 = lb * bs;
      if (blk < 0 || blk >= s.num_blocks) {
        bad_block.store(blk);
        return;
      }
      if (c.tag_faults && h == 0) check_tags(c, s, r, lb, blk, p0, std::min(n, p0 + bs));
      if (c.read_sums && p0 < ctx && wants_sum(c, s, r, lb)) {
        add_checksum(c, s, cache.data_ptr(), elem, r, h, lb, blk, std::min(ctx, p0 + bs) - p0);
        if (h == 0) count_layer(c, s, r, lb);
      }
    }
  });
  TORCH_CHECK(bad_block.load() == 0, "block table entry ", bad_block.load(),
              " out of range [0, ", s.num_blocks, ")");
}

}  // namespace pw_attn
