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
// Loop order (AVX512-BF16 path, x bf16): M <= direct_max_rows() (4; set_direct_max_rows
// changes it for benches and tests): work items of the kernels' pool (pool.h) are groups
// of 16 output columns (silu_mul: 8 gate rows and the 8 matching up rows); each 32-weight
// piece is decoded in registers and used at once for every 4 rows of x; nothing is written
// but the outputs, so W is read from memory at its quantized size. Each accumulator holds
// 16 lane partial sums along K, reduced once at the end. More rows: quant_tiles.cpp
// decodes each weight once per call into gemm.cpp's packed bf16 tiles and runs gemm.cpp's
// micro-kernel over them. int8 calls (quant.py's pick_kernel): 1 row and 2 rows
// quant_int8.cpp, from int8_tiles_min_rows() (3) quant_int8_tiles.cpp.
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
#include <tuple>
#include <utility>
#include <vector>

#include "norm_api.h"
#include "pool_bind.h"
#include "quant_int8.h"
#include "quant_int8_tiles.h"
#include "quant_scalar.h"
#include "quant_tiles.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "quant_decode.h"
#endif

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

  // Dot products of weight rows wrows[0, C) with rows [i0, i0 + R) (R <= 4) of x, decoding
  // in registers (the decode loop order); R x C independent accumulator chains.
  template <int R, int C>
  void dots_direct(const int64_t* wrows, int64_t i0, float (*sums)[4]) const {
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
          const __m512bh xv = load_bh(x + (i0 + i) * ldx + k0);
          for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
  }

  template <int R>
  void item_direct_r(int64_t n0, int64_t n1, int64_t i0) const {
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
      dots_direct<R, C>(wrows, i0, sums);
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < cnt; ++j)
          store(i0 + i, n + j, p.silu ? silu(sums[i][j]) * sums[i][j + per] : sums[i][j]);
    }
  }

  // Every row of x, 4 at a time (each group decodes the weights again).
  void item_direct(int64_t n0, int64_t n1) const {
    for (int64_t i0 = 0; i0 < p.m; i0 += 4) {
      switch (std::min<int64_t>(4, p.m - i0)) {
        case 1: item_direct_r<1>(n0, n1, i0); break;
        case 2: item_direct_r<2>(n0, n1, i0); break;
        case 3: item_direct_r<3>(n0, n1, i0); break;
        default: item_direct_r<4>(n0, n1, i0); break;
      }
    }
  }
};

template <int type>
void run_vector(const Problem& p, const Vec<type>& v) {
  constexpr int64_t kRows = 16;
  const int64_t per_item = p.silu ? kRows / 2 : kRows;
  const int64_t items = (p.n_out + per_item - 1) / per_item;
  pw::parallel_items(items, [&](int64_t it, int) {
    v.item_direct(it * per_item, std::min(p.n_out, (it + 1) * per_item));
  });
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

// bf16 x with more rows than this goes to quant_tiles.cpp (weights decoded once per call
// into packed tiles); up to it, weights are decoded in registers for every 4 rows.
int64_t& direct_max_rows() {
  static int64_t rows = 4;
  return rows;
}

int64_t set_direct_max_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "direct_max_rows >= 0");
  return std::exchange(direct_max_rows(), rows);
}

// The fewest bf16 rows whose gated call can fuse GELU-tanh (quant_tiles.cpp's epilogue);
// 0 where this build has no tiles path.
int64_t gelu_tiles_min_rows() { return kHasVector && has_tiles_kernel() ? direct_max_rows() + 1 : 0; }

// int8 calls with at least this many rows run quant_int8_tiles.cpp (weights decoded once
// per call into int8 tiles), fewer quant_int8.cpp (set_int8_tiles_min_rows: benches, tests;
// at 2 rows quant_int8.cpp's loop measured faster, at 4 the tiles: bench/quant_gemv.py).
int64_t& int8_tiles_min_rows() {
  static int64_t rows = 3;
  return rows;
}

