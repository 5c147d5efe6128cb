// The compact indexed layout: writer, strict structural reader and the pieces a ranged reader
// verifies one by one (compact_indexed.hpp; docs/compact-format.md).
#include "codec/compact_indexed.hpp"

#include <bit>

#include "core/error.hpp"
#include "core/little_endian.hpp"
#include "core/parse_number.hpp"
#include "format/sha256.hpp"

namespace deltasync::compact::indexed {

using ::deltasync::detail::load_le;
using ::deltasync::detail::store_le;

namespace {

constexpr std::string_view kNames[] = {kPresent, kPages, kRecords, kIndex, kPayload};

bool is_sha256_hex(std::string_view s) {
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

std::string metadata_hex(const st::Metadata& md, std::string_view key, const std::string& label) {
  const auto it = md.find(std::string(key));
  if (it == md.end()) throw BadInputError(label + ": compact_layout 2 without metadata " + std::string(key));
  if (!is_sha256_hex(it->second)) throw BadInputError(label + ": metadata " + std::string(key) + " is not 64 lowercase hex digits");
  return it->second;
}

}  // namespace

Hash hash_of(std::span<const uint8_t> bytes) {
  const auto full = sha256(bytes);
  Hash out;
  std::copy(full.begin(), full.begin() + kHashBytes, out.begin());
  return out;
}

void write_record(const Record& r, uint8_t* out) {
  store_le(out, r.ordinal);
  store_le(out + 4, r.index_bytes);
  store_le(out + 8, r.index_offset);
  store_le(out + 16, r.payload_offset);
  store_le(out + 24, r.base_digest);
  store_le(out + 32, r.result_digest);
  std::copy(r.index_sha.begin(), r.index_sha.end(), out + 40);
}

Record read_record(const uint8_t* in) {
  Record r{load_le<uint32_t>(in),      load_le<uint32_t>(in + 4),  load_le<uint64_t>(in + 8), load_le<uint64_t>(in + 16),
           load_le<uint64_t>(in + 24), load_le<uint64_t>(in + 32), {}};
  std::copy(in + 40, in + 40 + kHashBytes, r.index_sha.begin());
  return r;
}

Head build_head(std::span<const EntryInput> entries, const TensorTable& table, st::Metadata metadata, const std::string& label) {
  const uint64_t T = table.size();
  Head out;
  out.present.assign((T + 7) / 8, 0);
  out.records.resize(entries.size() * kRecordBytes);
  std::vector<uint8_t>& index = out.index;
  for (size_t k = 0; k < entries.size(); ++k) {
    const EntryInput& e = entries[k];
    if (e.ordinal >= T || (k > 0 && e.ordinal <= entries[k - 1].ordinal))
      throw BadInputError(label + ": record " + std::to_string(k) + " has ordinal " + std::to_string(e.ordinal) +
                          " (ordinals ascend inside a table of " + std::to_string(T) + ")");
    out.present[e.ordinal / 8] |= static_cast<uint8_t>(1u << (e.ordinal % 8));
    Record r;
    r.ordinal = e.ordinal;
    r.index_offset = index.size();
    r.payload_offset = out.payload_bytes;
    r.base_digest = e.base_digest;
    r.result_digest = e.result_digest;
    if (!e.block_index.empty()) {
      // Both index versions start with version 1's header, which holds the block count.
      const uint64_t blocks = e.block_index.size() >= kIndexHeaderBytes ? read_header(e.block_index.data(), kIndexVersion1).num_blocks : 0;
      if (blocks != e.block_hashes.size())
        throw BadInputError(label + ": tensor " + table.at(e.ordinal).name + ": " + std::to_string(e.block_hashes.size()) +
                            " block hashes for " + std::to_string(blocks) + " blocks");
      const size_t at = index.size();
      index.insert(index.end(), e.block_index.begin(), e.block_index.end());
      for (const Hash& h : e.block_hashes) index.insert(index.end(), h.begin(), h.end());
      const uint64_t bytes = index.size() - at;
      if (bytes > UINT32_MAX) throw BadInputError(label + ": tensor " + table.at(e.ordinal).name + ": block index over 4 GiB");
      r.index_bytes = static_cast<uint32_t>(bytes);
      r.index_sha = hash_of(std::span(index).subspan(at));
      out.payload_bytes += e.payload_bytes;
    }
    write_record(r, out.records.data() + k * kRecordBytes);
  }
  out.pages.reserve(page_count(entries.size()) * kHashBytes);
  for (uint64_t p = 0; p < page_count(entries.size()); ++p) {
    const uint64_t begin = p * kRecordsPerPage * kRecordBytes;
    const uint64_t end = std::min<uint64_t>(out.records.size(), begin + kRecordsPerPage * kRecordBytes);
    const Hash h = hash_of(std::span(out.records).subspan(begin, end - begin));
    out.pages.insert(out.pages.end(), h.begin(), h.end());
  }
  metadata[std::string(kLayoutKey)] = std::to_string(kLayout2);
  metadata[std::string(kTableTensorsKey)] = std::to_string(T);
  metadata[std::string(kTableSha256Key)] = table.sha256_hex();
  metadata[std::string(kPresentSha256Key)] = sha256_hex(out.present);
  metadata[std::string(kPagesSha256Key)] = sha256_hex(out.pages);
  out.metadata = std::move(metadata);
  return out;
}

std::vector<TensorMeta> Head::entries() const {
  return {{std::string(kPresent), DType::U8, {present.size()}},
          {std::string(kPages), DType::U8, {pages.size()}},
          {std::string(kRecords), DType::U8, {records.size()}},
          {std::string(kIndex), DType::U8, {index.size()}},
          {std::string(kPayload), DType::U8, {payload_bytes}}};
}

std::vector<uint8_t> Head::bytes() const {
  const std::string header = st::header_of(entries(), metadata);
  std::vector<uint8_t> out;
  out.reserve(header.size() + present.size() + pages.size() + records.size() + index.size());
  out.insert(out.end(), header.begin(), header.end());
  for (const auto* part : {&present, &pages, &records, &index}) out.insert(out.end(), part->begin(), part->end());
  return out;
}

uint32_t read_layout_version(const st::Metadata& md, const std::string& label) {
  const auto it = md.find(std::string(kLayoutKey));
  if (it == md.end()) return kLayout1;
  if (it->second == std::to_string(kLayout1)) return kLayout1;
  if (it->second == std::to_string(kLayout2)) return kLayout2;
  throw BadInputError(label + ": unsupported compact_layout '" + it->second + "' (this build reads 1 and 2)");
}

uint64_t Layout::page_end(uint64_t p) const {
  return std::min(records.end, records.begin + (p + 1) * kRecordsPerPage * kRecordBytes);
}

Layout read_layout(std::span<const st::TensorInfo> tensors, const st::Metadata& md, uint64_t data_bytes, const std::string& label) {
  Layout out;
  const auto T = md.find(std::string(kTableTensorsKey));
  if (T == md.end()) throw BadInputError(label + ": compact_layout 2 without metadata " + std::string(kTableTensorsKey));
  out.table_tensors = parse_decimal<uint64_t>(T->second, label + ": metadata " + std::string(kTableTensorsKey));
  if (out.table_tensors > UINT32_MAX) throw BadInputError(label + ": metadata " + std::string(kTableTensorsKey) + " is over 2^32 - 1");
  out.table_sha256 = metadata_hex(md, kTableSha256Key, label);
  out.present_sha256 = metadata_hex(md, kPresentSha256Key, label);
  out.pages_sha256 = metadata_hex(md, kPagesSha256Key, label);
  out.has_digests = md.contains("digest_algorithm");
  if (tensors.size() != std::size(kNames))
    throw BadInputError(label + ": compact_layout 2 holds exactly " + std::to_string(std::size(kNames)) + " tensors, this file " +
                        std::to_string(tensors.size()));
  st::TensorInfo* slots[] = {&out.present, &out.pages, &out.records, &out.index, &out.payload};
  uint64_t at = 0;
  for (size_t k = 0; k < std::size(kNames); ++k) {
    const st::TensorInfo* t = nullptr;
    for (const st::TensorInfo& c : tensors)
      if (c.name == kNames[k]) t = &c;
    if (!t) throw BadInputError(label + ": compact_layout 2 without tensor " + std::string(kNames[k]));
    if (t->dtype != DType::U8 || t->shape.size() != 1 || t->shape[0] != t->nbytes())
      throw BadInputError(label + ": tensor " + t->name + " is not a 1-D U8 tensor");
    if (t->begin != at) throw BadInputError(label + ": tensor " + t->name + " is not where compact_layout 2 puts it");
    at = t->end;
    *slots[k] = *t;
  }
  if (at != data_bytes) throw BadInputError(label + ": compact_layout 2 leaves data after " + std::string(kPayload));
  if (out.present.nbytes() != (out.table_tensors + 7) / 8)
    throw BadInputError(label + ": " + std::string(kPresent) + " has " + std::to_string(out.present.nbytes()) + " bytes for a table of " +
                        std::to_string(out.table_tensors) + " tensors");
  if (out.records.nbytes() % kRecordBytes != 0)
    throw BadInputError(label + ": " + std::string(kRecords) + " is not whole " + std::to_string(kRecordBytes) + "-byte records");
  if (out.pages.nbytes() != page_count(out.record_count()) * kHashBytes)
    throw BadInputError(label + ": " + std::string(kPages) + " has " + std::to_string(out.pages.nbytes()) + " bytes for " +
                        std::to_string(out.record_count()) + " records");
  return out;
}

void check_table(const Layout& layout, const TensorTable& table, const std::string& label) {
  if (layout.table_tensors == table.size() && layout.table_sha256 == table.sha256_hex()) return;
  throw BadInputError(label + ": written for another tensor table (" + std::to_string(layout.table_tensors) + " tensors, sha256 " +
                      layout.table_sha256.substr(0, 16) + "...) than this model's (" + std::to_string(table.size()) +
                      " tensors, sha256 " + table.sha256_hex().substr(0, 16) + "...): names, dtypes or shapes differ");
}

Presence::Presence(std::span<const uint8_t> bitmap, uint64_t table_tensors, const std::string& label) : bitmap_(bitmap) {
  if (bitmap.size() != (table_tensors + 7) / 8)
    throw BadInputError(label + ": presence bitmap has " + std::to_string(bitmap.size()) + " bytes for " + std::to_string(table_tensors) + " tensors");
  if (table_tensors % 8 && (bitmap.back() >> (table_tensors % 8)) != 0)
    throw BadInputError(label + ": presence bitmap sets bits past the table's " + std::to_string(table_tensors) + " tensors");
  before_.reserve(bitmap.size() / 8 + 2);
  uint64_t count = 0;
  for (size_t w = 0; w < bitmap.size(); w += 8) {
    before_.push_back(count);
    uint64_t word = 0;
    for (size_t b = w; b < std::min(bitmap.size(), w + 8); ++b) word |= uint64_t{bitmap[b]} << (8 * (b - w));
    count += static_cast<uint64_t>(std::popcount(word));
  }
  before_.push_back(count);
}

uint64_t Presence::record_of(uint32_t ordinal) const {
  const size_t w = ordinal / 64;
  uint64_t word = 0;
  for (size_t b = w * 8; b < std::min(bitmap_.size(), w * 8 + 8); ++b) word |= uint64_t{bitmap_[b]} << (8 * (b - w * 8));
  const uint64_t below = ordinal % 64 == 0 ? 0 : word & ((uint64_t{1} << (ordinal % 64)) - 1);
  return before_[w] + static_cast<uint64_t>(std::popcount(below));
}

namespace {

// The block index part of an entry, its size checked against the block count its header gives
// (followed by one hash per block).
std::span<const uint8_t> split_entry(std::span<const uint8_t> entry, uint32_t index_version, const std::string& where, IndexHeader& h) {
  const size_t header = index_header_bytes(index_version);
  if (entry.size() < header) throw BadInputError(where + ": block index entry truncated (" + std::to_string(entry.size()) + " bytes)");
  h = read_header(entry.data(), index_version);
  const uint64_t index_bytes = header + uint64_t{h.num_blocks} * compact::kRecordBytes;
  if (entry.size() != index_bytes + uint64_t{h.num_blocks} * kHashBytes)
    throw BadInputError(where + ": block index entry has " + std::to_string(entry.size()) + " bytes for " + std::to_string(h.num_blocks) +
                        " blocks and their hashes");
  return entry.first(index_bytes);
}

}  // namespace

Entry read_entry(std::span<const uint8_t> entry, std::span<const uint64_t> shape, uint32_t index_version, const std::string& where) {
  IndexHeader h;
  Entry out;
  out.block_index = split_entry(entry, index_version, where, h);
  out.records = read_block_records(out.block_index, h.payload_bytes, shape, index_version, where);
  out.block_hashes.resize(h.num_blocks);
  const uint8_t* hashes = entry.data() + out.block_index.size();
  for (uint32_t b = 0; b < h.num_blocks; ++b) std::copy_n(hashes + b * kHashBytes, kHashBytes, out.block_hashes[b].begin());
  return out;
}

Contents read_file(const st::File& file, const TensorTable& table, uint32_t version, uint32_t index_version) {
  const std::string& label = file.label();
  uint64_t data_bytes = 0;
  for (const st::TensorInfo& t : file.tensors()) data_bytes = std::max(data_bytes, t.end);
  const Layout layout = read_layout(file.tensors(), file.metadata(), data_bytes, label);
  check_table(layout, table, label);
  const Presence presence(file.bytes(layout.present), layout.table_tensors, label);
  const uint64_t n = layout.record_count();
  if (presence.count() != n)
    throw BadInputError(label + ": presence bitmap sets " + std::to_string(presence.count()) + " bits for " + std::to_string(n) + " records");
  const std::span<const uint8_t> records = file.bytes(layout.records), index = file.bytes(layout.index), payload = file.bytes(layout.payload);
  Contents out;
  if (layout.has_digests) out.digests.emplace().reserve(n);
  out.tensors.reserve(n);
  uint64_t index_at = 0, payload_at = 0;
  uint32_t ordinal = 0;
  for (uint64_t k = 0; k < n; ++k) {
    const Record r = read_record(records.data() + k * kRecordBytes);
    const std::string where = label + ": record " + std::to_string(k);
    // The k-th set bit of the bitmap is this record's ordinal.
    while (ordinal < layout.table_tensors && !presence.has(ordinal)) ++ordinal;
    if (r.ordinal != ordinal)
      throw BadInputError(where + " has ordinal " + std::to_string(r.ordinal) + ", the presence bitmap's " + std::to_string(k) +
                          "th tensor is " + std::to_string(ordinal));
    const TensorMeta& tensor = table.at(ordinal++);
    const std::string at = label + ": tensor " + tensor.name;
    if (r.index_offset != index_at || r.payload_offset != payload_at)
      throw BadInputError(at + ": its entry or payload is not where the records before it end");
    if (r.index_bytes > index.size() - index_at) throw BadInputError(at + ": its block index entry runs past " + std::string(kIndex));
    if (out.digests) out.digests->push_back(TensorDigests{tensor.name, r.base_digest, r.result_digest});
    if (r.index_bytes == 0) continue;  // its changes were left out of this file (a ranged reader's)
    IndexHeader h;
    const std::span<const uint8_t> block_index = split_entry(index.subspan(index_at, r.index_bytes), index_version, at, h);
    if (h.payload_bytes > payload.size() - payload_at) throw BadInputError(at + ": its payload runs past " + std::string(kPayload));
    out.tensors.push_back(EncodedTensorView{tensor.name, block_index, payload.subspan(payload_at, h.payload_bytes), version, index_version});
    out.changed += h.changed;
    index_at += r.index_bytes;
    payload_at += h.payload_bytes;
  }
  if (index_at != index.size() || payload_at != payload.size())
    throw BadInputError(label + ": " + std::string(index_at != index.size() ? kIndex : kPayload) + " holds bytes no record names");
  return out;
}

}  // namespace deltasync::compact::indexed
