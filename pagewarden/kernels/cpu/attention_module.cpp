// The cpu_attention extension's Python module: the entry points of attention_decode.cpp,
// attention_fresh.cpp and attention_step.cpp (declared in attention_common.h), bound for
// kernels/cpu/attention.py.

#include <memory>
#include <utility>
#include <vector>

#include "attention_common.h"
#include "pool_bind.h"

namespace {

// Each layer's checksum limb keys, found by its cache's storage: a step's layers look
// theirs up here instead of through a Python dict each (30 lookups a step at one stream).
class LayerKeys {
 public:
  LayerKeys(const std::vector<at::Tensor>& caches, const at::Tensor& keys) {
    TORCH_CHECK(keys.dim() == 3 && keys.size(0) == static_cast<int64_t>(caches.size()),
                "keys: (num_layers, 2, limbs per slot row), one row per cache");
    for (size_t i = 0; i < caches.size(); ++i) {
      caches_.push_back(caches[i].data_ptr());
      keys_.push_back(keys[static_cast<int64_t>(i)]);
    }
  }

  const at::Tensor& of(const at::Tensor& cache) const {
    const void* p = cache.data_ptr();
    for (size_t i = 0; i < caches_.size(); ++i)
      if (caches_[i] == p) return keys_[i];
    TORCH_CHECK(false, "no checksum keys for this cache: not one of the KV store's layers");
  }

 private:
  std::vector<const void*> caches_;
  std::vector<at::Tensor> keys_;
};

// What every layer's rope_write_decode of one decode step shares (the step's indices, its
// tags, the read checks' outputs), converted from Python once per step: passed per layer
// it was ~15 of the call's ~20 tensor arguments, 30 times a step, each costing more than
// its share of one stream's attention. Holds the tensors for the step.
class DecodeStep {
 public:
  DecodeStep(at::Tensor slot_mapping, c10::optional<at::Tensor> new_tags, c10::optional<at::Tensor> slot_tags,
             at::Tensor tables, at::Tensor seq_info, at::Tensor rows, c10::optional<at::Tensor> read_tags,
             c10::optional<at::Tensor> expected, c10::optional<at::Tensor> tag_faults,
             c10::optional<at::Tensor> read_sums, c10::optional<at::Tensor> read_layers,
             c10::optional<at::Tensor> offset_keys, int64_t num_splits,
             std::shared_ptr<LayerKeys> layer_keys)
      : slot_mapping_(std::move(slot_mapping)), new_tags_(std::move(new_tags)), slot_tags_(std::move(slot_tags)),
        tables_(std::move(tables)), seq_info_(std::move(seq_info)), rows_(std::move(rows)),
        read_tags_(std::move(read_tags)), expected_(std::move(expected)), tag_faults_(std::move(tag_faults)),
        read_sums_(std::move(read_sums)), read_layers_(std::move(read_layers)),
        offset_keys_(std::move(offset_keys)), num_splits_(num_splits), layer_keys_(std::move(layer_keys)) {}

  // pw_attn::rope_write_decode of one layer: its qkv, RoPE rows, cache and limb keys
  // (without them, where the step sums what it reads, the bound LayerKeys' for cache).
  at::Tensor rope_write_decode(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor cache, double scale, const c10::optional<at::Tensor>& limb_keys,
                               c10::optional<int64_t> sliding_window, c10::optional<double> softcap) const {
    c10::optional<at::Tensor> keys = limb_keys;
    if (!keys.has_value() && read_sums_.has_value() && layer_keys_) keys = layer_keys_->of(cache);
    return pw_attn::rope_write_decode(qkv, cos, sin, std::move(cache), slot_mapping_, new_tags_, slot_tags_, tables_,
                                      seq_info_, rows_, scale, read_tags_, expected_, tag_faults_, read_sums_,
                                      read_layers_, keys, offset_keys_, num_splits_, sliding_window, softcap);
  }

 private:
  at::Tensor slot_mapping_;
  c10::optional<at::Tensor> new_tags_, slot_tags_;
  at::Tensor tables_, seq_info_, rows_;
  c10::optional<at::Tensor> read_tags_, expected_, tag_faults_, read_sums_, read_layers_, offset_keys_;
  int64_t num_splits_;
  std::shared_ptr<LayerKeys> layer_keys_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_pool", &pw::set_pool, "hand work items to the pool behind a cpu_pool capsule");
  m.def("decode_attention", &pw_attn::decode_attention,
        "paged decode attention with fused read checks");
  m.def("check_reads", &pw_attn::check_reads, "the read checks of rows attended by the torch path");
  m.def("fresh_attention", &pw_attn::fresh_attention, "causal attention of fresh bf16 prompts");
  m.def("write_kv", &pw_attn::write_kv, "K/V rows and slot tags of new tokens into their slots");
  m.def("rope_write_decode", &pw_attn::rope_write_decode,
        "RoPE of q and k in place, their K/V written, then decode attention");
  pybind11::class_<LayerKeys, std::shared_ptr<LayerKeys>>(m, "LayerKeys", "each layer's checksum keys by its cache")
      .def(pybind11::init<const std::vector<at::Tensor>&, const at::Tensor&>());
  pybind11::class_<DecodeStep>(m, "DecodeStep", "one decode step's shared rope_write_decode arguments")
      .def(pybind11::init<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, at::Tensor, at::Tensor,
                          at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, int64_t, std::shared_ptr<LayerKeys>>())
      .def("rope_write_decode", &DecodeStep::rope_write_decode, "one layer's rope_write_decode in this step");
  m.def("has_fresh_attention", &pw_attn::has_fresh_attention, "whether fresh_attention runs here");
}
