// Pieces shared by the two TRL-style sparse layouts (delta_file.cpp: NAME.indices/NAME.values;
// delta_file_trl_idx.cpp: NAME.idx/NAME.val): one tensor pair per changed tensor, the same
// metadata checks, the same widest-first layout. Not part of the public format API.
#pragma once
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "format/delta_file.hpp"
#include "format/safetensors.hpp"

namespace deltasync::detail {

[[noreturn]] void fail(const std::string& label, const std::string& reason);

uint64_t metadata_u64(const st::Metadata& md, const std::string& key, const std::string& label);

// The metadata of a sparse-layout file, checked: `sparse` and `format` agree (a file without
// `format` is accepted), versions and the derived keys are well formed when present.
struct SparseMetadata {
  bool sparse = true;
  DeltaInfo info;
  std::optional<uint64_t> declared_changed;                      // total_changed_elements
  std::optional<std::vector<TensorMeta>> shapes;                 // tensor_shapes
  std::map<std::string_view, const TensorMeta*> listed_by_name;  // into shapes
  std::optional<std::vector<std::string>> changed_params;
};
// `delta_format` / `anchor_format`: the `format` value a delta / an anchor of this layout carries.
void parse_sparse_metadata(const st::File& file, std::string_view delta_format, std::string_view anchor_format,
                           SparseMetadata& out);

// NAME + index_suffix and NAME + values_suffix, paired in the order each NAME first appears.
struct TensorPair {
  std::string name;
  const st::TensorInfo* indices = nullptr;
  const st::TensorInfo* values = nullptr;
};
std::vector<TensorPair> pair_tensors(const st::File& file, std::string_view index_suffix,
                                     std::string_view values_suffix);

// Values of a weight dtype (and the one tensor_shapes lists), both 1-D and of equal length.
// Returns the number of changes.
uint64_t check_pair_shapes(const std::string& label, const TensorPair& pair, const SparseMetadata& md);

// changed_params and total_changed_elements, when present, agree with the file's pairs.
void check_declared_totals(const std::string& label, const SparseMetadata& md, std::span<const TensorPair> pairs,
                           uint64_t total_changed);

// The checks every writer of a sparse layout makes before laying out `delta`.
void check_delta_for_write(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta);

// A tensor to write and the alignment it needs (its element width).
struct PendingTensor {
  st::WriteTensor tensor;
  uint32_t alignment = 1;
};
// Widest elements first, so that every array starts naturally aligned in the data section.
std::vector<st::WriteTensor> widest_first(std::vector<PendingTensor> pending);

template <typename T>
std::span<const uint8_t> as_bytes_span(std::span<const T> values) {
  return {reinterpret_cast<const uint8_t*>(values.data()), values.size_bytes()};
}

}  // namespace deltasync::detail
