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

// Written as metadata "compact_version"; readers accept 1 and 2 and refuse other values. The two
// differ only in the rANS stream of a block (docs/compact-format.md): version 1 has four lanes
// sharing a byte-wise stream, version 2 has 32 interleaved lanes sharing a 16-bit-word stream
// (change i in lane i mod 32), so that a SIMD unit or a GPU warp decodes 32 tokens at once.
inline constexpr uint32_t kFormatVersion1 = 1;
inline constexpr uint32_t kFormatVersion2 = 2;
// What the writers produce unless told otherwise. Version 1 while the GPU decoder of version 2
// has not run on a GPU (a CPU publisher's file may be decoded by a CUDA subscriber).
inline constexpr uint32_t kDefaultFormatVersion = kFormatVersion1;
inline bool is_known_version(uint32_t version) { return version == kFormatVersion1 || version == kFormatVersion2; }
// Changes per block: large enough that the per-block tables cost < 1%, small enough that a
// 1%-dense 1B-element model gives thousands of blocks to spread over cores (or GPU threads).
inline constexpr uint32_t kDefaultBlockElements = 16384;

inline constexpr std::string_view kIndexSuffix = ".cindex";
inline constexpr std::string_view kDataSuffix = ".cdata";

struct Options {
  uint32_t block_elements = kDefaultBlockElements;  // 1 .. 2^24
  bool parallel = true;  // false: run on the calling thread only (per-core measurements)
  uint32_t version = kDefaultFormatVersion;  // the format the encoder writes (decoders read both)
};

// One changed tensor, encoded.
struct EncodedTensor {
  std::string name;                  // the model tensor's name
  uint64_t changed = 0;              // number of changed elements
  uint32_t version = kFormatVersion1;  // compact_version of the payload's blocks
  std::vector<uint8_t> block_index;  // content of NAME.cindex
  std::vector<uint8_t> payload;      // content of NAME.cdata
};

// A borrowed view of an encoded tensor (e.g. pointing into a mapped file).
struct EncodedTensorView {
  std::string_view name;
  std::span<const uint8_t> block_index;
  std::span<const uint8_t> payload;
  uint32_t version = kFormatVersion1;  // the file's compact_version
};

}  // namespace deltasync::compact
