// The many-row path of the bf16-decode quantized GEMM (quant.cpp sends calls with more
// rows than its decode-in-registers path takes): out (M, N) = x (M, K) @ W^T with W in
// GGUF blocks, epilogues + residual, silu(gate) * up, float32 outputs (logits).
//
// Loop order: the output columns are cut into tiles of 16 (silu: gate tile 0, up tile 0,
// gate tile 1, ...) and the tiles into groups of NR = 6, the work items of the kernels'
// pool (pool.h). An item decodes its group's 96 weight rows once into a per-thread
// scratch (NR x K x 16 bf16, 110-295 KB at the default model's K), in exactly the layout
// of gemm.cpp's packed tiles (K / 2, 16, 2): each 32-weight piece of 16 rows is decoded
// by quant_decode.h (bit for bit ggml's float32 weights, rounded to bf16) into 16
// registers, transposed as 16 x 16 32-bit pairs and stored. Then gemm.cpp's micro-kernel
// (a copy, with this file's epilogues) runs over every MR = 4 rows of x: MR x NR float32
// accumulators over all of K, NR 64-byte loads of W, MR broadcasts of an x pair and
// MR x NR vdpbf16ps per k pair. The decode is paid once per weight per call, whatever M
// is, and the inner loop is --quantization none's. SiLU is gemm.cpp's (exp by a degree-6
// polynomial), the same as the bf16 path's fused gate_up.

#include "quant_tiles.h"

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "quant_scalar.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "quant_decode.h"

namespace {

constexpr int MR = 4;   // rows of x per micro-kernel call
constexpr int NR = 6;   // column tiles per group (an even number: silu pairs)
constexpr int TW = 16;  // output columns per tile

using bf16_bits = uint16_t;

// exp(x) for x <= 0 on 16 lanes (gemm.cpp's): x = n ln2 + r, exp(r) by its degree-6 Taylor polynomial.
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// silu(g) * u = g * u / (1 + exp(-g)), exp taken of -|g| only (gemm.cpp's gated<kSilu>).
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
  return _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

// r[j] lane i <- r[i] lane j, for 16 x 16 32-bit lanes.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// Weight rows rows[0, 16) decoded to bf16 as one packed tile (K / 2, 16, 2) at dst (a
// short tile repeats its last row: those columns are never stored).
template <int type>
void decode_tile(const TilesProblem& p, const uint8_t* const* rows, bf16_bits* dst) {
  TypeInfo ti{};
  type_info(type, &ti);
  constexpr int pieces = type >= Q4_K ? 8 : 1;
  for (int64_t blk = 0, k0 = 0; blk < p.k / ti.block_weights; ++blk) {
    const int64_t off = blk * ti.block_bytes;
    for (int s = 0; s < pieces; ++s, k0 += 32) {
      __m512i v[16];
      for (int r = 0; r < 16; ++r)
        v[r] = reinterpret_cast<__m512i>(decode32_bf16<type>(rows[r] + off, s));
      transpose16(v);  // v[j]: k pair k0 / 2 + j of the 16 rows
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (k0 / 2 + j) * 2 * TW, v[j]);
    }
  }
}

