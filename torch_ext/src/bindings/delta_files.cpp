// Delta and anchor files of the C++ library (delta_io.hpp, delta_file.hpp, integrity.hpp,
// compact_codec.hpp) for the Python package (deltasync/_files.py), as plain functions of the
// native module -- not torch.ops: custom operators wrap tensor work only. They serialize an
// encode's host-staged output in any delta layout and read any delta back as concatenated
// (indices, values, counts). Thin: layouts, metadata and digest rules all live in the library;
// this file only converts arguments. A model is described by parallel lists: names, safetensors
// dtype names ("BF16", ...), ranks and the dims of all shapes back to back (the schema language
// of the operators had no nested lists). Absent versions travel as None (arguments) or -1
// (results). Argument errors are c10::Errors (RuntimeError in Python) prefixed by the function.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "codec/compact_two_phase.hpp"
#include "codec/delta_io.hpp"
#include "engine/integrity.hpp"
#include "sync/publisher.hpp"
#include "bindings/module.hpp"
#include "tensor_lists.hpp"

namespace deltasync::torch_ext {
namespace {

std::vector<TensorMeta> model_meta(const char* op, const std::vector<std::string>& names,
                                   const std::vector<std::string>& dtypes, const std::vector<int64_t>& ranks,
                                   const std::vector<int64_t>& dims) {
  TORCH_CHECK(names.size() == dtypes.size() && names.size() == ranks.size(), op,
              ": names, dtypes and ranks differ in length");
  std::vector<TensorMeta> meta(names.size());
  size_t next_dim = 0;
  for (size_t t = 0; t < names.size(); ++t) {
    auto dtype = dtype_from_name(dtypes[t]);
    TORCH_CHECK(dtype.has_value(), op, ": tensor ", names[t], ": unknown dtype ", dtypes[t]);
    TORCH_CHECK(ranks[t] >= 0 && next_dim + static_cast<size_t>(ranks[t]) <= dims.size(), op,
                ": tensor ", names[t], ": ranks and dims disagree");
    meta[t].name = names[t];
    meta[t].dtype = *dtype;
    for (int64_t d = 0; d < ranks[t]; ++d) {
      TORCH_CHECK(dims[next_dim] >= 0, op, ": tensor ", names[t], ": negative dimension");
      meta[t].shape.push_back(static_cast<uint64_t>(dims[next_dim++]));
    }
  }
  TORCH_CHECK(next_dim == dims.size(), op, ": ranks and dims disagree");
  return meta;
}

template <class T>
std::span<const T> host_span(const char* op, const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), op, ": ", what, " must be a contiguous CPU tensor");
  return {static_cast<const T*>(t.const_data_ptr()), static_cast<size_t>(t.numel() * t.element_size()) / sizeof(T)};
}

at::Tensor bytes_tensor(const std::vector<uint8_t>& bytes) {
  at::Tensor out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(out.mutable_data_ptr(), bytes.data(), bytes.size());
  return out;
}

std::optional<uint64_t> to_base_version(const std::optional<int64_t>& v, const char* op) {
  if (!v) return std::nullopt;
  TORCH_CHECK(*v >= 0, op, ": base_version must be non-negative");
  return static_cast<uint64_t>(*v);
}

// The encode's host-staged output (int64 indices, value bytes, optional base bytes, per-tensor
// counts; all on the CPU) as a DeltaView over those tensors, checked against the model. `which`
// prefixes the argument names in errors ("" or e.g. "older_" when an op takes two deltas).
// Not copyable: the view points into the offset vectors (a move keeps their storage).
struct StagedDelta {
  std::vector<uint64_t> offsets{0}, value_offsets{0};
  DeltaView view;
  StagedDelta() = default;
  StagedDelta(StagedDelta&&) = default;
  StagedDelta(const StagedDelta&) = delete;
  StagedDelta& operator=(const StagedDelta&) = delete;
};

