// The many-row path of the bf16-decode quantized GEMM (quant_tiles.cpp), called by
// quant.cpp once it has checked the operands: the same layouts as there, x bf16 only.
#pragma once

#include <cstdint>

struct TilesProblem {
  int type;  // a ggml type id of quant_scalar.h
  const uint8_t* w;
  int64_t row_bytes, m, k, n_out;  // n_out: output columns (silu: half of W's rows)
  bool silu;                        // W = [gate; up]: out = silu(gate . x) * (up . x)
  const uint16_t* x;                // (M, K) bf16 bits, row stride ldx
  int64_t ldx;
  const uint16_t* res;  // (M, N) bf16 residual added to out, or null
  int64_t ldres;
  uint16_t* out;   // (M, N) bf16, or null when out_f32 is set
  float* out_f32;  // (M, N) float32 outputs (logits)
  bool gelu = false;  // with silu: out = gelu_tanh(gate . x) * (up . x)
};

// Whether this build has the tiles path (AVX512-BF16).
bool has_tiles_kernel();

// out = x @ W^T (+ res; silu): W decoded to bf16 once per call, group by group, into
// the packed column tiles of gemm.cpp, then multiplied by every row of x.
void gemm_tiles(const TilesProblem& p);
