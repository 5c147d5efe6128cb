// The delta and anchor layouts on top of safetensors.
//
// Delta (sparse="True"), the layout TRL's delta receiver reads: for each changed tensor NAME,
// `NAME.indices` (I32 ascending flat row-major positions; I64 only for a tensor of more than
// 2^31-1 elements) and `NAME.values` (the tensor's dtype), both 1-D of the same length.
// Anchor (sparse="False"): every tensor whole under its own name.
// Metadata (all values strings; README documents them): sparse, format, model_version,
// base_version, sparsity, changed_params (JSON list), total_elements, total_changed_elements,
// tensor_shapes (JSON object name -> {"dtype": D, "shape": [..]} for every tensor of the model).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.hpp"
#include "format/safetensors.hpp"
#include "core/tensor.hpp"
#include "core/tensor_meta.hpp"

namespace deltasync {

// A changed tensor's digests before and after a delta (a delta part's: its rank's partials).
struct TensorDigests {
  std::string name;
  uint64_t base = 0, result = 0;
};

struct DeltaInfo {
  uint64_t model_version = 0;
  std::optional<uint64_t> base_version;
  st::Metadata extra;  // additional metadata written verbatim (e.g. digests)
  // The digests of extra's base_digests / result_digests, typed: integrity::put_delta_digests
  // sets both forms; the compact indexed layout (compact_layout 2) stores these in its binary
  // records instead of JSON, and its reader fills only these. nullopt: none typed.
  std::optional<std::vector<TensorDigests>> digests;
};

// Tensor metadata of a checkpoint file, in file order (throws if a dtype is not a weight dtype).
std::vector<TensorMeta> model_tensors(const st::File& checkpoint);

// Whether a delta's metadata names its tensors (changed_params, tensor_shapes): every layout but
// the compact indexed one, which numbers them instead so that its header stays one size.
enum class TensorNames { kListed, kNumbered };

// The metadata every delta layout carries (sparse, format, model_version, base_version,
// sparsity, changed_params, totals, tensor_shapes, then info.extra; keys with a typed field in
// DeltaInfo are refused in extra, derived keys in extra are replaced). `label` names errors.
// kNumbered leaves out changed_params and tensor_shapes.
st::Metadata delta_metadata(const std::string& label, std::span<const TensorMeta> tensors, const DeltaView& delta,
                            const DeltaInfo& info, std::string_view format, TensorNames names = TensorNames::kListed);

// The typed fields and the remaining keys (as extra) of a delta's metadata; Error("LABEL: ...")
// when model_version is missing or a version is not a non-negative integer.
DeltaInfo delta_info(const st::Metadata& metadata, const std::string& label);

// Writes a delta in the interoperable layout. `tensors` is the model in the order of the
// encode that produced `delta` (delta.num_tensors() == tensors.size()).
void write_trl_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                     const DeltaInfo& info);

// The same delta as bytes in memory (for a store upload).
std::vector<uint8_t> serialize_trl_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                         const DeltaInfo& info);

// Writes an anchor: every tensor whole. data[t] holds tensors[t]'s bytes.
void write_anchor(const std::string& path, std::span<const TensorMeta> tensors,
                  std::span<const std::span<const uint8_t>> data, const DeltaInfo& info);

// The same anchor as bytes in memory.
std::vector<uint8_t> serialize_anchor(std::span<const TensorMeta> tensors, std::span<const std::span<const uint8_t>> data,
                                      const DeltaInfo& info);

// A delta file read and checked for layout: each entry is one changed tensor with a PatchRef
// pointing into the mapped file.
struct DeltaEntry {
  std::string name;
  DType dtype;
  PatchRef patch;
};

struct ParsedDelta {
  bool sparse = true;
  DeltaInfo info;
  std::vector<DeltaEntry> entries;  // file order
};

// Checks the layout of a delta (pairs complete, indices I32/I64 1-D, values 1-D of the same
// length, metadata parseable). Throws Error("LABEL: reason"). The entries point into `file`,
// which must outlive them.
ParsedDelta parse_trl_delta(const st::File& file);

// TRL's later layout (its never-merged delta-weight-sync branches): for each changed tensor
// `NAME.idx` and `NAME.val` (the tensor's dtype), 1-D of the same length; metadata
// format="sparse_weight_patch", version="1", sparse, model_version, num_changed_params,
// total_changed_elements, total_elements, sparsity and encoding, which says how `NAME.idx` holds
// the ascending flat positions p[0] < p[1] < ...:
//   raw        I32 positions (deltasync writes I64 for a tensor of more than 2^31-1 elements)
//   gap_delta  g[k] = p[k] - p[k-1] - 1 with p[-1] = -1 (so g[0] = p[0]), as U16 when every gap
//              of the tensor fits, else U32: the index tensor's dtype is its width.
// An anchor is every tensor whole with sparse="False", as in the other layout. docs/trl-formats.md
// says which of this is TRL's and which is ours.
enum class IndexEncoding { Raw, GapDelta };
std::string_view index_encoding_name(IndexEncoding encoding);

// format="sparse_weight_patch" in the metadata.
bool is_trl_idx_file(const st::File& file);

void write_trl_idx_delta(const std::string& path, std::span<const TensorMeta> tensors, const DeltaView& delta,
                         const DeltaInfo& info, IndexEncoding encoding);
std::vector<uint8_t> serialize_trl_idx_delta(std::span<const TensorMeta> tensors, const DeltaView& delta,
                                             const DeltaInfo& info, IndexEncoding encoding);

// A NAME.idx/NAME.val delta read and checked for layout. Raw entries point into the file;
// gap_delta entries point into `positions` (decoded int64). Both must outlive the entries.
struct ParsedTrlIdxDelta {
  ParsedDelta delta;
  IndexEncoding encoding = IndexEncoding::GapDelta;
  std::vector<int64_t> positions;
};
// Throws Error("LABEL: reason") for a malformed file (an unknown version or encoding, an index
// dtype the encoding does not allow, ...). ParsedTrlIdxDelta is filled in place: its entries
// point into its own `positions`.
void parse_trl_idx_delta(const st::File& file, ParsedTrlIdxDelta& out);

// Every patch's positions strictly ascending and inside its base tensor; Error("LABEL: tensor
// NAME: ...") otherwise. For layouts whose positions are decoded (gap_delta) or foreign, so
// that a bad file is named before any weight is written.
void check_patch_positions(std::span<const PatchRef> patches, std::span<const TensorMeta> base,
                           const std::string& label);

// Matches a parsed delta against a base model: every entry names an existing tensor of the same
// dtype. Returns for each base tensor the patch to apply (count 0 where unchanged). Throws
// Error("LABEL: tensor NAME ...") for a delta made for another base.
std::vector<PatchRef> resolve_patches(const ParsedDelta& delta, std::span<const TensorMeta> base,
                                      const std::string& label);

}  // namespace deltasync
