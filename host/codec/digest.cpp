// CPU digests. The two hot loops (a contiguous slice; scattered positions) are compiled three
// times — AVX-512, AVX2 and baseline — and picked once at run time, because a term costs two
// 64-bit multiplies and only the vector units keep up with memory (baseline SSE2 has no 64-bit
// vector multiply). All three compute the same sum mod 2^64.
#include "codec/digest.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "codec/digest_mix.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/parse_number.hpp"

namespace deltasync {

void check_digest_width(uint32_t width, std::string_view name) {
  if (width != 1 && width != 2 && width != 4)
    throw BadInputError("digest: tensor " + std::string(name) + " has " + std::to_string(width) +
                "-byte elements; digests cover 1-, 2- and 4-byte elements");
}

namespace {

using digest_mix::kBlockElements;
using digest_mix::kBlockShift;

// Elements per parallel task: a power of two, so that no task straddles a 2^32 block.
constexpr uint64_t kChunkElements = uint64_t{1} << 20;
static_assert(kBlockElements % kChunkElements == 0);

void check_width(uint32_t width, std::string_view name) { check_digest_width(width, name); }

uint32_t load_bits(const uint8_t* p, uint32_t width) {
  switch (width) {
    case 1: return *p;
    case 2: { uint16_t v; std::memcpy(&v, p, 2); return v; }
    default: { uint32_t v; std::memcpy(&v, p, 4); return v; }
  }
}

uint64_t load_index(const void* indices, uint32_t index_width, uint64_t k) {
  if (index_width == 4) {
    int32_t v;
    std::memcpy(&v, static_cast<const uint8_t*>(indices) + 4 * k, 4);
    return static_cast<uint64_t>(static_cast<int64_t>(v));
  }
  int64_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(indices) + 8 * k, 8);
  return static_cast<uint64_t>(v);
}

// Σ term over elements [first, first + count) of one 2^32 block; p points at element `first`.
// Loads one 64-bit word at a time and splits it into 8 / W elements.
template <uint32_t W>
[[gnu::always_inline]] inline uint64_t block_slice_sum(const uint8_t* p, uint64_t first, uint64_t count) {
  constexpr uint32_t kPerWord = 8 / W;
  constexpr uint64_t kMask = W == 4 ? 0xFFFFFFFFull : (uint64_t{1} << (8 * W)) - 1;
  const uint64_t seed = digest_mix::block_seed(W, first >> kBlockShift);
  uint64_t sum = 0;
  uint64_t k = 0;
  for (; k + kPerWord <= count; k += kPerWord) {
    uint64_t word;
    std::memcpy(&word, p + k * W, 8);
    for (uint32_t e = 0; e < kPerWord; ++e)
      sum += digest_mix::term(seed, first + k + e, static_cast<uint32_t>((word >> (8 * W * e)) & kMask));
  }
  for (; k < count; ++k) sum += digest_mix::term(seed, first + k, load_bits(p + k * W, W));
  return sum;
}

// Σ term(seed, i_k, bits_k) over positions that all lie in one 2^32 block (one seed).
template <uint32_t W, uint32_t IW>
[[gnu::always_inline]] inline uint64_t block_scattered_sum(const uint8_t* idx, const uint8_t* bits, uint64_t count,
                                                           uint64_t seed) {
  using Index = std::conditional_t<IW == 4, int32_t, int64_t>;
  using Bits = std::conditional_t<W == 1, uint8_t, std::conditional_t<W == 2, uint16_t, uint32_t>>;
  uint64_t sum = 0;
  for (uint64_t k = 0; k < count; ++k) {
    Index i;
    Bits b;
    std::memcpy(&i, idx + k * IW, IW);
    std::memcpy(&b, bits + k * W, W);
    sum += digest_mix::term(seed, static_cast<uint64_t>(static_cast<int64_t>(i)), b);
  }
  return sum;
}

// The two hot loops, compiled once per instruction set.
struct Kernels {
  uint64_t (*slice)(uint32_t width, const uint8_t* p, uint64_t first, uint64_t count);
  uint64_t (*scattered)(uint32_t width, uint32_t index_width, const uint8_t* idx, const uint8_t* bits, uint64_t count,
                        uint64_t seed);
};

#define DELTASYNC_SLICE_BODY                                      \
  switch (width) {                                                \
    case 1: return block_slice_sum<1>(p, first, count);           \
    case 2: return block_slice_sum<2>(p, first, count);           \
    default: return block_slice_sum<4>(p, first, count);          \
  }
#define DELTASYNC_SCATTERED_BODY                                                          \
  const bool wide = index_width == 8;                                                     \
  switch (width) {                                                                        \
    case 1: return wide ? block_scattered_sum<1, 8>(idx, bits, count, seed)               \
                        : block_scattered_sum<1, 4>(idx, bits, count, seed);              \
    case 2: return wide ? block_scattered_sum<2, 8>(idx, bits, count, seed)               \
                        : block_scattered_sum<2, 4>(idx, bits, count, seed);              \
    default: return wide ? block_scattered_sum<4, 8>(idx, bits, count, seed)              \
                         : block_scattered_sum<4, 4>(idx, bits, count, seed);             \
  }
#define DELTASYNC_KERNELS(SUFFIX, ATTR)                                                                       \
  ATTR uint64_t slice_##SUFFIX(uint32_t width, const uint8_t* p, uint64_t first, uint64_t count) {            \
    DELTASYNC_SLICE_BODY                                                                                      \
  }                                                                                                           \
  ATTR uint64_t scattered_##SUFFIX(uint32_t width, uint32_t index_width, const uint8_t* idx, const uint8_t* bits, \
                                   uint64_t count, uint64_t seed) {                                           \
    DELTASYNC_SCATTERED_BODY                                                                                  \
  }

