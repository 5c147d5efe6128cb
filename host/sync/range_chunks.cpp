#include "sync/range_chunks.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "codec/compact_codec.hpp"
#include "core/error.hpp"

namespace deltasync::ranged {
namespace {

// Block boundaries of a compact tensor's payload to cut at, as offsets inside NAME.cdata (the
// payload's end not included); nothing when its index does not parse against its shape.
std::optional<std::vector<uint64_t>> block_cuts(const st::File& file, std::string_view name, const st::TensorInfo& data,
                                                const nlohmann::json& shapes, uint64_t target) {
  const st::TensorInfo* index = file.find(std::string(name) + std::string(compact::kIndexSuffix));
  if (!index || !shapes.is_object()) return std::nullopt;
  const auto shape = shapes.find(name);
  if (shape == shapes.end() || !shape->is_object() || !shape->contains("shape") || !(*shape)["shape"].is_array()) return std::nullopt;
  std::vector<uint64_t> dims;
  for (const auto& d : (*shape)["shape"]) {
    if (!d.is_number_unsigned()) return std::nullopt;
    dims.push_back(d.get<uint64_t>());
  }
  compact::BlockRecords records;
  try {
    records = compact::read_block_records(file.bytes(*index), data.nbytes(), dims,
                                          compact::read_index_version(file.metadata(), file.label()), file.label());
  } catch (const Error&) {
    return std::nullopt;  // sealed all the same; its readers refuse it
  }
  std::vector<uint64_t> cuts;
  uint64_t chunk_begin = 0;
  uint64_t tile = records.tiles.tile_of(records.blocks[0].first_position);
  for (const compact::BlockRecord& b : records.blocks) {
    const uint64_t b_tile = records.tiles.tile_of(b.first_position);
    const bool new_tile = b_tile != tile;
    if (b.payload_offset > chunk_begin && (new_tile || b.payload_offset + b.payload_bytes() - chunk_begin > target)) {
      cuts.push_back(b.payload_offset);
      chunk_begin = b.payload_offset;
    }
    tile = b_tile;
  }
  return cuts;
}

}  // namespace

std::vector<uint64_t> chunk_ends(const st::File& file, uint64_t data_bytes, uint64_t target) {
  const st::Metadata& md = file.metadata();
  const auto format = md.find("format");
  const bool compact_file = format != md.end() && format->second == "compact";
  nlohmann::json shapes;
  if (const auto it = md.find("tensor_shapes"); compact_file && it != md.end()) shapes = nlohmann::json::parse(it->second, nullptr, false);

  std::vector<const st::TensorInfo*> entries;
  for (const st::TensorInfo& t : file.tensors()) entries.push_back(&t);
  std::sort(entries.begin(), entries.end(), [](const auto* a, const auto* b) { return a->begin < b->begin; });
  std::vector<uint64_t> ends;
  uint64_t at = 0;  // where the next chunk begins
  const auto cut = [&](uint64_t offset) {
    if (offset > at) ends.push_back(offset);
    at = std::max(at, offset);
  };
  for (const st::TensorInfo* t : entries) {
    cut(t->begin);
    std::optional<std::vector<uint64_t>> inside;
    if (compact_file && t->name.ends_with(compact::kDataSuffix))
      inside = block_cuts(file, std::string_view(t->name).substr(0, t->name.size() - compact::kDataSuffix.size()), *t, shapes, target);
    if (inside) {
      for (const uint64_t c : *inside) cut(t->begin + c);
    } else {
      for (uint64_t c = t->begin + target; c < t->end; c += target) cut(c);
    }
    cut(t->end);
  }
  cut(data_bytes);  // bytes after the last entry, if a writer left any
  return ends;
}

}  // namespace deltasync::ranged
