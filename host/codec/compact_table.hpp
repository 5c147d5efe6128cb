// The model's tensor table as the compact indexed layout (codec/compact_indexed.hpp) numbers it:
// every tensor of the model sorted by name in natural order (name_less: runs of digits compare
// as numbers, so layer 2 comes before layer 10 and a layer's experts 0..47 are one run), its
// place in that order its *ordinal*. Records follow ordinals, so the records of what one
// expert-parallel receiver rank holds -- a run of experts per layer -- lie together. A
// delta records ordinals, not names, so what names a tensor is the table both ends hold; the file
// carries the table's size and SHA-256 (over every tensor's name, dtype and shape in ordinal
// order) and a reader whose table hashes otherwise -- another model, a tensor renamed, reshaped or
// of another dtype -- refuses the file before reading a record. Building a table sorts and hashes
// the model (tens of milliseconds at 70k tensors): readers of many objects build it once.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor_meta.hpp"

namespace deltasync::compact {

// Natural order: names split into runs of digits and of other bytes; digit runs compare by value
// (then by length: "01" after "1"), other runs bytewise. A strict total order of distinct names.
bool name_less(std::string_view a, std::string_view b);

class TensorTable {
 public:
  // `tensors` in any order (a model's); names must be unique (BadInputError naming the tensor).
  explicit TensorTable(std::span<const TensorMeta> tensors);
  // The same, for a model whose deltas are read one after another (a sharded version's parts
  // against one model): the last table built is kept and handed out again while the model asked
  // for equals the one it was built from, tensor for tensor (an O(T) comparison instead of a sort
  // and a hash per object). Thread-safe.
  static std::shared_ptr<const TensorTable> of(std::span<const TensorMeta> tensors);

  size_t size() const { return sorted_.size(); }
  // The tensor of an ordinal, and where it sits in the span the table was built from.
  const TensorMeta& at(uint32_t ordinal) const { return tensors_[sorted_[ordinal]]; }
  uint32_t model_index(uint32_t ordinal) const { return sorted_[ordinal]; }
  // The ordinal of a name (binary search), nullopt when the model has no such tensor.
  std::optional<uint32_t> ordinal(std::string_view name) const;
  // SHA-256 of the table (docs/compact-format.md, the indexed layout), lowercase hex.
  const std::string& sha256_hex() const { return sha256_hex_; }

 private:
  std::vector<TensorMeta> tensors_;  // as given
  std::vector<uint32_t> sorted_;     // ordinal -> index into tensors_
  std::string sha256_hex_;
};

}  // namespace deltasync::compact
