// The TRL-compatible delta layout and the anchor layout on top of the safetensors container.
//
// Metadata keys deltasync writes (all values strings):
//   sparse                  "True" for a delta, "False" for an anchor
//   format                  "trl" or "anchor"
//   model_version           decimal version the file brings the weights to
//   base_version            decimal version a delta applies to (deltas only, when known)
//   sparsity                1 - changed/total as a decimal ("1.0" for an empty model)
//   changed_params          JSON list of the changed tensor names (deltas only)
//   total_elements          elements in the whole model
//   total_changed_elements  changed elements (deltas only)
//   tensor_shapes           JSON object name -> {"dtype": "BF16", "shape": [..]}, every model tensor
// plus DeltaInfo::extra verbatim.
#include "format/delta_file.hpp"

#include <algorithm>
#include <charconv>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "core/error.hpp"
#include "core/parse_number.hpp"
#include "format/delta_file_internal.hpp"
#include "format/model_version.hpp"

namespace deltasync {

using detail::fail;
using detail::metadata_u64;

namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kIndicesSuffix = ".indices";
constexpr std::string_view kValuesSuffix = ".values";
constexpr std::string_view kWeightDtypeList = "BF16, F16, F32, F8_E4M3, F8_E5M2";

// Keys with a typed field in DeltaInfo: they never go through `extra`.
constexpr std::string_view kTypedKeys[] = {"sparse", "format", "model_version", "base_version"};
// Keys the writer derives from the data. A parsed file keeps them in `extra` (inspect shows them);
// when such an `extra` is written again, the freshly computed values replace them.
constexpr std::string_view kDerivedKeys[] = {"sparsity", "changed_params", "total_elements",
                                             "total_changed_elements", "tensor_shapes",
                                             // TRL's NAME.idx/NAME.val layout (delta_file_trl_idx.cpp)
                                             "version", "num_changed_params", "encoding"};

bool is_one_of(std::string_view key, std::span<const std::string_view> keys) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

std::string sparsity_text(uint64_t changed, uint64_t total) {
  const double sparsity = total == 0 ? 1.0 : 1.0 - static_cast<double>(changed) / static_cast<double>(total);
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, sparsity);
  std::string text(buffer, result.ptr);
  // Read back as a float by Python consumers; "1.0" rather than "1" keeps that obvious.
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

std::string tensor_shapes_json(std::span<const TensorMeta> tensors) {
  // Appended, not assigned by key: ordered_json's operator[] is a linear search (O(T^2) for T
  // tensors, minutes per delta part of a 70k-tensor MoE).
  Json shapes = Json::object();
  auto& entries = shapes.get_ref<Json::object_t&>();
  entries.reserve(tensors.size());
  std::set<std::string_view> seen;
  for (const TensorMeta& t : tensors) {
    if (!seen.insert(t.name).second) throw BadInputError("cannot write tensor \"" + t.name + "\" twice");
    entries.push_back({t.name, Json{{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}}});
  }
  return shapes.dump();
}

std::vector<TensorMeta> parse_tensor_shapes(const std::string& text, const std::string& label) {
  Json shapes;
  try {
    shapes = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(label, std::string("metadata tensor_shapes is not valid JSON (") + e.what() + ")");
  }
  if (!shapes.is_object()) fail(label, "metadata tensor_shapes is not a JSON object");
  std::vector<TensorMeta> tensors;
  for (const auto& [name, entry] : shapes.items()) {
    const std::string where = "metadata tensor_shapes entry \"" + name + "\"";
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry["dtype"].is_string() ||
        !entry["shape"].is_array()) {
      fail(label, where + " is not {\"dtype\": string, \"shape\": list}");
    }
    const auto dtype = dtype_from_name(entry["dtype"].get<std::string>());
    if (!dtype) fail(label, where + " has unknown dtype \"" + entry["dtype"].get<std::string>() + "\"");
    std::vector<uint64_t> shape;
    for (const Json& dim : entry["shape"]) {
      if (!dim.is_number_unsigned()) fail(label, where + " has shape entry " + dim.dump() + ", not a non-negative integer");
      shape.push_back(dim.get<uint64_t>());
    }
    tensors.push_back(TensorMeta{name, *dtype, std::move(shape)});
  }
  return tensors;
}