int64_t set_int8_tiles_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 2, "int8_tiles_min_rows >= 2");
  return std::exchange(int8_tiles_min_rows(), rows);
}

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
                bool silu_mul, bool portable, bool float_out, bool int8, bool gelu = false,
                const at::Tensor* into = nullptr) {
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
  // into (gemv_parts): a (1, n_out) column slice of a wider bf16 output, one row only
  TORCH_CHECK(!into || (p.m == 1 && into->size(1) == p.n_out && into->scalar_type() == x.scalar_type() && !float_out),
              "into: one row of x's dtype");
  at::Tensor out =
      into ? *into : at::empty({p.m, p.n_out}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  at::Tensor res;
  if (residual) {
    res = *residual;
    TORCH_CHECK(res.dim() == 2 && res.size(0) == p.m && res.size(1) == p.n && res.stride(1) == 1 &&
                    res.scalar_type() == x.scalar_type(), "residual: (M, N) rows of x's dtype");
  }
  if (p.m == 0 || p.n_out == 0) return out;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  // gelu: GELU-tanh(gate) * up, the epilogues of quant_int8.cpp and of both tiles paths
  // (not the few-row decode in registers nor the scalar path: gelu_tiles_min_rows)
  TORCH_CHECK(!gelu || (silu_mul && (int8 || (bf16 && !portable && p.m >= gelu_tiles_min_rows() && gelu_tiles_min_rows() > 0))),
              "gelu: int8 gated calls, or bf16 ones of at least gelu_tiles_min_rows() rows");
  if (int8) {  // quant_int8.cpp
    TORCH_CHECK(bf16 && !portable && has_int8_kernel(), "cpu_quant int8: needs bf16 x and an AVX512-VNNI build");
    TORCH_CHECK(p.k % 32 == 0 && (x.data_ptr() != nullptr), "cpu_quant int8: K a multiple of 32");
    const Int8Problem q{p.type, p.w, p.row_bytes, p.m, p.k, p.n_out, p.silu,
                        reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                        res.defined() ? reinterpret_cast<const uint16_t*>(res.data_ptr()) : nullptr,
                        res.defined() ? res.stride(0) : 0,
                        float_out ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr()),
                        float_out ? out.data_ptr<float>() : nullptr, gelu};
    if (p.m >= int8_tiles_min_rows() && has_int8_tiles_kernel())  // quant_int8_tiles.cpp
      gemm_int8_tiles(TilesProblem{q.type, q.w, q.row_bytes, q.m, q.k, q.n_out, q.silu, q.x, q.ldx, q.res, q.ldres,
                                   q.out, q.out_f32, gelu});
    else
      gemm_int8(q);
    return out;
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (bf16 && !portable && p.m > direct_max_rows()) {  // quant_tiles.cpp
    const TilesProblem q{p.type, p.w, p.row_bytes, p.m, p.k, p.n_out, p.silu,
                         reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                         res.defined() ? reinterpret_cast<const uint16_t*>(res.data_ptr()) : nullptr,
                         res.defined() ? res.stride(0) : 0,
                         float_out ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr()),
                         float_out ? out.data_ptr<float>() : nullptr, gelu};
    gemm_tiles(q);
    return out;
  }
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

// gemm's rule for one bf16 activation row (kernel auto: the int8 GEMV), its checks done
// here: a decode step's ~120 calls each spend about 2.5 us less than through quant.py's
// checks. act: 0 none, 1 SiLU(gate) * up, 2 GELU-tanh(gate) * up (W = [gate; up]). An
// undefined tensor (None in Python) where the rule does not apply: the caller then takes
// the general path.
at::Tensor gemv_auto(const at::Tensor& x, const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& residual,
                     int64_t act, bool float_out) {
  TORCH_CHECK(act >= 0 && act <= 2, "act: 0 (none), 1 (silu) or 2 (gelu_tanh)");
  if (!has_int8_kernel() || x.dim() != 2 || x.size(0) != 1 || x.scalar_type() != at::kBFloat16 || x.stride(1) != 1)
    return {};
  if (residual && (residual->scalar_type() != at::kBFloat16 || residual->stride(-1) != 1)) return {};
  return gemm(x, w, type, residual, act > 0, false, float_out && !residual && act == 0, true, act == 2);
}

// gemv_parts' product, its rule already checked.
at::Tensor parts_gemv(const at::Tensor& x, const std::vector<at::Tensor>& ws, const std::vector<int64_t>& types,
                      const c10::optional<at::Tensor>& residual) {
  int64_t n = 0;
  for (const auto& w : ws) n += w.size(0);
  TORCH_CHECK(!residual || (residual->dim() == 2 && residual->size(1) == n), "residual: (1, N)");
  at::Tensor out = at::empty({1, n}, x.options());
  for (size_t i = 0, col = 0; i < ws.size(); col += size_t(ws[i].size(0)), ++i) {
    const at::Tensor o = out.narrow(1, int64_t(col), ws[i].size(0));
    c10::optional<at::Tensor> r;
    if (residual) r = residual->narrow(1, int64_t(col), ws[i].size(0));
    gemm(x, ws[i], types[i], r, false, false, false, true, false, &o);
  }
  return out;
}

// A QuantRows weight (row ranges of different types over one K) against one bf16 row:
// every part's int8 GEMV written into its columns of one (1, N) output, the residual split
// the same way; one call from Python, no concatenation. None where gemv_auto's rule does
// not apply.
at::Tensor gemv_parts(const at::Tensor& x, const std::vector<at::Tensor>& ws, const std::vector<int64_t>& types,
                      const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "gemv_parts: one type per part");
  if (!has_int8_kernel() || x.dim() != 2 || x.size(0) != 1 || x.scalar_type() != at::kBFloat16 || x.stride(1) != 1)
    return {};
  if (residual && (residual->scalar_type() != at::kBFloat16 || residual->stride(-1) != 1)) return {};
  return parts_gemv(x, ws, types, residual);
}

