// Where pull writes an anchor it streams part by part: every file of OUT is created up front
// under a temporary name with its header (the tensor table and the manifest's digests are known
// before any data arrives), each tensor is written at its offset when its part has been
// verified, and commit() renames the new files into place (finish() before it leaves them
// complete under their temporary names, for a reader of the staged weights: CheckpointReceiver). Destroyed without commit(), it
// removes them and OUT stays as it was, every byte. Memory: none beyond what the caller hands in.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "format/checkpoint_folder.hpp"
#include "model_files.hpp"

namespace deltasync::cli {

class StreamedOutput {
 public:
  // `tensors` in anchor order; `digests` in the same order (or empty). The split follows
  // plan_output (a kept `layout`, or shards of at most max_shard_bytes).
  StreamedOutput(const std::string& path, std::vector<TensorMeta> tensors, std::optional<uint64_t> version,
                 std::span<const uint64_t> digests, const FolderLayout* layout, uint64_t max_shard_bytes);
  ~StreamedOutput();
  StreamedOutput(const StreamedOutput&) = delete;
  StreamedOutput& operator=(const StreamedOutput&) = delete;

  // Writes one tensor's bits. Error for a tensor not in the table, of another dtype or shape,
  // or written twice.
  void write(const TensorMeta& meta, std::span<const uint8_t> bytes);
  // Every tensor written: fsync, and a folder's index and carried files written. The output is
  // then a complete checkpoint at staged_path(), not yet visible under OUT's name (a reader of
  // the staged weights opens it there). Error when a tensor is missing.
  void finish();
  const std::string& staged_path() const;
  // finish(), then the new files take OUT's place.
  void commit();

 private:
  struct Slot {
    size_t file = 0;
    uint64_t offset = 0;  // in the file
    bool written = false;
  };
  std::string path_;
  std::vector<TensorMeta> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> tensors_ position
  std::vector<Slot> slots_;
  std::vector<std::string> file_paths_;  // temporary paths
  std::vector<int> fds_;
  std::unique_ptr<FolderWriter> folder_;  // set for a folder output
  std::optional<std::string> index_text_;
  const FolderLayout* layout_ = nullptr;
  bool finished_ = false;
  bool committed_ = false;
};

}  // namespace deltasync::cli
