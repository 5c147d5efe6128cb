// Benchmark inputs: a model's tensor shapes for the Tensors axis, random weight bits, and a
// uniformly random set of changed positions at a given share. Everything is seeded, so two runs
// (and the torch companion, which receives the same tensor sizes) measure the same problem.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/huge_buffer.hpp"
#include "core/tensor.hpp"

namespace deltasync::bench {

struct TensorShape {
  std::string name;
  uint64_t numel = 0;
};

// The tensors of a model of `total` elements for a Tensors axis value:
//   "N" (a number): N equal tensors (the last one takes the remainder);
//   "model": the tensor list of a Qwen3-0.6B-like decoder (embedding, 28 layers of attention,
//            MLP and norm weights; 310 tensors, from 128-element norms to the 156M-element
//            embedding) scaled so the sizes keep their proportions and sum to `total`.
std::vector<TensorShape> model_shapes(const std::string& tensors_axis, uint64_t total);

// Zero-filled host memory for an arena of weights (the weights of a model live in one arena, each
// tensor starting on its own cache line as separately allocated tensors would). Arenas of 2 MiB
// and more are 2 MiB aligned and advised for huge pages, as deltasync's own host copies of
// weights are (deltasync/huge_buffer.hpp): the sparse benchmarks would otherwise measure page
// walks rather than the codec.
struct AlignedBytes {
  HugeBuffer buffer;
  size_t size = 0;
  // Writable through a const reference, like the unique_ptr this struct used to hold: fixtures
  // are shared as const while their arenas remain the benchmarks' scratch space.
  uint8_t* data() const { return const_cast<uint8_t*>(buffer.data()); }
};
AlignedBytes allocate_aligned(size_t bytes);

// Fills with pseudo-random bits from `seed` (in parallel; never a constant pattern).
void fill_random(std::span<uint8_t> bytes, uint64_t seed);

// Positions changed in each tensor: every element independently with probability `share`
// (skip-sampled, O(changed) work), ascending.
std::vector<std::vector<int64_t>> random_changes(std::span<const TensorShape> shapes, double share, uint64_t seed);

// A model's weights on the host: one arena per copy, tensor t at byte offset offsets[t].
class HostModel {
 public:
  HostModel(std::vector<TensorShape> shapes, uint32_t width);

  const std::vector<TensorShape>& shapes() const { return shapes_; }
  uint32_t width() const { return width_; }
  uint64_t total_elements() const { return total_; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  uint64_t offset(size_t t) const { return offsets_[t]; }

  AlignedBytes new_arena() const { return allocate_aligned(arena_bytes_); }
  std::vector<TensorRef> refs(uint8_t* arena) const;
  std::vector<ConstTensorRef> const_refs(const uint8_t* arena) const;
  std::vector<EncodeItem> encode_items(const uint8_t* current, uint8_t* shadow) const;

 private:
  std::vector<TensorShape> shapes_;
  uint32_t width_;
  uint64_t total_ = 0;
  std::vector<uint64_t> offsets_;
  uint64_t arena_bytes_ = 0;
};

// Makes `dst` differ from `src` exactly at `changes`: dst = src everywhere, then each changed
// element moved by one unit in the last place (the common case after an Adam step at RL
// learning rates) or, one time in eight, given other random bits. Returns the number changed.
uint64_t derive_changed_copy(const HostModel& model, const uint8_t* src, uint8_t* dst,
                             const std::vector<std::vector<int64_t>>& changes, uint64_t seed);

// Sum of sizes of the change sets.
uint64_t count_changes(const std::vector<std::vector<int64_t>>& changes);

}  // namespace deltasync::bench
