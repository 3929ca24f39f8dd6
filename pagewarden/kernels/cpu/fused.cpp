/*
Fused elementwise kernels of the Llama decoder on the CPU: RMSNorm, RoPE, SiLU*mul.

Each op does its whole job in one pass over its rows, in one parallel region, where torch
runs four to nine small ops (each its own OpenMP region). Layouts and loop order:

  rms_norm(x (T, H), weight (H,), eps) -> out (T, H)
      x rows contiguous (any row stride), weight and out contiguous; x, weight, out of
      one dtype, float32 or bfloat16. Per row: the sum of squares in float32, in the
      order torch's sum kernel adds a contiguous row (`cascade_sum_sq`), mean = sum / H,
      r = 1 / sqrt(mean + float(eps)), out = (x * r) * weight, each step rounded to
      float32 as torch's separate ops round it, then once to the output dtype: bitwise
      the torch path (x.float(), F.rms_norm, .to(dtype)). A bfloat16 x may take a
      float32 weight (Gemma's 1 + w, kept in float32 as its norm computes it).
  rms_norm_add(x (T, H), weight (H,), residual (T, H), eps) -> out (T, H)
      residual + rms_norm(x): the norm rounded to x's dtype, then added to the residual
      in float32 and rounded again, as the torch path's separate add does (Gemma's
      post-norms: x + post_norm(o_proj(...))); bitwise that path. residual's rows
      contiguous (any row stride), of x's dtype.
  rms_norm_heads_(qk (T, NH, D), w_q (D,), w_k (D,), n_q, eps) -> qk, in place
      the same per-row math over each head's D values (q/k norms): heads h < n_q scaled
      by w_q, the others by w_k; qk's (NH, D) rows dense as for rope_, the weights
      float32 or of qk's dtype. Bitwise rms_norm of the heads as (T * NH, D) rows.
  rope_(qk (T, NH, D), cos (T, D), sin_signed (T, D)) -> qk, in place
      qk inner (NH, D) dense (stride(2) == 1, stride(1) == D), any row stride: a view of
      the fused qkv GEMM output; cos and sin_signed contiguous, of qk's dtype. Per row t
      and head h, for j < D/2 (a = x[j], b = x[j + D/2], read before either is written):
          x[j]       = fma(b, sin_signed[j],       a * cos[j])
          x[j + D/2] = fma(a, sin_signed[j + D/2], b * cos[j + D/2])
      (rotate-half with its sign folded into sin_signed; the fused multiply-add is what
      torch's addcmul does), in float32, rounded once to qk's dtype.
  silu_mul(gate_up (T, 2I)) -> out (T, I)
      gate_up rows contiguous (any row stride), out contiguous, one dtype. Per row:
      out[j] = (g / (1 + exp(-g))) * u with g = gate_up[j], u = gate_up[I + j], in float32,
      rounded once. exp is torch's vectorised one (Sleef, 1 ulp) on whole 2-vector chunks
      of a row and std::exp on the rest, as torch's silu kernel does on a strided row.

  argmax_rows(x (S, V)) -> ids (S,) int64
      x rows contiguous (any row stride), float32 or bfloat16. Per row, the index of its
      first maximum, as x.max(dim=-1).indices (a NaN counts as the maximum: the first
      NaN's index): one pass for the maximum (V lanes of float32, a NaN noted), one for
      the first index holding it. Greedy sampling over a 262k vocabulary without torch's
      bf16 reduction.
  mask_rows_(x (S, V), bits (S, W) int32, rows) -> x, in place
      the grammar's token bitmask (kernels/token_bitmask.py): for each listed row r,
      x[r, t] = -inf where bit t % 32 of bits[r, t / 32] is clear; W * 32 >= V, bits
      contiguous, x rows contiguous (any row stride), float32 or bfloat16. Words of all
      ones are skipped, words of zeros filled whole, the rest bit by bit.

All loops run over rows (tokens) outermost; runs of rows are the work items of the
kernels' pool (pool.h), and a call whose estimated serial time is under serial_us
stays on the calling thread: handing items to a sleeping thread (a futex wake, about 50
us on 2 cores) costs more than splitting such a call saves. The estimate is rows x row
elements x a per-op cost per element measured on a Zen 4 core (kNs* below; a decode
batch of 64 stays serial). Inputs are checked (dtype, shape, strides) with TORCH_CHECK;
the Python wrappers only call here when the layouts hold.
*/

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "norm_api.h"
#include "pool_bind.h"

