// bfloat16 GEMM for CPUs with AVX512-BF16: out (M, N) = x (M, K) @ W^T, float32 sums,
// with the decoder's epilogues fused: + residual (o_proj, down_proj) and
// act(gate) * up (gate_up_proj), act SiLU or GELU-tanh.
//
// Why: at the batch sizes a decode step runs (M = 1..256 rows) and the narrow layers of a
// small model (N = 576..3072, K = 576..1536), oneDNN's bf16 GEMM reaches 200-300 GFLOP/s
// on a 2-core Zen 4 where this machine's vdpbf16ps peak is about 450; the kernel below
// keeps every thread on whole 96-column panels of W and all of M.
//
// Layouts:
//     x, residual   (M, K) / (M, N) bf16, rows strided (x.stride(1) == 1), K even
//     packed        (N_tiles, K / 2, 16, 2) bf16: column tile t holds output columns
//                   [16 t, 16 t + 16), as pairs of consecutive k (the operand layout of
//                   vdpbf16ps: one 64-byte load is one k pair of 16 columns); N padded
//                   with zero columns to a multiple of 16. For a gated act the tiles
//                   alternate gate, up, gate, up (see cpu_linear.py).
//     out           (M, N) or (M, N / 2) for a gated act, bf16, contiguous
//
// Loop order: threads take the column tiles in groups of NR = 6 (gated: 3 gate/up
// pairs), work items of the kernels' pool (pool.h), and run each group over every
// MR = 4 rows of x; the micro-kernel holds the MR x NR accumulators (24 registers) over all of K, one k pair a
// step: NR 64-byte loads of W, MR broadcasts of a 32-bit x pair, MR x NR vdpbf16ps. A
// group's W panel (K/2 x 6 x 64 bytes, 110-295 KB) stays in L2 while every row block
// reuses it, so W is read from memory once per call. Sums are float32 (each vdpbf16ps
// adds two exact bf16 products to a lane); the epilogue adds the residual in float32 and
// rounds once to bf16 (round to nearest even), as oneDNN's fused add does.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "pool_bind.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "gemm_tile.h"
#endif

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kHasKernel = true;

constexpr int MR = 4;  // rows of x per micro-kernel call
constexpr int NR = 6;  // column tiles (of 16) per group

using bf16_bits = uint16_t;

inline __m256i round_bf16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }

inline __m512 widen(const bf16_bits* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

struct Args {
  const bf16_bits* x;
  int64_t ldx;
  const bf16_bits* w;  // packed
  int64_t pairs;       // K / 2
  const bf16_bits* res;
  int64_t ldres;
  bf16_bits* out;
  int64_t ldout;
  int64_t n_out;  // columns of out
  Act act;
};

// Rows [m0, m0 + R) x tiles [t0, t0 + C) of the product; writes their outputs.
template <int R, int C>
void micro(const Args& a, int64_t m0, int64_t t0) {
  const bf16_bits* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = a.x + (m0 + i) * a.ldx;
  {  // the epilogue's residual and output lines, asked for before the k loop (gemm_tile.h)
    const int64_t col = a.act != kNone ? t0 / 2 * 16 : t0 * 16;
    const int64_t cols = std::min<int64_t>((a.act != kNone ? C / 2 : C) * 16, a.n_out - col);
    for (int i = 0; cols > 0 && i < R; ++i) {
      if (a.res) prefetch_span<false>(a.res + (m0 + i) * a.ldres + col, cols * 2);
      prefetch_span<true>(a.out + (m0 + i) * a.ldout + col, cols * 2);
    }
  }
  __m512 acc[R][C];
  dot_tiles<R, C>(xr, a.w + t0 * a.pairs * 32, a.pairs, acc);
  for (int i = 0; i < R; ++i) {
    bf16_bits* o = a.out + (m0 + i) * a.ldout;
    if (a.act != kNone) {  // tiles alternate gate, up: tile pair j/2 is output tile t0/2 + j/2
      for (int j = 0; j + 1 < C; j += 2) {
        const int64_t col = (t0 + j) / 2 * 16;
        const __mmask16 mask = a.n_out - col >= 16 ? 0xFFFF : (1u << (a.n_out - col)) - 1;
        const __m512 v = a.act == kSilu ? gated<kSilu>(acc[i][j], acc[i][j + 1])
                                        : gated<kGeluTanh>(acc[i][j], acc[i][j + 1]);
        _mm256_mask_storeu_epi16(o + col, mask, round_bf16(v));
      }
      continue;
    }
    for (int j = 0; j < C; ++j) {
      const int64_t col = (t0 + j) * 16;
      const __mmask16 mask = a.n_out - col >= 16 ? 0xFFFF : (1u << (a.n_out - col)) - 1;
      __m512 v = acc[i][j];
      if (a.res) v = _mm512_add_ps(v, widen(a.res + (m0 + i) * a.ldres + col, mask));
      _mm256_mask_storeu_epi16(o + col, mask, round_bf16(v));
    }
  }
}

template <int C>
void rows(const Args& a, int64_t m, int64_t t0) {
  int64_t m0 = 0;
  for (; m0 + MR <= m; m0 += MR) micro<MR, C>(a, m0, t0);
  switch (m - m0) {
    case 3: micro<3, C>(a, m0, t0); break;
    case 2: micro<2, C>(a, m0, t0); break;
    case 1: micro<1, C>(a, m0, t0); break;
    default: break;
  }
}

void group(const Args& a, int64_t m, int64_t t0, int64_t tiles) {
  switch (tiles) {
    case 6: rows<6>(a, m, t0); break;
    case 5: rows<5>(a, m, t0); break;
    case 4: rows<4>(a, m, t0); break;
    case 3: rows<3>(a, m, t0); break;
    case 2: rows<2>(a, m, t0); break;
    case 1: rows<1>(a, m, t0); break;
    default: TORCH_CHECK(false, "bad tile count");
  }
}
#else
constexpr bool kHasKernel = false;
#endif

}  // namespace

