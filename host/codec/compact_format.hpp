// The compact format's constants and its encoded-tensor records, header-only: shared by the CPU
// codec (compact_codec.hpp) and its GPU twin (kernels/), which depend on core/ and nothing else
// of the host library (docs/compact-format.md is the byte-level specification).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace deltasync::compact {

// Written as metadata "compact_version"; readers refuse other values.
inline constexpr uint32_t kFormatVersion = 1;
// Changes per block: large enough that the per-block tables cost < 1%, small enough that a
// 1%-dense 1B-element model gives thousands of blocks to spread over cores (or GPU threads).
inline constexpr uint32_t kDefaultBlockElements = 16384;

inline constexpr std::string_view kIndexSuffix = ".cindex";
inline constexpr std::string_view kDataSuffix = ".cdata";

struct Options {
  uint32_t block_elements = kDefaultBlockElements;  // 1 .. 2^24
  bool parallel = true;  // false: run on the calling thread only (per-core measurements)
};

// One changed tensor, encoded.
struct EncodedTensor {
  std::string name;                  // the model tensor's name
  uint64_t changed = 0;              // number of changed elements
  std::vector<uint8_t> block_index;  // content of NAME.cindex
  std::vector<uint8_t> payload;      // content of NAME.cdata
};

// A borrowed view of an encoded tensor (e.g. pointing into a mapped file).
struct EncodedTensorView {
  std::string_view name;
  std::span<const uint8_t> block_index;
  std::span<const uint8_t> payload;
};

}  // namespace deltasync::compact
