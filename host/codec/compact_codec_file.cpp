// The compact format inside a safetensors container: NAME.cindex / NAME.cdata U8 tensors plus
// the metadata the interoperable layout has (so `inspect` reads both) and the codec's own keys.
#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>

#include "codec/compact_codec.hpp"
#include "codec/compact_indexed.hpp"
#include "codec/compact_table.hpp"
#include "core/error.hpp"
#include "core/parse_number.hpp"

namespace deltasync::compact {
namespace {

struct Container {
  std::vector<EncodedTensor> encoded;
  std::vector<st::WriteTensor> tensors;
  st::Metadata metadata;
  // Layout 2: the five entries' bytes (the tensors point into them).
  indexed::Head head;
  std::vector<uint8_t> payload;
};

// The indexed layout's entries (compact_indexed.hpp): `tensors` is the whole model, the table
// whose ordinals the records use (a delta part's too: it names only its changed tensors).
void build_indexed(Container& c, std::span<const TensorMeta> tensors, const DeltaInfo& info, uint32_t index_version) {
  const std::string label = "compact delta";
  const TensorTable table(tensors);
  // Digests go into the records: typed (integrity::put_delta_digests), one pair per changed tensor.
  std::unordered_map<std::string_view, const TensorDigests*> digests;
  if (info.digests)
    for (const TensorDigests& d : *info.digests) digests.emplace(d.name, &d);
  if (!info.digests && (c.metadata.contains("base_digests") || c.metadata.contains("result_digests") || c.metadata.contains("digest_algorithm")))
    throw BadInputError(label + ": compact_layout 2 records digests given typed (DeltaInfo::digests), not as metadata JSON");
  c.metadata.erase("base_digests");
  c.metadata.erase("result_digests");
  std::vector<std::pair<uint32_t, const EncodedTensor*>> order;
  for (const EncodedTensor& e : c.encoded) {
    const std::optional<uint32_t> ordinal = table.ordinal(e.name);
    if (!ordinal) throw BadInputError(label + ": encoded tensor " + e.name + " is not in the model");
    order.emplace_back(*ordinal, &e);
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (info.digests && digests.size() != order.size())
    throw BadInputError(label + ": " + std::to_string(digests.size()) + " tensors have digests, " + std::to_string(order.size()) + " changed");
  std::vector<indexed::EntryInput> entries;
  entries.reserve(order.size());
  for (const auto& [ordinal, e] : order) {
    const BlockRecords records =
        read_block_records(e->block_index, e->payload.size(), table.at(ordinal).shape, index_version, label + ": tensor " + e->name);
    indexed::EntryInput in{ordinal, e->block_index, {}, e->payload.size(), 0, 0};
    for (const BlockRecord& b : records.blocks)
      in.block_hashes.push_back(indexed::hash_of(std::span(e->payload).subspan(b.payload_offset, b.payload_bytes())));
    if (info.digests) {
      const auto d = digests.find(e->name);
      if (d == digests.end()) throw BadInputError(label + ": tensor " + e->name + " changes but has no digests");
      in.base_digest = d->second->base;
      in.result_digest = d->second->result;
    }
    entries.push_back(std::move(in));
  }
  c.head = indexed::build_head(entries, table, std::move(c.metadata), label);
  c.payload.reserve(c.head.payload_bytes);
  for (const auto& [ordinal, e] : order) c.payload.insert(c.payload.end(), e->payload.begin(), e->payload.end());
  c.metadata = c.head.metadata;
  const std::span<const uint8_t> bytes[] = {c.head.present, c.head.pages, c.head.records, c.head.index, c.payload};
  const std::vector<TensorMeta> metas = c.head.entries();
  for (size_t k = 0; k < metas.size(); ++k) c.tensors.push_back({metas[k].name, DType::U8, metas[k].shape, bytes[k]});
}

Container build(std::span<const TensorMeta> tensors, const DeltaView& delta, const DeltaInfo& info,
                const Options& options, std::vector<EncodedTensor> encoded) {
  Container c;
  c.encoded = std::move(encoded);
  // The file records one compact_version: every tensor must have been coded in it (the GPU
  // encoder writes version 1 only; a mix would be misread).
  uint32_t version = options.version;
  if (!c.encoded.empty()) version = c.encoded.front().version;
  for (const EncodedTensor& e : c.encoded)
    if (e.version != version)
      throw BadInputError("compact delta: tensor " + e.name + " is coded in compact_version " + std::to_string(e.version) +
                          ", tensor " + c.encoded.front().name + " in " + std::to_string(version));
  if (!is_known_version(version)) throw BadInputError("compact delta: unknown compact_version " + std::to_string(version));
  if (!is_known_layout(options.layout)) throw BadInputError("compact delta: unknown compact_layout " + std::to_string(options.layout));
  // Likewise one compact_index_version (every writer's follows its options; see Options).
  const uint32_t index_version = c.encoded.empty() ? options.index_version() : c.encoded.front().index_version;
  for (const EncodedTensor& e : c.encoded)
    if (e.index_version != index_version)
      throw BadInputError("compact delta: tensor " + e.name + " has a block index of compact_index_version " +
                          std::to_string(e.index_version) + ", tensor " + c.encoded.front().name + " of " + std::to_string(index_version));
  // The metadata of every delta layout, plus the codec's own keys; the indexed layout numbers the
  // tensors instead of naming them.
  const bool indexed = options.layout == kLayout2;
  c.metadata = delta_metadata("compact delta", tensors, delta, info, "compact", indexed ? TensorNames::kNumbered : TensorNames::kListed);
  c.metadata["compact_version"] = std::to_string(version);
  c.metadata["compact_block_elements"] = std::to_string(options.block_elements);
  // Absent means 1: files without tiles stay byte for byte what they were.
  if (index_version != kIndexVersion1) c.metadata[std::string(kIndexVersionKey)] = std::to_string(index_version);
  if (indexed) {
    build_indexed(c, tensors, info, index_version);
    return c;
  }
  for (const EncodedTensor& e : c.encoded) {
    c.tensors.push_back({e.name + std::string(kIndexSuffix), DType::U8, {e.block_index.size()}, e.block_index});
    c.tensors.push_back({e.name + std::string(kDataSuffix), DType::U8, {e.payload.size()}, e.payload});
  }
  return c;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

std::vector<uint8_t> serialize_compact_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                             const DeltaInfo& info, const Options& options) {
  const Container c = build(tensors, delta, info, options, encode(tensors, delta, options));
  return st::serialize(c.tensors, c.metadata);
}

void write_compact_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const DeltaInfo& info, const Options& options) {
  write_compact_delta(path, tensors, delta, info, encode(tensors, delta, options), options);
}

namespace {

// The metadata comes from `delta`, the tensors from `encoded`: a file whose two halves disagree
// would be refused only by its readers, so refuse to write it. encode() produces one tensor per
// changed tensor, in model order.
void check_encoded_match(const std::string& label, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const std::vector<EncodedTensor>& encoded) {
  if (delta.num_tensors() != tensors.size())
    throw BadInputError(label + ": delta has " + std::to_string(delta.num_tensors()) + " tensors, model has " +
                std::to_string(tensors.size()));
  size_t next = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (delta.count(t) == 0) continue;
    if (next == encoded.size() || encoded[next].name != tensors[t].name || encoded[next].changed != delta.count(t))
      throw BadInputError(label + ": tensor " + tensors[t].name + ": the encoded tensors do not match the delta's " +
                  std::to_string(delta.count(t)) + " changes");
    ++next;
  }
  if (next != encoded.size())
    throw BadInputError(label + ": encoded tensor " + encoded[next].name + " has no changes in the delta");
}

}  // namespace

void write_compact_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const DeltaInfo& info, std::vector<EncodedTensor> encoded, const Options& options) {
  check_encoded_match(path, tensors, delta, encoded);
  const Container c = build(tensors, delta, info, options, std::move(encoded));
  st::write_file(path, c.tensors, c.metadata);
}

