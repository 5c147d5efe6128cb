// Where `pull` reads and writes its weights: one safetensors file, or a checkpoint folder that
// keeps the shard split it had (a fresh folder is split like save_pretrained splits).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "engine/host_model.hpp"
#include "format/checkpoint_folder.hpp"

namespace deltasync::cli {

// save_pretrained's default shard size.
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000ull;

// OUT is a folder when it is an existing folder, or does not exist and does not end in
// ".safetensors".
bool is_folder_output(const std::string& path);

// An existing folder's split, kept when it is written again.
struct FolderLayout {
  WeightMap weight_map;
  std::string index_text;                      // empty: the folder had no index
  std::map<std::string, st::Metadata> shard_metadata;  // per file, without the keys deltasync writes
  std::string folder;                      // where it was read
  std::vector<std::string> other_files;    // config.json, tokenizer files: carried over
};

// Every tensor of a checkpoint (file or folder) in host memory, with the version its shards
// record; `layout` (when given) receives a folder's split.
HostModel load_model(const Checkpoint& checkpoint, FolderLayout* layout);

// Writes the weights atomically: a file (HostModel::save) unless `path` is a folder output, then
// a folder split as `layout` says when it names exactly these tensors (its index kept byte for
// byte), else in shards of at most max_shard_bytes. Each shard records model_version and the
// digests of its tensors (and keeps its other metadata; a fresh shard has "format": "pt", which
// transformers' loader requires).
void save_model(const HostModel& model, const std::string& path, const FolderLayout* layout, uint64_t max_shard_bytes);

}  // namespace deltasync::cli
