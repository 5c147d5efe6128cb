// Owning host storage for an encode result; view() gives the DeltaView both backends speak.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"

namespace deltasync {

struct SparseDelta {
  std::vector<uint64_t> offsets;        // T + 1
  std::vector<uint64_t> value_offsets;  // T + 1, bytes
  std::vector<int64_t> indices;
  std::vector<uint8_t> values;       // new bits
  std::vector<uint8_t> base_values;  // bits before the encode, same layout as values

  DeltaView view() const { return DeltaView{offsets, value_offsets, indices, values, base_values}; }
};

}  // namespace deltasync