namespace {

using at::BFloat16;
using fVec = at::vec::Vectorized<float>;
constexpr int64_t V = fVec::size();
constexpr int64_t kMaxHeadDim = 1024;

// Calls estimated to take less than this serially run on the calling thread;
// bench/fused_elementwise.py --serial-us measures other values.
double serial_us = 100.0;
// Serial cost per output element (ns), measured on one Zen 4 core for bf16 and float32.
constexpr double kNsRmsNorm = 0.3, kNsRope = 0.5, kNsSiluMul = 0.6, kNsMask = 0.05;

// Rows per work item, so that a call under serial_us stays serial.
int64_t grain_rows(int64_t row_elems, double ns_per_elem) {
  const double row_us = std::max<double>(1, row_elems) * ns_per_elem * 1e-3;
  return std::max<int64_t>(1, static_cast<int64_t>(serial_us / row_us));
}

// V consecutive elements as floats, and back.
inline fVec load_f(const float* p) { return fVec::loadu(p); }
inline fVec load_f(const BFloat16* p) {
  fVec out;
  at::vec::load_to_float(p, out);
  return out;
}
inline void store_f(float* p, fVec v) { v.store(p); }
inline void store_f(BFloat16* p, fVec v) { at::vec::convert<BFloat16>(v).store(p, V); }

// n < V elements (a row's tail) as floats, and back.
template <typename T>
inline fVec load_f(const T* p, int64_t n) {
  alignas(64) float buf[V] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return fVec::loadu(buf);
}
template <typename T>
inline void store_f(T* p, fVec v, int64_t n) {
  alignas(64) float buf[V];
  v.store(buf);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(buf[i]);
}

int64_t ceil_log2(int64_t x) {
  if (x <= 2) return std::max<int64_t>(x - 1, 0);
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// ATen's multi_row_sum (SumKernel.cpp) over 4 interleaved streams: stream k sums
// item(i, k) for i < size, through a 4-level cascade of partial sums.
template <typename Acc, typename Item>
std::array<Acc, 4> multi_row_sum(Item item, int64_t size) {
  constexpr int64_t levels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t step = int64_t(1) << power;
  const int64_t mask = step - 1;
  Acc acc[levels][4];
  for (auto& level : acc) std::fill(level, level + 4, Acc{});
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < 4; ++k) acc[0][k] = acc[0][k] + item(i, k);
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < 4; ++k) {
        acc[j][k] = acc[j][k] + acc[j - 1][k];
        acc[j - 1][k] = Acc{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < 4; ++k) acc[0][k] = acc[0][k] + item(i, k);
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < 4; ++k) acc[0][k] = acc[0][k] + acc[j][k];
  return {acc[0][0], acc[0][1], acc[0][2], acc[0][3]};
}

// ATen's row_sum: 4 streams, leftovers into stream 0, then the streams added in order.
template <typename Acc, typename Item>
Acc row_sum(Item item, int64_t size) {
  const int64_t size_ilp = size / 4;
  auto partial = multi_row_sum<Acc>([&](int64_t i, int64_t k) { return item(i * 4 + k); }, size_ilp);
  for (int64_t i = size_ilp * 4; i < size; ++i) partial[0] = partial[0] + item(i);
  return partial[0] + partial[1] + partial[2] + partial[3];
}

