// The K/V write of one layer, and a decode step's whole attention after the qkv GEMM in
// one call: what kernels/attention.py's write_kv and the torch path's RoPE do in a
// dozen ops and views per layer.
//
// Layouts (attention_common.h for the cache and the read-side tensors):
//
//     k, v          (T, n_kv, D)   dense (n_kv, D) rows, any token stride, the cache's dtype
//     slot_mapping  (T,) int64     the slot of each new token: block_id * bs + offset
//     new_tags      (T,) int64     the tag of each new token, written to slot_tags[slot]
//     slot_tags     (num_blocks * bs,) int64, contiguous (both tag tensors, or neither)
//     qkv           (T, (n_heads + 2 n_kv) * D)  the qkv GEMM's output, contiguous rows
//     cos, sin      (T, 1, D) contiguous, qkv's dtype: RopeTable rows (sin signed)
//
// write_kv: for every token t, K row t -> cache[0] slot, V row t -> cache[1] slot, and
// new_tags[t] -> slot_tags[slot]: the torch path's three index_copy_, byte for byte (a
// slot named twice keeps the later token's row). Every slot is range-checked before
// anything is written (IndexError, as index_copy_ raises). Runs of tokens are the pool's
// items; a step of a few tokens stays on the calling thread.
//
// rope_write_decode: for a step whose every row decodes (one new token each), per token
// t: the q and k heads of qkv row t rotated in place (rotate-half RoPE in float32,
// rounded once to qkv's dtype, bitwise cpu_fused's rope_: x[j] = fma(x[j + D/2],
// sin[j], x[j] * cos[j]) and x[j + D/2] = fma(x[j], sin[j + D/2], x[j + D/2] * cos[j +
// D/2]), both from the values before rotation); then write_kv of the rotated K and of
// V; then decode_attention (attention_decode.cpp) of the rotated q over the cache with
// the read checks it is given (read_tags: the slot tags they compare, as
// decode_attention's slot_tags), into a new (T, n_heads * D) output. The K/V of the step
// are written before anything reads the cache, as write_kv then attend order them.

#include <ATen/ops/empty.h>

#include "attention_common.h"

namespace pw_attn {
namespace {

// Tokens per work item of write_kv: a decode step of up to this many stays serial (the
// copies take a few microseconds; waking a thread costs more).
constexpr int64_t kWriteGrain = 256;

template <typename T>
inline float widen(T x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return std::bit_cast<float>(uint32_t(x) << 16);
}

template <typename T>
inline T narrow_to(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return c10::BFloat16(x).x;  // round to nearest even, as torch's casts do
}

// Rotate the NH heads of D values at x in place by cos, sin (D,) (rotate-half).
template <typename T>
void rope_heads(T* x, const T* cos, const T* sin, int64_t NH, int64_t D) {
  const int64_t half = D / 2;
  float c[1024], s[1024];
  for (int64_t j = 0; j < D; ++j) {
    c[j] = widen(cos[j]);
    s[j] = widen(sin[j]);
  }
  for (int64_t h = 0; h < NH; ++h) {
    T* xh = x + h * D;
    for (int64_t j = 0; j < half; ++j) {
      const float a = widen(xh[j]), b = widen(xh[half + j]);
      const float ac = a * c[j], bc = b * c[half + j];
      xh[j] = narrow_to<T>(std::fma(b, s[j], ac));
      xh[half + j] = narrow_to<T>(std::fma(a, s[half + j], bc));
    }
  }
}

void check_slots(const at::Tensor& slot_mapping, int64_t T_, int64_t num_slots) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T_ &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be (T,) int64, contiguous");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK_INDEX(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot ", slots[t],
                      " is out of bounds for a cache of ", num_slots, " slots");
}

struct Tags {
  const int64_t* fresh = nullptr;  // (T,)
  int64_t* store = nullptr;        // (num_slots,)
};

Tags tags_of(const c10::optional<at::Tensor>& new_tags, const c10::optional<at::Tensor>& slot_tags,
             int64_t T_, int64_t num_slots) {
  TORCH_CHECK(new_tags.has_value() == slot_tags.has_value(), "new_tags and slot_tags go together");
  if (!new_tags.has_value()) return {};
  TORCH_CHECK(new_tags->dim() == 1 && new_tags->size(0) == T_ && new_tags->is_contiguous() &&
                  new_tags->scalar_type() == at::kLong,
              "new_tags must be (T,) int64, contiguous");
  TORCH_CHECK(slot_tags->dim() == 1 && slot_tags->size(0) == num_slots &&
                  slot_tags->is_contiguous() && slot_tags->scalar_type() == at::kLong,
              "slot_tags must be (num_slots,) int64, contiguous");
  return {new_tags->data_ptr<int64_t>(), slot_tags->data_ptr<int64_t>()};
}

// Rows (n_kv * D elements of `elem` bytes) of tokens [b, e) into their slots.
void write_rows(char* cache, int64_t v_offset, const char* k, int64_t ks, const char* v,
                int64_t vs, const int64_t* slots, const Tags& tags, int64_t row_bytes,
                int64_t b, int64_t e) {
  for (int64_t t = b; t < e; ++t) {
    char* dst = cache + slots[t] * row_bytes;
    std::memcpy(dst, k + t * ks, row_bytes);
    std::memcpy(dst + v_offset, v + t * vs, row_bytes);
    if (tags.fresh) tags.store[slots[t]] = tags.fresh[t];
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& cache, int64_t T_, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == T_ && x.size(1) == cache.size(3) &&
                  x.size(2) == cache.size(4) && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "write_kv: ", name, " must be (T, n_kv, D) with dense (n_kv, D) rows");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), "write_kv: ", name,
              " must have the cache's dtype");
}

}  // namespace

