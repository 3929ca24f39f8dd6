// The int8 path of quant.cpp (llama.cpp's approach): the activation rows are quantized
// once per GEMM to int8 in blocks of 32 (one float32 scale per block), and each 32-weight
// piece of a GGUF block is dotted with them in integers (AVX512-VNNI vpdpbusd on 256-bit
// registers: unsigned weight quants x signed activation quants, four products per int32
// lane), the block's scales applied to the int32 sums in float32.
//
// Every supported type is written, per 32 weights and per half of 16, as
//     w_j = A_h * u_j - B_h        u_j in [0, 255] the unsigned quant
//     Q4_0 u = q, A = d, B = 8d     Q4_1 u = q, A = d, B = -m     Q8_0 u = q + 128, A = d, B = 128d
//     Q5_0 u = q, A = d, B = 16d    Q5_1 u = q, A = d, B = -m
//     Q4_K / Q5_K  A = d * sc, B = dmin * mn    Q6_K  A_h = d * sc_h, B_h = 32 A_h (per 16)
// and an activation block as x_j ~ dx * v_j (v_j int8, dx = max|x| / 127), so
//     sum_j w_j x_j ~ dx * sum_h A_h * (sum_{j in h} u_j v_j) - sum_h B_h * (dx * sum_{j in h} v_j).
// The integer dot runs per int32 lane (4 weights); lanes 0-3 are half 0, lanes 4-7 half 1,
// so A and B are 8-lane vectors and the activation side keeps, per block, dx and the 8
// lane sums dx * (v_4l + ... + v_4l+3) (`xs`), computed once with the quantization.
//
// Accuracy: the weights are used exactly (integers and the file's scales); the error is
// that of rounding each activation to 8 bits per block of 32 (relative step 1/254 of the
// block's largest value), as in llama.cpp's Q8 activations. Not the bf16 path's numerics:
// greedy tokens can differ from --quantization none (docs/quantization.md).
//
// One activation row (a single stream's decode step, the case pick_kernel sends here) runs
// the GEMV of quant_int8_row.h: 512-bit registers over two blocks, the per-block scales
// applied 16 blocks at a time, the offset term from precomputed activation sums, 4 weight
// rows per pass (PAGEWARDEN_INT8_ROW=0 sends it through the loop below instead).
//
// Loop order (2 rows and more): items of the kernels' pool are 16 output columns (silu:
// 8 gate + 8 up rows); inside, R (<= 4) activation rows x C weight rows accumulate in
// float32 lanes, each weight piece decoded once per group of R rows.

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "pool.h"
#include "quant_decode.h"
#include "quant_int8.h"
#include "quant_scalar.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "gemm_tile.h"  // the vector GELU-tanh epilogue of the one-row GEMV

namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
// Piece s (32 weights) of block b: unsigned quants u and the lane vectors A, B
// (quant_decode.h's decode_u; lanes 0-3 half 0, lanes 4-7 half 1).
template <int type>
inline void decode(const uint8_t* b, int s, __m256i& u, __m256& a, __m256& bias) {
  float av[2], bv[2];
  u = decode_u<type>(b, s, av, bv);
  if constexpr (type == Q6_K) {
    a = _mm256_set_m128(_mm_set1_ps(av[1]), _mm_set1_ps(av[0]));
    bias = _mm256_set_m128(_mm_set1_ps(bv[1]), _mm_set1_ps(bv[0]));
  } else {
    a = _mm256_set1_ps(av[0]);
    bias = _mm256_set1_ps(bv[0]);
  }
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The activations quantized: per row, K int8 and per 32-block dx and 8 lane sums.
struct QuantX {
  std::vector<int8_t> q;  // (M, K)
  std::vector<float> d;   // (M, K / 32)
  std::vector<float> xs;  // (M, K / 32, 8)
};

void quantize_rows(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, QuantX* out) {
  const int64_t nb = k / 32;
  out->q.resize(size_t(m * k));
  out->d.resize(size_t(m * nb));
  out->xs.resize(size_t(m * nb * 8));
  pw::parallel_ranges(0, m * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t bi = b0; bi < b1; ++bi) {
      const int64_t i = bi / nb, blk = bi % nb;
      const uint16_t* src = x + i * ldx + blk * 32;
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load32(reinterpret_cast<const uint8_t*>(src))), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load32(reinterpret_cast<const uint8_t*>(src + 16))), 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 idv = _mm512_set1_ps(id);
      const __m128i qlo = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, idv)));
      const __m128i qhi = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, idv)));
      const __m256i qv = _mm256_set_m128i(qhi, qlo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->q.data() + i * k + blk * 32), qv);
      out->d[size_t(bi)] = d;
      const __m256i lane = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), qv);
      _mm256_storeu_ps(out->xs.data() + bi * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(lane), _mm256_set1_ps(d)));
    }
  });
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }
// torch's gelu(approximate="tanh")
inline float gelu_tanh(float g) { return 0.5f * g * (1.0f + std::tanh(0.7978845608f * (g + 0.044715f * g * g * g))); }
// The gated epilogue: act(gate) * up, act SiLU or (p.gelu) GELU-tanh.
inline float gated(const Int8Problem& p, float g, float u) { return (p.gelu ? gelu_tanh(g) : silu(g)) * u; }

