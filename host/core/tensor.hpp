// Plain descriptions of tensors and of sparse changes to them. They hold pointers, never own
// memory, and mean the same thing on the host and on the device: the CPU twin and the CUDA
// kernels take exactly these structures, so a caller can switch backends without reshaping data.
#pragma once
#include <cstdint>
#include <span>
#include <string_view>

namespace deltasync {

// A tensor's raw bits: `numel` elements of `width` bytes (1, 2 or 4), contiguous, row-major.
struct TensorRef {
  std::string_view name;  // used in error messages only
  void* data = nullptr;
  uint64_t numel = 0;
  uint32_t width = 0;
};

struct ConstTensorRef {
  std::string_view name;
  const void* data = nullptr;
  uint64_t numel = 0;
  uint32_t width = 0;
};

// One tensor of an encode: `current` is compared bitwise with `shadow` (the bits last
// published); afterwards shadow == current bit for bit.
struct EncodeItem {
  std::string_view name;
  const void* current = nullptr;
  void* shadow = nullptr;
  uint64_t numel = 0;
  uint32_t width = 0;
};

// Changes to one tensor: `count` strictly ascending flat positions (int32 or int64, as
// `index_width` says: files store I32 where the tensor allows it) and the new bits at those
// positions (`value_width` bytes each, which must equal the target's width).
struct PatchRef {
  uint64_t count = 0;
  const void* indices = nullptr;
  uint32_t index_width = 8;
  const void* values = nullptr;
  uint32_t value_width = 0;
};

// The result of an encode of T tensors, packed in tensor order. Tensor t owns
// indices[offsets[t] .. offsets[t+1]) (int64 flat positions, strictly ascending) and the value
// bytes values[value_offsets[t] .. value_offsets[t+1]) (count × width bytes). base_values has
// the same layout and holds the shadow's bits before the encode (the base the delta applies
// to): the compact codec encodes values relative to them and digests are updated from them in
// O(changed). Both backends produce byte-identical arrays.
struct DeltaView {
  std::span<const uint64_t> offsets;        // T + 1 entries, offsets[0] == 0
  std::span<const uint64_t> value_offsets;  // T + 1 entries, in bytes
  std::span<const int64_t> indices;         // offsets[T] entries
  std::span<const uint8_t> values;          // value_offsets[T] bytes: new bits
  std::span<const uint8_t> base_values;     // value_offsets[T] bytes: bits before (may be empty
                                            // for a delta read from a file that lacks them)

  size_t num_tensors() const { return offsets.empty() ? 0 : offsets.size() - 1; }
  uint64_t total_changed() const { return offsets.empty() ? 0 : offsets.back(); }
  uint64_t count(size_t t) const { return offsets[t + 1] - offsets[t]; }
  // The changes to tensor t as a patch (indices int64).
  PatchRef patch(size_t t, uint32_t width) const {
    return PatchRef{count(t), indices.data() + offsets[t], 8, values.data() + value_offsets[t], width};
  }
};

}  // namespace deltasync