// Sum of x[i]^2 for i < n, in the order torch sums x.float().pow(2) over a contiguous
// row: cascade_sum's vectorized_inner_sum (n >= 8) or scalar_inner_sum (n < 8), at the
// width torch's sum kernel runs at on x86 (8 floats: it has no AVX-512 build).
using f8 = float __attribute__((vector_size(32)));
constexpr int64_t kSumWidth = 8;

template <typename T>
inline f8 load_sq8(const T* x) {
  f8 v;
  for (int64_t k = 0; k < kSumWidth; ++k) v[k] = float(x[k]);
  return v * v;
}

template <typename T>
float cascade_sum_sq(const T* x, int64_t n) {
  if (n < kSumWidth) {
    return row_sum<float>([&](int64_t i) { float v = float(x[i]); return v * v; }, n);
  }
  const int64_t nvec = n / kSumWidth;
  const f8 vsum = row_sum<f8>([&](int64_t i) { return load_sq8(x + i * kSumWidth); }, nvec);
  float total = 0.f;
  for (int64_t i = nvec * kSumWidth; i < n; ++i) {
    float v = float(x[i]);
    total += v * v;
  }
  for (int64_t k = 0; k < kSumWidth; ++k) total += vsum[k];
  return total;
}

// One row: yr = (xr * r) * w with r = 1 / sqrt(mean(xr^2) + eps), rounded to T, then
// (res given) yr = res + yr, rounded again; yr may be xr.
template <typename T, typename WT>
inline void rms_norm_row(const T* xr, const WT* w, T* yr, int64_t H, float eps,
                         const T* res = nullptr) {
  float var = cascade_sum_sq(xr, H) / float(H);
  const float r = 1.f / std::sqrt(var + eps);
  const fVec rv(r);
  int64_t j = 0;
  for (; j + V <= H; j += V) {
    store_f(yr + j, (load_f(xr + j) * rv) * load_f(w + j));
    if (res) store_f(yr + j, load_f(res + j) + load_f(yr + j));
  }
  if (j < H) {
    const int64_t n = H - j;
    store_f(yr + j, (load_f(xr + j, n) * rv) * load_f(w + j, n), n);
    if (res) store_f(yr + j, load_f(res + j, n) + load_f(yr + j, n), n);
  }
}

template <typename T, typename WT>
void rms_norm_rows(const T* x, int64_t x_stride, const WT* w, T* out, int64_t T_, int64_t H,
                   float eps, const T* res = nullptr, int64_t res_stride = 0) {
  pw::parallel_ranges(0, T_, grain_rows(H, kNsRmsNorm), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rms_norm_row(x + t * x_stride, w, out + t * H, H, eps, res ? res + t * res_stride : nullptr);
  });
}

template <typename T, typename WT>
void rms_norm_heads_rows(T* qk, int64_t row_stride, const WT* wq, const WT* wk, int64_t T_,
                         int64_t NH, int64_t n_q, int64_t D, float eps) {
  pw::parallel_ranges(0, T_, grain_rows(NH * D, kNsRmsNorm), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < NH; ++h) {
        T* x = qk + t * row_stride + h * D;
        rms_norm_row(x, h < n_q ? wq : wk, x, D, eps);
      }
  });
}