StagedDelta staged_delta(const char* op, const std::vector<TensorMeta>& meta, const char* which,
                         const at::Tensor& indices, const at::Tensor& values,
                         const std::optional<at::Tensor>& base_values, const at::Tensor& counts) {
  const std::string indices_name = std::string(which) + "indices", values_name = std::string(which) + "values",
                    base_name = std::string(which) + "base_values", counts_name = std::string(which) + "counts";
  TORCH_CHECK(indices.scalar_type() == at::kLong, op, ": ", indices_name, " must be int64");
  TORCH_CHECK(counts.scalar_type() == at::kLong && static_cast<size_t>(counts.numel()) == meta.size(), op, ": ",
              counts_name, " must be int64 with one entry per tensor");
  const auto count_span = host_span<int64_t>(op, counts, counts_name.c_str());
  StagedDelta d;
  d.view.indices = host_span<int64_t>(op, indices, indices_name.c_str());
  d.view.values = host_span<uint8_t>(op, values, values_name.c_str());
  if (base_values) d.view.base_values = host_span<uint8_t>(op, *base_values, base_name.c_str());
  for (size_t t = 0; t < meta.size(); ++t) {
    TORCH_CHECK(count_span[t] >= 0 && static_cast<uint64_t>(count_span[t]) <= meta[t].numel(), op, ": tensor ",
                meta[t].name, ": ", counts_name, " entry ", count_span[t], " outside 0..", meta[t].numel());
    const uint64_t count = static_cast<uint64_t>(count_span[t]);
    // Checked against what is left of the arrays, not summed first: sums of huge counts (of
    // huge tensors) could wrap around to the sizes of small arrays.
    TORCH_CHECK(count <= d.view.indices.size() - d.offsets.back() &&
                    count <= (d.view.values.size() - d.value_offsets.back()) / meta[t].width(),
                op, ": ", indices_name, "/", values_name, " sizes disagree with ", counts_name);
    d.offsets.push_back(d.offsets.back() + count);
    d.value_offsets.push_back(d.value_offsets.back() + count * meta[t].width());
  }
  d.view.offsets = d.offsets;
  d.view.value_offsets = d.value_offsets;
  TORCH_CHECK(d.view.indices.size() == d.offsets.back() && d.view.values.size() == d.value_offsets.back(), op, ": ",
              indices_name, "/", values_name, " sizes disagree with ", counts_name);
  TORCH_CHECK(d.view.base_values.empty() || d.view.base_values.size() == d.value_offsets.back(), op, ": ",
              base_name, " size disagrees with ", counts_name);
  return d;
}

// The encode's output serialized as a delta in `format` ("trl" or "compact"), with the versions and,
// for every tensor that has changes, base_digests[t] and result_digests[t] (int64
// reinterpretations of the unsigned digests; the lists are in model order).
at::Tensor delta_serialize(std::string format, std::vector<std::string> names, std::vector<std::string> dtypes,
                           std::vector<int64_t> ranks, std::vector<int64_t> dims, const at::Tensor& indices,
                           const at::Tensor& values, const std::optional<at::Tensor>& base_values,
                           const at::Tensor& counts, int64_t version, std::optional<int64_t> base_version,
                           std::vector<int64_t> base_digests, std::vector<int64_t> result_digests) {
  constexpr const char* op = "deltasync.delta_serialize";
  const std::vector<TensorMeta> meta = model_meta(op, names, dtypes, ranks, dims);
  TORCH_CHECK(base_digests.size() == meta.size() && result_digests.size() == meta.size(), op,
              ": base_digests and result_digests need one entry per tensor");
  const StagedDelta staged = staged_delta(op, meta, "", indices, values, base_values, counts);
  const DeltaView& view = staged.view;
  return translate_errors(op, [&] {
    const DeltaFormat delta_format = parse_delta_format(format);
    integrity::DeltaDigests digests;
    digests.model_version = static_cast<uint64_t>(version);
    digests.base_version = to_base_version(base_version, op);
    for (size_t t = 0; t < meta.size(); ++t) {
      if (view.count(t) == 0) continue;
      digests.base.emplace(meta[t].name, static_cast<uint64_t>(base_digests[t]));
      digests.result.emplace(meta[t].name, static_cast<uint64_t>(result_digests[t]));
    }
    DeltaInfo info;
    integrity::put_delta_digests(info, digests);
    return bytes_tensor(serialize_delta(delta_format, meta, view, info));
  });
}