// Bytes [p, p + n) towards L2 (the next tile's rows, while this one decodes: strided
// reads of 16 rows at once are otherwise latency-bound).
inline void prefetch_l2(const uint8_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

struct Args {
  const TilesProblem& p;
  const bf16_bits* w;  // the group's decoded tiles
  int64_t pairs;       // K / 2
  int64_t col0;        // the group's first output column
};

// Rows [m0, m0 + R) x the group's tiles [0, C); writes their outputs.
template <int R, int C>
void micro(const Args& a, int64_t m0) {
  const TilesProblem& p = a.p;
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  const bf16_bits* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = p.x + (m0 + i) * p.ldx;
  for (int64_t k = 0; k < a.pairs; ++k) {
    __m512bh b[C];
    for (int j = 0; j < C; ++j)
      b[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(a.w + (j * a.pairs + k) * 2 * TW));
    for (int i = 0; i < R; ++i) {
      int32_t pair;  // x[m, 2k] and x[m, 2k + 1]
      std::memcpy(&pair, xr[i] + 2 * k, sizeof pair);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, b[j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const int64_t row = m0 + i;
    const int step = p.silu ? 2 : 1;
    for (int j = 0; j + step - 1 < C; j += step) {
      const int64_t col = a.col0 + j / step * TW;
      const __mmask16 mask = p.n_out - col >= TW ? 0xFFFF : (1u << (p.n_out - col)) - 1;
      __m512 v = p.silu ? silu_mul(acc[i][j], acc[i][j + 1]) : acc[i][j];
      if (p.res) {
        const __m256i r = _mm256_maskz_loadu_epi16(mask, p.res + row * p.ldres + col);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
      }
      if (p.out_f32)
        _mm512_mask_storeu_ps(p.out_f32 + row * p.n_out + col, mask, v);
      else
        _mm256_mask_storeu_epi16(p.out + row * p.n_out + col, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

template <int C>
void all_rows(const Args& a) {
  const int64_t m = a.p.m;
  int64_t m0 = 0;
  for (; m0 + MR <= m; m0 += MR) micro<MR, C>(a, m0);
  switch (m - m0) {
    case 3: micro<3, C>(a, m0); break;
    case 2: micro<2, C>(a, m0); break;
    case 1: micro<1, C>(a, m0); break;
    default: break;
  }
}

void group(const Args& a, int tiles) {
  switch (tiles) {
    case 6: all_rows<6>(a); break;
    case 5: all_rows<5>(a); break;
    case 4: all_rows<4>(a); break;
    case 3: all_rows<3>(a); break;
    case 2: all_rows<2>(a); break;
    default: all_rows<1>(a); break;
  }
}

template <int type>
void run(const TilesProblem& p) {
  const int64_t out_tiles = (p.n_out + TW - 1) / TW;
  const int64_t tiles = p.silu ? 2 * out_tiles : out_tiles;
  const int64_t groups = (tiles + NR - 1) / NR;
  const size_t need = size_t(NR) * TW * p.k;
  pw::parallel_items(groups, [&](int64_t g, int) {
    thread_local std::vector<bf16_bits> scratch;
    if (scratch.size() < need) scratch.resize(need);
    const int64_t t0 = g * NR;
    const int c = int(std::min<int64_t>(NR, tiles - t0));
    auto first_row = [&](int64_t t, int* cnt) {  // tile t's rows: cnt from this one
      const int64_t n0 = (p.silu ? t / 2 : t) * TW;
      const int64_t base = p.silu && (t & 1) ? p.n_out : 0;  // an up tile: rows [n_out, N)
      *cnt = int(std::min<int64_t>(TW, p.n_out - n0));
      return p.w + (base + n0) * p.row_bytes;
    };
    int cnt = 0;
    prefetch_l2(first_row(t0, &cnt), cnt * p.row_bytes);
    for (int j = 0; j < c; ++j) {
      const uint8_t* row0 = first_row(t0 + j, &cnt);
      if (j + 1 < c) {
        int next = 0;
        const uint8_t* ahead = first_row(t0 + j + 1, &next);
        prefetch_l2(ahead, next * p.row_bytes);
      }
      const uint8_t* rows[TW];
      for (int r = 0; r < TW; ++r) rows[r] = row0 + std::min(r, cnt - 1) * p.row_bytes;
      decode_tile<type>(p, rows, scratch.data() + size_t(j) * TW * p.k);
    }
    group(Args{p, scratch.data(), p.k / 2, (p.silu ? t0 / 2 : t0) * TW}, c);
  });
}

}  // namespace

bool has_tiles_kernel() { return true; }

void gemm_tiles(const TilesProblem& p) {
  switch (p.type) {
    case Q4_0: run<Q4_0>(p); break;
    case Q4_1: run<Q4_1>(p); break;
    case Q5_0: run<Q5_0>(p); break;
    case Q5_1: run<Q5_1>(p); break;
    case Q8_0: run<Q8_0>(p); break;
    case Q4_K: run<Q4_K>(p); break;
    case Q5_K: run<Q5_K>(p); break;
    case Q6_K: run<Q6_K>(p); break;
    default: TORCH_CHECK(false, "cpu_quant tiles: unsupported type ", p.type);
  }
}
#else
bool has_tiles_kernel() { return false; }

void gemm_tiles(const TilesProblem&) { TORCH_CHECK(false, "cpu_quant tiles: this build has no AVX512-BF16 path"); }
#endif
