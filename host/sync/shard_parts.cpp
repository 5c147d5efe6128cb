#include "sync/shard_parts.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "codec/compact_two_phase.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/engine.hpp"
#include "format/delta_file.hpp"
#include "format/model_version.hpp"

namespace deltasync {
namespace {

using json = nlohmann::json;

}  // namespace

json placement_to_json(const Placement& p) { return json::array({p.first, p.run_length, p.run_stride, p.run_count}); }

std::optional<Placement> placement_from_json(const json& j) {
  if (!j.is_array() || j.size() != 4 || !std::all_of(j.begin(), j.end(), [](const json& x) { return x.is_number_unsigned(); }))
    return std::nullopt;
  return Placement{j[0].get<uint64_t>(), j[1].get<uint64_t>(), j[2].get<uint64_t>(), j[3].get<uint64_t>()};
}

void resolve_delta_part(const protocol::Manifest& manifest, const st::File& file, std::span<const TensorMeta> base_meta,
                        std::span<const ConstTensorRef> base_bits, const std::function<Placement(size_t)>& held, ResolvedPart& out) {
  out.relative = base_bits.empty() && compact::is_compact_delta(file);
  if (out.relative) {
    out.delta.patches = compact::decode_compact_delta_unbased(file, base_meta, out.delta.decoded);
    out.delta.info = out.delta.decoded.info;
  } else if (base_bits.empty()) {
    resolve_trl_delta(file, base_meta, out.delta);
  } else {
    resolve_delta(file, base_meta, base_bits, out.delta);
  }
  const engine::DeltaToApply entry{&file, manifest.version, manifest.base_version};
  out.promises = engine::delta_promises(entry, out.delta.info);
  for (size_t t = 0; t < out.delta.patches.size(); ++t) {
    const PatchRef& p = out.delta.patches[t];
    if (!p.count) continue;
    const Placement mine = held(t);
    for (uint64_t i = 0; i < p.count; ++i)
      if (!mine.contains(patch_index(p, i)))
        throw BadInputError(file.label() + ": changes tensor " + base_meta[t].name + " at position " + std::to_string(patch_index(p, i)) +
                            ", outside the placement " + placement_text(mine) + " its manifest entry gives it");
    out.patches.emplace_back(t, p);
  }
  out.delta.patches = {};  // per base tensor: 32 bytes x tensors x parts when a reader combines many
}

CombinedDelta combine_delta_parts(const protocol::Manifest& manifest, std::span<const st::File> files,
                                  std::span<const TensorMeta> base_meta, std::span<const ConstTensorRef> base_bits) {
  const std::string label = "version " + std::to_string(manifest.version);
  const auto& parts = manifest.delta_parts;
  const protocol::PartPlacements& placements = manifest.part_placements;
  if (files.size() != parts.size())
    throw Error(label + ": " + std::to_string(files.size()) + " delta part files for " + std::to_string(parts.size()) + " parts");
  const size_t T = base_meta.size();
  std::unordered_map<std::string_view, size_t> index;
  for (size_t t = 0; t < T; ++t) index.emplace(base_meta[t].name, t);

  // 1. The parts tile every tensor exactly: each placement pattern checked once per tensor size.
  std::vector<std::string> part_names;
  for (const auto& p : parts) part_names.push_back("part " + p.object.key);
  for (const auto& [name, pattern] : placements.tensors())
    if (!index.contains(name))
      throw BadInputError(label + ": " + part_names[placements.patterns()[pattern].front().part] + " covers tensor " + name +
                          ", which the model lacks");
  protocol::TilingChecker tiling(placements, part_names, label);
  for (size_t t = 0; t < T; ++t) tiling.check(base_meta[t].name, base_meta[t].numel());

  // 2. Each part resolved and checked against its manifest entry.
  std::vector<ResolvedPart> resolved(parts.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    resolve_delta_part(manifest, files[k], base_meta, base_bits, [&](size_t t) { return placements.placement(base_meta[t].name, k); },
                       resolved[k]);
    if (k > 0 && resolved[k].relative != resolved[0].relative)
      throw BadInputError(files[k].label() + (resolved[k].relative ? ": a compact part among parts of another layout"
                                                                    : ": a part of another layout among compact parts"));
  }

  // 3. What the version's changes add to each tensor's digest: every part's promises, including
  // those of parts whose changes a ranged reader left out (they lie outside its elements).
  std::vector<uint64_t> shift(T, 0);
  for (size_t k = 0; k < parts.size(); ++k)
    for (const auto& [name, base] : resolved[k].promises.base) {
      const auto t = index.find(name);
      const auto r = resolved[k].promises.result.find(name);
      if (t != index.end() && r != resolved[k].promises.result.end()) shift[t->second] += r->second - base;
    }

  // 4. Per tensor changed here: the parts' changes merged in position order, and its promises:
  // the manifest's digest as the result, that minus the changes as the base.
  struct Change {
    size_t tensor, part;
    const PatchRef* patch;
  };
  std::vector<Change> changes;
  for (size_t k = 0; k < parts.size(); ++k)
    for (const auto& [t, p] : resolved[k].patches) {
      if (!resolved[k].promises.base.contains(base_meta[t].name) || !resolved[k].promises.result.contains(base_meta[t].name))
        throw BadInputError(files[k].label() + ": changes tensor " + base_meta[t].name + " but records no partial digests of it");
      changes.push_back(Change{t, k, &p});
    }
  std::stable_sort(changes.begin(), changes.end(), [](const Change& a, const Change& b) { return a.tensor < b.tensor; });
  CombinedDelta out;
  out.relative = !resolved.empty() && resolved[0].relative;
  out.digests.model_version = manifest.version;
  out.digests.base_version = manifest.base_version;
  out.patches.resize(T);
  out.positions.resize(T);
  out.values.resize(T);
  for (size_t i = 0; i < changes.size();) {
    const size_t t = changes[i].tensor;
    size_t end = i;
    while (end < changes.size() && changes[end].tensor == t) ++end;
    const std::string& name = base_meta[t].name;
    const uint32_t w = base_meta[t].width();
    const auto manifest_digest = manifest.digests.find(name);
    if (manifest_digest == manifest.digests.end())
      throw BadInputError(label + ": the manifest records no digest of tensor " + name + ", which its parts change");
    const uint64_t result = digest_from_hex(manifest_digest->second, label);
    struct Ref {
      uint64_t position;
      size_t part;
      uint64_t k;
      const PatchRef* patch;
    };
    std::vector<Ref> refs;
    for (size_t c = i; c < end; ++c) {
      const PatchRef& p = *changes[c].patch;
      for (uint64_t j = 0; j < p.count; ++j) refs.push_back(Ref{patch_index(p, j), changes[c].part, j, &p});
    }
    std::sort(refs.begin(), refs.end(), [](const Ref& a, const Ref& b) { return a.position < b.position; });
    for (size_t j = 1; j < refs.size(); ++j)
      if (refs[j].position == refs[j - 1].position)
        throw BadInputError(label + ": " + part_names[refs[j - 1].part] + " and " + part_names[refs[j].part] + " both change tensor " + name +
                            " at position " + std::to_string(refs[j].position));
    auto& pos = out.positions[t];
    auto& val = out.values[t];
    pos.reserve(refs.size());
    val.resize(refs.size() * w);
    for (size_t j = 0; j < refs.size(); ++j) {
      pos.push_back(static_cast<int64_t>(refs[j].position));
      std::memcpy(val.data() + j * w, static_cast<const uint8_t*>(refs[j].patch->values) + refs[j].k * w, w);
    }
    out.patches[t] = PatchRef{pos.size(), pos.data(), 8, val.data(), w};
    out.changed_elements += pos.size();
    out.digests.base.emplace(name, result - shift[t]);
    out.digests.result.emplace(name, result);
    i = end;
  }
  return out;
}

std::vector<uint8_t> serialize_anchor_slices(std::span<const TensorMeta> tensors, std::span<const Placement> placements,
                                             std::span<const std::span<const uint8_t>> local, uint64_t version,
                                             const std::string& part_label) {
  std::vector<st::WriteTensor> write;
  json where = json::object();
  integrity::DigestMap digests;
  std::vector<ConstTensorRef> refs;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorMeta& m = tensors[k];
    refs.push_back(ConstTensorRef{m.name, local[k].data(), placements[k].numel(), m.width()});
    write.push_back(st::WriteTensor{m.name, m.dtype, {placements[k].numel()}, local[k]});
    const Placement& p = placements[k];
    where[m.name] = json{{"shape", m.shape}, {"placement", placement_to_json(p)}};
  }
  const std::vector<uint64_t> partials = digest_placed_tensors(refs, placements);
  for (size_t k = 0; k < tensors.size(); ++k) digests.emplace(tensors[k].name, partials[k]);
  st::Metadata md{{"sparse", "False"}, {"format", "anchor"}, {"model_version", std::to_string(version)}, {"anchor_part", part_label},
                  {shard_keys::kPlacements, where.dump()}};
  integrity::put_digest_map(md, shard_keys::kSliceDigests, digests);
  return st::serialize(write, md);
}

