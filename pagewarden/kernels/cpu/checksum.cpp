// Content checksums of the paged KV cache (worker/integrity.py defines them; this is the
// CPU kernel, bit for bit the torch path's): block sums and slot sums over every layer.
//
// Layouts:
//     caches        L tensors, each (2, num_blocks, block_size, ...) contiguous, same shape
//                   and dtype; a slot row (one K or V row of one slot) is R 32-bit limbs
//                   (its bytes read as signed int32, 4 bytes per limb)
//     limb_keys     (L, 2, R) int64, odd keys
//     offset_keys   (block_size,) int64, odd keys
//     block_ids     (n,) int64 in [0, num_blocks); slots (n,) int64 in [0, num_blocks * bs)
//
//     slot_sum(s)  = sum_{layer, kv, i} limb_keys[layer, kv, i] * row(layer, kv, s)[i]
//     block_sum(b) = sum_o offset_keys[o] * slot_sum(b * bs + o)          all mod 2^64
//
// Loop order: one output at a time (block or slot); within it layer, K/V, then the
// block's bs rows, which lie next to each other (bs * R limbs read in order), against the
// R keys of (layer, K/V) held in L1. The dot product of one row widens 8 limbs to int64,
// multiplies with the 8 keys (vpmullq, AVX512DQ) and adds (wrapping); without AVX512DQ it
// is the scalar loop, which the compiler vectorises for the ISA at hand. Unsigned
// arithmetic: its wrap-around is defined and is the two's-complement wrap of torch's int64.
// Every index is checked before any read (IndexError, as torch's gather raises).
// The kernels run on the calling thread with the GIL released.

#include <torch/extension.h>

#include <immintrin.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace {

// sum_i k[i] * x[i] mod 2^64, x signed 32-bit limbs.
inline uint64_t dot_scalar(const int32_t* x, const uint64_t* k, int64_t n) {
  uint64_t acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += k[i] * static_cast<uint64_t>(static_cast<int64_t>(x[i]));
  return acc;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
constexpr bool kVector = true;

inline uint64_t dot(const int32_t* x, const uint64_t* k, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i x0 = _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    const __m512i x1 = _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8)));
    a0 = _mm512_add_epi64(a0, _mm512_mullo_epi64(x0, _mm512_loadu_si512(k + i)));
    a1 = _mm512_add_epi64(a1, _mm512_mullo_epi64(x1, _mm512_loadu_si512(k + i + 8)));
  }
  if (i + 8 <= n) {
    const __m512i x0 = _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    a0 = _mm512_add_epi64(a0, _mm512_mullo_epi64(x0, _mm512_loadu_si512(k + i)));
    i += 8;
  }
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1))) +
         dot_scalar(x + i, k + i, n - i);
}
#else
constexpr bool kVector = false;

inline uint64_t dot(const int32_t* x, const uint64_t* k, int64_t n) { return dot_scalar(x, k, n); }
#endif

struct Layers {
  std::vector<const int32_t*> base;  // layer l's limbs, K at base, V at base + half
  int64_t num_blocks = 0, bs = 0, row = 0, half = 0;
};

Layers layers_of(const std::vector<at::Tensor>& caches, const at::Tensor& limb_keys) {
  TORCH_CHECK(!caches.empty(), "need at least one layer");
  const at::Tensor& c0 = caches[0];
  TORCH_CHECK(c0.device().is_cpu() && c0.dim() >= 3 && c0.size(0) == 2,
              "caches are CPU tensors (2, num_blocks, block_size, ...)");
  const int64_t row_bytes = c0[0][0][0].numel() * c0.element_size();
  TORCH_CHECK(row_bytes % 4 == 0, "a slot row has ", row_bytes, " bytes; 32-bit limbs need 4k");
  Layers ls;
  ls.num_blocks = c0.size(1);
  ls.bs = c0.size(2);
  ls.row = row_bytes / 4;
  ls.half = ls.num_blocks * ls.bs * ls.row;
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.sizes() == c0.sizes() && c.scalar_type() == c0.scalar_type() && c.is_contiguous() &&
                    c.device().is_cpu(),
                "every layer's cache: contiguous, on the CPU, same shape and dtype");
    ls.base.push_back(static_cast<const int32_t*>(c.data_ptr()));
  }
  TORCH_CHECK(limb_keys.scalar_type() == at::kLong && limb_keys.is_contiguous() &&
                  limb_keys.numel() == static_cast<int64_t>(caches.size()) * 2 * ls.row,
              "limb_keys: (num_layers, 2, limbs per row) int64, contiguous");
  return ls;
}

at::Tensor checked(const at::Tensor& index, int64_t limit, const char* what) {
  at::Tensor flat = index.to(at::kLong).reshape(-1).contiguous();
  const int64_t* p = flat.data_ptr<int64_t>();
  for (int64_t j = 0; j < flat.numel(); ++j)
    TORCH_CHECK_INDEX(p[j] >= 0 && p[j] < limit, what, " ", p[j], " out of range [0, ", limit, ")");
  return flat;
}

