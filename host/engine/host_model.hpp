// A model's weights held in host memory, with the version they are at and their per-tensor
// digests: what a subscriber updates in place and what the CLI reads from / writes to a
// checkpoint file.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "format/delta_file.hpp"
#include "format/safetensors.hpp"
#include "core/tensor.hpp"

namespace deltasync {

struct HostModel {
  std::vector<TensorMeta> tensors;
  std::vector<std::vector<uint8_t>> data;  // data[t]: tensors[t]'s bytes (huge-page advised by load)
  std::optional<uint64_t> version;         // nullopt: unknown / nothing loaded
  std::vector<uint64_t> digests;           // digests[t] of data[t]; empty until computed

  bool empty() const { return tensors.empty(); }
  uint64_t bytes() const;
  uint64_t elements() const;
  std::vector<TensorRef> refs();
  std::vector<ConstTensorRef> const_refs() const;
  void compute_digests();

  // Reads every weight tensor of a safetensors checkpoint (model_version from its metadata when
  // present). Throws Error("PATH: reason").
  static HostModel load(const std::string& path);
  // Builds a model from an opened file (the bytes are copied).
  static HostModel from_file(const st::File& file);
  // Writes the weights atomically as a safetensors checkpoint with model_version, the digests
  // and `extra` in its metadata.
  void save(const std::string& path, const st::Metadata& extra = {}) const;
};

}  // namespace deltasync