bool holds_anchor_slices(const st::File& file) { return file.metadata().contains(shard_keys::kPlacements); }

std::vector<AnchorSlice> anchor_part_slices(const st::File& file) {
  std::vector<AnchorSlice> out;
  if (!holds_anchor_slices(file)) {  // an ordinary anchor part: each tensor whole
    for (const TensorMeta& m : model_tensors(file)) out.push_back(AnchorSlice{m, whole_placement(m.numel()), file.bytes(file.at(m.name))});
    return out;
  }
  const std::string& where = file.label();
  json j = json::parse(file.metadata().at(shard_keys::kPlacements), nullptr, false);
  if (!j.is_object()) throw BadInputError(where + ": metadata placements is not a JSON object");
  const auto recorded = integrity::read_digest_map(file.metadata(), shard_keys::kSliceDigests, where);
  if (!recorded) throw BadInputError(where + ": anchor slices without slice_digests");
  std::vector<ConstTensorRef> refs;
  std::vector<Placement> placements;
  for (const st::TensorInfo& ti : file.tensors()) {
    auto e = j.find(ti.name);
    const bool ok = e != j.end() && e->is_object() && e->contains("shape") && (*e)["shape"].is_array() && e->contains("placement");
    if (!ok) throw BadInputError(where + ": tensor " + ti.name + " has no placement entry");
    TensorMeta meta{ti.name, ti.dtype, {}};
    for (const auto& d : (*e)["shape"]) {
      if (!d.is_number_unsigned()) throw BadInputError(where + ": tensor " + ti.name + " has a malformed full shape");
      meta.shape.push_back(d.get<uint64_t>());
    }
    const std::optional<Placement> parsed = placement_from_json((*e)["placement"]);
    if (!parsed) throw BadInputError(where + ": tensor " + ti.name + " has a malformed placement");
    const Placement pl = *parsed;
    if (ti.numel() != pl.numel())
      throw BadInputError(where + ": tensor " + ti.name + " holds " + std::to_string(ti.numel()) + " elements, its placement " +
                          placement_text(pl) + " " + std::to_string(pl.numel()));
    if (!pl.empty() && (pl.run_stride < pl.run_length || pl.end() > meta.numel()))
      throw BadInputError(where + ": tensor " + ti.name + ": placement " + placement_text(pl) + " does not fit its " +
                          std::to_string(meta.numel()) + " elements");
    out.push_back(AnchorSlice{std::move(meta), pl, file.bytes(ti)});
    refs.push_back(ConstTensorRef{ti.name, file.bytes(ti).data(), ti.numel(), dtype_width(ti.dtype)});
    placements.push_back(pl);
  }
  // Each slice's bytes are what its tensor table and digests say.
  const std::vector<uint64_t> partials = digest_placed_tensors(refs, placements);
  for (size_t k = 0; k < refs.size(); ++k) {
    auto r = recorded->find(refs[k].name);
    if (r == recorded->end() || r->second != partials[k])
      throw BadInputError(where + ": slice of tensor " + std::string(refs[k].name) + " does not match its recorded digest");
  }
  return out;
}

