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
// Loop order: blocks one at a time; within one, layer, K/V, then the block's bs rows,
// which lie next to each other (bs * R limbs read in order), against the R keys of
// (layer, K/V) held in L1, the next (layer, K/V) part prefetched. Slots: (layer, K/V)
// outermost, then the slots, each row prefetched a few rows ahead (slot_sums_into).
// The dot product of one row widens 8 limbs to int64, multiplies with the 8 keys
// (vpmullq, AVX512DQ) and adds (wrapping); without AVX512DQ it is the scalar loop,
// which the compiler vectorises for the ISA at hand. Unsigned
// arithmetic: its wrap-around is defined and is the two's-complement wrap of torch's int64.
// Every index is checked before any read (IndexError, as torch's gather raises).
// The kernels run on the calling thread with the GIL released.

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
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

// worker/integrity.py's splitmix64 and mix64, in uint64 (wrapping, as its masks do).
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline uint64_t mix64(uint64_t prev_tag, uint64_t token, uint64_t position) {
  uint64_t x = splitmix64(prev_tag ^ 0xBF58476D1CE4E5B9ULL);
  x = splitmix64(x ^ token);
  return splitmix64(x ^ (position * 0x9E3779B97F4A7C15ULL));
}

struct Layers {
  std::vector<const int32_t*> base;  // layer l's limbs, K at base, V at base + half
  int64_t num_blocks = 0, bs = 0, row = 0, half = 0;
};

