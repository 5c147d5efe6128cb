// Private to the compact codec: the coder of one block.
// Kept apart from the container code so that a GPU twin can mirror it function by function.
#pragma once
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "codec/compact_block_index.hpp"

namespace deltasync::compact::detail {

// The block index's layout is public (codec/compact_block_index.hpp).
using compact::BlockRecord;
using compact::IndexHeader;

// A defect found while decoding one block; the caller adds the file, tensor and block.
struct BlockError : std::runtime_error {
  explicit BlockError(const std::string& what) : std::runtime_error(what) {}
};

// Encodes `count` >= 1 changes: ascending positions, new and base bits (`width` bytes each), in
// compact_version `version` (1 or 2). Appends the payload to `out` and returns the record
// (payload_offset = out.size() before).
BlockRecord encode_block(const int64_t* positions, const uint8_t* new_bits, const uint8_t* base_bits,
                         uint32_t count, uint32_t width, uint32_t version, std::vector<uint8_t>& out);

// Decodes one block of compact_version `version` whose payload is `payload` (exactly
// record.payload_bytes() bytes). `base` is the whole base tensor (numel elements of `width`
// bytes), or nullptr: decoded against zeros (base bits 0; the values to be rebased later).
// Writes `record.count` positions, new bits and base bits (three distinct buffers; without a
// base, `base_bits` may be nullptr: no base bits wanted, none written). Throws
// BlockError on any defect (positions are checked against numel before the base is read); the
// outputs are then unspecified.
void decode_block(const BlockRecord& record, std::span<const uint8_t> payload, const uint8_t* base,
                  uint64_t numel, uint32_t width, uint32_t version, int64_t* positions, uint8_t* new_bits,
                  uint8_t* base_bits);

}  // namespace deltasync::compact::detail
