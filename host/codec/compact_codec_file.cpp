// The compact format inside a safetensors container: NAME.cindex / NAME.cdata U8 tensors plus
// the metadata the interoperable layout has (so `inspect` reads both) and the codec's own keys.
#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <string>

#include "codec/compact_codec.hpp"
#include "core/error.hpp"

namespace deltasync::compact {
namespace {

struct Container {
  std::vector<EncodedTensor> encoded;
  std::vector<st::WriteTensor> tensors;
  st::Metadata metadata;
};

Container build(std::span<const TensorMeta> tensors, const DeltaView& delta, const DeltaInfo& info,
                const Options& options, std::vector<EncodedTensor> encoded) {
  Container c;
  c.encoded = std::move(encoded);
  for (const EncodedTensor& e : c.encoded) {
    c.tensors.push_back({e.name + std::string(kIndexSuffix), DType::U8, {e.block_index.size()}, e.block_index});
    c.tensors.push_back({e.name + std::string(kDataSuffix), DType::U8, {e.payload.size()}, e.payload});
  }
  // The metadata of every delta layout, plus the codec's own keys.
  c.metadata = delta_metadata("compact delta", tensors, delta, info, "compact");
  c.metadata["compact_version"] = std::to_string(kFormatVersion);
  c.metadata["compact_block_elements"] = std::to_string(options.block_elements);
  return c;
}

uint64_t parse_u64(const st::File& file, const std::string& key, const std::string& text) {
  if (text.empty() || text.size() > 20 || text.find_first_not_of("0123456789") != std::string::npos)
    throw Error(file.label() + ": metadata " + key + " is not a non-negative integer: '" + text + "'");
  try {
    return std::stoull(text);
  } catch (const std::exception&) {
    throw Error(file.label() + ": metadata " + key + " is out of range: '" + text + "'");
  }
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

void write_compact_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const DeltaInfo& info, std::vector<EncodedTensor> encoded, const Options& options) {
  // The metadata comes from `delta`, the tensors from `encoded`: a file whose two halves
  // disagree would be refused only by its readers, so refuse to write it. encode() produces one
  // tensor per changed tensor, in model order.
  if (delta.num_tensors() != tensors.size())
    throw Error(path + ": delta has " + std::to_string(delta.num_tensors()) + " tensors, model has " +
                std::to_string(tensors.size()));
  size_t next = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (delta.count(t) == 0) continue;
    if (next == encoded.size() || encoded[next].name != tensors[t].name || encoded[next].changed != delta.count(t))
      throw Error(path + ": tensor " + tensors[t].name + ": the encoded tensors do not match the delta's " +
                  std::to_string(delta.count(t)) + " changes");
    ++next;
  }
  if (next != encoded.size())
    throw Error(path + ": encoded tensor " + encoded[next].name + " has no changes in the delta");
  const Container c = build(tensors, delta, info, options, std::move(encoded));
  st::write_file(path, c.tensors, c.metadata);
}

bool is_compact_delta(const st::File& file) {
  const auto it = file.metadata().find("format");
  return it != file.metadata().end() && it->second == "compact";
}

std::vector<PatchRef> decode_compact_delta(const st::File& file, std::span<const TensorMeta> base_meta,
                                           std::span<const ConstTensorRef> base, DecodedDelta& out,
                                           const Options& options) {
  const std::string& label = file.label();
  const st::Metadata& md = file.metadata();
  if (!is_compact_delta(file)) throw Error(label + ": not a compact delta (metadata format is not \"compact\")");
  const auto version = md.find("compact_version");
  if (version == md.end() || version->second != std::to_string(kFormatVersion))
    throw Error(label + ": unsupported compact_version '" + (version == md.end() ? "" : version->second) +
                "' (this build reads " + std::to_string(kFormatVersion) + ")");

  out.info = delta_info(md, label);

  // Pair NAME.cindex with NAME.cdata, in file order of the index tensors.
  std::vector<EncodedTensorView> views;
  std::vector<std::string> names;
  for (const st::TensorInfo& t : file.tensors()) {
    if (t.dtype != DType::U8 || t.shape.size() != 1)
      throw Error(label + ": tensor " + t.name + " is not a 1-D U8 tensor");
    if (ends_with(t.name, kDataSuffix)) {
      const std::string name = t.name.substr(0, t.name.size() - kDataSuffix.size());
      if (!file.find(name + std::string(kIndexSuffix)))
        throw Error(label + ": tensor " + t.name + " has no " + name + std::string(kIndexSuffix));
      continue;
    }
    if (!ends_with(t.name, kIndexSuffix))
      throw Error(label + ": tensor " + t.name + " is neither a " + std::string(kIndexSuffix) + " nor a " +
                  std::string(kDataSuffix) + " tensor");
    names.push_back(t.name.substr(0, t.name.size() - kIndexSuffix.size()));
    const st::TensorInfo* data = file.find(names.back() + std::string(kDataSuffix));
    if (!data) throw Error(label + ": tensor " + t.name + " has no " + names.back() + std::string(kDataSuffix));
    views.push_back({{}, file.bytes(t), file.bytes(*data)});
  }
  for (size_t i = 0; i < views.size(); ++i) views[i].name = names[i];

  // The recorded dtype and shape must be the base's: a delta for another model is refused here.
  const auto shapes_it = md.find("tensor_shapes");
  if (shapes_it != md.end()) {
    const nlohmann::json shapes = nlohmann::json::parse(shapes_it->second, nullptr, false);
    if (!shapes.is_object()) throw Error(label + ": metadata tensor_shapes is not a JSON object");
    for (const TensorMeta& m : base_meta) {
      const auto it = shapes.find(m.name);
      if (it == shapes.end()) continue;
      const nlohmann::json expected{{"dtype", std::string(dtype_name(m.dtype))}, {"shape", m.shape}};
      if (*it != expected)
        throw Error(label + ": tensor " + m.name + " is recorded as " + it->dump() + ", the base has " +
                    expected.dump());
    }
  }

  decode(views, base_meta, base, label, out, options);

  const auto total_it = md.find("total_changed_elements");
  if (total_it != md.end()) {
    const uint64_t recorded = parse_u64(file, "total_changed_elements", total_it->second);
    if (recorded != out.storage.offsets.back())
      throw Error(label + ": metadata total_changed_elements is " + total_it->second + ", the blocks hold " +
                  std::to_string(out.storage.offsets.back()));
  }
  return out.patches(base_meta);
}

}  // namespace deltasync::compact
