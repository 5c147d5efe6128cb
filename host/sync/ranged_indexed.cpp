// Ranged reads of an indexed compact delta (codec/compact_indexed.hpp), after its header: the
// bitmap and page hashes, the records of the tensors this receiver needs, the block index entries
// of those whose placement meets its elements, the blocks that meet them -- each piece checked
// against its hash from the step before -- and the reduced file of the same layout they make.
#include <algorithm>

#include "codec/compact_block_subset.hpp"
#include "codec/compact_codec.hpp"
#include "codec/compact_indexed.hpp"
#include "core/error.hpp"
#include "format/sha256.hpp"
#include "sync/range_reader.hpp"

namespace deltasync::ranged {

namespace ix = compact::indexed;

void read_indexed(RangeReader& reader, const SealedHeader& header, const NeededRanges& needed, const PartScope& scope,
                  const ReadOptions& options, const std::string& label, RangedDelta& out) {
  if (!options.table) throw Error(label + ": an indexed compact delta is read against the receiver's tensor table, and none was given");
  const compact::TensorTable& table = *options.table;
  const ix::Layout layout = ix::read_layout(header.tensors, header.metadata, header.data_bytes(), label);
  ix::check_table(layout, table, label);
  const uint32_t index_version = compact::read_index_version(header.metadata, label);
  // Object bytes [offset, +length) of entry `t` of the data section.
  auto at = [&](const st::TensorInfo& t, uint64_t offset, uint64_t length) { return ByteRange{header.data_offset + t.begin + offset, length}; };
  auto fetch = [&](std::vector<ByteRange> ranges) { return reader.fetch(merge_gaps(std::move(ranges), options.gap_bytes)); };
  auto corrupt = [&](const std::string& what) { return BadInputError(label + ": " + what + " (corrupt object)"); };

  // 1. The bitmap and the page hashes, right after the header, checked against the header's hashes.
  const ByteRange root = at(layout.present, 0, layout.pages.end - layout.present.begin);
  reader.fetch(std::span(&root, 1));
  // Kept: a view lasts until the next fetch.
  const auto copy = [](std::span<const uint8_t> s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  const std::vector<uint8_t> bitmap = copy(reader.view(at(layout.present, 0, layout.present.nbytes())));
  const std::vector<uint8_t> page_hashes = copy(reader.view(at(layout.pages, 0, layout.pages.nbytes())));
  if (sha256_hex(bitmap) != layout.present_sha256) throw corrupt("presence bitmap sha256 differs from its header's");
  if (sha256_hex(page_hashes) != layout.pages_sha256) throw corrupt("record page hashes' sha256 differs from its header's");
  const ix::Presence presence(bitmap, layout.table_tensors, label);
  if (presence.count() != layout.record_count())
    throw BadInputError(label + ": presence bitmap sets " + std::to_string(presence.count()) + " bits for " +
                        std::to_string(layout.record_count()) + " records");

  // 2. The records of the needed tensors the object has: whole pages, each checked.
  struct Wanted {
    const std::string* name;
    const NeededTensor* need;
    uint32_t ordinal;
    ix::Record record;
    ix::Entry entry;
    std::vector<uint32_t> chosen;
  };
  std::vector<Wanted> wanted;
  std::vector<ByteRange> page_reads;
  std::vector<uint64_t> pages;
  for (const auto& [name, need] : needed) {
    const std::optional<uint32_t> ordinal = table.ordinal(name);
    // A tensor needed without elements still wants its record: its digests.
    if (ordinal && presence.has(*ordinal)) wanted.push_back(Wanted{&name, &need, *ordinal, {}, {}, {}});
  }
  std::sort(wanted.begin(), wanted.end(), [](const Wanted& a, const Wanted& b) { return a.ordinal < b.ordinal; });
  for (const Wanted& w : wanted) {
    const uint64_t page = presence.record_of(w.ordinal) / ix::kRecordsPerPage;
    if (pages.empty() || pages.back() != page) {
      pages.push_back(page);
      page_reads.push_back(at(layout.records, layout.page_begin(page) - layout.records.begin, layout.page_end(page) - layout.page_begin(page)));
    }
  }
  out.index_bytes += fetch(page_reads);
  for (size_t k = 0; k < pages.size(); ++k) {
    const ix::Hash got = ix::hash_of(reader.view(page_reads[k]));
    if (!std::equal(got.begin(), got.end(), page_hashes.begin() + static_cast<std::ptrdiff_t>(pages[k] * ix::kHashBytes)))
      throw corrupt("record page " + std::to_string(pages[k]) + " sha256 differs from its hash");
  }

  // 3. The entries of those whose placement in this part meets the needed elements.
  std::vector<ByteRange> entry_reads;
  std::vector<Wanted*> reading;
  for (Wanted& w : wanted) {
    const uint64_t k = presence.record_of(w.ordinal);
    w.record = ix::read_record(reader.view(at(layout.records, k * ix::kRecordBytes, ix::kRecordBytes)).data());
    if (w.record.ordinal != w.ordinal)
      throw BadInputError(label + ": record " + std::to_string(k) + " has ordinal " + std::to_string(w.record.ordinal) +
                          ", the presence bitmap says " + std::to_string(w.ordinal));
    if (w.record.index_bytes == 0 || w.need->spans.empty()) continue;
    if (scope.placements && !placement_overlaps(scope.placements->placement(*w.name, scope.part), w.need->spans)) continue;
    if (w.record.index_offset > layout.index.nbytes() || w.record.index_bytes > layout.index.nbytes() - w.record.index_offset)
      throw BadInputError(label + ": tensor " + *w.name + ": its block index entry runs past " + std::string(ix::kIndex));
    entry_reads.push_back(at(layout.index, w.record.index_offset, w.record.index_bytes));
    reading.push_back(&w);
  }
  out.index_bytes += fetch(entry_reads);
  std::vector<ByteRange> block_reads;
  for (size_t k = 0; k < reading.size(); ++k) {
    Wanted& w = *reading[k];
    const std::string where = label + ": tensor " + *w.name;
    const std::span<const uint8_t> entry = reader.view(entry_reads[k]);
    if (ix::hash_of(entry) != w.record.index_sha) throw corrupt("tensor " + *w.name + ": block index entry sha256 differs from its record's");
    w.entry = ix::read_entry(entry, table.at(w.ordinal).shape, index_version, where);
    const compact::BlockRecord& last = w.entry.records.blocks.back();
    if (w.record.payload_offset > layout.payload.nbytes() || last.payload_offset + last.payload_bytes() > layout.payload.nbytes() - w.record.payload_offset)
      throw BadInputError(where + ": its payload runs past " + std::string(ix::kPayload));
    w.chosen = compact::blocks_overlapping(w.entry.records, w.need->spans);
    for (const uint32_t b : w.chosen) {
      const compact::BlockRecord& block = w.entry.records.blocks[b];
      block_reads.push_back(at(layout.payload, w.record.payload_offset + block.payload_offset, block.payload_bytes()));
    }
  }

  // 4. The blocks, each checked against its entry's hash.
  out.block_bytes = fetch(block_reads);
  std::vector<compact::BlockSubset> subsets;
  subsets.reserve(reading.size());
  std::vector<ix::EntryInput> entries;
  size_t next_block = 0, next_reading = 0;
  uint64_t changed = 0;
  for (const Wanted& w : wanted) {
    ix::EntryInput in{w.ordinal, {}, {}, 0, w.record.base_digest, w.record.result_digest};
    const bool read = next_reading < reading.size() && reading[next_reading] == &w;
    if (read && !w.chosen.empty()) {
      const std::string where = label + ": tensor " + *w.name;
      std::vector<std::span<const uint8_t>> payloads;
      BlockReads reads{*w.name, w.entry.records, w.chosen, {}};
      for (const uint32_t b : w.chosen) {
        const ByteRange r = block_reads[next_block++];
        payloads.push_back(reader.view(r));
        if (ix::hash_of(payloads.back()) != w.entry.block_hashes[b])
          throw corrupt("tensor " + *w.name + ": block " + std::to_string(b) + " sha256 differs from its entry's");
        in.block_hashes.push_back(w.entry.block_hashes[b]);
        reads.ranges.push_back({r.offset - header.data_offset, r.length});
      }
      subsets.push_back(compact::build_block_subset(w.entry.records, w.chosen, payloads, where));
      in.block_index = subsets.back().block_index;
      in.payload_bytes = subsets.back().payload.size();
      changed += subsets.back().changed;
      out.blocks.push_back(std::move(reads));
    }
    next_reading += read;
    entries.push_back(std::move(in));
  }

  // The reduced file: the records this receiver needs (their digests count even where it read
  // none of the blocks), the chosen blocks' entries and payloads; same table, same metadata but
  // the change count.
  st::Metadata metadata = header.metadata;
  metadata["total_changed_elements"] = std::to_string(changed);
  const ix::Head head = ix::build_head(entries, table, std::move(metadata), label);
  out.file = head.bytes();
  out.file.reserve(out.file.size() + head.payload_bytes);
  for (const compact::BlockSubset& s : subsets) out.file.insert(out.file.end(), s.payload.begin(), s.payload.end());
}

}  // namespace deltasync::ranged