std::vector<std::string> parse_changed_params(const std::string& text, const std::string& label) {
  Json list;
  try {
    list = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(label, std::string("metadata changed_params is not valid JSON (") + e.what() + ")");
  }
  if (!list.is_array()) fail(label, "metadata changed_params is not a JSON list");
  std::vector<std::string> names;
  for (const Json& name : list) {
    if (!name.is_string()) fail(label, "metadata changed_params holds " + name.dump() + ", not a tensor name");
    names.push_back(name.get<std::string>());
  }
  return names;
}

// Metadata common to deltas and anchors; `extra` first so that derived keys are overwritten.
st::Metadata base_metadata(const std::string& path, std::span<const TensorMeta> tensors, const DeltaInfo& info,
                           bool sparse, uint64_t total_elements, bool name_tensors = true) {
  st::Metadata md;
  for (const auto& [key, value] : info.extra) {
    if (is_one_of(key, kTypedKeys)) {
      fail(path, "metadata key \"" + key + "\" comes from DeltaInfo's fields; remove it from extra");
    }
    if (!is_one_of(key, kDerivedKeys)) md[key] = value;
  }
  md["sparse"] = sparse ? "True" : "False";
  md["format"] = sparse ? "trl" : "anchor";
  md["model_version"] = std::to_string(info.model_version);
  md["total_elements"] = std::to_string(total_elements);
  if (name_tensors) md["tensor_shapes"] = tensor_shapes_json(tensors);
  return md;
}

uint64_t model_numel(std::span<const TensorMeta> tensors, const std::string& path) {
  uint64_t total = 0;
  for (const TensorMeta& t : tensors) {
    if (__builtin_add_overflow(total, t.numel(), &total)) fail(path, "model has more than 2^64 elements");
  }
  return total;
}

// Narrows one tensor's int64 positions to the I32 the TRL layout uses. A position outside the
// tensor could not be narrowed faithfully (it would wrap), so it is refused here already.
std::vector<int32_t> narrow_indices(std::span<const int64_t> indices, const TensorMeta& tensor,
                                    const std::string& path) {
  std::vector<int32_t> narrow(indices.size());
  const auto numel = static_cast<int64_t>(tensor.numel());
  for (size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < 0 || indices[i] >= numel) {
      fail(path, "tensor " + tensor.name + ": changed position " + std::to_string(indices[i]) +
                     " is outside its " + std::to_string(numel) + " elements");
    }
    narrow[i] = static_cast<int32_t>(indices[i]);
  }
  return narrow;
}

}  // namespace

namespace detail {

void fail(const std::string& label, const std::string& reason) { throw BadInputError(label + ": " + reason); }

uint64_t metadata_u64(const st::Metadata& md, const std::string& key, const std::string& label) {
  return parse_decimal<uint64_t>(md.at(key), label + ": metadata " + key);
}

}  // namespace detail

std::vector<TensorMeta> model_tensors(const st::File& checkpoint) {
  std::vector<TensorMeta> tensors;
  tensors.reserve(checkpoint.tensors().size());
  for (const st::TensorInfo& t : checkpoint.tensors()) {
    if (!is_weight_dtype(t.dtype)) {
      fail(checkpoint.label(), "tensor " + t.name + " has dtype " + std::string(dtype_name(t.dtype)) +
                                   "; deltasync handles " + std::string(kWeightDtypeList));
    }
    tensors.push_back(TensorMeta{t.name, t.dtype, t.shape});
  }
  return tensors;
}

