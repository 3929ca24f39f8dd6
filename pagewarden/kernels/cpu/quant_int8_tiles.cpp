// The many-row int8 path of the quantized GEMM (llama.cpp's numerics, as a register-blocked
// GEMM): out (M, N) = x (M, K) @ W^T, W in GGUF blocks, epilogues + residual, silu(gate) *
// up, float32 outputs (logits). quant.cpp sends it int8 calls of 2 rows and more.
//
// Numerics: those of quant_int8.cpp. Each 32 (Q6_K: 16) weights are w = A * u - B with u
// the unsigned quant in [0, 255] (Q8_0: q + 128) and A, B float32 from the file's scales;
// the activations are rounded per block of 32 to x ~ dx * v (v int8, dx = max|x| / 127), so
//     sum w x ~ sum_blocks (A dx) * sum(u v) - B * (dx * sum v)
// with sum(u v) exact in int32 (vpdpbusd: unsigned u x signed v, 4 products per lane).
//
// Layouts (per call, per thread: the scratch of one group, L2-resident):
//     xq   (M, K) int8 and, per 16 activations h, xd[h] = dx and xs[h] = dx * sum v (of the
//          16 (Q6_K) or of the block of 32, at its first half); quantized once per call
//     tile 16 weight rows as (K / 4, 16, 4) uint8: one 64-byte load is 4 consecutive k of
//          16 output columns, the operand of vpdpbusd; beside it A and B as (K / 16, 16)
//          float32 (a 32-weight block's values at both of its halves)
//
// Loop order: output columns in tiles of 16 (silu: gate tile 0, up tile 0, ...), groups of
// NR tiles (silu 4, else 3) are the pool's work items: an item decodes its group's 16 NR
// weight rows once (quant_int8_unpack.h: 16 rows' quant words unpacked straight to quads,
// their scales decoded 16 rows per vector; every type), then runs every
// MR rows of x (silu 3, else 4) through the micro-kernel: per block, MR x NR int32
// accumulators over its 8 (Q6_K: 4) k quads (NR 64-byte loads, MR 4-byte broadcasts,
// MR x NR vpdpbusd per quad), then per (row, tile) int32 -> float32, * dx, FMA by A, FMA
// of -B by dx * sum v into the MR x NR float32 accumulators (24 + 4 registers). The
// epilogues are quant_tiles.cpp's.

#include "quant_int8_tiles.h"

#include <c10/util/Exception.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "quant_scalar.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "gemm_tile.h"
#include "quant_decode.h"
#include "quant_int8_unpack.h"
#include "scratch64.h"

namespace {

// Register blocks (rows of x per micro-kernel call x column tiles per group): silu's
// groups hold gate/up pairs, NR = 4 (MR = 3); the other calls take NR = 3, MR = 4: a
// decode batch of 64 rows is 16 whole row blocks (MR = 3: 21 and a one-row call), and
// the default model's N = 576 / 960 are 12 / 20 groups, which two threads share evenly
// (NR = 4: 9 / 15, each decoded twice when split by rows).
constexpr int SILU_MR = 3, SILU_NR = 4;
constexpr int PLAIN_MR = 4, PLAIN_NR = 3;
constexpr int TW = 16;  // output columns per tile

// The activations quantized (the calling thread's; workers only read them during a call).
struct QuantRows {
  std::vector<int8_t> q;  // (M, K)
  std::vector<float> d;   // (M, K / 16): dx of the block holding these 16
  std::vector<float> s;   // (M, K / 16): dx * sum v over the 16 (SB 16) or the block (SB 32)
};

template <int SB>
void quantize(const TilesProblem& p, QuantRows* out) {
  const int64_t nb = p.k / 32, nh = p.k / 16;
  out->q.resize(size_t(p.m * p.k));
  out->d.assign(size_t(p.m * nh), 0.0f);
  out->s.assign(size_t(p.m * nh), 0.0f);
  pw::parallel_ranges(0, p.m * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t bi = b0; bi < b1; ++bi) {
      const int64_t i = bi / nb, blk = bi % nb;
      const uint16_t* src = p.x + i * p.ldx + blk * 32;
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_u32(reinterpret_cast<const uint8_t*>(src))), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_u32(reinterpret_cast<const uint8_t*>(src + 16))), 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 idv = _mm512_set1_ps(id);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, idv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, idv));
      int8_t* dst = out->q.data() + i * p.k + blk * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
      const float s0 = float(_mm512_reduce_add_epi32(qlo)), s1 = float(_mm512_reduce_add_epi32(qhi));
      const int64_t h = i * nh + 2 * blk;
      out->d[size_t(h)] = out->d[size_t(h + 1)] = d;
      if constexpr (SB == 16) {
        out->s[size_t(h)] = d * s0;
        out->s[size_t(h + 1)] = d * s1;
      } else {
        out->s[size_t(h)] = d * (s0 + s1);
      }
    }
  });
}

