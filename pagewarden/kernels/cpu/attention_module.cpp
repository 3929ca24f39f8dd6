// The cpu_attention extension's Python module: the entry points of attention_decode.cpp,
// attention_fresh.cpp and attention_step.cpp (declared in attention_common.h), bound for
// kernels/cpu/attention.py.

#include "attention_common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_pool", &pw::set_pool, "hand work items to the pool behind a cpu_pool capsule");
  m.def("decode_attention", &pw_attn::decode_attention,
        "paged decode attention with fused read checks");
  m.def("check_reads", &pw_attn::check_reads, "the read checks of rows attended by the torch path");
  m.def("fresh_attention", &pw_attn::fresh_attention, "causal attention of fresh bf16 prompts");
  m.def("write_kv", &pw_attn::write_kv, "K/V rows and slot tags of new tokens into their slots");
  m.def("rope_write_decode", &pw_attn::rope_write_decode,
        "RoPE of q and k in place, their K/V written, then decode attention");
  m.def("has_fresh_attention", &pw_attn::has_fresh_attention, "whether fresh_attention runs here");
}