// Two consecutive staged deltas (older: base B -> A, newer: A -> C) as one from B to C
// (merge_deltas: union of positions, newest values, oldest base values), for a publisher whose
// uploads fell behind. The older delta needs its base values; the newer one needs them only
// where the older does not touch.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> delta_merge(
    std::vector<std::string> names, std::vector<std::string> dtypes, std::vector<int64_t> ranks,
    std::vector<int64_t> dims, const at::Tensor& older_indices, const at::Tensor& older_values,
    const at::Tensor& older_base_values, const at::Tensor& older_counts, const at::Tensor& newer_indices,
    const at::Tensor& newer_values, const at::Tensor& newer_base_values, const at::Tensor& newer_counts) {
  constexpr const char* op = "deltasync.delta_merge";
  const std::vector<TensorMeta> meta = model_meta(op, names, dtypes, ranks, dims);
  const StagedDelta older =
      staged_delta(op, meta, "older_", older_indices, older_values, older_base_values, older_counts);
  const StagedDelta newer =
      staged_delta(op, meta, "newer_", newer_indices, newer_values, newer_base_values, newer_counts);
  return translate_errors(op, [&] {
    const SparseDelta merged = merge_deltas(older.view, newer.view, meta);
    at::Tensor indices = at::empty({static_cast<int64_t>(merged.indices.size())}, at::kLong);
    if (!merged.indices.empty())
      std::memcpy(indices.mutable_data_ptr(), merged.indices.data(), merged.indices.size() * sizeof(int64_t));
    at::Tensor counts = at::empty({static_cast<int64_t>(meta.size())}, at::kLong);
    for (size_t t = 0; t < meta.size(); ++t)
      counts.mutable_data_ptr<int64_t>()[t] = static_cast<int64_t>(merged.offsets[t + 1] - merged.offsets[t]);
    return std::make_tuple(indices, bytes_tensor(merged.values), bytes_tensor(merged.base_values), counts);
  });
}

// One anchor part: the tensors whole (contiguous CPU), with format="anchor",
// anchor_part="PART/PARTS", model_version and the checkpoint digests of its tensors.
at::Tensor anchor_serialize(std::vector<std::string> names, std::vector<std::string> dtypes, std::vector<int64_t> ranks,
                            std::vector<int64_t> dims, const std::vector<at::Tensor>& tensors, int64_t version, int64_t part,
                            int64_t parts, std::vector<int64_t> digests) {
  constexpr const char* op = "deltasync.anchor_serialize";
  const std::vector<TensorMeta> meta = model_meta(op, names, dtypes, ranks, dims);
  TORCH_CHECK(tensors.size() == meta.size() && digests.size() == meta.size(), op,
              ": tensors and digests need one entry per name");
  TORCH_CHECK(version >= 0 && part >= 0 && part < parts, op, ": bad version or part");
  std::vector<std::span<const uint8_t>> data;
  integrity::DigestMap digest_map;
  for (size_t t = 0; t < meta.size(); ++t) {
    data.push_back(host_span<uint8_t>(op, tensors[t], "anchor tensors"));
    digest_map.emplace(meta[t].name, static_cast<uint64_t>(digests[t]));
  }
  return translate_errors(op, [&] {
    DeltaInfo info;
    info.model_version = static_cast<uint64_t>(version);
    info.extra = {{"anchor_part", std::to_string(part) + "/" + std::to_string(parts)}};
    integrity::put_checkpoint_digests(info.extra, digest_map);
    return bytes_tensor(serialize_anchor(meta, data, info));
  });
}

using DeltaRead = std::tuple<std::string, bool, int64_t, int64_t, std::vector<std::string>, at::Tensor, at::Tensor, at::Tensor,
                             bool, std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>>;

