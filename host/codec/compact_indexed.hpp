// The compact indexed layout (metadata compact_layout "2"; docs/compact-format.md is the byte-level
// specification): the encoded tensors of a compact delta in five fixed U8 entries instead of a
// NAME.cindex / NAME.cdata pair per tensor, so that the JSON header stays the same size whatever
// the number of tensors and a reader that needs a few tensors (a tensor-parallel rank reading a
// delta part of a 70k-tensor model) reads a few fixed-size records by range:
//
//   compact.present   one bit per tensor of the model's table (codec/compact_table.hpp, tensors
//                     sorted by name), set when the delta has a record for it
//   compact.pages     the SHA-256/128 of every page of 64 records
//   compact.records   one 56-byte record per set bit, in ordinal order: where the tensor's block
//                     index entry and payload are, its base and result digests (a part's
//                     partials), the SHA-256/128 of its entry
//   compact.index     per record, its entry: the block index (as NAME.cindex) followed by the
//                     SHA-256/128 of every block's payload
//   compact.payload   per record, its blocks' payloads back to back (as NAME.cdata)
//
// Verification is a chain that a ranged reader follows only as far as it reads: the manifest's
// header_sha256 vouches for the header, the header's compact_present_sha256 / compact_pages_sha256
// for the bitmap and the page hashes, a page hash for its 64 records, a record for its entry, an
// entry for each block. A whole-object reader has the object's SHA-256 and checks the structure
// only (read_file below); the hashes are the ranged reader's (sync/ranged_fetch.cpp).
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "codec/compact_block_index.hpp"
#include "codec/compact_format.hpp"
#include "codec/compact_table.hpp"
#include "format/delta_file.hpp"
#include "format/safetensors.hpp"