st::Metadata delta_metadata(const std::string& label, std::span<const TensorMeta> tensors, const DeltaView& delta,
                            const DeltaInfo& info, std::string_view format, TensorNames names) {
  if (delta.num_tensors() != tensors.size()) {
    fail(label, "delta covers " + std::to_string(delta.num_tensors()) + " tensors but the model has " +
                    std::to_string(tensors.size()));
  }
  const bool listed = names == TensorNames::kListed;
  std::vector<std::string> changed_names;
  for (size_t t = 0; t < tensors.size() && listed; ++t)
    if (delta.count(t)) changed_names.push_back(tensors[t].name);
  const uint64_t total = model_numel(tensors, label);
  const uint64_t total_changed = delta.total_changed();
  st::Metadata md = base_metadata(label, tensors, info, /*sparse=*/true, total, listed);
  md["format"] = std::string(format);
  if (info.base_version) md["base_version"] = std::to_string(*info.base_version);
  md["sparsity"] = sparsity_text(total_changed, total);
  if (listed) md["changed_params"] = Json(changed_names).dump();
  md["total_changed_elements"] = std::to_string(total_changed);
  return md;
}

namespace detail {

void check_delta_for_write(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta) {
  if (delta.num_tensors() != tensors.size()) {
    fail(path, "delta covers " + std::to_string(delta.num_tensors()) + " tensors but the model has " +
                   std::to_string(tensors.size()));
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint64_t value_bytes = delta.value_offsets[t + 1] - delta.value_offsets[t];
    if (value_bytes != delta.count(t) * tensors[t].width()) {
      fail(path, "tensor " + tensors[t].name + ": " + std::to_string(value_bytes) + " value bytes for " +
                     std::to_string(delta.count(t)) + " changes of width " + std::to_string(tensors[t].width()));
    }
  }
}

std::vector<st::WriteTensor> widest_first(std::vector<PendingTensor> pending) {
  std::stable_sort(pending.begin(), pending.end(),
                   [](const PendingTensor& a, const PendingTensor& b) { return a.alignment > b.alignment; });
  std::vector<st::WriteTensor> ordered;
  ordered.reserve(pending.size());
  for (PendingTensor& p : pending) ordered.push_back(std::move(p.tensor));
  return ordered;
}

}  // namespace detail

namespace {

using detail::as_bytes_span;
using detail::PendingTensor;

// The tensors and metadata of a delta file, ready for st::serialize or st::write_file. `path`
// labels errors; `narrowed` keeps the I32 index copies the tensors point to.
std::pair<std::vector<st::WriteTensor>, st::Metadata> trl_delta_layout(
    const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta, const DeltaInfo& info,
    std::vector<std::vector<int32_t>>& narrowed) {
  detail::check_delta_for_write(path, tensors, delta);
  std::vector<PendingTensor> pending;
  narrowed.reserve(tensors.size());  // no reallocation: tensors point into its elements

  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorMeta& meta = tensors[t];
    const uint64_t count = delta.count(t);
    if (count == 0) continue;
    const auto indices = delta.indices.subspan(delta.offsets[t], count);
    const auto values = delta.values.subspan(delta.value_offsets[t], count * meta.width());
    if (meta.numel() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
      pending.push_back({{meta.name + std::string(kIndicesSuffix), DType::I64, {count}, as_bytes_span(indices)}, 8});
    } else {
      narrowed.push_back(narrow_indices(indices, meta, path));
      const std::span<const int32_t> narrow(narrowed.back());
      pending.push_back({{meta.name + std::string(kIndicesSuffix), DType::I32, {count}, as_bytes_span(narrow)}, 4});
    }
    pending.push_back({{meta.name + std::string(kValuesSuffix), meta.dtype, {count}, values}, meta.width()});
  }
  return {detail::widest_first(std::move(pending)), delta_metadata(path, tensors, delta, info, "trl")};
}