std::vector<uint8_t> serialize_compact_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                             const DeltaInfo& info, std::vector<EncodedTensor> encoded,
                                             const Options& options) {
  check_encoded_match("compact delta", tensors, delta, encoded);
  const Container c = build(tensors, delta, info, options, std::move(encoded));
  return st::serialize(c.tensors, c.metadata);
}

bool is_compact_delta(const st::File& file) {
  const auto it = file.metadata().find("format");
  return it != file.metadata().end() && it->second == "compact";
}

uint32_t read_index_version(const st::Metadata& md, const std::string& label) {
  const auto it = md.find(std::string(kIndexVersionKey));
  if (it == md.end()) return kIndexVersion1;
  if (it->second == std::to_string(kIndexVersion1)) return kIndexVersion1;
  if (it->second == std::to_string(kIndexVersion2)) return kIndexVersion2;
  throw BadInputError(label + ": unsupported " + std::string(kIndexVersionKey) + " '" + it->second + "' (this build reads " +
                      std::to_string(kIndexVersion1) + " and " + std::to_string(kIndexVersion2) + ")");
}

CompactFile read_compact_file(const st::File& file, std::span<const TensorMeta> base_meta) {
  CompactFile out;
  const std::string& label = file.label();
  const st::Metadata& md = file.metadata();
  if (!is_compact_delta(file)) throw BadInputError(label + ": not a compact delta (metadata format is not \"compact\")");
  const auto version = md.find("compact_version");
  const std::string version_text = version == md.end() ? "" : version->second;
  uint32_t file_version = 0;
  if (version_text == std::to_string(kFormatVersion1)) file_version = kFormatVersion1;
  if (version_text == std::to_string(kFormatVersion2)) file_version = kFormatVersion2;
  if (file_version == 0)
    throw BadInputError(label + ": unsupported compact_version '" + version_text + "' (this build reads " +
                        std::to_string(kFormatVersion1) + " and " + std::to_string(kFormatVersion2) + ")");

  const uint32_t index_version = read_index_version(md, label);
  out.info = delta_info(md, label);
  if (indexed::read_layout_version(md, label) == kLayout2) {
    // Tensors by ordinal in the model's table; the table's hash stands for the recorded shapes.
    out.table = TensorTable::of(base_meta);
    indexed::Contents contents = indexed::read_file(file, *out.table, file_version, index_version);
    out.tensors = std::move(contents.tensors);
    out.info.digests = std::move(contents.digests);
    return out;
  }

  // Pair NAME.cindex with NAME.cdata, in file order of the index tensors. Names are views of
  // the index tensors' names, so they live as long as the file.
  std::vector<EncodedTensorView>& views = out.tensors;
  for (const st::TensorInfo& t : file.tensors()) {
    if (t.dtype != DType::U8 || t.shape.size() != 1)
      throw BadInputError(label + ": tensor " + t.name + " is not a 1-D U8 tensor");
    if (ends_with(t.name, kDataSuffix)) {
      const std::string name = t.name.substr(0, t.name.size() - kDataSuffix.size());
      if (!file.find(name + std::string(kIndexSuffix)))
        throw BadInputError(label + ": tensor " + t.name + " has no " + name + std::string(kIndexSuffix));
      continue;
    }
    if (!ends_with(t.name, kIndexSuffix))
      throw BadInputError(label + ": tensor " + t.name + " is neither a " + std::string(kIndexSuffix) + " nor a " +
                  std::string(kDataSuffix) + " tensor");
    const std::string_view name = std::string_view(t.name).substr(0, t.name.size() - kIndexSuffix.size());
    const st::TensorInfo* data = file.find(std::string(name) + std::string(kDataSuffix));
    if (!data) throw BadInputError(label + ": tensor " + t.name + " has no " + std::string(name) + std::string(kDataSuffix));
    views.push_back({name, file.bytes(t), file.bytes(*data), file_version, index_version});
  }

  // The recorded dtype and shape must be the base's: a delta for another model is refused here.
  const auto shapes_it = md.find("tensor_shapes");
  if (shapes_it != md.end()) {
    const nlohmann::json shapes = nlohmann::json::parse(shapes_it->second, nullptr, false);
    if (!shapes.is_object()) throw BadInputError(label + ": metadata tensor_shapes is not a JSON object");
    for (const TensorMeta& m : base_meta) {
      const auto it = shapes.find(m.name);
      if (it == shapes.end()) continue;
      const nlohmann::json expected{{"dtype", std::string(dtype_name(m.dtype))}, {"shape", m.shape}};
      if (*it != expected)
        throw BadInputError(label + ": tensor " + m.name + " is recorded as " + it->dump() + ", the base has " +
                    expected.dump());
    }
  }
  return out;
}

void check_total_changed(const st::File& file, uint64_t decoded_total) {
  const st::Metadata& md = file.metadata();
  const auto total_it = md.find("total_changed_elements");
  if (total_it == md.end()) return;
  const uint64_t recorded = parse_decimal<uint64_t>(total_it->second, file.label() + ": metadata total_changed_elements");
  if (recorded != decoded_total)
    throw BadInputError(file.label() + ": metadata total_changed_elements is " + total_it->second + ", the blocks hold " +
                std::to_string(decoded_total));
}

std::vector<PatchRef> decode_compact_delta(const st::File& file, std::span<const TensorMeta> base_meta,
                                           std::span<const ConstTensorRef> base, DecodedDelta& out,
                                           const Options& options) {
  CompactFile contents = read_compact_file(file, base_meta);
  out.info = std::move(contents.info);
  decode(contents.tensors, base_meta, base, file.label(), out, options);
  check_total_changed(file, out.storage.offsets.back());
  return out.patches(base_meta);
}

}  // namespace deltasync::compact