template <int type>
struct Int8Gemm {
  const Int8Problem& p;
  const QuantX& xq;
  int block_weights, block_bytes;

  // sums[i][j] = row (i0 + i) of x . weight row wrows[j], i < R, j < C.
  template <int R, int C>
  void dots(int64_t i0, const int64_t* wrows, float (*sums)[4]) const {
    __m256 acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
    const uint8_t* rows[C];
    for (int j = 0; j < C; ++j) rows[j] = p.w + wrows[j] * p.row_bytes;
    const int pieces = block_weights / 32;
    const int64_t nb = p.k / 32;
    const int8_t* xbase = xq.q.data() + i0 * p.k;
    const float* dbase = xq.d.data() + i0 * nb;
    const float* sbase = xq.xs.data() + i0 * nb * 8;
    for (int64_t blk = 0, pc = 0; blk < p.k / block_weights; ++blk) {
      const int64_t off = blk * block_bytes;
      for (int s = 0; s < pieces; ++s, ++pc) {
        __m256i u[C];
        __m256 a[C], bias[C];
        for (int j = 0; j < C; ++j) decode<type>(rows[j] + off, s, u[j], a[j], bias[j]);
        for (int i = 0; i < R; ++i) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xbase + i * p.k + pc * 32));
          const __m256 dx = _mm256_set1_ps(dbase[i * nb + pc]);
          const __m256 xs = _mm256_loadu_ps(sbase + (i * nb + pc) * 8);
          for (int j = 0; j < C; ++j) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u[j], v));
            acc[i][j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(a[j], dx), acc[i][j]);
            acc[i][j] = _mm256_fnmadd_ps(bias[j], xs, acc[i][j]);
          }
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) sums[i][j] = hsum(acc[i][j]);
  }

  void store(int64_t i, int64_t n, float v) const {
    if (p.res) v += bf16_to_float(p.res[i * p.ldres + n]);
    if (p.out_f32)
      p.out_f32[i * p.n_out + n] = v;
    else
      p.out[i * p.n_out + n] = c10::BFloat16(v).x;
  }
  static float bf16_to_float(uint16_t v) {
    const uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }

  template <int R>
  void rows_r(int64_t i0, int64_t n0, int64_t n1) const {
    constexpr int C = R <= 2 ? 4 : 2;  // weight rows per pass (silu: gate and up rows)
    float sums[4][4];
    const int per = p.silu ? C / 2 : C;
    for (int64_t n = n0; n < n1; n += per) {
      const int cnt = int(std::min<int64_t>(per, n1 - n));
      int64_t wrows[C];
      for (int j = 0; j < C; ++j) {
        const int o = std::min(j % per, cnt - 1);  // a short pass repeats its last row
        wrows[j] = n + o + (p.silu && j >= per ? p.n_out : 0);
      }
      dots<R, C>(i0, wrows, sums);
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < cnt; ++j)
          store(i0 + i, n + j, p.silu ? gated(p, sums[i][j], sums[i][j + per]) : sums[i][j]);
    }
  }

  void item(int64_t n0, int64_t n1) const {
    for (int64_t i0 = 0; i0 < p.m; i0 += 4) {
      switch (std::min<int64_t>(4, p.m - i0)) {
        case 1: rows_r<1>(i0, n0, n1); break;
        case 2: rows_r<2>(i0, n0, n1); break;
        case 3: rows_r<3>(i0, n0, n1); break;
        default: rows_r<4>(i0, n0, n1); break;
      }
    }
  }
};

}  // namespace