std::pair<std::vector<st::WriteTensor>, st::Metadata> anchor_layout(const std::string& path,
                                                                    std::span<const TensorMeta> tensors,
                                                                    std::span<const std::span<const uint8_t>> data,
                                                                    const DeltaInfo& info) {
  if (data.size() != tensors.size()) {
    fail(path, std::to_string(data.size()) + " data buffers for " + std::to_string(tensors.size()) + " tensors");
  }
  std::vector<st::WriteTensor> whole;
  whole.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) whole.push_back({tensors[t].name, tensors[t].dtype, tensors[t].shape, data[t]});
  const uint64_t total = model_numel(tensors, path);
  // An anchor stands alone: it has no base, so base_version is not written even when set.
  st::Metadata md = base_metadata(path, tensors, info, /*sparse=*/false, total);
  md["sparsity"] = sparsity_text(0, total);
  return {std::move(whole), std::move(md)};
}

}  // namespace

void write_trl_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                     const DeltaInfo& info) {
  std::vector<std::vector<int32_t>> narrowed;
  const auto [layout, md] = trl_delta_layout(path, tensors, delta, info, narrowed);
  st::write_file(path, layout, md);
}

std::vector<uint8_t> serialize_trl_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                         const DeltaInfo& info) {
  std::vector<std::vector<int32_t>> narrowed;
  const auto [layout, md] = trl_delta_layout("delta", tensors, delta, info, narrowed);
  return st::serialize(layout, md);
}

void write_anchor(const std::string& path, std::span<const TensorMeta> tensors,
                  std::span<const std::span<const uint8_t>> data, const DeltaInfo& info) {
  const auto [layout, md] = anchor_layout(path, tensors, data, info);
  st::write_file(path, layout, md);
}

std::vector<uint8_t> serialize_anchor(std::span<const TensorMeta> tensors, std::span<const std::span<const uint8_t>> data,
                                      const DeltaInfo& info) {
  const auto [layout, md] = anchor_layout("anchor", tensors, data, info);
  return st::serialize(layout, md);
}

DeltaInfo delta_info(const st::Metadata& md, const std::string& label) {
  DeltaInfo info;
  if (!md.contains("model_version")) fail(label, "metadata has no \"model_version\" key");
  info.model_version = *read_model_version(md, label);
  if (md.contains("base_version")) info.base_version = metadata_u64(md, "base_version", label);
  for (const auto& [key, value] : md) {
    if (!is_one_of(key, kTypedKeys)) info.extra.emplace(key, value);
  }
  return info;
}