namespace deltasync::compact::indexed {

inline constexpr std::string_view kLayoutKey = "compact_layout";
inline constexpr std::string_view kTableTensorsKey = "compact_table_tensors";
inline constexpr std::string_view kTableSha256Key = "compact_table_sha256";
inline constexpr std::string_view kPresentSha256Key = "compact_present_sha256";
inline constexpr std::string_view kPagesSha256Key = "compact_pages_sha256";

// The five entries, in this order in the data section, which they tile.
inline constexpr std::string_view kPresent = "compact.present";
inline constexpr std::string_view kPages = "compact.pages";
inline constexpr std::string_view kRecords = "compact.records";
inline constexpr std::string_view kIndex = "compact.index";
inline constexpr std::string_view kPayload = "compact.payload";

inline constexpr size_t kHashBytes = 16;  // SHA-256 truncated to 128 bits
using Hash = std::array<uint8_t, kHashBytes>;
Hash hash_of(std::span<const uint8_t> bytes);

inline constexpr size_t kRecordBytes = 56;
inline constexpr uint64_t kRecordsPerPage = 64;
inline constexpr uint64_t page_count(uint64_t records) { return (records + kRecordsPerPage - 1) / kRecordsPerPage; }

// One record, little-endian: u32 ordinal, u32 index_bytes, u64 index_offset, u64 payload_offset,
// u64 base_digest, u64 result_digest, 16 bytes index_sha.
struct Record {
  uint32_t ordinal = 0;
  uint32_t index_bytes = 0;      // the entry's size; 0: none of the tensor's changes are in this file
  uint64_t index_offset = 0;     // inside compact.index
  uint64_t payload_offset = 0;   // inside compact.payload (the entry's header says how many bytes)
  uint64_t base_digest = 0;      // 0 unless the file records digests (metadata digest_algorithm)
  uint64_t result_digest = 0;
  Hash index_sha{};              // of the entry's bytes (zeros without an entry)
};
void write_record(const Record& r, uint8_t* out);
Record read_record(const uint8_t* in);

// One tensor as a writer lays it out (ascending ordinals).
struct EntryInput {
  uint32_t ordinal = 0;
  std::span<const uint8_t> block_index;  // the tensor's NAME.cindex bytes; empty: no changes here
  std::vector<Hash> block_hashes;        // hash_of each block's payload, one per block
  uint64_t payload_bytes = 0;            // its payloads' size (the block index says the same)
  uint64_t base_digest = 0, result_digest = 0;
};

// Everything of an indexed file but its payloads: the metadata (`metadata` given plus the
// layout's own keys: compact_layout, the table's size and SHA-256, the bitmap's and the page
// hashes' SHA-256), the bitmap, the page hashes, the records and the entries. The payloads follow
// in `entries` order. Throws BadInputError naming `label` for ordinals out of order or outside
// the table, or a hash count that differs from a block index's blocks.
struct Head {
  st::Metadata metadata;
  std::vector<uint8_t> present, pages, records, index;
  uint64_t payload_bytes = 0;
  // The five entries as the safetensors header lists them (compact.payload payload_bytes long).
  std::vector<TensorMeta> entries() const;
  // The file's bytes up to where compact.payload starts: length, header, the first four entries.
  std::vector<uint8_t> bytes() const;
};
Head build_head(std::span<const EntryInput> entries, const TensorTable& table, st::Metadata metadata, const std::string& label);

// True when the metadata says compact_layout 2; 1 when absent; any other value is refused.
uint32_t read_layout_version(const st::Metadata& metadata, const std::string& label);

// Where the five entries lie in the data section and what the header promises of them, checked
// (names, U8 1-D, order, sizes consistent with the table size and the record count, hex keys).
struct Layout {
  uint64_t table_tensors = 0;
  std::string table_sha256, present_sha256, pages_sha256;  // lowercase hex
  bool has_digests = false;  // metadata digest_algorithm: the records carry digests
  st::TensorInfo present, pages, records, index, payload;  // begin/end in the data section
  uint64_t record_count() const { return records.nbytes() / kRecordBytes; }
  // compact.records bytes of page p (whole records).
  uint64_t page_begin(uint64_t p) const { return records.begin + p * kRecordsPerPage * kRecordBytes; }
  uint64_t page_end(uint64_t p) const;
};
Layout read_layout(std::span<const st::TensorInfo> tensors, const st::Metadata& metadata, uint64_t data_bytes, const std::string& label);
// Refuses a file whose table is not `table`: "LABEL: written for another tensor table ...".
void check_table(const Layout& layout, const TensorTable& table, const std::string& label);

// The bitmap: which ordinals have records, and which record each one is (rank by popcount).
class Presence {
 public:
  // Checks the size (one bit per table tensor, whole bytes) and that the padding bits are 0.
  Presence(std::span<const uint8_t> bitmap, uint64_t table_tensors, const std::string& label);
  bool has(uint32_t ordinal) const { return (bitmap_[ordinal / 8] >> (ordinal % 8)) & 1; }
  uint64_t record_of(uint32_t ordinal) const;  // for an ordinal that has one
  uint64_t count() const { return before_.back(); }

 private:
  std::span<const uint8_t> bitmap_;
  std::vector<uint64_t> before_;  // set bits before each 64-bit word (+ the total)
};

// An entry split into its block index (checked against the tensor's shape) and block hashes.
struct Entry {
  BlockRecords records;
  std::span<const uint8_t> block_index;
  std::vector<Hash> block_hashes;
};
Entry read_entry(std::span<const uint8_t> entry, std::span<const uint64_t> shape, uint32_t index_version, const std::string& where);

// A whole indexed file read for a decoder: every structural rule of the layout checked (the table,
// the bitmap against the records' ordinals, entries and payloads tiling their sections in record
// order, each entry's size against its block count; the block indexes themselves are checked by
// the decoder's parse_block_index), the hashes not (the object's SHA-256 covers a whole read).
// `tensors[k]` views the file and `table` (names); records without an entry have none.
struct Contents {
  std::vector<EncodedTensorView> tensors;
  std::optional<std::vector<TensorDigests>> digests;  // every record's, when the file has digests
  uint64_t changed = 0;
};
Contents read_file(const st::File& file, const TensorTable& table, uint32_t version, uint32_t index_version);

}  // namespace deltasync::compact::indexed
