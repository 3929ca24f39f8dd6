// A thread's scratch at a 64-byte boundary, for the quantized tiles' decoded weights
// (quant_tiles.cpp, quant_int8_tiles.cpp). A std::vector's data is only 16-byte aligned
// (malloc; a large one is mmap'd, page + 16), so every 64-byte load of a tile read from
// it would straddle two cache lines: the micro-kernels' weight loads are all of that
// kind. The packed bf16 weights of --quantization none (torch tensors) are 64-aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

// n elements of v from a 64-byte boundary (v grows, never shrinks).
template <class T>
T* scratch64(std::vector<T>& v, size_t n) {
  constexpr size_t pad = 64 / sizeof(T);
  if (v.size() < n + pad) v.resize(n + pad);
  const auto at = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((at + 63) & ~uintptr_t(63));
}

}  // namespace