at::Tensor block_sums(const std::vector<at::Tensor>& caches, const at::Tensor& block_ids,
                      const at::Tensor& limb_keys, const at::Tensor& offset_keys) {
  const Layers ls = layers_of(caches, limb_keys);
  TORCH_CHECK(offset_keys.scalar_type() == at::kLong && offset_keys.is_contiguous() &&
                  offset_keys.numel() == ls.bs,
              "offset_keys: (block_size,) int64");
  const at::Tensor ids = checked(block_ids, ls.num_blocks, "block id");
  at::Tensor out = at::empty({ids.numel()}, ids.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const auto* keys = reinterpret_cast<const uint64_t*>(limb_keys.data_ptr<int64_t>());
  const auto* okeys = reinterpret_cast<const uint64_t*>(offset_keys.data_ptr<int64_t>());
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  const int64_t block_limbs = ls.bs * ls.row;
  std::vector<uint64_t> slot(ls.bs);
  for (int64_t j = 0; j < ids.numel(); ++j) {
    std::fill(slot.begin(), slot.end(), 0);
    for (size_t layer = 0; layer < ls.base.size(); ++layer) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        const int32_t* block = ls.base[layer] + kv * ls.half + id[j] * block_limbs;
        const uint64_t* k = keys + (layer * 2 + kv) * ls.row;
        for (int64_t r = 0; r < ls.bs; ++r) slot[r] += dot(block + r * ls.row, k, ls.row);
      }
    }
    uint64_t total = 0;
    for (int64_t r = 0; r < ls.bs; ++r) total += okeys[r] * slot[r];
    o[j] = total;
  }
  return out;
}

at::Tensor slot_sums_of(const Layers& ls, const at::Tensor& limb_keys, const at::Tensor& slots) {
  const at::Tensor flat = checked(slots, ls.num_blocks * ls.bs, "slot");
  at::Tensor out = at::empty({flat.numel()}, flat.options());
  const int64_t* s = flat.data_ptr<int64_t>();
  const auto* keys = reinterpret_cast<const uint64_t*>(limb_keys.data_ptr<int64_t>());
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  for (int64_t j = 0; j < flat.numel(); ++j) {
    uint64_t acc = 0;
    for (size_t layer = 0; layer < ls.base.size(); ++layer)
      for (int64_t kv = 0; kv < 2; ++kv)
        acc += dot(ls.base[layer] + kv * ls.half + s[j] * ls.row, keys + (layer * 2 + kv) * ls.row, ls.row);
    o[j] = acc;
  }
  return out;
}

at::Tensor slot_sums(const std::vector<at::Tensor>& caches, const at::Tensor& slots,
                     const at::Tensor& limb_keys) {
  return slot_sums_of(layers_of(caches, limb_keys), limb_keys, slots);
}

// One KV store's layer caches and limb keys, checked once: the guard sums the slots each
// step wrote, and handing over (and checking) every layer's cache again per call cost
// more than the sums of one stream's slot (30 tensors through pybind and layers_of).
// Holds the tensors, so the pointers stay valid as long as it lives.
class CacheSums {
 public:
  CacheSums(std::vector<at::Tensor> caches, at::Tensor limb_keys)
      : caches_(std::move(caches)), keys_(std::move(limb_keys)), ls_(layers_of(caches_, keys_)) {}

  at::Tensor slot_sums(const at::Tensor& slots) const { return slot_sums_of(ls_, keys_, slots); }

  // into[slots[j]] = slot_sum(slots[j]): the guard's write-time sums, recorded in place.
  void store_slot_sums(const at::Tensor& slots, const at::Tensor& into) const {
    TORCH_CHECK(into.device().is_cpu() && into.scalar_type() == at::kLong && into.dim() == 1 &&
                    into.is_contiguous() && into.numel() == ls_.num_blocks * ls_.bs,
                "into: (num_blocks * block_size,) int64, contiguous, on the CPU");
    const at::Tensor sums = slot_sums_of(ls_, keys_, slots);
    const at::Tensor flat = slots.to(at::kLong).reshape(-1).contiguous();  // checked above
    const int64_t* s = flat.data_ptr<int64_t>();
    const int64_t* v = sums.data_ptr<int64_t>();
    int64_t* o = into.data_ptr<int64_t>();
    for (int64_t j = 0; j < flat.numel(); ++j) o[s[j]] = v[j];
  }

 private:
  std::vector<at::Tensor> caches_;
  at::Tensor keys_;
  Layers ls_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("vectorised", [] { return kVector; }, "whether this build has the AVX512DQ dot product");
  m.def("block_sums", &block_sums, "block checksums over every layer", py::call_guard<py::gil_scoped_release>());
  m.def("slot_sums", &slot_sums, "slot checksums over every layer", py::call_guard<py::gil_scoped_release>());
  py::class_<CacheSums>(m, "CacheSums", "slot sums over one fixed list of layer caches")
      .def(py::init<std::vector<at::Tensor>, at::Tensor>())
      .def("slot_sums", &CacheSums::slot_sums, "slot checksums over every layer",
           py::call_guard<py::gil_scoped_release>())
      .def("store_slot_sums", &CacheSums::store_slot_sums, "into[slots] = their slot checksums",
           py::call_guard<py::gil_scoped_release>());
}
