// Private to the compact codec: the byte layout of the block index and the coder of one block.
// Kept apart from the container code so that a GPU twin can mirror it function by function.
#pragma once
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace deltasync::compact::detail {

// NAME.cindex = IndexHeader followed by num_blocks BlockRecords, all little-endian.
inline constexpr size_t kIndexHeaderBytes = 24;
inline constexpr size_t kRecordBytes = 32;

struct IndexHeader {
  uint64_t changed = 0;        // changes in the tensor (sum of block counts)
  uint64_t payload_bytes = 0;  // size of NAME.cdata (sum of block sizes)
  uint32_t block_elements = 0; // changes per block (the last block may hold fewer)
  uint32_t num_blocks = 0;
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

void write_header(const IndexHeader& h, uint8_t* out);
IndexHeader read_header(const uint8_t* in);
void write_record(const BlockRecord& r, uint8_t* out);
BlockRecord read_record(const uint8_t* in);

// A defect found while decoding one block; the caller adds the file, tensor and block.
struct BlockError : std::runtime_error {
  explicit BlockError(const std::string& what) : std::runtime_error(what) {}
};

// Encodes `count` >= 1 changes: ascending positions, new and base bits (`width` bytes each).
// Appends the payload to `out` and returns the record (payload_offset = out.size() before).
BlockRecord encode_block(const int64_t* positions, const uint8_t* new_bits, const uint8_t* base_bits,
                         uint32_t count, uint32_t width, std::vector<uint8_t>& out);

// Decodes one block whose payload is `payload` (exactly record.payload_bytes() bytes). `base`
// is the whole base tensor (numel elements of `width` bytes). Writes `record.count` positions,
// new bits and base bits (three distinct buffers). Throws BlockError on any defect (positions
// are checked against numel before the base is read); the outputs are then unspecified.
void decode_block(const BlockRecord& record, std::span<const uint8_t> payload, const uint8_t* base,
                  uint64_t numel, uint32_t width, int64_t* positions, uint8_t* new_bits, uint8_t* base_bits);

}  // namespace deltasync::compact::detail