namespace detail {

void parse_sparse_metadata(const st::File& file, std::string_view delta_format, std::string_view anchor_format,
                           SparseMetadata& out) {
  const std::string& label = file.label();
  const st::Metadata& md = file.metadata();

  const auto sparse = md.find("sparse");
  if (sparse == md.end()) fail(label, "metadata has no \"sparse\" key; not a delta or anchor");
  if (sparse->second != "True" && sparse->second != "False") {
    fail(label, "metadata sparse is \"" + sparse->second + "\"; expected \"True\" or \"False\"");
  }
  out.sparse = sparse->second == "True";
  if (const auto format = md.find("format"); format != md.end()) {
    const std::string expected(out.sparse ? delta_format : anchor_format);
    if (format->second != expected) {
      fail(label, "metadata format is \"" + format->second + "\" but sparse=\"" + sparse->second +
                      "\" means format \"" + expected + "\"");
    }
  }
  out.info = delta_info(md, label);

  // Derived keys are optional (other writers may omit them) but must be well formed when present.
  if (md.contains("total_elements")) metadata_u64(md, "total_elements", label);
  if (md.contains("total_changed_elements")) out.declared_changed = metadata_u64(md, "total_changed_elements", label);
  if (const auto s = md.find("sparsity"); s != md.end()) {
    const double value = parse_decimal_real(s->second, label + ": metadata sparsity");
    if (value > 1.0) fail(label, "metadata sparsity " + quoted_input(s->second) + ": out of range (max 1)");
  }
  if (md.contains("tensor_shapes")) {
    out.shapes = parse_tensor_shapes(md.at("tensor_shapes"), label);
    for (const TensorMeta& m : *out.shapes) out.listed_by_name.emplace(m.name, &m);
  }
  if (md.contains("changed_params")) out.changed_params = parse_changed_params(md.at("changed_params"), label);
}

std::vector<TensorPair> pair_tensors(const st::File& file, std::string_view index_suffix,
                                     std::string_view values_suffix) {
  const std::string& label = file.label();
  std::vector<TensorPair> pairs;
  std::map<std::string, size_t, std::less<>> position;
  for (const st::TensorInfo& t : file.tensors()) {
    const std::string_view name = t.name;
    const bool is_indices = name.ends_with(index_suffix);
    if (!is_indices && !name.ends_with(values_suffix)) {
      fail(label, "tensor " + t.name + " is neither NAME" + std::string(index_suffix) + " nor NAME" +
                      std::string(values_suffix));
    }
    const std::string base(name.substr(0, name.size() - (is_indices ? index_suffix : values_suffix).size()));
    auto [it, inserted] = position.try_emplace(base, pairs.size());
    if (inserted) pairs.push_back(TensorPair{base});
    (is_indices ? pairs[it->second].indices : pairs[it->second].values) = &t;
  }
  for (const TensorPair& pair : pairs) {
    if (pair.indices == nullptr) {
      fail(label, "tensor " + pair.name + std::string(values_suffix) + " has no matching " + pair.name +
                      std::string(index_suffix));
    }
    if (pair.values == nullptr) {
      fail(label, "tensor " + pair.name + std::string(index_suffix) + " has no matching " + pair.name +
                      std::string(values_suffix));
    }
  }
  return pairs;
}

uint64_t check_pair_shapes(const std::string& label, const TensorPair& pair, const SparseMetadata& md) {
  const st::TensorInfo& idx = *pair.indices;
  const st::TensorInfo& val = *pair.values;
  if (!is_weight_dtype(val.dtype)) {
    fail(label, "tensor " + val.name + " has dtype " + std::string(dtype_name(val.dtype)) + "; deltasync handles " +
                    std::string(kWeightDtypeList));
  }
  for (const st::TensorInfo* t : {&idx, &val}) {
    if (t->shape.size() != 1) fail(label, "tensor " + t->name + " has shape " + st::shape_text(t->shape) + "; expected 1-D");
  }
  if (idx.shape[0] != val.shape[0]) {
    fail(label, "tensor " + pair.name + " has " + std::to_string(idx.shape[0]) + " indices but " +
                    std::to_string(val.shape[0]) + " values");
  }
  if (md.shapes) {
    const auto listed = md.listed_by_name.find(pair.name);
    if (listed == md.listed_by_name.end()) {
      fail(label, "tensor " + pair.name + " is changed but missing from metadata tensor_shapes");
    }
    if (listed->second->dtype != val.dtype) {
      fail(label, "tensor " + pair.name + " has values of dtype " + std::string(dtype_name(val.dtype)) +
                      " but tensor_shapes says " + std::string(dtype_name(listed->second->dtype)));
    }
  }
  return idx.shape[0];
}

void check_declared_totals(const std::string& label, const SparseMetadata& md, std::span<const TensorPair> pairs,
                           uint64_t total_changed) {
  if (md.changed_params) {
    const std::set<std::string> listed(md.changed_params->begin(), md.changed_params->end());
    std::set<std::string> present;
    for (const TensorPair& pair : pairs) present.insert(pair.name);
    if (listed.size() != md.changed_params->size()) fail(label, "metadata changed_params names a tensor twice");
    if (listed != present) {
      fail(label, "metadata changed_params lists " + std::to_string(listed.size()) +
                      " tensors that differ from the file's " + std::to_string(present.size()) + " changed tensors");
    }
  }
  if (md.declared_changed && *md.declared_changed != total_changed) {
    fail(label, "metadata total_changed_elements is " + std::to_string(*md.declared_changed) +
                    " but the file holds " + std::to_string(total_changed) + " changes");
  }
}

}  // namespace detail

