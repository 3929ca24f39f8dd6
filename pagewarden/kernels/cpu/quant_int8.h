// The int8 (VNNI) path of the quantized GEMM (quant_int8.cpp), called by quant.cpp once it
// has checked the operands: the same layouts as there, x bf16 only.
#pragma once

#include <cstdint>

struct Int8Problem {
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
  bool gelu = false;  // with silu: out = gelu_tanh(gate . x) * (up . x) instead
};

// Whether this build has the AVX512-VNNI int8 path.
bool has_int8_kernel();

// out = x @ W^T (+ res; silu), activations quantized to int8 per block of 32.
void gemm_int8(const Int8Problem& p);
