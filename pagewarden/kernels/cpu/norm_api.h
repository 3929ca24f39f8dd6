// How one kernel extension reaches the fused extension's RMSNorm (fused.cpp) without
// linking it: fused's norm_api() returns a capsule of this struct, and cpu_quant's
// set_norm takes it (kernels/cpu/quant.py binds them at load), so a one-row decode chain
// in cpu_quant normalises exactly as fused.rms_norm does: the same function, the same
// build flags, the same rounding.

#pragma once

#include <cstdint>

struct PwNormApi {
  int version;
  // y (H,) = RMSNorm of the bf16 row x (H,) by w (H,), bf16 (w_f32 0) or float32 (1):
  // fused.rms_norm's row. y may not alias x.
  void (*row_bf16)(const void* x, const void* w, int w_f32, void* y, int64_t H, float eps);
  // y = res + RMSNorm(x) (the norm rounded to bf16 first): fused.rms_norm_add's row.
  void (*row_add_bf16)(const void* x, const void* w, int w_f32, const void* res, void* y, int64_t H, float eps);
};

constexpr int kPwNormApiVersion = 2;
constexpr const char* kPwNormCapsuleName = "pagewarden.cpu_norm";