// f(T*) with x's element type, float32 or bfloat16.
template <typename F>
void dispatch_values(const at::Tensor& x, const char* op, F f) {
  if (x.scalar_type() == at::kFloat) {
    f(x.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only");
    f(x.data_ptr<BFloat16>());
  }
}

// f(T*, WT*) with x's and the weight's element types: (float, float), (bf16, bf16) or
// (bf16, float).
template <typename F>
void dispatch_norm(const at::Tensor& x, const at::Tensor& w, const char* op, F f) {
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  if (xt == at::kFloat && wt == at::kFloat) {
    f(x.data_ptr<float>(), w.data_ptr<float>());
  } else if (xt == at::kBFloat16 && wt == at::kBFloat16) {
    f(x.data_ptr<BFloat16>(), w.data_ptr<BFloat16>());
  } else if (xt == at::kBFloat16 && wt == at::kFloat) {
    f(x.data_ptr<BFloat16>(), w.data_ptr<float>());
  } else {
    TORCH_CHECK(false, op, ": x float32 or bfloat16, weight of x's dtype or float32");
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be (T, H) with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be contiguous (H,)");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t T_ = x.size(0), H = x.size(1);
  // eps rounded to float as torch's add_(eps) on a float tensor rounds it
  const float eps_f = static_cast<float>(eps);
  dispatch_norm(x, weight, "rms_norm", [&](auto* xp, auto* wp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    rms_norm_rows(static_cast<const T*>(xp), x.stride(0), wp, out.data_ptr<T>(), T_, H, eps_f);
  });
  return out;
}

at::Tensor rms_norm_add(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& residual,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm_add: x must be (T, H) with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm_add: weight must be contiguous (H,)");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "rms_norm_add: residual must be (T, H) rows of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t T_ = x.size(0), H = x.size(1);
  dispatch_norm(x, weight, "rms_norm_add", [&](auto* xp, auto* wp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    rms_norm_rows(static_cast<const T*>(xp), x.stride(0), wp, out.data_ptr<T>(), T_, H,
                  static_cast<float>(eps), residual.data_ptr<T>(), residual.stride(0));
  });
  return out;
}

at::Tensor rms_norm_heads_(at::Tensor qk, const at::Tensor& w_q, const at::Tensor& w_k,
                           int64_t n_q, double eps) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "rms_norm_heads_: qk must be (T, NH, D) with dense (NH, D) rows");
  const int64_t T_ = qk.size(0), NH = qk.size(1), D = qk.size(2);
  TORCH_CHECK(n_q >= 0 && n_q <= NH, "rms_norm_heads_: n_q must be in [0, NH]");
  for (const auto* w : {&w_q, &w_k})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == D && w->is_contiguous(),
                "rms_norm_heads_: weights must be contiguous (D,)");
  TORCH_CHECK(w_q.scalar_type() == w_k.scalar_type(), "rms_norm_heads_: weights differ in dtype");
  dispatch_norm(qk, w_q, "rms_norm_heads_", [&](auto* xp, auto* wq) {
    using WT = std::remove_const_t<std::remove_pointer_t<decltype(wq)>>;
    rms_norm_heads_rows(xp, qk.stride(0), wq, w_k.data_ptr<WT>(), T_, NH, n_q, D,
                        static_cast<float>(eps));
  });
  return qk;
}

template <typename T>
void rope_rows(T* qk, int64_t row_stride, const T* cos, const T* sin, int64_t T_, int64_t NH, int64_t D) {
  const int64_t half = D / 2;
  pw::parallel_ranges(0, T_, grain_rows(NH * D, kNsRope), [&](int64_t begin, int64_t end) {
    alignas(64) float c[kMaxHeadDim + V], s[kMaxHeadDim + V];  // this row's cos, sin_signed
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < D; ++j) {
        c[j] = float(cos[t * D + j]);
        s[j] = float(sin[t * D + j]);
      }
      for (int64_t h = 0; h < NH; ++h) {
        T* x = qk + t * row_stride + h * D;
        for (int64_t j = 0; j < half; j += V) {
          const int64_t n = std::min(V, half - j);
          const bool full = n == V;
          const fVec a = full ? load_f(x + j) : load_f(x + j, n);
          const fVec b = full ? load_f(x + half + j) : load_f(x + half + j, n);
          const fVec lo = at::vec::fmadd(b, fVec::loadu(s + j), a * fVec::loadu(c + j));
          const fVec hi = at::vec::fmadd(a, fVec::loadu(s + half + j), b * fVec::loadu(c + half + j));
          if (full) {
            store_f(x + j, lo);
            store_f(x + half + j, hi);
          } else {
            store_f(x + j, lo, n);
            store_f(x + half + j, hi, n);
          }
        }
      }
    }
  });
}

