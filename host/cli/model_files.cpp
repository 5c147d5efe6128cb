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

bool same_tensors(const WeightMap& map, const HostModel& model) {
  if (map.size() != model.tensors.size()) return false;
  for (const auto& t : model.tensors)
    if (!map.count(t.name)) return false;
  return true;
}

}  // namespace

bool is_folder_output(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return true;
  if (std::filesystem::exists(path, ec)) return false;
  return !ends_with(path, ".safetensors");
}

HostModel load_model(const Checkpoint& checkpoint, FolderLayout* layout) {
  if (!checkpoint.is_folder()) return HostModel::from_file(checkpoint.shards().front().data);
  HostModel model;
  for (const auto& shard : checkpoint.shards()) {
    HostModel part = HostModel::from_file(shard.data);
    for (size_t t = 0; t < part.tensors.size(); ++t) {
      if (layout) layout->weight_map.emplace(part.tensors[t].name, shard.file);
      model.tensors.push_back(std::move(part.tensors[t]));
      model.data.push_back(std::move(part.data[t]));
    }
    if (layout) {
      st::Metadata kept;
      for (const auto& [key, value] : shard.data.metadata())
        if (!written_here(key)) kept.emplace(key, value);
      layout->shard_metadata.emplace(shard.file, std::move(kept));
    }
  }
  if (layout) {
    layout->index_text = checkpoint.index_text();
    layout->folder = checkpoint.path();
    layout->other_files = checkpoint.other_files();
  }
  model.version = checkpoint.recorded_version();
  return model;
}

void save_model(const HostModel& model, const std::string& path, const FolderLayout* layout, uint64_t max_shard_bytes) {
  if (!is_folder_output(path)) {
    model.save(path);
    return;
  }
  const bool keep = layout && same_tensors(layout->weight_map, model);
  const WeightMap weight_map = keep ? layout->weight_map : plan_shards(model.tensors, max_shard_bytes);
  std::map<std::string, std::vector<size_t>> by_file;  // file -> tensors, model order
  for (size_t t = 0; t < model.tensors.size(); ++t) by_file[weight_map.at(model.tensors[t].name)].push_back(t);

  FolderWriter writer(path);
  for (const auto& [file, members] : by_file) {
    st::Metadata md{{"format", "pt"}};
    if (keep && layout->shard_metadata.count(file)) md = layout->shard_metadata.at(file);
    if (model.version) md["model_version"] = std::to_string(*model.version);
    std::vector<st::WriteTensor> tensors;
    integrity::DigestMap digests;
    for (size_t t : members) {
      tensors.push_back({model.tensors[t].name, model.tensors[t].dtype, model.tensors[t].shape, model.data[t]});
      if (model.digests.size() == model.tensors.size()) digests.emplace(model.tensors[t].name, model.digests[t]);
    }
    if (!digests.empty()) integrity::put_checkpoint_digests(md, digests);
    writer.write_shard(file, tensors, md);
  }
  if (keep && !layout->index_text.empty()) {
    writer.write_bytes(kIndexFileName, {reinterpret_cast<const uint8_t*>(layout->index_text.data()), layout->index_text.size()});
  } else if (!keep && by_file.size() > 1) {
    const std::string index = index_json(weight_map, model.bytes());
    writer.write_bytes(kIndexFileName, {reinterpret_cast<const uint8_t*>(index.data()), index.size()});
  }
  if (layout) writer.copy_files(layout->folder, layout->other_files);
  writer.commit();
}

}  // namespace deltasync::cli