// Reads any delta (either layout) and resolves it against the model described by the lists:
// returns (format, relative, model_version, base_version or -1, changed tensor names in model
// order, int64 indices, value bytes, per-changed-tensor counts, whether digests are present,
// the digest names, base digests, result digests). A compact delta's values are coded relative
// to the base bits: with `base` (the model's tensors, contiguous CPU) they are decoded here;
// without it `relative` is true and the values are unbased bits, which compact_rebase turns
// into new bits once the caller has gathered the base bits at the indices (compact_two_phase.hpp).
DeltaRead delta_read(const at::Tensor& data, std::string label, std::vector<std::string> names,
                     std::vector<std::string> dtypes, std::vector<int64_t> ranks, std::vector<int64_t> dims,
                     std::optional<std::vector<at::Tensor>> base) {
  constexpr const char* op = "deltasync.delta_read";
  const std::vector<TensorMeta> meta = model_meta(op, names, dtypes, ranks, dims);
  const auto bytes = host_span<uint8_t>(op, data, "data");
  std::vector<ConstTensorRef> base_refs;
  if (base) {
    TORCH_CHECK(base->size() == meta.size(), op, ": base needs one tensor per name");
    for (size_t t = 0; t < meta.size(); ++t) {
      const auto span = host_span<uint8_t>(op, (*base)[t], "base tensors");
      TORCH_CHECK(span.size() == meta[t].numel() * meta[t].width(), op, ": tensor ", names[t],
                  ": base tensor size disagrees with its shape");
      base_refs.push_back(ConstTensorRef{meta[t].name, span.data(), meta[t].numel(), meta[t].width()});
    }
  }
  return translate_errors(op, [&] {
    st::File file = st::File::from_bytes(std::vector<uint8_t>(bytes.begin(), bytes.end()), label);
    const bool relative = compact::is_compact_delta(file) && !base;
    ResolvedDelta resolved;
    if (relative) {
      resolved.format = DeltaFormat::Compact;
      resolved.patches = compact::decode_compact_delta_unbased(file, meta, resolved.decoded);
      resolved.info = resolved.decoded.info;
      resolved.changed_names = resolved.decoded.changed_names;
    } else {
      resolve_delta(file, meta, base_refs, resolved);
    }
    const std::set<std::string, std::less<>> changed(resolved.changed_names.begin(), resolved.changed_names.end());
    std::vector<std::string> changed_names;
    std::vector<int64_t> counts;
    uint64_t total = 0, total_bytes = 0;
    for (size_t t = 0; t < meta.size(); ++t) {
      if (!changed.count(meta[t].name)) continue;
      changed_names.push_back(meta[t].name);
      counts.push_back(static_cast<int64_t>(resolved.patches[t].count));
      total += resolved.patches[t].count;
      total_bytes += resolved.patches[t].count * meta[t].width();
    }
    at::Tensor indices = at::empty({static_cast<int64_t>(total)}, at::kLong);
    at::Tensor values = at::empty({static_cast<int64_t>(total_bytes)}, at::kByte);
    int64_t* index_out = indices.mutable_data_ptr<int64_t>();
    uint8_t* value_out = values.mutable_data_ptr<uint8_t>();
    for (size_t t = 0; t < meta.size(); ++t) {
      if (!changed.count(meta[t].name)) continue;
      const PatchRef& p = resolved.patches[t];
      for (uint64_t i = 0; i < p.count; ++i)
        index_out[i] = p.index_width == 4 ? static_cast<const int32_t*>(p.indices)[i] : static_cast<const int64_t*>(p.indices)[i];
      if (p.count) std::memcpy(value_out, p.values, p.count * meta[t].width());
      index_out += p.count;
      value_out += p.count * meta[t].width();
    }
    std::optional<integrity::DeltaDigests> digests = integrity::read_delta_digests(resolved.info, label);
    std::vector<std::string> digest_names;
    std::vector<int64_t> base_digests, result_digests;
    if (digests) {
      for (const auto& [name, value] : digests->base) {
        digest_names.push_back(name);
        base_digests.push_back(static_cast<int64_t>(value));
        result_digests.push_back(static_cast<int64_t>(digests->result.at(name)));
      }
    }
    const int64_t base_version = resolved.info.base_version ? static_cast<int64_t>(*resolved.info.base_version) : -1;
    return DeltaRead{std::string(delta_format_name(resolved.format)), relative, static_cast<int64_t>(resolved.info.model_version),
                     base_version, changed_names, indices, values,
                     at::tensor(counts, at::TensorOptions().dtype(at::kLong)), digests.has_value(), digest_names,
                     base_digests, result_digests};
  });
}