AssembledTensors assemble_anchor_slices(std::span<const st::File* const> parts, const std::string& label) {
  struct Whole {
    TensorMeta meta;
    std::vector<AnchorSlice> slices;
    std::vector<std::string> part_names;
  };
  std::vector<Whole> wholes;
  std::map<std::string, size_t> at;
  for (const st::File* file : parts) {
    for (AnchorSlice& slice : anchor_part_slices(*file)) {
      auto [it, fresh] = at.emplace(slice.full.name, wholes.size());
      if (fresh) wholes.push_back(Whole{slice.full, {}, {}});
      Whole& w = wholes[it->second];
      if (w.meta.dtype != slice.full.dtype || w.meta.shape != slice.full.shape)
        throw BadInputError(file->label() + ": tensor " + slice.full.name + " is " + std::string(dtype_name(slice.full.dtype)) +
                            shape_text(slice.full.shape) + " here, " + std::string(dtype_name(w.meta.dtype)) + shape_text(w.meta.shape) +
                            " in another part");
      w.part_names.push_back("part " + file->label());
      w.slices.push_back(std::move(slice));
    }
  }
  AssembledTensors out;
  for (Whole& w : wholes) {
    std::vector<Placement> pls;
    for (const AnchorSlice& s : w.slices) pls.push_back(s.placement);
    check_tiling(pls, w.part_names, w.meta.numel(), w.meta.name, label);
    const uint32_t width = w.meta.width();
    std::vector<uint8_t> full(w.meta.numel() * width);
    for (const AnchorSlice& s : w.slices) {
      const Placement& p = s.placement;
      for (uint64_t r = 0; r < p.run_count; ++r)
        std::memcpy(full.data() + (p.first + r * p.run_stride) * width, s.bytes.data() + r * p.run_length * width, p.run_length * width);
    }
    out.tensors.push_back(std::move(w.meta));
    out.storage.push_back(std::move(full));
  }
  return out;
}

}  // namespace deltasync
