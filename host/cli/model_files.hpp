// Where `pull` reads and writes its weights: one safetensors file, or a checkpoint folder that
// keeps the shard split it had (a fresh folder is split like save_pretrained splits).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <optional>
#include <span>
#include <string>
#include <vector>

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

// A folder checkpoint's split, read from its headers (no tensor data).
FolderLayout layout_of(const Checkpoint& checkpoint);

// Every tensor of a checkpoint (file or folder) in host memory, with the version its shards
// record; `layout` (when given) receives a folder's split.
HostModel load_model(const Checkpoint& checkpoint, FolderLayout* layout);

// The files pull writes for `tensors` (with `digests` in the same order, or none): one file
// unless `path` is a folder output, then a folder split as `layout` says when it names exactly
// these tensors (its index kept byte for byte), else in shards of at most max_shard_bytes. Each
// file records model_version and the digests of its tensors (and keeps its other metadata; a
// fresh shard has "format": "pt", which transformers' loader requires).
struct OutputFile {
  std::string name;             // inside the folder; the path itself for a single file
  std::vector<size_t> members;  // indices into `tensors`, in file order
  st::Metadata metadata;
};
struct OutputPlan {
  bool folder = false;
  std::vector<OutputFile> files;
  std::optional<std::string> index;  // model.safetensors.index.json's text, when one is written
};
OutputPlan plan_output(std::span<const TensorMeta> tensors, std::optional<uint64_t> version, std::span<const uint64_t> digests,
                       const std::string& path, const FolderLayout* layout, uint64_t max_shard_bytes);

// Writes the weights atomically: a file (HostModel::save) unless `path` is a folder output, then
// a folder, as plan_output says.
void save_model(const HostModel& model, const std::string& path, const FolderLayout* layout, uint64_t max_shard_bytes);

}  // namespace deltasync::cli
