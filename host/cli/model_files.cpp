#include "model_files.hpp"

#include <filesystem>
#include <set>

#include "core/error.hpp"
#include "engine/integrity.hpp"

namespace deltasync::cli {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Keys a pulled shard gets afresh (the rest of a kept shard's metadata stays as it was).
bool written_here(const std::string& key) {
  return key == "model_version" || key == integrity::keys::kDigests || key == integrity::keys::kDigestAlgorithm;
}

}  // namespace

bool is_folder_output(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return true;
  if (std::filesystem::exists(path, ec)) return false;
  return !ends_with(path, ".safetensors");
}

FolderLayout layout_of(const Checkpoint& checkpoint) {
  FolderLayout layout;
  for (const auto& shard : checkpoint.shards()) {
    for (const TensorMeta& m : shard.tensors) layout.weight_map.emplace(m.name, shard.file);
    st::Metadata kept;
    for (const auto& [key, value] : shard.data.metadata())
      if (!written_here(key)) kept.emplace(key, value);
    layout.shard_metadata.emplace(shard.file, std::move(kept));
  }
  layout.index_text = checkpoint.index_text();
  layout.folder = checkpoint.path();
  layout.other_files = checkpoint.other_files();
  return layout;
}

HostModel load_model(const Checkpoint& checkpoint, FolderLayout* layout) {
  if (!checkpoint.is_folder()) return HostModel::from_file(checkpoint.shards().front().data);
  HostModel model;
  for (const auto& shard : checkpoint.shards()) {
    HostModel part = HostModel::from_file(shard.data);
    for (size_t t = 0; t < part.tensors.size(); ++t) {
      model.tensors.push_back(std::move(part.tensors[t]));
      model.data.push_back(std::move(part.data[t]));
    }
  }
  if (layout) *layout = layout_of(checkpoint);
  model.version = checkpoint.recorded_version();
  return model;
}

OutputPlan plan_output(std::span<const TensorMeta> tensors, std::optional<uint64_t> version, std::span<const uint64_t> digests,
                       const std::string& path, const FolderLayout* layout, uint64_t max_shard_bytes) {
  OutputPlan plan;
  const bool with_digests = digests.size() == tensors.size();
  if (!is_folder_output(path)) {
    // One file, as HostModel::save writes it.
    OutputFile file{path, {}, {}};
    integrity::DigestMap map;
    for (size_t t = 0; t < tensors.size(); ++t) {
      file.members.push_back(t);
      if (with_digests) map.emplace(tensors[t].name, digests[t]);
    }
    if (version) file.metadata["model_version"] = std::to_string(*version);
    if (with_digests) integrity::put_checkpoint_digests(file.metadata, map);
    plan.files.push_back(std::move(file));
    return plan;
  }
  plan.folder = true;
  bool keep = layout && layout->weight_map.size() == tensors.size();
  for (size_t t = 0; keep && t < tensors.size(); ++t) keep = layout->weight_map.count(tensors[t].name) > 0;
  const WeightMap weight_map = keep ? layout->weight_map : plan_shards(tensors, max_shard_bytes);
  std::map<std::string, std::vector<size_t>> by_file;  // file -> tensors, model order
  for (size_t t = 0; t < tensors.size(); ++t) by_file[weight_map.at(tensors[t].name)].push_back(t);
  for (auto& [name, members] : by_file) {
    st::Metadata md{{"format", "pt"}};
    if (keep && layout->shard_metadata.count(name)) md = layout->shard_metadata.at(name);
    if (version) md["model_version"] = std::to_string(*version);
    integrity::DigestMap map;
    if (with_digests)
      for (size_t t : members) map.emplace(tensors[t].name, digests[t]);
    if (!map.empty()) integrity::put_checkpoint_digests(md, map);
    plan.files.push_back({name, std::move(members), std::move(md)});
  }
  if (keep && !layout->index_text.empty()) {
    plan.index = layout->index_text;
  } else if (!keep && by_file.size() > 1) {
    uint64_t total = 0;
    for (const auto& t : tensors) total += t.numel() * t.width();
    plan.index = index_json(weight_map, total);
  }
  return plan;
}

void save_model(const HostModel& model, const std::string& path, const FolderLayout* layout, uint64_t max_shard_bytes) {
  const OutputPlan plan = plan_output(model.tensors, model.version, model.digests, path, layout, max_shard_bytes);
  if (!plan.folder) {
    model.save(path);
    return;
  }
  FolderWriter writer(path);
  for (const OutputFile& file : plan.files) {
    std::vector<st::WriteTensor> tensors;
    for (size_t t : file.members) tensors.push_back({model.tensors[t].name, model.tensors[t].dtype, model.tensors[t].shape, model.data[t]});
    writer.write_shard(file.name, tensors, file.metadata);
  }
  if (plan.index) writer.write_bytes(kIndexFileName, {reinterpret_cast<const uint8_t*>(plan.index->data()), plan.index->size()});
  if (layout) writer.copy_files(layout->folder, layout->other_files);
  writer.commit();
}

}  // namespace deltasync::cli