bool has_kernel() { return kHasKernel; }

// out = x @ W^T (+ residual) or act(gate) * up (act 1: SiLU, 2: GELU-tanh), W packed as
// in the header.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& residual,
                int64_t act) {
  TORCH_CHECK(kHasKernel, "cpu_gemm: this build has no AVX512-BF16 kernel");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: (M, K) bf16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              "packed: (N_tiles, K / 2, 16, 2) bf16 matching x's K");
  const int64_t m = x.size(0), tiles = packed.size(0);
  TORCH_CHECK(x.size(1) % 2 == 0, "K must be even");
  TORCH_CHECK(act >= 0 && act <= 2, "act: 0 (none), 1 (silu) or 2 (gelu_tanh)");
  const bool gated_out = act != 0;  // (M, N / 2): act(gate) * up
  TORCH_CHECK(!gated_out || (tiles % 2 == 0 && !residual), "gated act: gate/up tile pairs, no residual");
  const int64_t n_out = gated_out ? n / 2 : n;
  TORCH_CHECK(n > 0 && (gated_out ? tiles * 8 : tiles * 16) >= n_out && (gated_out ? tiles * 8 : tiles * 16) < n_out + 16,
              "n does not match the packed tiles");
  at::Tensor out = at::empty({m, n_out}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  Args a{reinterpret_cast<const bf16_bits*>(x.data_ptr()), x.stride(0),
         reinterpret_cast<const bf16_bits*>(packed.data_ptr()), packed.size(1), nullptr, 0,
         reinterpret_cast<bf16_bits*>(out.data_ptr()), n_out, n_out, static_cast<Act>(act)};
  at::Tensor res;
  if (residual) {
    res = *residual;
    TORCH_CHECK(res.dim() == 2 && res.size(0) == m && res.size(1) == n && res.stride(1) == 1 &&
                    res.scalar_type() == at::kBFloat16, "residual: (M, N) bf16 rows");
    a.res = reinterpret_cast<const bf16_bits*>(res.data_ptr());
    a.ldres = res.stride(0);
  }
  if (m == 0) return out;
  // Groups are claimed one at a time, not split in equal halves: a thread that starts
  // late (woken from sleep) takes fewer.
  const int64_t groups = (tiles + NR - 1) / NR;
  pw::parallel_items(groups, [&](int64_t g, int) {
    const int64_t t0 = g * NR;
    group(a, m, t0, std::min<int64_t>(NR, tiles - t0));
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_pool", &pw::set_pool, "hand work items to the pool behind a cpu_pool capsule");
  m.def("has_kernel", &has_kernel, "whether this build has the AVX512-BF16 GEMM");
  m.def("gemm", &gemm, "bf16 GEMM against a vdpbf16ps-packed weight, fused epilogues");
}