// Fetch n limbs from p on into the cache, one line at a time (a hint: never faults).
inline void prefetch(const int32_t* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * 4; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

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

// The block checksum of block id (checked by the caller); slot: bs words of scratch.
uint64_t block_sum(const Layers& ls, const uint64_t* keys, const uint64_t* okeys, int64_t id,
                   std::vector<uint64_t>& slot) {
  std::fill(slot.begin(), slot.end(), 0);
  const int64_t block_limbs = ls.bs * ls.row;
  const size_t n_layers = ls.base.size();
  for (size_t layer = 0; layer < n_layers; ++layer) {
    for (int64_t kv = 0; kv < 2; ++kv) {
      const int32_t* block = ls.base[layer] + kv * ls.half + id * block_limbs;
      // The next (layer, K/V) part of the block, a separate place in memory, is fetched
      // while this one is summed (the hardware prefetcher only follows one part).
      const size_t next = layer + static_cast<size_t>(kv);  // kv 0: V of this layer
      if (next < n_layers)
        prefetch(ls.base[next] + (1 - kv) * ls.half + id * block_limbs, block_limbs);
      const uint64_t* k = keys + (layer * 2 + kv) * ls.row;
      for (int64_t r = 0; r < ls.bs; ++r) slot[r] += dot(block + r * ls.row, k, ls.row);
    }
  }
  uint64_t total = 0;
  for (int64_t r = 0; r < ls.bs; ++r) total += okeys[r] * slot[r];
  return total;
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
  std::vector<uint64_t> slot(ls.bs);
  for (int64_t j = 0; j < ids.numel(); ++j) o[j] = block_sum(ls, keys, okeys, id[j], slot);
  return out;
}

// out[j] = the slot checksum of slots[j] (checked by the caller): every layer's K and V
// row. Rows lie apart in memory (one per slot, layer and K/V), so the loop runs over
// (layer, K/V, slot), the keys of one (layer, K/V) in L1, and fetches the row
// kSlotAhead steps ahead while it sums this one: the sums after a decode step were
// bound by one memory latency per row (64 slots x 60 rows: ~0.3 ms at 64 streams).
constexpr int64_t kSlotAhead = 8;

void slot_sums_into(const Layers& ls, const uint64_t* keys, const int64_t* slots, int64_t n, uint64_t* out) {
  std::fill(out, out + n, 0);
  const int64_t parts = static_cast<int64_t>(ls.base.size()) * 2, total = parts * n;
  auto row_of = [&](int64_t t) {  // t = part * n + j, part = layer * 2 + kv
    const int64_t part = t / n, j = t - part * n;
    return ls.base[part / 2] + (part % 2) * ls.half + slots[j] * ls.row;
  };
  for (int64_t t = 0; t < std::min(kSlotAhead, total); ++t) prefetch(row_of(t), ls.row);
  for (int64_t t = 0; t < total; ++t) {
    if (t + kSlotAhead < total) prefetch(row_of(t + kSlotAhead), ls.row);
    const int64_t part = t / n, j = t - part * n;
    out[j] += dot(row_of(t), keys + part * ls.row, ls.row);
  }
}

at::Tensor slot_sums_of(const Layers& ls, const at::Tensor& limb_keys, const at::Tensor& slots) {
  const at::Tensor flat = checked(slots, ls.num_blocks * ls.bs, "slot");
  at::Tensor out = at::empty({flat.numel()}, flat.options());
  const auto* keys = reinterpret_cast<const uint64_t*>(limb_keys.data_ptr<int64_t>());
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  slot_sums_into(ls, keys, flat.data_ptr<int64_t>(), flat.numel(), o);
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

// One decode step's guard work at `standard` on the CPU, in two calls around the forward
// pass (worker/kv_guard.py's decode path, which keeps the general path for everything
// else and for any step where this one finds something wrong). Every scheduled sequence
// i writes one token, at position starts[i]; block_index is the step's (S * width)
// padded tables, the index attention reads through. The guard's state tensors are bound
// once (they live as long as the guard and are changed in place only):
//
//     sealed (num_blocks,) bool   tags, slot_sums (num_blocks * bs,) int64
//     block_sums (num_blocks,) int64
//
// bind():  the step's slot tags and the kernel's inputs, then open(): each sequence's
//          new tag, mix64(tag at start - 1, its token, start) (worker/integrity.py's
//          mix64; the root tag at 0), written to its row of the tag-chain table (rows,
//          cols) int64 (worker/tag_chains.py: each row holds its chain up to start);
//          returns (expected tags (S, max start + 1), 0 past each sequence's stop; for one
//          sequence a view of its table row; the new tags (S,); tag_faults zeroed;
//          read_sums zeroed and read_layers where the step reads a scrub pick, else None).
// open():  a block the step writes at offset 0 starts a new life (unsealed, tags zeroed);
//          read_layers -1 but where a sequence reads one of the scrub picks (the kernel's
//          outputs come zeroed); each sequence's write block is remembered for close().
// close(): the new slots' write-time sums are stored; then, changing nothing else, the
//          step must be clean: no tag fault, each slot_mapping entry the slot block_index
//          reads its position from, every sealed pick's sum (the kernel's where it read
//          the pick in every layer, else re-read) equal to its seal, a block the step
//          filled re-reading to its slots' sums. Only then are filled blocks sealed.
//          At strict (bind's flag) the kernel sums every block it reads, and close()
//          also holds each context block to it (strict_reads). Returns (clean, picks
//          verified by the kernel's sums, picks re-read, sealed picks, blocks sealed after
//          a re-read, blocks sealed as written, strict's blocks and slots verified).
class DecodeGuard {
 public:
  DecodeGuard(std::vector<at::Tensor> caches, at::Tensor limb_keys, at::Tensor offset_keys,
              at::Tensor sealed, at::Tensor tags, at::Tensor slot_sums, at::Tensor block_sums)
      : caches_(std::move(caches)),
        keys_(std::move(limb_keys)),
        okeys_(std::move(offset_keys)),
        sealed_(std::move(sealed)),
        tags_(std::move(tags)),
        slot_sums_(std::move(slot_sums)),
        block_sums_(std::move(block_sums)),
        ls_(layers_of(caches_, keys_)) {
    const int64_t nb = ls_.num_blocks, slots = nb * ls_.bs;
    TORCH_CHECK(okeys_.scalar_type() == at::kLong && okeys_.is_contiguous() && okeys_.numel() == ls_.bs,
                "offset_keys: (block_size,) int64");
    TORCH_CHECK(sealed_.scalar_type() == at::kBool && sealed_.is_contiguous() && sealed_.numel() == nb &&
                    sealed_.device().is_cpu(),
                "sealed: (num_blocks,) bool on the CPU");
    for (const at::Tensor* t : {&tags_, &slot_sums_})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == slots && t->device().is_cpu(),
                  "tags, slot_sums: (num_blocks * block_size,) int64 on the CPU");
    TORCH_CHECK(block_sums_.scalar_type() == at::kLong && block_sums_.is_contiguous() && block_sums_.numel() == nb &&
                    block_sums_.device().is_cpu(),
                "block_sums: (num_blocks,) int64 on the CPU");
  }

  // The next k sealed block ids from cursor on, wrapping round to the start; fewer when
  // fewer are sealed.
  std::vector<int64_t> scrub_picks(int64_t cursor, int64_t k) const {
    std::vector<int64_t> picks;
    const bool* sealed = sealed_.data_ptr<bool>();
    const int64_t nb = ls_.num_blocks;
    cursor = std::min(std::max<int64_t>(cursor, 0), nb);
    for (int64_t b = cursor; b < nb && static_cast<int64_t>(picks.size()) < k; ++b)
      if (sealed[b]) picks.push_back(b);
    for (int64_t b = 0; b < cursor && static_cast<int64_t>(picks.size()) < k; ++b)
      if (sealed[b]) picks.push_back(b);
    return picks;
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>> bind(
      const at::Tensor& block_index, const at::Tensor& table, const std::vector<int64_t>& rows,
      const std::vector<int64_t>& starts, const std::vector<int64_t>& tokens, int64_t root_tag,
      const std::vector<int64_t>& picks, int64_t num_kv_heads, bool strict) {
    const int64_t s = static_cast<int64_t>(starts.size());
    TORCH_CHECK(s > 0 && static_cast<int64_t>(rows.size()) == s && static_cast<int64_t>(tokens.size()) == s,
                "rows, starts, tokens: one entry per sequence");
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                    table.device().is_cpu(),
                "table: (rows, cols) int64, contiguous, on the CPU");
    const int64_t n_rows = table.size(0), cols = table.size(1);
    int64_t* chains = table.data_ptr<int64_t>();
    at::Tensor new_tags = at::empty({s}, table.options());
    int64_t* out = new_tags.data_ptr<int64_t>();
    int64_t width = 0;
    for (int64_t i = 0; i < s; ++i) {
      const int64_t row = rows[i], p = starts[i];
      TORCH_CHECK_INDEX(row >= 0 && row < n_rows && p >= 0 && p < cols, "row ", row, " position ", p,
                        " outside the tag table");
      int64_t* chain = chains + row * cols;
      const uint64_t prev = static_cast<uint64_t>(p > 0 ? chain[p - 1] : root_tag);
      chain[p] = out[i] = static_cast<int64_t>(mix64(prev, static_cast<uint64_t>(tokens[i]), static_cast<uint64_t>(p)));
      width = std::max(width, p + 1);
    }
    at::Tensor expected;
    if (s == 1) {
      expected = table.narrow(0, rows[0], 1).narrow(1, 0, width);  // a view: (1, width) is contiguous
    } else {
      expected = at::empty({s, width}, table.options());
      int64_t* e = expected.data_ptr<int64_t>();
      for (int64_t i = 0; i < s; ++i) {
        const int64_t n = starts[i] + 1;
        std::copy(chains + rows[i] * cols, chains + rows[i] * cols + n, e + i * width);
        std::fill(e + i * width + n, e + (i + 1) * width, 0);
      }
    }
    TORCH_CHECK(block_index.numel() % s == 0, "block_index: (S * width,)");
    const int64_t blocks = block_index.numel() / s;
    const auto int32 = table.options().dtype(at::kInt);
    at::Tensor tag_faults = at::zeros({s, blocks}, int32);
    c10::optional<at::Tensor> read_sums, read_layers;
    if (strict || !picks.empty()) {
      read_sums = at::zeros({s, num_kv_heads, blocks}, table.options());
      read_layers = at::empty({s, blocks}, int32);
    }
    strict_ = strict;
    if (!open(block_index, starts, picks, tag_faults, read_sums, read_layers) && !strict) {
      read_sums.reset();  // no pick is read: the scrub verifies them from the cache
      read_layers.reset();
    }
    return std::make_tuple(expected, new_tags, tag_faults, read_sums, read_layers);
  }

  bool open(const at::Tensor& block_index, const std::vector<int64_t>& starts, const std::vector<int64_t>& picks,
            const at::Tensor& tag_faults, const c10::optional<at::Tensor>& read_sums,
            const c10::optional<at::Tensor>& read_layers) {
    const int64_t s = static_cast<int64_t>(starts.size());
    const int64_t width = table_width(block_index, s);
    TORCH_CHECK(width > 0, "block_index: (S * width,) int64 on the CPU, S = len(starts)");
    const int64_t* bi = block_index.data_ptr<int64_t>();
    for (int64_t j = 0; j < s * width; ++j)
      TORCH_CHECK_INDEX(bi[j] >= 0 && bi[j] < ls_.num_blocks, "block id ", bi[j], " out of range");
    check_out(tag_faults, at::kInt, s * width, "tag_faults");
    starts_ = starts;
    write_blocks_.assign(s, 0);
    bool* sealed = sealed_.data_ptr<bool>();
    int64_t* tags = tags_.data_ptr<int64_t>();
    for (int64_t i = 0; i < s; ++i) {
      const int64_t p = starts[i];
      TORCH_CHECK(p >= 0 && p / ls_.bs < width, "sequence ", i, " writes position ", p, " past its table");
      const int64_t b = bi[i * width + p / ls_.bs];
      write_blocks_[i] = b;
      if (p % ls_.bs == 0) {
        sealed[b] = false;
        std::fill(tags + b * ls_.bs, tags + (b + 1) * ls_.bs, 0);
      }
    }
    if (!read_sums.has_value()) return false;
    TORCH_CHECK(read_layers.has_value(), "read_sums come with read_layers");
    check_out(*read_layers, at::kInt, s * width, "read_layers");
    TORCH_CHECK(read_sums->numel() % (s * width) == 0, "read_sums: (S, num_kv_heads, width)");
    check_out(*read_sums, at::kLong, read_sums->numel(), "read_sums");
    int32_t* layers = read_layers->data_ptr<int32_t>();
    bool any = false;
    for (int64_t j = 0; j < s * width; ++j) {
      const bool pick = std::find(picks.begin(), picks.end(), bi[j]) != picks.end();
      layers[j] = strict_ || pick ? 0 : -1;
      any = any || pick;
    }
    return any;
  }

  std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> close(
      const at::Tensor& block_index, const at::Tensor& slot_mapping, const std::vector<int64_t>& picks,
      const at::Tensor& tag_faults, const c10::optional<at::Tensor>& read_sums,
      const c10::optional<at::Tensor>& read_layers) {
    constexpr int64_t z = 0;
    const auto dirty = std::make_tuple(false, z, z, z, z, z, z, z);
    const int64_t s = static_cast<int64_t>(starts_.size()), bs = ls_.bs, nb = ls_.num_blocks;
    const int64_t width = table_width(block_index, s);
    // Anything the general path would treat differently (a swapped index of another
    // shape, a slot outside the pool) is left to it.
    if (width <= 0 || slot_mapping.scalar_type() != at::kLong || !slot_mapping.is_contiguous() ||
        slot_mapping.numel() != s || !slot_mapping.device().is_cpu())
      return dirty;
    const int64_t* bi = block_index.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t j = 0; j < s * width; ++j)
      if (bi[j] < 0 || bi[j] >= nb) return dirty;
    for (int64_t i = 0; i < s; ++i)
      if (slots[i] < 0 || slots[i] >= nb * bs) return dirty;
    const auto* keys = reinterpret_cast<const uint64_t*>(keys_.data_ptr<int64_t>());
    const auto* okeys = reinterpret_cast<const uint64_t*>(okeys_.data_ptr<int64_t>());
    auto* slot_sums = reinterpret_cast<uint64_t*>(slot_sums_.data_ptr<int64_t>());
    std::vector<uint64_t> new_sums(s);  // the write-time sums, first, as the general path
    slot_sums_into(ls_, keys, slots, s, new_sums.data());
    for (int64_t i = 0; i < s; ++i) slot_sums[slots[i]] = new_sums[i];
    const int32_t* faults = tag_faults.data_ptr<int32_t>();
    for (int64_t j = 0; j < s * width; ++j)
      if (faults[j]) return dirty;
    for (int64_t i = 0; i < s; ++i) {
      const int64_t p = starts_[i];
      if (slots[i] != bi[i * width + p / bs] * bs + p % bs) return dirty;
    }
    // The scrub picks still sealed: by the kernel's sums where it read them whole in
    // every layer, else from the cache.
    const bool* sealed = sealed_.data_ptr<bool>();
    const auto* block_sums = reinterpret_cast<const uint64_t*>(block_sums_.data_ptr<int64_t>());
    std::vector<int64_t> want, covered;
    for (int64_t b : picks) {
      if (b <= 0 || b >= nb) return dirty;
      if (sealed[b]) want.push_back(b);
    }
    if (!want.empty() && read_sums.has_value() && read_layers.has_value()) {
      const int64_t n_kv = read_sums->numel() / (s * width);
      const int32_t* layers = read_layers->data_ptr<int32_t>();
      const auto* sums = reinterpret_cast<const uint64_t*>(read_sums->data_ptr<int64_t>());
      const int64_t n_layers = static_cast<int64_t>(ls_.base.size());
      for (int64_t i = 0; i < s; ++i) {
        for (int64_t lb = 0; lb < starts_[i] / bs; ++lb) {  // full context blocks
          const int64_t b = bi[i * width + lb];
          if (layers[i * width + lb] != n_layers || std::find(want.begin(), want.end(), b) == want.end()) continue;
          uint64_t sum = 0;
          for (int64_t h = 0; h < n_kv; ++h) sum += sums[(i * n_kv + h) * width + lb];
          if (sum != block_sums[b]) return dirty;
          if (std::find(covered.begin(), covered.end(), b) == covered.end()) covered.push_back(b);
        }
      }
    }
    std::vector<uint64_t> scratch(bs);
    int64_t reread = 0;
    for (int64_t b : want) {
      if (std::find(covered.begin(), covered.end(), b) != covered.end()) continue;
      ++reread;
      if (block_sum(ls_, keys, okeys, b, scratch) != block_sums[b]) return dirty;
    }
    int64_t strict_blocks = 0, strict_slots = 0;
    if (strict_ && !strict_reads(block_index, read_sums, read_layers, s, width, strict_blocks, strict_slots))
      return dirty;
    // Blocks this step filled: re-read where earlier steps wrote some of their slots.
    std::vector<std::pair<int64_t, uint64_t>> seals;
    int64_t after_read = 0;
    for (int64_t i = 0; i < s; ++i) {
      const int64_t p = starts_[i], b = write_blocks_[i];
      if ((p + 1) % bs != 0 || b == 0) continue;
      uint64_t recorded = 0;
      for (int64_t o = 0; o < bs; ++o) recorded += okeys[o] * slot_sums[b * bs + o];
      if (p % bs != 0) {
        ++after_read;
        if (block_sum(ls_, keys, okeys, b, scratch) != recorded) return dirty;
      }
      seals.emplace_back(b, recorded);
    }
    bool* sealed_w = sealed_.data_ptr<bool>();
    auto* block_sums_w = reinterpret_cast<uint64_t*>(block_sums_.data_ptr<int64_t>());
    for (const auto& [b, sum] : seals) {
      block_sums_w[b] = sum;
      sealed_w[b] = true;
    }
    const int64_t written = static_cast<int64_t>(seals.size()) - after_read;
    return std::make_tuple(true, static_cast<int64_t>(covered.size()), reread, static_cast<int64_t>(want.size()),
                           after_read, written, strict_blocks, strict_slots);
  }

 private:
  // strict: every context block the step read, as the kernel summed it (the general
  // path's _fused_sum_faults and _open_block_faults). A full sealed block by its
  // kernel sum where every layer read it, else (a sliding-window layer skipped it) re-read
  // once; the open block's sum over its written slots and the new one by the offset-keyed
  // write-time sums, or its written slots re-read where not every layer read it. True
  // where all match; counts the blocks and slots verified.
  bool strict_reads(const at::Tensor& block_index, const c10::optional<at::Tensor>& read_sums,
                    const c10::optional<at::Tensor>& read_layers, int64_t s, int64_t width, int64_t& blocks,
                    int64_t& slots_verified) const {
    if (!read_sums.has_value() || !read_layers.has_value()) return false;
    const int64_t bs = ls_.bs, n_layers = static_cast<int64_t>(ls_.base.size());
    const int64_t n_kv = read_sums->numel() / (s * width);
    const int64_t* bi = block_index.data_ptr<int64_t>();
    const int32_t* layers = read_layers->data_ptr<int32_t>();
    const auto* sums = reinterpret_cast<const uint64_t*>(read_sums->data_ptr<int64_t>());
    const bool* sealed = sealed_.data_ptr<bool>();
    const auto* keys = reinterpret_cast<const uint64_t*>(keys_.data_ptr<int64_t>());
    const auto* okeys = reinterpret_cast<const uint64_t*>(okeys_.data_ptr<int64_t>());
    const auto* block_sums = reinterpret_cast<const uint64_t*>(block_sums_.data_ptr<int64_t>());
    const auto* slot_sums = reinterpret_cast<const uint64_t*>(slot_sums_.data_ptr<int64_t>());
    auto kernel_sum = [&](int64_t i, int64_t lb) {
      uint64_t sum = 0;
      for (int64_t h = 0; h < n_kv; ++h) sum += sums[(i * n_kv + h) * width + lb];
      return sum;
    };
    std::vector<int64_t> partial;
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t lb = 0; lb < starts_[i] / bs; ++lb) {
        const int64_t b = bi[i * width + lb], read = layers[i * width + lb];
        if (b == 0 || !sealed[b] || read == 0) continue;
        if (read != n_layers) {
          partial.push_back(b);
          continue;
        }
        ++blocks;
        if (kernel_sum(i, lb) != block_sums[b]) return false;
      }
    }
    std::sort(partial.begin(), partial.end());  // each once, however many requests share it
    partial.erase(std::unique(partial.begin(), partial.end()), partial.end());
    std::vector<uint64_t> scratch(bs);
    for (int64_t b : partial) {
      ++blocks;
      if (block_sum(ls_, keys, okeys, b, scratch) != block_sums[b]) return false;
    }
    std::vector<int64_t> reread;
    for (int64_t i = 0; i < s; ++i) {
      const int64_t p = starts_[i], lb = p / bs, b = bi[i * width + lb];
      if (p % bs == 0 || b == 0) continue;  // no open context block
      if (layers[i * width + lb] != n_layers) {
        for (int64_t o = 0; o < p % bs; ++o) reread.push_back(b * bs + o);
        continue;
      }
      const int64_t m = p % bs + 1;  // the written slots and the new one
      slots_verified += m;
      uint64_t want = 0;
      for (int64_t o = 0; o < m; ++o) want += okeys[o] * slot_sums[b * bs + o];
      if (kernel_sum(i, lb) != want) return false;
    }
    if (!reread.empty()) {
      slots_verified += static_cast<int64_t>(reread.size());
      std::vector<uint64_t> now(reread.size());
      slot_sums_into(ls_, keys, reread.data(), static_cast<int64_t>(reread.size()), now.data());
      for (size_t j = 0; j < reread.size(); ++j)
        if (now[j] != slot_sums[reread[j]]) return false;
    }
    return true;
  }

  static int64_t table_width(const at::Tensor& block_index, int64_t s) {
    if (s <= 0 || !block_index.device().is_cpu() || block_index.scalar_type() != at::kLong ||
        !block_index.is_contiguous() || block_index.numel() % s != 0)
      return 0;
    return block_index.numel() / s;
  }

  static void check_out(const at::Tensor& t, at::ScalarType type, int64_t numel, const char* what) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == numel && t.device().is_cpu(), what,
                ": contiguous CPU tensor of the step's shape");
  }

  std::vector<at::Tensor> caches_;
  at::Tensor keys_, okeys_, sealed_, tags_, slot_sums_, block_sums_;
  Layers ls_;
  std::vector<int64_t> starts_, write_blocks_;
  bool strict_ = false;
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
  py::class_<DecodeGuard>(m, "DecodeGuard", "a decode step's guard work at standard, around the forward pass")
      .def(py::init<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor>())
      .def("scrub_picks", &DecodeGuard::scrub_picks, "the next k sealed block ids from cursor on, round robin")
      .def("bind", &DecodeGuard::bind, "before the forward pass: the new tags, the kernel's inputs, then open")
      .def("close", &DecodeGuard::close, "after the forward pass: write-time sums, checks, seals",
           py::call_guard<py::gil_scoped_release>());
}
