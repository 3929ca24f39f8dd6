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
// (gemm_tile.h, shared; this file's epilogues) runs over every MR = 4 rows of x: MR x NR float32
// accumulators over all of K, NR 64-byte loads of W, MR broadcasts of an x pair and
// MR x NR vdpbf16ps per k pair. The decode is paid once per weight per call, whatever M
// is, and the inner loop is --quantization none's. SiLU is gemm_tile.h's (exp by a degree-6
// polynomial), the same as the bf16 path's fused gate_up.

#include "quant_tiles.h"

#include <c10/util/Exception.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "quant_scalar.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "gemm_tile.h"
#include "quant_decode.h"
#include "scratch64.h"

namespace {

constexpr int MR = 4;   // rows of x per micro-kernel call
constexpr int NR = 6;   // column tiles per group (an even number: silu pairs)
constexpr int TW = 16;  // output columns per tile

using bf16_bits = uint16_t;

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
  const bf16_bits* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = p.x + (m0 + i) * p.ldx;
  prefetch_epilogue<R, C>(p, m0, a.col0);
  __m512 acc[R][C];
  dot_tiles<R, C>(xr, a.w, a.pairs, acc);
  tiles_epilogue<R, C>(p, acc, m0, a.col0);
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
    thread_local std::vector<bf16_bits> scratch_v;
    bf16_bits* const scratch = scratch64(scratch_v, need);
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
      decode_tile<type>(p, rows, scratch + size_t(j) * TW * p.k);
    }
    group(Args{p, scratch, p.k / 2, (p.silu ? t0 / 2 : t0) * TW}, c);
  });
}

}  // namespace

bool has_tiles_kernel() { return true; }

void gemm_tiles(const TilesProblem& p) {
  TORCH_CHECK(with_type(p.type, [&](auto t) { run<decltype(t)::value>(p); }), "cpu_quant tiles: unsupported type ", p.type);
}
#else
bool has_tiles_kernel() { return false; }

void gemm_tiles(const TilesProblem&) { TORCH_CHECK(false, "cpu_quant tiles: this build has no AVX512-BF16 path"); }
#endif
