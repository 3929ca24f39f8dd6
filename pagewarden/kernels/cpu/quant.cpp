// GEMM against GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K), read in the file's own block layout: out (M, N) = x (M, K) @ W^T, with the
// decoder's epilogues fused as in gemm.cpp (+ residual; silu(gate) * up).
//
// Layouts:
//     x, residual   (M, K) / (M, N) bf16 or float32 rows (stride(1) == 1); out the same dtype
//     w             (N, row_bytes) uint8: row n is output column n, K / block_weights GGUF
//                   blocks back to back (ggml's block_q4_1 etc., little-endian fp16 scales),
//                   exactly as the file stores the tensor; K a multiple of the block size
//     out           (M, N) (x's dtype, or float32 with float_out: logits), or (M, N / 2) for silu_mul where rows [0, N/2) are gate and
//                   [N/2, N) up: out[m, n] = silu(gate_n . x_m) * (up_n . x_m)
//
// Dequantization: every 32 weights of a row (a Q*_0/Q*_1 block, or one sub-block of a
// 256-weight K-quant block) are decoded to float32 exactly as ggml and the gguf package
// compute them (q * d + m, (q - 8) * d, d * sc * q - dmin * m, ...; float32 mul then add,
// built with -ffp-contract=off so no FMA changes a rounding), then rounded to bf16: the
// weights the kernel multiplies by are bit-identical to the bf16 weights the dequantize-
// at-load path (--quantization none) keeps. Products are vdpbf16ps (two bf16 products per
// float32 lane), sums float32.
//
// Loop order (AVX512-BF16 path, x bf16): work items of the kernels' pool (pool.h) are
// groups of ROWS = 16 output columns (silu_mul: 8 gate rows and the 8 matching up rows).
// M <= 4 (decode): each 32-weight piece is decoded in registers and used at once for every
// row of x; nothing is written but the outputs, so W is read from memory once, at its
// quantized size. M > 4: the item first decodes its 16 rows into a per-thread bf16 scratch
// (16 x K), then runs 4 x 4 (rows of x x rows of W) dot-product tiles over it, so each
// weight is decoded once per call whatever M is. Each accumulator holds 16 lane partial
// sums along K, reduced once at the end.
//
// Portable path (any x86-64, x float32 or bf16, or a build without AVX512-BF16): each row
// is decoded to float32 by the scalar decoder below (the AVX2 build vectorises it) and
// dotted with x in float32. It is also what tests compare the vector decoder with.
//
// Checks: dtype, contiguity and shape of every operand (K against row_bytes and the type's
// block size; residual (M, N)); the type is one of the eight.

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "quant_int8.h"
#include "quant_scalar.h"

namespace {

// The type table and scalar decoders: quant_scalar.h.

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return float(v); }

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

struct Problem {
  int type;
  TypeInfo ti;
  const uint8_t* w;
  int64_t row_bytes, m, k, n, n_out;
  bool silu;
};

