// A strict safetensors reader and an atomic writer.
//
// Reader: validates everything before any tensor byte is touched (header length bounded, JSON
// valid, known dtypes, shapes that fit in 64 bits, data_offsets inside the file, consistent with
// dtype x shape, non-overlapping and covering the data section, no duplicate names, metadata
// values strings). Files are memory-mapped, not copied. Every error is one line that starts
// with the file's label ("path: reason").
// Writer: header + data written to a temporary name in the target's folder, fsynced, renamed.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.hpp"
#include "core/tensor_meta.hpp"

namespace deltasync::st {

// Largest JSON header accepted (safetensors' own limit is 100 MB).
inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
  uint64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

using Metadata = std::map<std::string, std::string>;

// "[2, 3]": a shape as error messages print it (core/tensor_meta.hpp).
using ::deltasync::shape_text;

class File {
 public:
  // Maps and validates a file. Throws Error("PATH: reason").
  static File open(const std::string& path);
  // Validates bytes already in memory (a fetched object); `label` names it in errors.
  static File from_bytes(std::vector<uint8_t> bytes, std::string label);

  const std::string& label() const;
  // Tensors in header order (the order a writer emitted them).
  const std::vector<TensorInfo>& tensors() const;
  const TensorInfo* find(std::string_view name) const;
  // Throws Error("LABEL: no tensor NAME") when missing.
  const TensorInfo& at(std::string_view name) const;
  std::span<const uint8_t> bytes(const TensorInfo& t) const;
  const Metadata& metadata() const;
  uint64_t size_bytes() const;  // whole file

  File(File&&) noexcept;
  File& operator=(File&&) noexcept;
  ~File();

 private:
  struct Impl;
  explicit File(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One tensor to write; `bytes.size()` must equal numel(shape) * dtype width.
struct WriteTensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  std::span<const uint8_t> bytes;
};

// The 8-byte length and the header of a file holding `tensors` in this order, data packed from
// offset 0: what a writer that fills the data section later (pull streaming an anchor part by
// part) writes first. Throws BadInputError as serialize does.
std::string header_of(std::span<const TensorMeta> tensors, const Metadata& metadata);

// Serializes to memory (header padded with spaces to a multiple of 8, as the reference
// implementation does). Throws Error on inconsistent input (duplicate names, size mismatch).
std::vector<uint8_t> serialize(std::span<const WriteTensor> tensors, const Metadata& metadata);

// Writes atomically: PATH.tmp.<random> in the same folder, fsync, rename over PATH. On any
// failure the temporary file is removed and PATH is untouched. Streams tensor bytes, so a large
// checkpoint is never held twice in memory.
void write_file(const std::string& path, std::span<const WriteTensor> tensors, const Metadata& metadata);

}  // namespace deltasync::st
