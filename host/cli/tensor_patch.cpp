#include "tensor_patch.hpp"

#include <set>
#include <string_view>

#include "core/error.hpp"

namespace deltasync::cli {

FilePatch file_patch(std::span<const PatchRef> patches, uint64_t model_version, const std::optional<integrity::DeltaDigests>& promises,
                     std::span<const TensorMeta> meta, size_t first, size_t n) {
  FilePatch out;
  out.model_version = model_version;
  out.patches.assign(patches.begin() + static_cast<ptrdiff_t>(first), patches.begin() + static_cast<ptrdiff_t>(first + n));
  if (promises) {
    integrity::DeltaDigests part{promises->model_version, promises->base_version, {}, {}};
    for (size_t t = first; t < first + n; ++t) {
      const std::string& name = meta[t].name;
      if (auto it = promises->base.find(name); it != promises->base.end()) part.base.emplace(name, it->second);
      if (auto it = promises->result.find(name); it != promises->result.end()) part.result.emplace(name, it->second);
    }
    out.promises = std::move(part);
  }
  return out;
}

void check_promises_name_changes(std::span<const PatchRef> patches, const integrity::DeltaDigests& promises,
                                 std::span<const TensorMeta> meta, const std::string& label) {
  std::set<std::string_view> changed;
  for (size_t t = 0; t < meta.size(); ++t)
    if (patches[t].count) changed.insert(meta[t].name);
  for (const auto* map : {&promises.base, &promises.result})
    for (const auto& [name, digest] : *map)
      if (!changed.count(name)) throw Error(label + ": digests name tensor " + name + ", which the delta does not change");
}

std::vector<uint64_t> changed_digests(engine::SyncEngine& engine, const std::vector<ConstTensorRef>& all, const FilePatch& patch,
                                      bool in_engine_memory) {
  std::vector<ConstTensorRef> changed;
  for (size_t t = 0; t < all.size(); ++t)
    if (patch.patches[t].count) changed.push_back(all[t]);
  const std::vector<uint64_t> d = in_engine_memory ? engine.digests(changed) : engine_digests(engine, changed);
  std::vector<uint64_t> out(all.size(), 0);
  for (size_t t = 0, k = 0; t < all.size(); ++t)
    if (patch.patches[t].count) out[t] = d[k++];
  return out;
}

std::vector<uint64_t> patch_tensors(engine::SyncEngine& engine, std::span<const TensorRef> host, const FilePatch& patch,
                                    std::optional<uint64_t> version, const std::string& label) {
  PlacedTensors placed(engine, host);
  engine::TransferCounters transfer;
  if (!patch.promises) {
    engine.scatter(placed.refs(), patch.patches, transfer);
    placed.download();
    return {};
  }
  try {
    std::vector<uint64_t> digests = changed_digests(engine, placed.views(), patch, true);
    engine.apply_patches(placed.refs(), patch.patches, *patch.promises, digests, version, transfer);
    placed.download();
    return digests;
  } catch (const Error& e) {
    throw Error(label + ": " + e.what());
  }
}

}  // namespace deltasync::cli
