// Helpers the subcommands share for safetensors checkpoints on disk.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/huge_buffer.hpp"
#include "core/tensor.hpp"
#include "format/checkpoint_folder.hpp"
#include "format/delta_file.hpp"
#include "format/safetensors.hpp"

namespace deltasync::cli {

// One safetensors file's raw bytes in memory (a private, writable copy of the file; of one
// shard, for a checkpoint folder) with its parsed layout: apply patches these bytes in place and
// writes them back, so the output keeps the input's header byte for byte.
struct CheckpointImage {
  st::File file;                 // the validated, mapped original
  std::vector<TensorMeta> meta;  // header order
  // Whole file, in huge pages where granted: apply writes at random positions across it, which
  // with 4 KiB pages costs a page walk per change (see core/huge_buffer.hpp).
  HugeBuffer bytes;
  uint64_t data_start = 0;       // offset of the data section in `bytes`

  static CheckpointImage load(const std::string& path);
  uint8_t* tensor_data(size_t t);
  std::vector<TensorRef> targets();
  std::vector<ConstTensorRef> views() const;
};

// Checks that `other` holds exactly the tensors of `base` (names, dtypes, shapes), whatever its
// shard split, and returns for each base tensor its bytes in `other`. Error("OTHER: ...") names
// the first difference.
std::vector<const uint8_t*> matching_tensors(const Checkpoint& other, const std::vector<TensorMeta>& base);

// Views of every tensor of a checkpoint (mapped, not copied), in Checkpoint::tensors() order.
std::vector<ConstTensorRef> checkpoint_views(const Checkpoint& checkpoint, const std::vector<TensorMeta>& tensors);

// "12.3 MB" style sizes for human-readable lines.
std::string human_bytes(double bytes);

}  // namespace deltasync::cli
