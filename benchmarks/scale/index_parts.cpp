#include "scale/index_parts.hpp"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "codec/compact_block_index.hpp"
#include "codec/compact_indexed.hpp"
#include "codec/compact_tiles.hpp"
#include "core/error.hpp"

namespace deltasync::scale_model {
namespace {

namespace ix = compact::indexed;

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Coded positions [begin, end) of the slice inside one tile.
struct Segment {
  uint64_t begin, end;
};

// The slice's coded positions tile by tile, in coded order: Shard(0) holds whole rows [r0, r1)
// of a tensor of two or more dimensions (a 1-D tensor has one tile).
std::vector<Segment> segments(const compact::TileGeometry& g, uint64_t first, uint64_t end) {
  std::vector<Segment> out;
  if (g.bands == 1 && g.stripes == 1) return {{first, end}};
  const uint64_t r0 = first / g.cols, r1 = (end + g.cols - 1) / g.cols, w = g.band_width(), h = g.stripe_rows();
  for (uint64_t k = 0; k < g.bands; ++k)
    for (uint64_t s = 0; s < g.stripes; ++s) {
      const uint64_t a = std::max(r0, s * h), b = std::min(r1, (s + 1) * h);
      if (a < b) out.push_back({k * g.band_elements() + a * w, k * g.band_elements() + b * w});
    }
  return out;
}

}  // namespace

IndexPart index_part(const compact::TensorTable& table, std::span<const ShardTensor> tensors, uint64_t rank, double changed,
                     double bytes_per_change, const compact::Options& options) {
  std::vector<ix::EntryInput> entries;
  std::vector<std::vector<uint8_t>> indexes;  // the entries' block indexes (entries point into them)
  std::unordered_map<uint64_t, ix::Hash> zero_hash;  // by payload size
  std::vector<uint8_t> zeros;
  auto hash_of_zeros = [&](uint64_t n) {
    auto it = zero_hash.find(n);
    if (it != zero_hash.end()) return it->second;
    zeros.resize(std::max<uint64_t>(zeros.size(), n), 0);
    return zero_hash.emplace(n, ix::hash_of(std::span<const uint8_t>(zeros).first(n))).first->second;
  };
  IndexPart out;
  uint64_t total_elements = 0, payload = 0;
  for (const ShardTensor& st : tensors) {
    total_elements += st.full.numel();
    const Placement& p = st.placement;
    if (p.empty()) continue;
    const uint32_t ordinal = *table.ordinal(st.full.name);
    // The slice's changes at `changed`, the fraction rounded up for a hash's share of the slices.
    const double expected = static_cast<double>(p.numel()) * changed;
    uint64_t c = static_cast<uint64_t>(expected);
    if (static_cast<double>(mix(ordinal * 0x100000001b3ull ^ rank) >> 11) / 9007199254740992.0 < expected - static_cast<double>(c)) ++c;
    if (c == 0) continue;
    compact::BlockRecords records;
    records.index_version = options.index_version();
    records.block_elements = options.block_elements;
    records.changed = c;
    records.tiles = options.index_version() == compact::kIndexVersion1 ? compact::tensor_geometry(st.full.shape)
                                                                        : compact::choose_tiles(st.full.shape, c, options.block_elements, options.max_tiles);
    const std::vector<Segment> segs = segments(records.tiles, p.first, p.first + (p.run_count - 1) * p.run_stride + p.run_length);
    uint64_t span = 0;
    for (const Segment& s : segs) span += s.end - s.begin;
    uint64_t given = 0, offset = 0;
    std::vector<ix::Hash> hashes;
    for (size_t i = 0; i < segs.size(); ++i) {
      const uint64_t length = segs[i].end - segs[i].begin;
      const uint64_t share = i + 1 == segs.size() ? c - given : c * length / span;
      given += share;
      const uint64_t blocks = (share + options.block_elements - 1) / options.block_elements;
      for (uint64_t b = 0; b < blocks; ++b) {
        const uint32_t count = static_cast<uint32_t>(std::min<uint64_t>(options.block_elements, share - b * options.block_elements));
        const auto bytes = static_cast<uint32_t>(std::max<double>(1, std::llround(count * bytes_per_change)));
        records.blocks.push_back(compact::BlockRecord{segs[i].begin + b * length / blocks, offset, count, bytes, 0, 0});
        hashes.push_back(hash_of_zeros(bytes));
        offset += bytes;
      }
    }
    indexes.push_back(compact::write_block_index(records));
    const uint64_t base = mix(ordinal ^ (rank << 32));
    entries.push_back(ix::EntryInput{ordinal, {}, std::move(hashes), offset, base, base + mix(base) % 1000});
    out.changes += c;
    payload += offset;
  }
  // Ascending ordinals (the rank's table is in model order).
  std::vector<size_t> order(entries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return entries[a].ordinal < entries[b].ordinal; });
  std::vector<ix::EntryInput> sorted;
  sorted.reserve(entries.size());
  for (const size_t i : order) {
    sorted.push_back(std::move(entries[i]));
    sorted.back().block_index = indexes[i];
  }
  const double sparsity = 1.0 - static_cast<double>(out.changes) / static_cast<double>(std::max<uint64_t>(1, total_elements));
  const st::Metadata metadata{{"sparse", "True"},
                              {"format", "compact"},
                              {"compact_version", std::to_string(options.version)},
                              {"compact_block_elements", std::to_string(options.block_elements)},
                              {"compact_index_version", std::to_string(options.index_version())},
                              {"model_version", "2"},
                              {"base_version", "1"},
                              {"digest_algorithm", "sum-mix64-v1"},
                              {"total_elements", std::to_string(total_elements)},
                              {"total_changed_elements", std::to_string(out.changes)},
                              {"sparsity", std::to_string(sparsity)}};
  const ix::Head head = ix::build_head(sorted, table, metadata, "rank " + std::to_string(rank) + "'s part");
  out.head = head.bytes();
  out.size = out.head.size() + payload;
  out.records = sorted.size();
  return out;
}

}  // namespace deltasync::scale_model