// A one-token decode step's layers in fewer calls (models/decode_chain.py): the fused
// extension's RMSNorm row (norm_api.h, bound by set_norm) and gemv_auto's int8 GEMVs,
// chained in C++. Each step is the same call, on the same bytes, as the Python chain of
// fused.rms_norm and gemv_auto it replaces, so the results are those bit for bit; what
// goes is a decode step's ~5 Python-to-C++ calls per layer and their tensor handling.
const PwNormApi*& norm_api() {
  static const PwNormApi* api = nullptr;
  return api;
}

void set_norm(const py::object& capsule) {
  if (capsule.is_none()) {
    norm_api() = nullptr;
    return;
  }
  auto* api = static_cast<const PwNormApi*>(PyCapsule_GetPointer(capsule.ptr(), kPwNormCapsuleName));
  if (api == nullptr) throw py::error_already_set();
  TORCH_CHECK(api->version == kPwNormApiVersion, "cpu_norm: api version ", api->version, ", want ",
              kPwNormApiVersion);
  norm_api() = api;
}

// Whether decode_layer_head / decode_layer_tail run here: the int8 GEMV and a bound norm.
bool has_decode_chain() { return has_int8_kernel() && norm_api() != nullptr; }

void check_row(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == 1 && t.scalar_type() == at::kBFloat16 && t.stride(1) == 1,
              "decode chain: ", what, " must be one contiguous bf16 row (1, K)");
}

// The chain's checks of a tail's rows and activation code.
void check_tail(const at::Tensor& a, const at::Tensor& x, int64_t act) {
  TORCH_CHECK(has_decode_chain(), "decode chain: needs the int8 GEMV and set_norm");
  TORCH_CHECK(act == 1 || act == 2, "decode chain: act 1 (silu) or 2 (gelu_tanh)");
  check_row(a, "a");
  check_row(x, "x");
}

void check_norm_weight(const at::Tensor& w, const at::Tensor& x) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
                  (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "decode chain: a norm weight must be contiguous (H,) bf16 or float32");
}

