// GGUF block types for quant.cpp: the type table (block size, bytes, weights per block)
// and the scalar decoder, which decodes 32 weights of a block to float32 exactly as ggml
// and the gguf package do (the reference every vector path is compared with, and the
// portable path itself). Included by quant.cpp only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// ggml type ids (gguf GGMLQuantizationType).
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct TypeInfo {
  int block_weights;
  int block_bytes;
};

bool type_info(int type, TypeInfo* info) {
  switch (type) {
    case Q4_0: *info = {32, 18}; return true;
    case Q4_1: *info = {32, 20}; return true;
    case Q5_0: *info = {32, 22}; return true;
    case Q5_1: *info = {32, 24}; return true;
    case Q8_0: *info = {32, 34}; return true;
    case Q4_K: *info = {256, 144}; return true;
    case Q5_K: *info = {256, 176}; return true;
    case Q6_K: *info = {256, 210}; return true;
    default: return false;
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Scalar decoder: the 32 weights of piece `s` of block `b` into out[0..32).
void decode32_scalar(int type, const uint8_t* b, int s, float* out) {
  switch (type) {
    case Q4_0: {
      const float d = half_to_float(b);
      for (int j = 0; j < 16; ++j) {
        out[j] = float((b[2 + j] & 0xF) - 8) * d;
        out[j + 16] = float((b[2 + j] >> 4) - 8) * d;
      }
      return;
    }
    case Q4_1: {
      const float d = half_to_float(b), m = half_to_float(b + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = float(b[4 + j] & 0xF) * d + m;
        out[j + 16] = float(b[4 + j] >> 4) * d + m;
      }
      return;
    }
    case Q5_0:
    case Q5_1: {
      const bool one = type == Q5_1;
      const float d = half_to_float(b), m = one ? half_to_float(b + 2) : 0.0f;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        if (one) {
          out[j] = float(lo) * d + m;
          out[j + 16] = float(hi) * d + m;
        } else {
          out[j] = float(lo - 16) * d;
          out[j + 16] = float(hi - 16) * d;
        }
      }
      return;
    }
    case Q8_0: {
      const float d = half_to_float(b);
      for (int j = 0; j < 32; ++j) out[j] = float(int8_t(b[2 + j])) * d;
      return;
    }
    case Q4_K:
    case Q5_K: {
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      int sc, mn;
      scale_min_k4(s, b + 4, &sc, &mn);
      const float d1 = d * float(sc), m1 = dmin * float(mn);
      const bool five = type == Q5_K;
      const uint8_t* qs = b + (five ? 48 : 16) + 32 * (s / 2);
      const int shift = (s & 1) * 4;
      for (int l = 0; l < 32; ++l) {
        int q = (qs[l] >> shift) & 0xF;
        if (five) q |= ((b[16 + l] >> s) & 1) << 4;
        out[l] = d1 * float(q) - m1;
      }
      return;
    }
    case Q6_K: {
      const float d = half_to_float(b + 208);
      const int half = s / 4, t = s % 4;
      const uint8_t* ql = b + 64 * half + (t & 1) * 32;
      const uint8_t* qh = b + 128 + 32 * half;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * half);
      for (int l = 0; l < 32; ++l) {
        const int q = (((ql[l] >> (t >= 2 ? 4 : 0)) & 0xF) | (((qh[l] >> (2 * t)) & 3) << 4)) - 32;
        out[l] = d * float(sc[2 * t + l / 16]) * float(q);
      }
      return;
    }
    default: TORCH_CHECK(false, "cpu_quant: unsupported type ", type);
  }
}

void decode_row_scalar(int type, const TypeInfo& ti, const uint8_t* row, int64_t k, float* out) {
  const int pieces = ti.block_weights / 32;
  for (int64_t blk = 0; blk < k / ti.block_weights; ++blk)
    for (int s = 0; s < pieces; ++s)
      decode32_scalar(type, row + blk * ti.block_bytes, s, out + blk * ti.block_weights + 32 * s);
}

}  // namespace
