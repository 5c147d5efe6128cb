// A checkpoint on disk, as Hugging Face writes them: one safetensors file, or a folder of shards
// (model-00001-of-00004.safetensors ... with model.safetensors.index.json, whose weight_map names
// each tensor's shard; or a folder of *.safetensors files without an index).
//
// Reader: every shard is mapped (not copied) and validated before any tensor byte is touched:
// the index is valid JSON with a weight_map of plain file names, every shard it names exists,
// every *.safetensors in the folder is named by it, each shard holds exactly the tensors the
// weight_map gives it, no tensor name appears in two shards, and metadata.total_size (when
// present) equals the bytes of all tensors. Errors are one line naming the file and the reason.
// Writer: shards go into a temporary folder beside the target, which replaces the target in one
// rename (an atomic exchange when the target exists), so a reader sees the old checkpoint or the
// new one, never a mix.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "format/delta_file.hpp"
#include "format/safetensors.hpp"

namespace deltasync {

inline constexpr const char* kIndexFileName = "model.safetensors.index.json";

// Which shard file holds each tensor (the index's weight_map).
using WeightMap = std::map<std::string, std::string>;

class Checkpoint {
 public:
  struct Shard {
    std::string file;  // name inside the folder; for a single-file checkpoint, the file's name
    std::string path;  // full path
    st::File data;     // mapped and validated
    std::vector<TensorMeta> tensors;  // every tensor of this shard, header order
  };

  // Opens a file or a folder. Throws Error("PATH: reason").
  static Checkpoint open(const std::string& path);

  const std::string& path() const { return path_; }
  bool is_folder() const { return folder_; }
  // Shards in file-name order (one for a single file).
  const std::vector<Shard>& shards() const { return shards_; }
  // Every model tensor: shard by shard, each in header order. Error("SHARD: ...") for a tensor
  // whose dtype is not a weight dtype.
  std::vector<TensorMeta> tensors() const;
  // The mapped bytes of a tensor, or nullopt when no shard holds it.
  struct Located {
    size_t shard = 0;
    const st::TensorInfo* info = nullptr;
  };
  std::optional<Located> find(std::string_view name) const;
  std::span<const uint8_t> bytes(const Located& at) const { return shards_[at.shard].data.bytes(*at.info); }
  // A folder's other regular files (config.json, tokenizer files, ...), which a rewritten
  // folder carries over.
  const std::vector<std::string>& other_files() const { return other_files_; }
  // The index file's text as read (empty when the folder has none).
  const std::string& index_text() const { return index_text_; }
  uint64_t tensor_bytes() const;
  // model_version recorded by the shards: nullopt when none records one; Error when shards
  // disagree or a value is not a version number.
  std::optional<uint64_t> recorded_version() const;

 private:
  void index_names();  // fills by_name_; Error for a name in two shards
  std::string path_;
  bool folder_ = false;
  std::vector<Shard> shards_;
  std::map<std::string, Located, std::less<>> by_name_;
  std::string index_text_;
  std::vector<std::string> other_files_;
};

// The text of a model.safetensors.index.json: {"metadata": {"total_size": N}, "weight_map": ...}.
std::string index_json(const WeightMap& weight_map, uint64_t total_size);

// A fresh split of `tensors` (in order) into shards of at most `max_shard_bytes` each (a tensor
// larger than that gets a shard of its own), named as save_pretrained names them:
// model.safetensors for one shard, else model-0000K-of-0000N.safetensors.
WeightMap plan_shards(std::span<const TensorMeta> tensors, uint64_t max_shard_bytes);

// Builds a checkpoint folder in a temporary folder beside `target` and puts it in place on commit().
// Destroyed without commit(), it removes the temporary folder and leaves `target` as it was.
class FolderWriter {
 public:
  explicit FolderWriter(std::string target);
  ~FolderWriter();
  FolderWriter(const FolderWriter&) = delete;
  FolderWriter& operator=(const FolderWriter&) = delete;

  // Where to write the file `name` of the new folder (inside the temporary folder).
  std::string path_of(const std::string& name) const;
  // The temporary folder itself (readable as a Checkpoint once its files are written).
  const std::string& temporary_path() const { return temp_; }
  void write_shard(const std::string& name, std::span<const st::WriteTensor> tensors, const st::Metadata& metadata);
  void write_bytes(const std::string& name, std::span<const uint8_t> bytes);
  // Copies files of `folder` (e.g. a Checkpoint's other_files) into the new folder.
  void copy_files(const std::string& folder, std::span<const std::string> names);
  // Replaces `target` (a folder, or nothing) by the new folder. Throws Error when `target` is a file.
  void commit();

 private:
  std::string target_;
  std::string temp_;
  bool committed_ = false;
};

}  // namespace deltasync
