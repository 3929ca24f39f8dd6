// fresh_attention: causal attention of n prompts of Q tokens each over their own K/V
// (bfloat16 with AVX512-BF16 only; kernels/attention.py's _fresh elsewhere). It reads no
// cache, so it checks nothing itself: the step's own K/V were just written, and
// check_reads (attention_decode.cpp) checks their tags through the block tables.
// q, out (T, n_heads, D) and k, v (T, n_kv, D) rows may be strided (views of the qkv
// projection); prompt s's token t is flat token tokens[s * Q + t] (or s * Q + t).
// Work items are (prompt, kv head). Per item K is packed once into the pair layout
// vdpbf16ps multiplies (two bf16 per 32-bit lane) and V widened once to float32:
//     kp[kt][p][j]  = (K[16 kt + j][2p], K[16 kt + j][2p + 1])   16 keys x D/2 pairs a tile
//     vf[j][d]      = float(V[j][d])                             keys x D columns
// then for each of the kv head's G query heads and each tile of 16 queries, over the key
// tiles from the one holding the tile's first query's first key (the first, without a
// sliding window) up to the diagonal: S (16 x 16) in 16 registers, one per query, summed
// over the D/2 pairs (exact bf16 products, float32 sums, as torch's bf16 GEMM); scaled,
// capped to softcap * tanh(S / softcap) when a cap is given; keys outside each query's
// window (j <= i, and i - W < j with a window of W) masked; an online softmax of the 16
// rows in float32; O (16 x D, float32) += P V with P kept in float32 (torch's bf16 SDPA rounds P to bf16 first; that rounding flipped a
// near-tie of the default model's first answer token); at the end O / l, rounded once.
// The packing is 2 of the item's ~70 passes over its K/V; every loop after it runs on
// registers and L1.

#include <initializer_list>

#include "attention_common.h"

namespace pw_attn {

#ifdef PW_BF16_KERNEL
template <int NC>  // NC = D / 16
void fresh_item(const bf16_bits* q, int64_t qs, const bf16_bits* k, int64_t ks,
                const bf16_bits* v, int64_t vs, bf16_bits* out, int64_t os, const int64_t* rows,
                int64_t Q, int64_t G, int64_t h, float scale, int64_t window, float cap,
                uint32_t* kp, float* vf, uint32_t* qw, float* o) {
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
      // A sliding window starts at the key tile of the tile's first query's first key.
      const int64_t kt0 = window > 0 ? std::max<int64_t>(0, qt * 16 - window + 1) / 16 : 0;
      for (int64_t kt = kt0; kt <= qt; ++kt) {
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
          // Keys [lo, hi) of this tile: causal on the diagonal tile, and with a window
          // from query qt * 16 + i's first key (a row may keep none of a tile).
          const int64_t hi = kt < qt ? 16 : i + 1;
          const int64_t lo = window > 0 ? qt * 16 + i - window + 1 - kt * 16 : 0;
          const uint32_t upto = hi == 16 ? 0xFFFFu : (1u << hi) - 1;
          const uint32_t below = lo <= 0 ? 0u : lo >= 16 ? 0xFFFFu : (1u << lo) - 1;
          keep[i] = __mmask16(upto & ~below);
          __m512 scaled = _mm512_mul_ps(_mm512_load_ps(sc[i]), _mm512_set1_ps(scale));
          if (cap > 0.f) scaled = __m512(softcap16(f32x16(scaled), cap));
          const __m512 si = _mm512_mask_blend_ps(keep[i], neg_inf, scaled);
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
        // independent accumulators hide the FMA latency (R = 1 for D = 256).
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
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
  (void)head_dim;
  return false;
#endif
}

void fresh_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out,
                     const c10::optional<at::Tensor>& tokens, int64_t num_prompts,
                     int64_t query_len, double scale, c10::optional<int64_t> sliding_window,
                     c10::optional<double> softcap) {
  const int64_t D = q.size(2), n_kv = k.size(1);
  TORCH_CHECK(has_fresh_attention(D), "fresh_attention needs AVX512-BF16 and head dim 64, 128 or 256");
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&q, &k, &v, &out})
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == at::kBFloat16 && x->stride(2) == 1 &&
                    x->stride(1) == D && x->size(2) == D,
                "fresh_attention: bf16 (T, heads, D) rows with dense heads");
  TORCH_CHECK(q.size(1) % n_kv == 0 && v.size(1) == n_kv && out.sizes() == q.sizes());
  TORCH_CHECK(!sliding_window || *sliding_window >= 1, "sliding_window must be >= 1");
  TORCH_CHECK(!softcap || *softcap > 0, "softcap must be > 0");
  const int64_t window = sliding_window.value_or(0);  // 0: every earlier key
  const float cap = float(softcap.value_or(0.0));    // 0: no cap
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
    auto run = D == 64 ? fresh_item<4> : D == 128 ? fresh_item<8> : fresh_item<16>;
    run(qp, q.stride(0), kp, k.stride(0), vp, v.stride(0), op, out.stride(0), r, query_len, G,
        h, float(scale), window, cap, kbuf.data(), vbuf.data(), qbuf.data(), obuf.data());
  });
#else
  (void)scale;
  (void)window;
  (void)cap;
#endif
}

}  // namespace pw_attn