at::Tensor rope_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin_signed) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "rope_: qk must be (T, NH, D) with dense (NH, D) rows");
  const int64_t T_ = qk.size(0), NH = qk.size(1), D = qk.size(2);
  TORCH_CHECK(D % 2 == 0 && D <= kMaxHeadDim, "rope_: head_dim must be even and at most 1024");
  for (const auto* tab : {&cos, &sin_signed}) {
    TORCH_CHECK(tab->is_contiguous() && tab->numel() == T_ * D && tab->size(0) == T_ &&
                    tab->size(-1) == D,
                "rope_: cos and sin_signed must be contiguous (T, D) or (T, 1, D)");
    TORCH_CHECK(tab->scalar_type() == qk.scalar_type(), "rope_: cos/sin and qk differ in dtype");
  }
  if (qk.scalar_type() == at::kFloat) {
    rope_rows(qk.data_ptr<float>(), qk.stride(0), cos.data_ptr<float>(), sin_signed.data_ptr<float>(), T_, NH, D);
  } else {
    TORCH_CHECK(qk.scalar_type() == at::kBFloat16, "rope_: float32 or bfloat16 only");
    rope_rows(qk.data_ptr<BFloat16>(), qk.stride(0), cos.data_ptr<BFloat16>(),
              sin_signed.data_ptr<BFloat16>(), T_, NH, D);
  }
  return qk;
}

template <typename T>
void silu_mul_rows(const T* gu, int64_t gu_stride, T* out, int64_t T_, int64_t I) {
  const fVec one(1.f);
  const int64_t body = I - I % (2 * V);  // torch's vectorised loop covers 2 vectors a step
  pw::parallel_ranges(0, T_, grain_rows(I, kNsSiluMul), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gu + t * gu_stride;
      const T* u = g + I;
      T* y = out + t * I;
      int64_t j = 0;
      for (; j < body; j += V) {
        fVec gv = load_f(g + j);
        store_f(y + j, (gv / (one + gv.neg().exp())) * load_f(u + j));
      }
      for (; j < I; ++j) {
        const float gj = float(g[j]);
        y[j] = static_cast<T>((gj / (1.f + std::exp(-gj))) * float(u[j]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be (T, 2I) with contiguous rows");
  const int64_t T_ = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T_, I}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), T_, I);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16 only");
    silu_mul_rows(gate_up.data_ptr<BFloat16>(), gate_up.stride(0), out.data_ptr<BFloat16>(), T_, I);
  }
  return out;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  fVec best(-std::numeric_limits<float>::infinity());
  bool nan = false;
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    const fVec v = load_f(x + j);
    nan |= v.isnan().zero_mask() != (1 << V) - 1;  // zero_mask: a bit per lane that is not NaN
    best = at::vec::maximum(best, v);
  }
  alignas(64) float lanes[V];
  best.store(lanes);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) m = std::max(m, lanes[i]);
  for (; j < n; ++j) {
    const float v = float(x[j]);
    nan |= std::isnan(v);
    m = std::max(m, v);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = float(x[i]);
    if (nan ? std::isnan(v) : v == m) return i;
  }
  return 0;  // an empty row (V == 0 is refused by the caller)
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be (S, V) with contiguous rows, V > 0");
  const int64_t S = x.size(0), n = x.size(1), stride = x.stride(0);
  auto ids = at::empty({S}, x.options().dtype(at::kLong));
  int64_t* out = ids.data_ptr<int64_t>();
  dispatch_values(x, "argmax_rows", [&](const auto* p) {
    pw::parallel_ranges(0, S, grain_rows(n, kNsRmsNorm), [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) out[s] = argmax_row(p + s * stride, n);
    });
  });
  return ids;
}

