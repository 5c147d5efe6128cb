// Sizes of one delta under the encodings we compare against, and the order-0 entropy bound.
// Every function takes the delta exactly as cpu::encode produced it (int64 ascending positions,
// new and base bits of each changed element).
#pragma once
#include <cstdint>
#include <span>

#include "format/delta_file.hpp"
#include "core/tensor.hpp"

namespace realistic {

// Interoperable (TRL) layout: an int32 index plus the new bits per changed element.
uint64_t interop_bytes(std::span<const deltasync::TensorMeta> tensors, const deltasync::DeltaView& delta);

// The same arrays, each tensor's .indices and .values compressed with zstd at `level`.
uint64_t interop_zstd_bytes(std::span<const deltasync::TensorMeta> tensors, const deltasync::DeltaView& delta,
                            int level);

// PULSE-style: per tensor, COO indices delta-coded (first absolute) and narrowed to the smallest
// of uint8/uint16/uint32 holding every delta, then the raw new bits; all tensors concatenated
// and compressed with zstd level 1.
uint64_t pulse_bytes(std::span<const deltasync::TensorMeta> tensors, const deltasync::DeltaView& delta);

// Order-0 entropy of the delta's symbols: gaps (position - previous - 1, the first from -1,
// per tensor) and value changes (compact::value_symbol), each with one histogram over the
// whole delta. Returned in bytes for all changed elements together.
struct EntropyBound {
  double gap_bytes = 0;
  double value_bytes = 0;
  double total() const { return gap_bytes + value_bytes; }
};
EntropyBound order0_entropy(std::span<const deltasync::TensorMeta> tensors, const deltasync::DeltaView& delta);

}  // namespace realistic
