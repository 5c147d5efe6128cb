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

// Written as metadata "compact_index_version" (absent: 1); readers accept 1 and 2. Version 2's
// block index header has 8 more bytes, the tensor's tiles (codec/compact_tiles.hpp): its column
// bands (positions coded band by band) and row stripes, which no block crosses.
inline constexpr uint32_t kIndexVersion1 = 1;
inline constexpr uint32_t kIndexVersion2 = 2;
inline bool is_known_index_version(uint32_t version) { return version == kIndexVersion1 || version == kIndexVersion2; }
// Tiles per dimension: at most 8 column bands and 8 row stripes, powers of two. The writers'
// default cuts tensors into tiles (index version 2); max_tiles = 1 writes index version 1.
inline constexpr uint32_t kMaxTilesPerDim = 8;
inline constexpr uint32_t kDefaultMaxTiles = kMaxTilesPerDim;

inline constexpr std::string_view kIndexSuffix = ".cindex";
inline constexpr std::string_view kDataSuffix = ".cdata";

// Written as metadata "compact_layout" (absent: 1): how the container holds the encoded tensors.
// Layout 1: a NAME.cindex and a NAME.cdata entry per changed tensor, names, shapes and digests in
// the JSON header (which grows with the changed tensors). Layout 2, the indexed layout
// (codec/compact_indexed.hpp): five fixed entries -- a presence bitmap over the model's tensor
// table, fixed-size binary records, the block indexes and the payloads -- so that the header is
// constant-size and a reader fetches the records of the tensors it needs by ranges, every piece
// verified by a hash chain from the header. The blocks themselves are the same in both.
inline constexpr uint32_t kLayout1 = 1;
inline constexpr uint32_t kLayout2 = 2;
// A standalone delta file (`deltasync diff`, write_compact_delta with default options) keeps
// layout 1: it names its tensors, so a file applied to another model is refused naming the tensor
// that differs. Publishers write layout 2 (their manifests carry the tensor table the records
// index; receivers read their records by ranges).
inline constexpr uint32_t kDefaultLayout = kLayout1;
inline constexpr uint32_t kPublisherDefaultLayout = kLayout2;
inline bool is_known_layout(uint32_t layout) { return layout == kLayout1 || layout == kLayout2; }

struct Options {
  uint32_t block_elements = kDefaultBlockElements;  // 1 .. 2^24
  bool parallel = true;  // false: run on the calling thread only (per-core measurements)
  uint32_t version = kDefaultFormatVersion;  // the format the encoder writes (decoders read both)
  // Tiles of a tensor with two or more dimensions (compact_tiles.hpp: choose_tiles): at most this
  // many column bands and as many row stripes, 1, 2, 4 or 8. 1: no tiles, block index version 1
  // (the bytes writers produced before tiles existed).
  uint32_t max_tiles = kDefaultMaxTiles;
  // The container layout the writer produces (kLayout1 or kLayout2; readers read both).
  uint32_t layout = kDefaultLayout;
  uint32_t index_version() const { return max_tiles > 1 ? kIndexVersion2 : kIndexVersion1; }
};

struct EncodedTensorView;

// One changed tensor, encoded.
struct EncodedTensor {
  std::string name;                  // the model tensor's name
  uint64_t changed = 0;              // number of changed elements
  uint32_t version = kFormatVersion1;  // compact_version of the payload's blocks
  uint32_t index_version = kIndexVersion1;  // compact_index_version of the block index
  std::vector<uint8_t> block_index;  // content of NAME.cindex
  std::vector<uint8_t> payload;      // content of NAME.cdata
  EncodedTensorView view() const;
};

// A borrowed view of an encoded tensor (e.g. pointing into a mapped file).
struct EncodedTensorView {
  std::string_view name;
  std::span<const uint8_t> block_index;
  std::span<const uint8_t> payload;
  uint32_t version = kFormatVersion1;  // the file's compact_version
  uint32_t index_version = kIndexVersion1;  // the file's compact_index_version
};

inline EncodedTensorView EncodedTensor::view() const { return {name, block_index, payload, version, index_version}; }

}  // namespace deltasync::compact