// The portable path: rows decoded to float32, dotted in float32; items of 16 rows.
template <typename T, typename O>
void gemm_portable(const Problem& p, const T* x, int64_t ldx, const T* res, int64_t ldres, O* out) {
  constexpr int64_t kRows = 16;
  const int64_t items = (p.n_out + kRows - 1) / kRows;
  pw::parallel_items(items, [&](int64_t it, int) {
    std::vector<float> wa(p.k), wb(p.silu ? p.k : 0);
    for (int64_t n = it * kRows; n < std::min(p.n_out, (it + 1) * kRows); ++n) {
      decode_row_scalar(p.type, p.ti, p.w + n * p.row_bytes, p.k, wa.data());
      if (p.silu) decode_row_scalar(p.type, p.ti, p.w + (n + p.n_out) * p.row_bytes, p.k, wb.data());
      for (int64_t i = 0; i < p.m; ++i) {
        const T* xr = x + i * ldx;
        float a = 0.0f, b = 0.0f;
        for (int64_t j = 0; j < p.k; ++j) a += wa[j] * to_float(xr[j]);
        if (p.silu) {
          for (int64_t j = 0; j < p.k; ++j) b += wb[j] * to_float(xr[j]);
          a = silu(a) * b;
        } else if (res) {
          a += to_float(res[i * ldres + n]);
        }
        out[i * p.n_out + n] = O(a);
      }
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kHasVector = true;

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

using bf16_bits = uint16_t;

inline __m512bh load_bh(const bf16_bits* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

inline float bf16_to_float(bf16_bits v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline bf16_bits float_to_bf16(float f) {  // round to nearest even, as vcvtneps2bf16
  return at::BFloat16(f).x;
}

template <int type>
struct Vec {
  const Problem& p;
  const bf16_bits* x;
  int64_t ldx;
  const bf16_bits* res;
  int64_t ldres;
  bf16_bits* out;
  float* out_f32;  // instead of out: float32 outputs (logits)

  void store(int64_t i, int64_t n, float v) const {
    if (res) v += bf16_to_float(res[i * ldres + n]);
    if (out_f32)
      out_f32[i * p.n_out + n] = v;
    else
      out[i * p.n_out + n] = float_to_bf16(v);
  }

  // Dot products of weight rows [w0, w0 + C) with the first R (<= 4) rows of x, decoding
  // in registers (the decode loop order); R x C independent accumulator chains.
  template <int R, int C>
  void dots_direct(const int64_t* wrows, float (*sums)[4]) const {
    __m512 acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
    const uint8_t* rows[C];
    for (int j = 0; j < C; ++j) rows[j] = p.w + wrows[j] * p.row_bytes;
    constexpr int pieces = type >= Q4_K ? 8 : 1;
    for (int64_t blk = 0, k0 = 0; blk < p.k / p.ti.block_weights; ++blk) {
      const int64_t off = blk * p.ti.block_bytes;
      for (int s = 0; s < pieces; ++s, k0 += 32) {
        __m512bh wv[C];
        for (int j = 0; j < C; ++j) wv[j] = decode32_bf16<type>(rows[j] + off, s);
        for (int i = 0; i < R; ++i) {
          const __m512bh xv = load_bh(x + i * ldx + k0);
          for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
  }

  template <int R>
  void item_direct_r(int64_t n0, int64_t n1) const {
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
      dots_direct<R, C>(wrows, sums);
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < cnt; ++j)
          store(i, n + j, p.silu ? silu(sums[i][j]) * sums[i][j + per] : sums[i][j]);
    }
  }

  void item_direct(int64_t n0, int64_t n1) const {
    switch (p.m) {
      case 1: item_direct_r<1>(n0, n1); break;
      case 2: item_direct_r<2>(n0, n1); break;
      case 3: item_direct_r<3>(n0, n1); break;
      default: item_direct_r<4>(n0, n1); break;
    }
  }

  // Decoded rows: scratch holds `rows` weight rows of K bf16 each.
  template <int R, int C>
  void tile(const bf16_bits* scratch, int64_t i0, int j0, float (*sums)[4]) const {
    __m512 acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < p.k; k0 += 32) {
      __m512bh wv[C];
      for (int j = 0; j < C; ++j) wv[j] = load_bh(scratch + (j0 + j) * p.k + k0);
      for (int i = 0; i < R; ++i) {
        const __m512bh xv = load_bh(x + (i0 + i) * ldx + k0);
        for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
  }

  template <int R>
  void tile_rows(const bf16_bits* scratch, int64_t i0, int j0, int c, float (*sums)[4]) const {
    switch (c) {
      case 4: tile<R, 4>(scratch, i0, j0, sums); break;
      case 3: tile<R, 3>(scratch, i0, j0, sums); break;
      case 2: tile<R, 2>(scratch, i0, j0, sums); break;
      default: tile<R, 1>(scratch, i0, j0, sums); break;
    }
  }

  // Rows [n0, n1) of out (and their up rows for silu), through a decoded scratch.
  void item_scratch(int64_t n0, int64_t n1, bf16_bits* scratch) const {
    const int64_t cnt = n1 - n0;
    const int rows = int(p.silu ? 2 * cnt : cnt);  // silu: gate rows then up rows
    const int pieces = p.ti.block_weights / 32;
    for (int r = 0; r < rows; ++r) {
      const int64_t wrow = r < cnt ? n0 + r : n0 + (r - cnt) + p.n_out;
      const uint8_t* row = p.w + wrow * p.row_bytes;
      bf16_bits* dst = scratch + r * p.k;
      for (int64_t blk = 0, k0 = 0; blk < p.k / p.ti.block_weights; ++blk)
        for (int s = 0; s < pieces; ++s, k0 += 32)
          _mm512_storeu_si512(dst + k0, reinterpret_cast<__m512i>(decode32_bf16<type>(row + blk * p.ti.block_bytes, s)));
    }
    float sums[4][4];
    std::vector<float> gate(p.silu ? 4 * cnt : 0);
    for (int64_t i0 = 0; i0 < p.m; i0 += 4) {
      const int r = int(std::min<int64_t>(4, p.m - i0));
      for (int j0 = 0; j0 < rows; j0 += 4) {
        const int c = std::min(4, rows - j0);
        switch (r) {
          case 4: tile_rows<4>(scratch, i0, j0, c, sums); break;
          case 3: tile_rows<3>(scratch, i0, j0, c, sums); break;
          case 2: tile_rows<2>(scratch, i0, j0, c, sums); break;
          default: tile_rows<1>(scratch, i0, j0, c, sums); break;
        }
        for (int i = 0; i < r; ++i)
          for (int j = 0; j < c; ++j) {
            const int row = j0 + j;
            if (!p.silu) {
              store(i0 + i, n0 + row, sums[i][j]);
            } else if (row < cnt) {
              gate[i * cnt + row] = sums[i][j];
            } else {
              const int64_t o = row - cnt;
              store(i0 + i, n0 + o, silu(gate[i * cnt + o]) * sums[i][j]);
            }
          }
      }
    }
  }
};
template <int type>
void run_vector(const Problem& p, const Vec<type>& v) {
  constexpr int64_t kRows = 16;
  const int64_t per_item = p.silu ? kRows / 2 : kRows;
  const int64_t items = (p.n_out + per_item - 1) / per_item;
  if (p.m <= 4) {
    pw::parallel_items(items, [&](int64_t it, int) {
      v.item_direct(it * per_item, std::min(p.n_out, (it + 1) * per_item));
    });
  } else {
    const int threads = pw::max_threads();
    std::vector<bf16_bits> scratch(size_t(threads) * kRows * p.k);
    pw::parallel_items(items, [&](int64_t it, int thread) {
      v.item_scratch(it * per_item, std::min(p.n_out, (it + 1) * per_item), scratch.data() + thread * kRows * p.k);
    });
  }
}

template <int type>
void run_vector(const Problem& p, const at::Tensor& x, const at::Tensor& res, const at::Tensor& out, bool float_out) {
  const Vec<type> v{p, reinterpret_cast<const bf16_bits*>(x.data_ptr()), x.stride(0),
                    res.defined() ? reinterpret_cast<const bf16_bits*>(res.data_ptr()) : nullptr,
                    res.defined() ? res.stride(0) : 0,
                    float_out ? nullptr : reinterpret_cast<bf16_bits*>(out.data_ptr()),
                    float_out ? out.data_ptr<float>() : nullptr};
  run_vector<type>(p, v);
}
#else
constexpr bool kHasVector = false;
#endif

}  // namespace

bool has_vector_kernel() { return kHasVector; }

// The scalar decoder over a whole tensor (N, row_bytes) -> (N, K) float32: for tests.
at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t k) {
  TypeInfo ti;
  TORCH_CHECK(type_info(int(type), &ti), "cpu_quant: unsupported type ", type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w: (N, row_bytes) uint8");
  TORCH_CHECK(k > 0 && k % ti.block_weights == 0 && w.size(1) == k / ti.block_weights * ti.block_bytes,
              "K does not match row_bytes");
  at::Tensor out = at::empty({w.size(0), k}, w.options().dtype(at::kFloat));
  for (int64_t n = 0; n < w.size(0); ++n)
    decode_row_scalar(int(type), ti, w.data_ptr<uint8_t>() + n * w.size(1), k, out.data_ptr<float>() + n * k);
  return out;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& residual,
                bool silu_mul, bool portable, bool float_out, bool int8) {
  Problem p{};
  p.type = int(type);
  TORCH_CHECK(type_info(p.type, &p.ti), "cpu_quant: unsupported type ", type);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: (M, K) bf16 or float32 rows");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 && w.stride(0) == w.size(1),
              "w: (N, row_bytes) uint8, contiguous");
  p.w = w.data_ptr<uint8_t>();
  p.row_bytes = w.size(1);
  p.m = x.size(0);
  p.k = x.size(1);
  p.n = w.size(0);
  TORCH_CHECK(p.k % p.ti.block_weights == 0 && p.row_bytes == p.k / p.ti.block_weights * p.ti.block_bytes,
              "K = ", p.k, " does not match row_bytes = ", p.row_bytes);
  TORCH_CHECK(!silu_mul || (p.n % 2 == 0 && !residual), "silu_mul: [gate; up] rows, no residual");
  p.silu = silu_mul;
  p.n_out = silu_mul ? p.n / 2 : p.n;
  TORCH_CHECK(!float_out || !residual, "float_out: no residual");
  at::Tensor out = at::empty({p.m, p.n_out}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  at::Tensor res;
  if (residual) {
    res = *residual;
    TORCH_CHECK(res.dim() == 2 && res.size(0) == p.m && res.size(1) == p.n && res.stride(1) == 1 &&
                    res.scalar_type() == x.scalar_type(), "residual: (M, N) rows of x's dtype");
  }
  if (p.m == 0 || p.n_out == 0) return out;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (int8) {  // quant_int8.cpp
    TORCH_CHECK(bf16 && !portable && has_int8_kernel(), "cpu_quant int8: needs bf16 x and an AVX512-VNNI build");
    TORCH_CHECK(p.k % 32 == 0 && (x.data_ptr() != nullptr), "cpu_quant int8: K a multiple of 32");
    const Int8Problem q{p.type, p.w, p.row_bytes, p.m, p.k, p.n_out, p.silu,
                        reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                        res.defined() ? reinterpret_cast<const uint16_t*>(res.data_ptr()) : nullptr,
                        res.defined() ? res.stride(0) : 0,
                        float_out ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr()),
                        float_out ? out.data_ptr<float>() : nullptr};
    gemm_int8(q);
    return out;
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (bf16 && !portable) {
    switch (p.type) {
      case Q4_0: run_vector<Q4_0>(p, x, res, out, float_out); break;
      case Q4_1: run_vector<Q4_1>(p, x, res, out, float_out); break;
      case Q5_0: run_vector<Q5_0>(p, x, res, out, float_out); break;
      case Q5_1: run_vector<Q5_1>(p, x, res, out, float_out); break;
      case Q8_0: run_vector<Q8_0>(p, x, res, out, float_out); break;
      case Q4_K: run_vector<Q4_K>(p, x, res, out, float_out); break;
      case Q5_K: run_vector<Q5_K>(p, x, res, out, float_out); break;
      default: run_vector<Q6_K>(p, x, res, out, float_out); break;
    }
    return out;
  }
#endif
  (void)portable;
  if (bf16) {
    using T = at::BFloat16;
    const T* r = res.defined() ? res.data_ptr<T>() : nullptr;
    const int64_t ldr = res.defined() ? res.stride(0) : 0;
    if (float_out)
      gemm_portable<T, float>(p, x.data_ptr<T>(), x.stride(0), r, ldr, out.data_ptr<float>());
    else
      gemm_portable<T, T>(p, x.data_ptr<T>(), x.stride(0), r, ldr, out.data_ptr<T>());
  } else {
    gemm_portable<float, float>(p, x.data_ptr<float>(), x.stride(0), res.defined() ? res.data_ptr<float>() : nullptr,
                                res.defined() ? res.stride(0) : 0, out.data_ptr<float>());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_pool", &pw::set_pool, "hand work items to the pool behind a cpu_pool capsule");
  m.def("has_vector_kernel", &has_vector_kernel, "whether this build has the AVX512-BF16 path");
  m.def("dequantize", &dequantize, "scalar decoder: (N, row_bytes) uint8 -> (N, K) float32");
  m.def("has_int8_kernel", &has_int8_kernel, "whether this build has the AVX512-VNNI int8 path");
  m.def("gemm", &gemm, "x @ W^T against GGUF-quantized W, fused epilogues (int8: quant_int8.cpp)");
}
