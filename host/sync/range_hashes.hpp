// Objects sealed for ranged reads: a reader that needs only some byte ranges of a delta (a
// tensor-parallel rank, sync/ranged_fetch.hpp) must still verify every byte it uses before use.
// The object's SHA-256 in the manifest covers only whole objects, so a sealed object also
// carries, in its safetensors metadata, the SHA-256 of every chunk of its data section, and the
// manifest records the SHA-256 of the header that holds them (ObjectRef::header_sha256). A
// reader fetches the header by ranged GET and checks it against the manifest, then fetches whole
// chunks around the ranges it needs and checks each against the header. Any safetensors object
// (compact or TRL delta, a delta part) can be sealed; data offsets do not move (they are
// relative to the data section). docs/stores.md.
//   range_chunk_sizes   every chunk's size in bytes, decimal, comma-separated, in data order:
//                       chunks end where a rank's reads do (sync/range_chunks.hpp)
//   range_chunk_sha256  each chunk's SHA-256 truncated to its first 16 bytes (128 bits, as
//                       SHA-256/128 is), lowercase hex, concatenated in data order
// Objects sealed before chunks followed the layout have `range_chunk_bytes` (one size for every
// chunk, the last one shorter) instead of `range_chunk_sizes`; readers take both. A compact delta
// of the indexed layout (codec/compact_indexed.hpp) needs no chunks: its header vouches for its
// records and they for its block indexes and blocks; seal() leaves it as it is and only its
// header_sha256 is recorded.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "codec/delta_io.hpp"
#include "format/safetensors.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"

namespace deltasync::ranged {

inline constexpr const char* kChunkSizesKey = "range_chunk_sizes";
inline constexpr const char* kChunkBytesKey = "range_chunk_bytes";  // objects sealed before
inline constexpr const char* kChunkSha256Key = "range_chunk_sha256";
// A rank's ranges are rounded out to whole chunks, and every reader reads every hash (32 header
// bytes a chunk): chunks end where ranks' reads do (range_chunks.hpp), and between those cuts
// grow to a target of at least 256 bytes that makes at most ~1024 chunks (a 7 MB delta: 8 KiB),
// so the header stays bounded.
inline constexpr size_t kChunkHashBytes = 16;
using ChunkHash = std::array<uint8_t, kChunkHashBytes>;
inline constexpr uint64_t kMinChunkBytes = 256;
inline constexpr uint64_t kTargetChunks = 1024;
// The chunk size seal() aims at for a data section of `data_bytes`: the smallest power of two of
// at least kMinChunkBytes that makes at most kTargetChunks chunks.
uint64_t chunk_bytes_for(uint64_t data_bytes);

// The safetensors file `file` with its chunks' sizes and hashes added to its metadata (tensors,
// their order and data unchanged), chunks cut by range_chunks.hpp aiming at `chunk_bytes` (0:
// chunk_bytes_for(its data)). Throws BadInputError naming `label` for bytes that are not
// safetensors.
std::vector<uint8_t> seal(std::span<const uint8_t> file, const std::string& label, uint64_t chunk_bytes = 0);
// Seals `bytes`, uploads them under `key` and returns their reference with header_sha256 set.
protocol::ObjectRef put_sealed_object(Store& store, const std::string& key, std::span<const uint8_t> bytes);
// A delta object as publishers upload it: compact deltas sealed (the layout ranged readers decode
// block by block), the interoperable layouts as they are (byte for byte what TRL reads).
protocol::ObjectRef put_delta_object(Store& store, const std::string& key, std::span<const uint8_t> bytes, DeltaFormat format);

// A sealed object's header as a ranged reader holds it: verified against the manifest, parsed.
struct SealedHeader {
  uint64_t object_size = 0;
  uint64_t data_offset = 0;  // where the data section starts in the object (8 + header length)
  std::vector<st::TensorInfo> tensors;  // file order; begin/end relative to the data section
  st::Metadata metadata;                // without the range_* keys
  std::vector<uint64_t> chunk_ends;     // chunk c is data bytes [chunk_begin(c), chunk_ends[c]); none in the indexed layout
  std::vector<ChunkHash> chunk_sha256;
  // tensors' indices in name order: find() is a binary search (a part of a 70k-tensor model names
  // ~140k tensors, and a planner looks each up; a linear search made that O(T^2) per part).
  std::vector<uint32_t> by_name;
  const st::TensorInfo* find(std::string_view name) const;
  uint64_t data_bytes() const { return object_size - data_offset; }
  uint64_t chunk_begin(size_t c) const { return c == 0 ? 0 : chunk_ends[c - 1]; }
};

// The bytes [0, 8 + header length) of an object whose length prefix says so: the header length
// read from the first 8 bytes, bounded by the object's size.
uint64_t header_prefix_bytes(std::span<const uint8_t> first8, uint64_t object_size, const std::string& label);
// Checks `prefix` (exactly header_prefix_bytes) against ref.header_sha256, then parses it: dtypes,
// shapes and data offsets inside the data section, chunks (either form) that tile the data, a hash
// for every chunk. Throws
// BadInputError("LABEL: reason") (a header that differs from the manifest's: "header sha256
// differs from the manifest's (corrupt object)").
SealedHeader read_sealed_header(std::span<const uint8_t> prefix, const protocol::ObjectRef& ref, const std::string& label);

// Checks fetched data bytes [data_begin, data_begin + bytes.size()) of the data section, which
// must start at a chunk boundary and end at one, against the chunk hashes. Throws BadInputError("LABEL: data chunk K sha256 differs from its header's (corrupt
// object)").
void verify_chunks(const SealedHeader& header, uint64_t data_begin, std::span<const uint8_t> bytes, const std::string& label);

}  // namespace deltasync::ranged