void write_kv(at::Tensor cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& new_tags,
              const c10::optional<at::Tensor>& slot_tags) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "cache must be contiguous (2, num_blocks, bs, n_kv, D)");
  const int64_t T_ = k.size(0), num_slots = cache.size(1) * cache.size(2);
  check_rows(k, cache, T_, "k");
  check_rows(v, cache, T_, "v");
  check_slots(slot_mapping, T_, num_slots);
  const Tags tags = tags_of(new_tags, slot_tags, T_, num_slots);
  const int64_t elem = cache.element_size(), row_bytes = cache.size(3) * cache.size(4) * elem;
  char* cp = static_cast<char*>(cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t v_offset = num_slots * row_bytes, ks = k.stride(0) * elem, vs = v.stride(0) * elem;
  if (T_ <= kWriteGrain) {
    write_rows(cp, v_offset, kp, ks, vp, vs, slots, tags, row_bytes, 0, T_);
    return;
  }
  // A slot named twice must keep the later token's row: write in runs, later runs last.
  // Slots repeat only when a caller writes the same slot twice in one step (never in the
  // engine); parallel runs would race there, so such a step is written serially.
  std::vector<int64_t> seen(slots, slots + T_);
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) {
    write_rows(cp, v_offset, kp, ks, vp, vs, slots, tags, row_bytes, 0, T_);
    return;
  }
  pw::parallel_ranges(0, T_, kWriteGrain, [&](int64_t b, int64_t e) {
    write_rows(cp, v_offset, kp, ks, vp, vs, slots, tags, row_bytes, b, e);
  });
}

at::Tensor rope_write_decode(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor cache, const at::Tensor& slot_mapping,
                             const c10::optional<at::Tensor>& new_tags,
                             const c10::optional<at::Tensor>& slot_tags, const at::Tensor& tables,
                             const at::Tensor& seq_info, const at::Tensor& rows, double scale,
                             const c10::optional<at::Tensor>& read_tags,
                             const c10::optional<at::Tensor>& expected,
                             const c10::optional<at::Tensor>& tag_faults,
                             const c10::optional<at::Tensor>& read_sums,
                             const c10::optional<at::Tensor>& read_layers,
                             const c10::optional<at::Tensor>& limb_keys,
                             const c10::optional<at::Tensor>& offset_keys, int64_t num_splits,
                             c10::optional<int64_t> sliding_window,
                             c10::optional<double> softcap) {
  TORCH_CHECK(cache.dim() == 5, "cache must be (2, num_blocks, bs, n_kv, D)");
  const int64_t T_ = qkv.size(0), n_kv = cache.size(3), D = cache.size(4);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) % D == 0 &&
                  qkv.size(1) / D > 2 * n_kv && D % 2 == 0 && D <= 1024,
              "qkv must be (T, (n_heads + 2 n_kv) * D) with contiguous rows, D even, <= 1024");
  TORCH_CHECK(qkv.scalar_type() == cache.scalar_type(), "qkv must have the cache's dtype");
  for (const auto* x : {&cos, &sin})
    TORCH_CHECK(x->is_contiguous() && x->numel() == T_ * D && x->scalar_type() == qkv.scalar_type(),
                "cos and sin must be contiguous (T, 1, D) of qkv's dtype");
  const int64_t n_heads = qkv.size(1) / D - 2 * n_kv;
  const at::Tensor heads = qkv.view({T_, n_heads + 2 * n_kv, D});
  const at::Tensor k = heads.narrow(1, n_heads, n_kv), v = heads.narrow(1, n_heads + n_kv, n_kv);
  const int64_t row = qkv.stride(0);
  if (cache.scalar_type() == at::kFloat) {
    float* x = qkv.data_ptr<float>();
    for (int64_t t = 0; t < T_; ++t)
      rope_heads(x + t * row, cos.data_ptr<float>() + t * D, sin.data_ptr<float>() + t * D,
                 n_heads + n_kv, D);
  } else {
    TORCH_CHECK(cache.scalar_type() == at::kBFloat16, "cache must be float32 or bfloat16");
    bf16_bits* x = reinterpret_cast<bf16_bits*>(qkv.data_ptr());
    const bf16_bits* c = reinterpret_cast<const bf16_bits*>(cos.data_ptr());
    const bf16_bits* s = reinterpret_cast<const bf16_bits*>(sin.data_ptr());
    for (int64_t t = 0; t < T_; ++t)
      rope_heads(x + t * row, c + t * D, s + t * D, n_heads + n_kv, D);
  }
  write_kv(cache, k, v, slot_mapping, new_tags, slot_tags);
  at::Tensor out = at::empty({T_, n_heads * D}, qkv.options());
  decode_attention(heads.narrow(1, 0, n_heads), cache, tables, seq_info, rows, scale,
                   out.view({T_, n_heads, D}), read_tags, expected, tag_faults, read_sums,
                   read_layers, limb_keys, offset_keys, num_splits, sliding_window, softcap);
  return out;
}

}  // namespace pw_attn