// One group's decoded tiles: tile j's quads at q + j * qstride, its A / B at a / b + j * sstride.
struct Group {
  uint8_t* q;
  float* a;
  float* b;
  int64_t qstride, sstride;
};

inline void prefetch_l2(const uint8_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

// Rows [m0, m0 + R) x the group's tiles [0, C); SB: weights per scale (32, Q6_K 16).
template <int R, int C, int SB>
void micro(const TilesProblem& p, const QuantRows& x, const Group& g, int64_t m0, int64_t col0) {
  constexpr int quads = SB / 4;
  const int64_t nh = p.k / 16;
  const int8_t* xr[R];
  const float* xd[R];
  const float* xs[R];
  for (int i = 0; i < R; ++i) {
    xr[i] = x.q.data() + (m0 + i) * p.k;
    xd[i] = x.d.data() + (m0 + i) * nh;
    xs[i] = x.s.data() + (m0 + i) * nh;
  }
  prefetch_epilogue<R, C>(p, m0, col0);
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < p.k / SB; ++sb) {
    __m512i ia[R][C];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) ia[i][j] = _mm512_setzero_si512();
    for (int t = 0; t < quads; ++t) {
      const int64_t kq = sb * quads + t;
      __m512i w[C];
      for (int j = 0; j < C; ++j) w[j] = _mm512_loadu_si512(g.q + j * g.qstride + kq * 64);
      for (int i = 0; i < R; ++i) {
        int32_t quad;
        std::memcpy(&quad, xr[i] + kq * 4, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int j = 0; j < C; ++j) ia[i][j] = _mm512_dpbusd_epi32(ia[i][j], w[j], xv);
      }
    }
    const int64_t h = sb * SB / 16;
    for (int j = 0; j < C; ++j) {
      const __m512 a = _mm512_loadu_ps(g.a + j * g.sstride + h * TW);
      const __m512 b = _mm512_loadu_ps(g.b + j * g.sstride + h * TW);
      for (int i = 0; i < R; ++i) {
        const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(ia[i][j]), _mm512_set1_ps(xd[i][h]));
        acc[i][j] = _mm512_fnmadd_ps(b, _mm512_set1_ps(xs[i][h]), _mm512_fmadd_ps(dot, a, acc[i][j]));
      }
    }
  }
  tiles_epilogue<R, C>(p, acc, m0, col0);
}

// Rows [m0, m1) x the group's C tiles, MR rows per micro-kernel call.
template <int MR, int C, int SB>
void all_rows(const TilesProblem& p, const QuantRows& x, const Group& g, int64_t col0, int64_t m0, int64_t m1) {
  for (; m0 + MR <= m1; m0 += MR) micro<MR, C, SB>(p, x, g, m0, col0);
  switch (m1 - m0) {
    case 3: micro<3, C, SB>(p, x, g, m0, col0); break;
    case 2: micro<2, C, SB>(p, x, g, m0, col0); break;
    case 1: micro<1, C, SB>(p, x, g, m0, col0); break;
    default: break;
  }
}

