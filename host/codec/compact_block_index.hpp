// The block index of a compact tensor (NAME.cindex, docs/compact-format.md): its byte layout and
// the strict parser every decoder runs before touching a block -- the CPU codec and its GPU twin
// alike, so both refuse the same indexes with the same words.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "codec/compact_format.hpp"
#include "codec/compact_tiles.hpp"

namespace deltasync::compact {

// NAME.cindex = IndexHeader followed by num_blocks BlockRecords, all little-endian. The header
// is 24 bytes in compact_index_version 1, 32 in version 2 (which adds the tiles).
inline constexpr size_t kIndexHeaderBytes = 24;
inline constexpr size_t kIndexHeaderBytesV2 = 32;
inline constexpr size_t kRecordBytes = 32;
inline constexpr size_t index_header_bytes(uint32_t index_version) { return index_version >= 2 ? kIndexHeaderBytesV2 : kIndexHeaderBytes; }

struct IndexHeader {
  uint64_t changed = 0;         // changes in the tensor (sum of block counts)
  uint64_t payload_bytes = 0;   // size of NAME.cdata (sum of block sizes)
  uint32_t block_elements = 0;  // changes per block (the last block of a tile may hold fewer)
  uint32_t num_blocks = 0;
  uint32_t bands = 1;           // version 2: column bands (positions are coded positions)
  uint32_t stripes = 1;         // version 2: row stripes
};

struct BlockRecord {
  uint64_t first_position = 0;  // flat position of the block's first change
  uint64_t payload_offset = 0;  // where the block starts inside NAME.cdata
  uint32_t count = 0;           // changes in the block (>= 1)
  uint32_t table_bytes = 0;     // the two frequency tables
  uint32_t rans_bytes = 0;      // the rANS stream of tokens
  uint32_t bits_bytes = 0;      // the raw low bits
  uint64_t payload_bytes() const { return uint64_t{table_bytes} + rans_bytes + bits_bytes; }
};

// index_header_bytes(index_version) bytes; version 1 has no tiles (bands = stripes = 1).
void write_header(const IndexHeader& h, uint32_t index_version, uint8_t* out);
IndexHeader read_header(const uint8_t* in, uint32_t index_version);
void write_record(const BlockRecord& r, uint8_t* out);
BlockRecord read_record(const uint8_t* in);

// A block index read and checked against its payload and tensor.
struct ParsedBlockIndex {
  size_t base_index = 0;  // the base tensor it belongs to (the caller's numbering)
  uint32_t version = 1;   // compact_version: how the blocks' rANS streams are laid out
  uint64_t changed = 0;
  TileGeometry tiles;     // the tensor's rows and columns and its tiles (1 x 1: untiled)
  std::vector<BlockRecord> blocks;
  std::span<const uint8_t> payload;
};

// The records of a block index, checked against the size of its payload only: what a reader
// that has not fetched the payload (a tensor-parallel rank choosing blocks to fetch) and the
// decoder (parse_block_index) both rely on. `shape` is the tensor's, `index_version` the file's
// compact_index_version. Every check of parse_block_index below; throws
// BadInputError("WHERE: reason").
struct BlockRecords {
  uint32_t index_version = 1;
  uint64_t changed = 0;
  uint32_t block_elements = 0;
  TileGeometry tiles;  // rows x cols = the tensor's elements
  std::vector<BlockRecord> blocks;
  uint64_t numel() const { return tiles.rows * tiles.cols; }
};
BlockRecords read_block_records(std::span<const uint8_t> block_index, uint64_t payload_bytes, std::span<const uint64_t> shape,
                                uint32_t index_version, const std::string& where);
// The NAME.cindex bytes of `records` (its header with the blocks' count, changes and payload
// size recomputed).
std::vector<uint8_t> write_block_index(const BlockRecords& records);

// Checks everything the index promises before any block is decoded: its size, a nonzero change
// count no larger than the tensor, tiles that fit the tensor's shape (version 2), blocks of
// 1..block_elements changes that tile the payload in order, first positions inside the tensor
// and strictly ascending, counts that sum up. Throws Error("WHERE: reason") (WHERE names the
// file and tensor; a block adds ": block B"). That no block crosses a tile boundary is checked
// after decoding (the index holds first positions only).
ParsedBlockIndex parse_block_index(std::span<const uint8_t> block_index, std::span<const uint8_t> payload,
                                   size_t base_index, std::span<const uint64_t> shape, uint32_t index_version,
                                   const std::string& where);

}  // namespace deltasync::compact