template <typename T>
void mask_row(T* x, const uint32_t* words, int64_t n) {
  const T neg_inf = T(-std::numeric_limits<float>::infinity());
  for (int64_t w = 0; w * 32 < n; ++w) {
    const uint32_t word = words[w];
    if (word == 0xFFFFFFFFu) continue;
    const int64_t j0 = w * 32, len = std::min<int64_t>(32, n - j0);
    if (word == 0) {
      std::fill_n(x + j0, len, neg_inf);
      continue;
    }
    for (int64_t b = 0; b < len; ++b)
      if (!((word >> b) & 1u)) x[j0 + b] = neg_inf;
  }
}

at::Tensor mask_rows_(at::Tensor x, const at::Tensor& bits, const std::vector<int64_t>& rows) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "mask_rows_: x must be (S, V), rows contiguous");
  TORCH_CHECK(bits.dim() == 2 && bits.is_contiguous() && bits.scalar_type() == at::kInt,
              "mask_rows_: bits must be contiguous (S, W) int32");
  const int64_t S = x.size(0), n = x.size(1), stride = x.stride(0), W = bits.size(1);
  TORCH_CHECK(bits.size(0) >= S && W * 32 >= n, "mask_rows_: bits narrower than x");
  for (int64_t r : rows) TORCH_CHECK(r >= 0 && r < S, "mask_rows_: row out of range");
  const uint32_t* words = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  const int64_t R = static_cast<int64_t>(rows.size());
  dispatch_values(x, "mask_rows_", [&](auto* p) {
    pw::parallel_ranges(0, R, grain_rows(n, kNsMask), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        mask_row(p + rows[i] * stride, words + rows[i] * W, n);
    });
  });
  return x;
}

// rms_norm's row for one bf16 row, behind norm_api.h's capsule (cpu_quant's decode chain).
void norm_row_bf16(const void* x, const void* w, int w_f32, void* y, int64_t H, float eps) {
  const auto* xr = static_cast<const BFloat16*>(x);
  auto* yr = static_cast<BFloat16*>(y);
  if (w_f32)
    rms_norm_row(xr, static_cast<const float*>(w), yr, H, eps);
  else
    rms_norm_row(xr, static_cast<const BFloat16*>(w), yr, H, eps);
}

void norm_row_add_bf16(const void* x, const void* w, int w_f32, const void* res, void* y, int64_t H, float eps) {
  const auto* xr = static_cast<const BFloat16*>(x);
  const auto* rr = static_cast<const BFloat16*>(res);
  auto* yr = static_cast<BFloat16*>(y);
  if (w_f32)
    rms_norm_row(xr, static_cast<const float*>(w), yr, H, eps, rr);
  else
    rms_norm_row(xr, static_cast<const BFloat16*>(w), yr, H, eps, rr);
}

const PwNormApi kNormApi{kPwNormApiVersion, &norm_row_bf16, &norm_row_add_bf16};

pybind11::object norm_api() {
  return pybind11::reinterpret_steal<pybind11::object>(
      PyCapsule_New(const_cast<PwNormApi*>(&kNormApi), kPwNormCapsuleName, nullptr));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_pool", &pw::set_pool, "hand work items to the pool behind a cpu_pool capsule");
  m.def("rms_norm", &rms_norm, "RMSNorm of x (T, H) by weight (H,), bitwise the torch path");
  m.def("norm_api", &norm_api, "the one-row RMSNorm's capsule, for cpu_quant's set_norm");
  m.def("rms_norm_add", &rms_norm_add, "residual + rms_norm(x), bitwise the torch path");
  m.def("rms_norm_heads_", &rms_norm_heads_, "RMSNorm of each head of qk (T, NH, D) in place");
  m.def("rope_", &rope_, "rotate-half RoPE of qk (T, NH, D) in place");
  m.def("argmax_rows", &argmax_rows, "index of each row's first maximum, as max(dim=-1)");
  m.def("mask_rows_", &mask_rows_, "the grammar's token bitmask on the listed rows, in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of gate_up (T, 2I) -> (T, I)");
  m.def("serial_us", [] { return serial_us; }, "calls estimated under this many us stay serial");
  m.def("set_serial_us", [](double us) { serial_us = us; }, "for benchmarks");
}