// Second phase of a compact delta read without the base (delta_read's `relative`): the new
// bits from the unbased bits and the base bits at the same positions (both value-byte layout:
// counts[t] elements of widths[t] bytes per tensor, back to back).
at::Tensor compact_rebase(const at::Tensor& unbased, const at::Tensor& base_bits, const at::Tensor& counts,
                          std::vector<int64_t> widths) {
  constexpr const char* op = "deltasync.compact_rebase";
  const auto u = host_span<uint8_t>(op, unbased, "unbased");
  const auto b = host_span<uint8_t>(op, base_bits, "base_bits");
  const auto c = host_span<int64_t>(op, counts, "counts");
  TORCH_CHECK(counts.scalar_type() == at::kLong && c.size() == widths.size(), op,
              ": counts must be int64 with one entry per width");
  TORCH_CHECK(u.size() == b.size(), op, ": unbased and base_bits differ in size");
  at::Tensor out = at::empty({static_cast<int64_t>(u.size())}, at::kByte);
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  size_t at = 0;
  translate_errors(op, [&] {
    for (size_t t = 0; t < widths.size(); ++t) {
      TORCH_CHECK(c[t] >= 0 && widths[t] > 0, op, ": bad count or width");
      const size_t n = static_cast<size_t>(c[t]) * static_cast<size_t>(widths[t]);
      TORCH_CHECK(at + n <= u.size(), op, ": counts x widths exceed the value bytes");
      compact::rebase_values(u.subspan(at, n), b.subspan(at, n), static_cast<uint32_t>(widths[t]), {dst + at, n});
      at += n;
    }
  });
  TORCH_CHECK(at == u.size(), op, ": counts x widths do not cover the value bytes");
  return out;
}

// An anchor part's version and checkpoint digests (strictly parsed by the library); the
// tensors themselves are read by the caller. Refuses a file that is not an anchor.
std::tuple<int64_t, bool, std::vector<std::string>, std::vector<int64_t>> anchor_read_digests(const at::Tensor& data,
                                                                                               std::string label) {
  constexpr const char* op = "deltasync.anchor_read_digests";
  const auto bytes = host_span<uint8_t>(op, data, "data");
  return translate_errors(op, [&] {
    st::File file = st::File::from_bytes(std::vector<uint8_t>(bytes.begin(), bytes.end()), label);
    const auto sparse = file.metadata().find("sparse");
    if (sparse == file.metadata().end() || sparse->second != "False") throw Error(label + ": not an anchor");
    const DeltaInfo info = delta_info(file.metadata(), label);
    std::optional<integrity::DigestMap> digests = integrity::read_checkpoint_digests(file.metadata(), label);
    std::vector<std::string> names;
    std::vector<int64_t> values;
    if (digests) {
      for (const auto& [name, value] : *digests) {
        names.push_back(name);
        values.push_back(static_cast<int64_t>(value));
      }
    }
    return std::make_tuple(static_cast<int64_t>(info.model_version), digests.has_value(), names, values);
  });
}

}  // namespace

void bind_files(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("delta_serialize", &delta_serialize, py::arg("format"), py::arg("names"), py::arg("dtypes"), py::arg("ranks"),
        py::arg("dims"), py::arg("indices"), py::arg("values"), py::arg("base_values"), py::arg("counts"), py::arg("version"),
        py::arg("base_version"), py::arg("base_digests"), py::arg("result_digests"),
        "An encode's host-staged output as delta bytes (uint8 tensor) in `format`, with versions and digests.");
  m.def("anchor_serialize", &anchor_serialize, py::arg("names"), py::arg("dtypes"), py::arg("ranks"), py::arg("dims"),
        py::arg("tensors"), py::arg("version"), py::arg("part"), py::arg("parts"), py::arg("digests"),
        "One anchor part's bytes (uint8 tensor).");
  m.def("delta_read", &delta_read, py::arg("data"), py::arg("label"), py::arg("names"), py::arg("dtypes"), py::arg("ranks"),
        py::arg("dims"), py::arg("base") = py::none(),
        "(format, relative, version, base_version, changed, indices, values, counts, has_digests, digest_names, "
        "base_digests, result_digests) of any delta resolved against the model.");
  m.def("delta_merge", &delta_merge, "Two consecutive staged deltas as one (C++ merge_deltas).");
  m.def("compact_rebase", &compact_rebase, py::arg("unbased"), py::arg("base_bits"), py::arg("counts"), py::arg("widths"),
        "Second phase of a relative compact read: the new bits from unbased values and base bits.");
  m.def("anchor_read_digests", &anchor_read_digests, py::arg("data"), py::arg("label"),
        "(version, has_digests, names, digests) of an anchor part.");
}

}  // namespace deltasync::torch_ext