// RMSNorm of the row x (1, H) by w (H,) (bf16 or float32), as fused.rms_norm computes it.
at::Tensor norm_row(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm_weight(w, x);
  at::Tensor y = at::empty_like(x);
  norm_api()->row_bf16(x.data_ptr(), w.data_ptr(), w.scalar_type() == at::kFloat, y.data_ptr(), x.size(1),
                       static_cast<float>(eps));
  return y;
}

// y = res + norm(x, w): what fused.rms_norm_add computes, for rows (1, H).
at::Tensor norm_row_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& res, double eps) {
  check_norm_weight(w, x);
  at::Tensor y = at::empty_like(x);
  norm_api()->row_add_bf16(x.data_ptr(), w.data_ptr(), w.scalar_type() == at::kFloat, res.data_ptr(), y.data_ptr(),
                           x.size(1), static_cast<float>(eps));
  return y;
}

// A layer's head: norm(x) @ Wqkv^T for the row x (1, H); Wqkv one GGUF weight or the row
// ranges of several (a QuantRows: gemv_parts' product).
at::Tensor decode_layer_head(const at::Tensor& x, const at::Tensor& norm_w, double eps,
                             const std::vector<at::Tensor>& wqkv, const std::vector<int64_t>& tqkv) {
  TORCH_CHECK(has_decode_chain(), "decode chain: needs the int8 GEMV and set_norm");
  TORCH_CHECK(!wqkv.empty() && wqkv.size() == tqkv.size(), "decode chain: one type per qkv part");
  check_row(x, "x");
  const at::Tensor h = norm_row(x, norm_w, eps);
  if (wqkv.size() == 1) return gemm(h, wqkv[0], tqkv[0], c10::nullopt, false, false, false, true);
  return parts_gemv(h, wqkv, tqkv, c10::nullopt);
}

// The next layer's head where one is given (next_w defined), else None.
c10::optional<at::Tensor> next_head(const at::Tensor& x2, const c10::optional<at::Tensor>& next_w, double next_eps,
                                    const std::vector<at::Tensor>& wqkv, const std::vector<int64_t>& tqkv) {
  if (!next_w) return c10::nullopt;
  return decode_layer_head(x2, *next_w, next_eps, wqkv, tqkv);
}

// A pre-norm layer after its attention a (1, q_size), for the residual row x (1, H):
//   x1 = x + a @ Wo^T;  x2 = x1 + act(gate_up(norm(x1, post_w))) @ Wdown^T
// (act 1 SiLU, 2 GELU-tanh, of gate times up), then, given the next layer's input norm
// weight and qkv weight, that layer's head on x2. Returns (x2, next qkv or None).
std::tuple<at::Tensor, c10::optional<at::Tensor>> decode_layer_tail(
    const at::Tensor& a, const at::Tensor& x, const at::Tensor& wo, int64_t to, const at::Tensor& post_w,
    double eps, const at::Tensor& wgu, int64_t tgu, int64_t act, const at::Tensor& wd, int64_t td,
    const c10::optional<at::Tensor>& next_w, double next_eps, const std::vector<at::Tensor>& wqkv,
    const std::vector<int64_t>& tqkv) {
  check_tail(a, x, act);
  const at::Tensor x1 = gemm(a, wo, to, x, false, false, false, true);
  const at::Tensor g = gemm(norm_row(x1, post_w, eps), wgu, tgu, c10::nullopt, true, false, false, true, act == 2);
  at::Tensor x2 = gemm(g, wd, td, x1, false, false, false, true);
  return {x2, next_head(x2, next_w, next_eps, wqkv, tqkv)};
}

