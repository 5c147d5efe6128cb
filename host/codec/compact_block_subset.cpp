#include "codec/compact_block_subset.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace deltasync::compact {

std::vector<ElementSpan> merge_spans(std::vector<ElementSpan> spans) {
  std::erase_if(spans, [](const ElementSpan& s) { return s.end <= s.begin; });
  std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  std::vector<ElementSpan> out;
  for (const auto& s : spans) {
    if (!out.empty() && s.begin <= out.back().end)
      out.back().end = std::max(out.back().end, s.end);
    else
      out.push_back(s);
  }
  return out;
}

std::vector<ElementSpan> coded_spans(const TileGeometry& g, std::span<const ElementSpan> flat) {
  if (g.bands == 1) return {flat.begin(), flat.end()};
  const uint64_t w = g.band_width();
  std::vector<ElementSpan> out;
  // Columns [c0, c1) of row r, band by band.
  const auto part_row = [&](uint64_t r, uint64_t c0, uint64_t c1) {
    for (uint64_t k = c0 / w; k < g.bands && k * w < c1; ++k) {
      const uint64_t lo = std::max(c0, k * w), hi = std::min(c1, (k + 1) * w);
      out.push_back({k * g.band_elements() + r * w + lo - k * w, k * g.band_elements() + r * w + hi - k * w});
    }
  };
  for (const ElementSpan& s : flat) {
    if (s.end <= s.begin) continue;
    uint64_t r0 = s.begin / g.cols, r1 = s.end / g.cols;  // rows of the first and one-past-the-last element
    const uint64_t c0 = s.begin % g.cols, c1 = s.end % g.cols;
    if (r0 == r1) {  // inside one row
      part_row(r0, c0, c1);
      continue;
    }
    if (c0 != 0) part_row(r0++, c0, g.cols);
    if (r0 < r1)  // whole rows [r0, r1): one range per band
      for (uint64_t k = 0; k < g.bands; ++k) out.push_back({k * g.band_elements() + r0 * w, k * g.band_elements() + r1 * w});
    if (c1 != 0) part_row(r1, 0, c1);
  }
  return merge_spans(std::move(out));
}

std::vector<uint32_t> blocks_overlapping(const BlockRecords& records, std::span<const ElementSpan> needed) {
  const std::vector<ElementSpan> coded = coded_spans(records.tiles, needed);
  const std::span<const BlockRecord> blocks = records.blocks;
  const uint64_t numel = records.numel();
  std::vector<uint32_t> out;
  size_t s = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const uint64_t begin = blocks[b].first_position;
    uint64_t end = b + 1 < blocks.size() ? blocks[b + 1].first_position : numel;
    if (records.tiles.tiles() > 1) end = std::min(end, records.tiles.tile_end(records.tiles.tile_of(begin)));
    while (s < coded.size() && coded[s].end <= begin) ++s;  // spans wholly before this block
    if (s == coded.size()) break;
    if (coded[s].begin < end) out.push_back(static_cast<uint32_t>(b));
  }
  return out;
}

BlockSubset build_block_subset(const BlockRecords& records, std::span<const uint32_t> chosen,
                               std::span<const std::span<const uint8_t>> payloads, const std::string& where) {
  if (chosen.empty() || chosen.size() != payloads.size())
    throw BadInputError(where + ": " + std::to_string(chosen.size()) + " blocks chosen for " + std::to_string(payloads.size()) +
                        " payloads");
  BlockSubset out;
  BlockRecords kept = records;
  kept.blocks.clear();
  kept.blocks.reserve(chosen.size());
  for (size_t k = 0; k < chosen.size(); ++k) {
    if (chosen[k] >= records.blocks.size() || (k > 0 && chosen[k] <= chosen[k - 1]))
      throw BadInputError(where + ": block " + std::to_string(chosen[k]) + " chosen out of order or not in the index");
    BlockRecord r = records.blocks[chosen[k]];
    if (payloads[k].size() != r.payload_bytes())
      throw BadInputError(where + ": block " + std::to_string(chosen[k]) + ": payload has " + std::to_string(payloads[k].size()) +
                          " bytes, its record says " + std::to_string(r.payload_bytes()));
    r.payload_offset = out.payload.size();  // rebased: the kept blocks tile the new payload
    out.payload.insert(out.payload.end(), payloads[k].begin(), payloads[k].end());
    out.changed += r.count;
    kept.blocks.push_back(r);
  }
  out.block_index = write_block_index(kept);
  const uint64_t shape[] = {records.tiles.rows, records.tiles.cols};
  // What every decoder checks, checked here too.
  (void)parse_block_index(out.block_index, out.payload, 0, shape, records.index_version, where);
  return out;
}

}  // namespace deltasync::compact