#include "quant_int8_row.h"

namespace {

// PAGEWARDEN_INT8_ROW=0: one-row calls take the multi-row loop too (tests, benches).
bool row_kernel_off() {
  const char* v = std::getenv("PAGEWARDEN_INT8_ROW");
  return v != nullptr && v[0] == '0';
}

inline float bf16_bits_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One activation row (quant_int8_row.h): items of whole passes, about 8 per thread so both
// cores stream to the end.
template <int type>
void run_row(const Int8Problem& p) {
  thread_local row1::RowX xr;  // the caller's: the workers only read it during the call
  row1::quantize_row(p.x, p.k, type, &xr);
  TypeInfo ti;
  type_info(type, &ti);
  const row1::RowGemv<type> g{xr, p.k, ti.block_bytes};
  constexpr int C = row1::rows_per_pass(type);
  const int per = p.silu ? C / 2 : C;
  const int64_t passes = (p.n_out + per - 1) / per;
  const int64_t per_item = std::max<int64_t>(4, passes / (8 * int64_t(pw::max_threads())));
  const int64_t items = (passes + per_item - 1) / per_item;
  pw::parallel_items(items, [&](int64_t it, int) {
    const int64_t n_end = std::min(p.n_out, (it + 1) * per_item * per);
    for (int64_t n = it * per_item * per; n < n_end; n += per) {
      const int cnt = int(std::min<int64_t>(per, n_end - n));
      const uint8_t* rows[C];
      for (int j = 0; j < C; ++j) {
        const int64_t o = std::min(j % per, cnt - 1);  // a short pass repeats its last row
        rows[j] = p.w + (n + o + (p.silu && j >= per ? p.n_out : 0)) * p.row_bytes;
      }
      float sums[C];
      g.pass(rows, 2 * per * p.row_bytes, sums);  // prefetch: 2 passes ahead
      if (p.gelu) {  // the pass's `per` gate and up sums on one vector (std::tanh: 20 ns each)
        const __mmask16 lanes = __mmask16((1u << per) - 1);
        const __m512 v = gated<kGeluTanh>(_mm512_maskz_loadu_ps(lanes, sums), _mm512_maskz_loadu_ps(lanes, sums + per));
        _mm512_mask_storeu_ps(sums, lanes, v);
      }
      for (int j = 0; j < cnt; ++j) {
        float v = p.silu && !p.gelu ? gated(p, sums[j], sums[j + per]) : sums[j];
        if (p.res) v += bf16_bits_to_float(p.res[n + j]);
        if (p.out_f32)
          p.out_f32[n + j] = v;
        else
          p.out[n + j] = c10::BFloat16(v).x;
      }
    }
  });
}

template <int type>
void run(const Int8Problem& p, const QuantX& xq) {
  TypeInfo ti;
  type_info(type, &ti);
  const Int8Gemm<type> g{p, xq, ti.block_weights, ti.block_bytes};
  constexpr int64_t kRows = 16;
  const int64_t per_item = p.silu ? kRows / 2 : kRows;
  const int64_t items = (p.n_out + per_item - 1) / per_item;
  pw::parallel_items(items, [&](int64_t it, int) { g.item(it * per_item, std::min(p.n_out, (it + 1) * per_item)); });
}

}  // namespace

bool has_int8_kernel() { return true; }

void gemm_int8(const Int8Problem& p) {
  bool known = false;
  if (p.m == 1 && !row_kernel_off()) {
    known = with_type(p.type, [&](auto t) { run_row<decltype(t)::value>(p); });
  } else {
    QuantX xq;
    quantize_rows(p.x, p.ldx, p.m, p.k, &xq);
    known = with_type(p.type, [&](auto t) { run<decltype(t)::value>(p, xq); });
  }
  TORCH_CHECK(known, "cpu_quant int8: unsupported type ", p.type);
}
#else
bool has_int8_kernel() { return false; }

void gemm_int8(const Int8Problem&) { TORCH_CHECK(false, "cpu_quant: this build has no AVX512-VNNI int8 path"); }
#endif