// The group's C <= NR tiles over rows [m0, m1).
template <int MR, int NR, int SB>
void group_rows(const TilesProblem& p, const QuantRows& x, const Group& g, int c, int64_t col0, int64_t m0, int64_t m1) {
  static_assert(NR >= 3 && NR <= 4, "NR: 3 or 4");
  switch (c) {
    case 4: all_rows<MR, NR == 4 ? 4 : 3, SB>(p, x, g, col0, m0, m1); break;
    case 3: all_rows<MR, 3, SB>(p, x, g, col0, m0, m1); break;
    case 2: all_rows<MR, 2, SB>(p, x, g, col0, m0, m1); break;
    default: all_rows<MR, 1, SB>(p, x, g, col0, m0, m1); break;
  }
}

template <int type, int MR, int NR>
void run_blocked(const TilesProblem& p, const QuantRows& x) {
  constexpr int SB = type == Q6_K ? 16 : 32;
  const int64_t out_tiles = (p.n_out + TW - 1) / TW;
  const int64_t tiles = p.silu ? 2 * out_tiles : out_tiles;
  const int64_t groups = (tiles + NR - 1) / NR;
  const int64_t qstride = p.k * TW, sstride = p.k;  // bytes; floats
  // Few groups that the threads cannot share evenly (N = 576: 9 groups on 2 threads): each
  // group is an item per thread, over its share of the rows (the decode, paid per item, is
  // small beside a share of 64 rows).
  const int64_t th = pw::max_threads();
  const int64_t parts = th > 1 && groups % th != 0 && groups < 8 * th && p.m >= 8 * th ? th : 1;
  const int64_t chunk = ((p.m + parts - 1) / parts + MR - 1) / MR * MR;
  pw::parallel_items(groups * parts, [&](int64_t item, int) {
    const int64_t gi = item / parts, m0 = item % parts * chunk, m1 = std::min(p.m, m0 + chunk);
    if (m0 >= m1) return;
    thread_local std::vector<uint8_t> qs;
    thread_local std::vector<float> ab;
    float* const a = scratch64(ab, size_t(2 * NR * sstride));
    const Group g{scratch64(qs, size_t(NR * qstride)), a, a + NR * sstride, qstride, sstride};
    const int64_t t0 = gi * NR;
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
      unpack_tile<type>(rows, p.k, g.q + j * qstride, g.a + j * sstride, g.b + j * sstride);
    }
    // The group this thread likely takes next (items go round the threads): its weight
    // rows towards L2 while this one computes (a decode batch's few rows compute for
    // ~15 us a group; without this the next group's first tile waits on memory).
    const int64_t next = (item + th) / parts;
    if (next != gi && next < groups)
      for (int64_t t = next * NR; t < std::min<int64_t>(tiles, next * NR + NR); ++t) {
        const uint8_t* row0 = first_row(t, &cnt);
        prefetch_l2(row0, cnt * p.row_bytes);
      }
    group_rows<MR, NR, SB>(p, x, g, c, (p.silu ? t0 / 2 : t0) * TW, m0, m1);
  });
}

template <int type>
void run(const TilesProblem& p) {
  thread_local QuantRows mine;  // the caller's; a worker's own thread_local would be empty
  quantize<type == Q6_K ? 16 : 32>(p, &mine);
  if (p.silu)
    run_blocked<type, SILU_MR, SILU_NR>(p, mine);
  else
    run_blocked<type, PLAIN_MR, PLAIN_NR>(p, mine);
}

}  // namespace

bool has_int8_tiles_kernel() { return true; }

void gemm_int8_tiles(const TilesProblem& p) {
  TORCH_CHECK(with_type(p.type, [&](auto t) { run<decltype(t)::value>(p); }), "cpu_quant int8 tiles: unsupported type ",
              p.type);
}
#else
bool has_int8_tiles_kernel() { return false; }

void gemm_int8_tiles(const TilesProblem&) { TORCH_CHECK(false, "cpu_quant int8 tiles: this build has no AVX512-VNNI path"); }
#endif