// The same for a sandwich layer (Gemma 2 / 3: each block's output normed before its add):
//   x1 = x + norm(a @ Wo^T, post_attn);  h = norm(x1, pre_ffw)
//   x2 = x1 + norm(act(gate_up(h)) @ Wdown^T, post_ffw)
// then the next layer's head on x2, as decode_layer_tail.
std::tuple<at::Tensor, c10::optional<at::Tensor>> decode_sandwich_tail(
    const at::Tensor& a, const at::Tensor& x, const at::Tensor& wo, int64_t to, const at::Tensor& post_attn_w,
    const at::Tensor& pre_ffw_w, double eps, const at::Tensor& wgu, int64_t tgu, int64_t act, const at::Tensor& wd,
    int64_t td, const at::Tensor& post_ffw_w, const c10::optional<at::Tensor>& next_w, double next_eps,
    const std::vector<at::Tensor>& wqkv, const std::vector<int64_t>& tqkv) {
  check_tail(a, x, act);
  const at::Tensor x1 = norm_row_add(gemm(a, wo, to, c10::nullopt, false, false, false, true), post_attn_w, x, eps);
  const at::Tensor g = gemm(norm_row(x1, pre_ffw_w, eps), wgu, tgu, c10::nullopt, true, false, false, true, act == 2);
  at::Tensor x2 = norm_row_add(gemm(g, wd, td, c10::nullopt, false, false, false, true), post_ffw_w, x1, eps);
  return {x2, next_head(x2, next_w, next_eps, wqkv, tqkv)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_pool", &pw::set_pool, "hand work items to the pool behind a cpu_pool capsule");
  m.def("has_vector_kernel", &has_vector_kernel, "whether this build has the AVX512-BF16 path");
  m.def("dequantize", &dequantize, "scalar decoder: (N, row_bytes) uint8 -> (N, K) float32");
  m.def("set_direct_max_rows", &set_direct_max_rows,
        "rows up to which bf16 x decodes in registers (above: packed tiles); returns the old value");
  m.def("set_int8_tiles_min_rows", &set_int8_tiles_min_rows,
        "rows from which int8 calls run the int8 tiles (below: quant_int8.cpp); returns the old value");
  m.def("has_int8_tiles_kernel", &has_int8_tiles_kernel, "whether this build has the int8 tiles (AVX512-VNNI)");
  m.def("gelu_tiles_min_rows", &gelu_tiles_min_rows,
        "the fewest bf16 rows whose gated call fuses GELU-tanh (the bf16 tiles; 0: none in this build)");
  m.def("has_int8_kernel", &has_int8_kernel, "whether this build has the AVX512-VNNI int8 path");
  m.def(
      "gemm",
      [](const at::Tensor& x, const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& residual,
         bool silu_mul, bool portable, bool float_out, bool int8,
         bool gelu) { return gemm(x, w, type, residual, silu_mul, portable, float_out, int8, gelu); },
      "x @ W^T against GGUF-quantized W, fused epilogues (int8: quant_int8.cpp; gelu: with silu_mul, int8 or "
      "gelu_tiles_min_rows() bf16 rows, GELU-tanh(gate) * up)",
      py::arg("x"), py::arg("w"), py::arg("type"), py::arg("residual"), py::arg("silu_mul"), py::arg("portable"),
      py::arg("float_out"), py::arg("int8"), py::arg("gelu") = false);
  m.def("gemv_parts", &gemv_parts, "a QuantRows weight's parts against one bf16 row, into one output (or None)");
  m.def("set_norm", &set_norm, "bind the decode chain to fused's norm_api() capsule (None unbinds)");
  m.def("has_decode_chain", &has_decode_chain, "whether decode_layer_head / _tail run in this build");
  m.def("decode_layer_head", &decode_layer_head, "norm(x) @ Wqkv^T for one bf16 row (Wqkv in row parts)");
  m.def("decode_sandwich_tail", &decode_sandwich_tail,
        "decode_layer_tail for a sandwich layer (each block's output normed before its add)");
  m.def("decode_layer_tail", &decode_layer_tail,
        "o_proj + residual, post norm, gated MLP + residual, and the next layer's head, for one bf16 row");
  m.def("gemv_auto", &gemv_auto, "gemm's auto rule for one bf16 row (the int8 GEMV; act 0/1/2), or None");
}
