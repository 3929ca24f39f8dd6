// The many-row int8 (AVX512-VNNI) path of the quantized GEMM (quant_int8_tiles.cpp), called
// by quant.cpp once it has checked the operands: the operands of quant_tiles.h.
#pragma once

#include <cstdint>

#include "quant_tiles.h"

// Whether this build has the int8 tiles (AVX512-VNNI, BW, VL).
bool has_int8_tiles_kernel();

// out = x @ W^T (+ res; silu): x quantized to int8 per block of 32 once per call, W decoded
// once per call, group by group, to unsigned int8 tiles with per-block float32 scales.
void gemm_int8_tiles(const TilesProblem& p);