DELTASYNC_KERNELS(baseline, )
#if defined(__x86_64__) && defined(__GNUC__)
DELTASYNC_KERNELS(avx2, __attribute__((target("avx2"))))
DELTASYNC_KERNELS(avx512, __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw"))))
#endif
#undef DELTASYNC_KERNELS
#undef DELTASYNC_SCATTERED_BODY
#undef DELTASYNC_SLICE_BODY

// The best path the CPU supports. DELTASYNC_DIGEST_ISA=baseline|avx2 caps it (tests use this to
// check every path against the reference on one machine).
Kernels pick_kernels() {
  const char* cap = std::getenv("DELTASYNC_DIGEST_ISA");
  const std::string_view limit = cap ? cap : "";
  if (limit == "baseline") return {&slice_baseline, &scattered_baseline};
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (limit != "avx2" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    return {&slice_avx512, &scattered_avx512};
  if (__builtin_cpu_supports("avx2")) return {&slice_avx2, &scattered_avx2};
#endif
  return {&slice_baseline, &scattered_baseline};
}

const Kernels& kernels() {
  static const Kernels k = pick_kernels();
  return k;
}

uint64_t slice_sum(uint32_t width, const uint8_t* p, uint64_t first, uint64_t count) {
  const auto fn = kernels().slice;
  uint64_t sum = 0;
  // Split at 2^32 block boundaries: each piece has a single seed.
  while (count > 0) {
    const uint64_t block_end = ((first >> kBlockShift) + 1) << kBlockShift;
    const uint64_t n = block_end == 0 ? count : std::min(count, block_end - first);
    sum += fn(width, p, first, n);
    p += n * width;
    first += n;
    count -= n;
  }
  return sum;
}

// Positions come in any order; groups whose positions share one 2^32 block (all of them, for
// any tensor below 4G elements) take the vectorized single-seed loop, others go term by term.
uint64_t scattered_sum(uint32_t width, uint64_t count, const void* indices, uint32_t index_width, const uint8_t* bits) {
  constexpr uint64_t kGroup = 2048;
  const auto fn = kernels().scattered;
  const auto* idx = static_cast<const uint8_t*>(indices);
  uint64_t sum = 0;
  for (uint64_t g = 0; g < count; g += kGroup) {
    const uint64_t n = std::min(kGroup, count - g);
    const uint8_t* gi = idx + g * index_width;
    const uint8_t* gb = bits + g * width;
    const uint64_t block = load_index(gi, index_width, 0) >> kBlockShift;
    bool one_block = true;
    for (uint64_t k = 1; k < n; ++k) one_block &= (load_index(gi, index_width, k) >> kBlockShift) == block;
    if (one_block) {
      sum += fn(width, index_width, gi, gb, n, digest_mix::block_seed(width, block));
    } else {
      for (uint64_t k = 0; k < n; ++k)
        sum += digest_mix::term_at(width, load_index(gi, index_width, k), load_bits(gb + k * width, width));
    }
  }
  return sum;
}

void check_index_width(uint32_t index_width) {
  if (index_width != 4 && index_width != 8)
    throw BadInputError("digest: patch index width " + std::to_string(index_width) + " (want 4 or 8)");
}

}  // namespace

uint64_t digest_slice(uint32_t width, const void* bits, uint64_t first, uint64_t count) {
  check_width(width, "(slice)");
  return slice_sum(width, static_cast<const uint8_t*>(bits), first, count);
}

uint64_t digest_tensor(const ConstTensorRef& tensor) { return digest_tensors(std::span(&tensor, 1)).front(); }

std::vector<uint64_t> digest_tensors(std::span<const ConstTensorRef> tensors) {
  std::vector<Placement> whole;
  whole.reserve(tensors.size());
  for (const auto& x : tensors) whole.push_back(whole_placement(x.numel));
  return digest_placed_tensors(tensors, whole);
}

std::vector<uint64_t> digest_placed_tensors(std::span<const ConstTensorRef> tensors, std::span<const Placement> placements) {
  if (placements.size() != tensors.size()) throw Error("digest: " + std::to_string(tensors.size()) + " tensors, " + std::to_string(placements.size()) + " placements");
  // Tasks task_begin[t] .. task_begin[t+1] are the chunks of tensor t: chunks_per_run[t] per run,
  // so a chunk never straddles two runs (its full positions are contiguous).
  std::vector<uint64_t> task_begin(tensors.size() + 1, 0);
  std::vector<uint64_t> chunks_per_run(tensors.size(), 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    const auto& x = tensors[t];
    const Placement& pl = placements[t];
    check_width(x.width, x.name);
    if (x.numel > 0 && x.data == nullptr) throw BadInputError("digest: tensor " + std::string(x.name) + " has no data");
    if (pl.numel() != x.numel)
      throw BadInputError("digest: tensor " + std::string(x.name) + " holds " + std::to_string(x.numel) + " elements, its placement " +
                          placement_text(pl) + " " + std::to_string(pl.numel()));
    chunks_per_run[t] = (pl.run_length + kChunkElements - 1) / kChunkElements;
    task_begin[t + 1] = task_begin[t] + chunks_per_run[t] * pl.run_count;
  }
  std::vector<uint64_t> partial(task_begin.back(), 0);
  parallel_for(partial.size(), [&](size_t task) {
    const size_t t = std::upper_bound(task_begin.begin(), task_begin.end(), task) - task_begin.begin() - 1;
    const auto& x = tensors[t];
    const Placement& pl = placements[t];
    const uint64_t run = (task - task_begin[t]) / chunks_per_run[t];
    const uint64_t in_run = (task - task_begin[t]) % chunks_per_run[t] * kChunkElements;
    const uint64_t count = std::min(kChunkElements, pl.run_length - in_run);
    const uint64_t local = run * pl.run_length + in_run;
    partial[task] = slice_sum(x.width, static_cast<const uint8_t*>(x.data) + local * x.width,
                              pl.first + run * pl.run_stride + in_run, count);
  });
  std::vector<uint64_t> out(tensors.size(), 0);
  for (size_t t = 0; t < tensors.size(); ++t)
    for (uint64_t task = task_begin[t]; task < task_begin[t + 1]; ++task) out[t] += partial[task];
  return out;
}

uint64_t digest_scattered(uint32_t width, uint64_t count, const void* indices, uint32_t index_width, const void* bits) {
  check_width(width, "(scattered)");
  check_index_width(index_width);
  return scattered_sum(width, count, indices, index_width, static_cast<const uint8_t*>(bits));
}

uint64_t digest_at(const ConstTensorRef& tensor, uint64_t count, const void* indices, uint32_t index_width) {
  check_width(tensor.width, tensor.name);
  check_index_width(index_width);
  const auto* data = static_cast<const uint8_t*>(tensor.data);
  const uint32_t w = tensor.width;
  uint64_t sum = 0;
  uint64_t seed_block = ~uint64_t{0}, seed = 0;  // positions mostly ascend: cache the block seed
  for (uint64_t k = 0; k < count; ++k) {
    const uint64_t i = load_index(indices, index_width, k);
    if ((i >> kBlockShift) != seed_block) {
      seed_block = i >> kBlockShift;
      seed = digest_mix::block_seed(w, seed_block);
    }
    sum += digest_mix::term(seed, i, load_bits(data + i * w, w));
  }
  return sum;
}

uint64_t digest_update(uint64_t digest, uint32_t width, uint64_t count, const int64_t* indices, const void* old_bits,
                       const void* new_bits) {
  return digest - digest_scattered(width, count, indices, 8, old_bits) + digest_scattered(width, count, indices, 8, new_bits);
}

uint64_t digest_shift(const PatchRef& patch, const void* old_bits) {
  return digest_scattered(patch.value_width, patch.count, patch.indices, patch.index_width, patch.values) -
         digest_scattered(patch.value_width, patch.count, patch.indices, patch.index_width, old_bits);
}

uint64_t digest_update(uint64_t digest, const PatchRef& patch, const void* old_bits) {
  return digest + digest_shift(patch, old_bits);
}

std::vector<uint64_t> digest_shifts(std::span<const PatchRef> patches, std::span<const void* const> old_bits) {
  if (old_bits.size() != patches.size()) throw BadInputError("digest: digest_shifts needs one old-bits buffer per patch");
  // Same chunking as digest_tensors, over changed elements instead of all elements.
  std::vector<uint64_t> task_begin(patches.size() + 1, 0);
  for (size_t t = 0; t < patches.size(); ++t) {
    check_width(patches[t].value_width, "(patch " + std::to_string(t) + ")");
    check_index_width(patches[t].index_width);
    task_begin[t + 1] = task_begin[t] + (patches[t].count + kChunkElements - 1) / kChunkElements;
  }
  std::vector<uint64_t> partial(task_begin.back(), 0);
  parallel_for(partial.size(), [&](size_t task) {
    const size_t t = std::upper_bound(task_begin.begin(), task_begin.end(), task) - task_begin.begin() - 1;
    const PatchRef& p = patches[t];
    const uint64_t first = (task - task_begin[t]) * kChunkElements;
    const uint64_t count = std::min(kChunkElements, p.count - first);
    const auto* idx = static_cast<const uint8_t*>(p.indices) + first * p.index_width;
    const auto* new_bits = static_cast<const uint8_t*>(p.values) + first * p.value_width;
    const auto* old = static_cast<const uint8_t*>(old_bits[t]) + first * p.value_width;
    partial[task] = scattered_sum(p.value_width, count, idx, p.index_width, new_bits) -
                    scattered_sum(p.value_width, count, idx, p.index_width, old);
  });
  std::vector<uint64_t> out(patches.size(), 0);
  for (size_t t = 0; t < patches.size(); ++t)
    for (uint64_t task = task_begin[t]; task < task_begin[t + 1]; ++task) out[t] += partial[task];
  return out;
}

std::string digest_to_hex(uint64_t digest) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int k = 15; k >= 0; --k, digest >>= 4) out[k] = kDigits[digest & 15];
  return out;
}

uint64_t digest_from_hex(std::string_view text, std::string_view label) {
  return parse_hex64(text, std::string(label) + ": digest");
}

}  // namespace deltasync