ParsedDelta parse_trl_delta(const st::File& file) {
  const std::string& label = file.label();
  detail::SparseMetadata md;
  detail::parse_sparse_metadata(file, "trl", "anchor", md);
  ParsedDelta parsed;
  parsed.sparse = md.sparse;
  parsed.info = md.info;
  if (!parsed.sparse) return parsed;

  const std::vector<detail::TensorPair> pairs = detail::pair_tensors(file, kIndicesSuffix, kValuesSuffix);
  uint64_t total_changed = 0;
  for (const detail::TensorPair& pair : pairs) {
    const st::TensorInfo& idx = *pair.indices;
    const st::TensorInfo& val = *pair.values;
    if (idx.dtype != DType::I32 && idx.dtype != DType::I64) {
      fail(label, "tensor " + idx.name + " has dtype " + std::string(dtype_name(idx.dtype)) +
                      "; indices must be I32 or I64");
    }
    const uint64_t count = detail::check_pair_shapes(label, pair, md);
    total_changed += count;
    parsed.entries.push_back(DeltaEntry{pair.name, val.dtype,
                                        PatchRef{count, file.bytes(idx).data(), dtype_width(idx.dtype),
                                                 file.bytes(val).data(), dtype_width(val.dtype)}});
  }
  detail::check_declared_totals(label, md, pairs, total_changed);
  return parsed;
}

std::vector<PatchRef> resolve_patches(const ParsedDelta& delta, std::span<const TensorMeta> base,
                                      const std::string& label) {
  if (!delta.sparse) fail(label, "file is an anchor (sparse=\"False\"), not a delta to apply to a base");
  std::unordered_map<std::string_view, size_t> base_index;
  for (size_t i = 0; i < base.size(); ++i) base_index.emplace(base[i].name, i);

  std::vector<PatchRef> patches(base.size());
  for (size_t i = 0; i < base.size(); ++i) patches[i].value_width = base[i].width();

  for (const DeltaEntry& entry : delta.entries) {
    const auto it = base_index.find(entry.name);
    if (it == base_index.end()) fail(label, "tensor " + entry.name + " not in base checkpoint");
    const TensorMeta& target = base[it->second];
    if (target.dtype != entry.dtype) {
      fail(label, "tensor " + entry.name + " has dtype " + std::string(dtype_name(entry.dtype)) + " in delta but " +
                      std::string(dtype_name(target.dtype)) + " in base");
    }
    patches[it->second] = entry.patch;
  }

  // tensor_shapes describes the model the delta was made from; every base tensor it lists must
  // match it. Tensors it lists that the base lacks are allowed: the base may be one shard.
  if (const auto shapes = delta.info.extra.find("tensor_shapes"); shapes != delta.info.extra.end()) {
    for (const TensorMeta& listed : parse_tensor_shapes(shapes->second, label)) {
      const auto it = base_index.find(listed.name);
      if (it == base_index.end()) continue;
      const TensorMeta& target = base[it->second];
      if (target.dtype != listed.dtype) {
        fail(label, "tensor " + listed.name + " has dtype " + std::string(dtype_name(listed.dtype)) +
                        " in delta but " + std::string(dtype_name(target.dtype)) + " in base");
      }
      if (target.shape != listed.shape) {
        fail(label, "tensor " + listed.name + " has shape " + st::shape_text(listed.shape) + " in delta but " +
                        st::shape_text(target.shape) + " in base");
      }
    }
  }
  return patches;
}

}  // namespace deltasync
