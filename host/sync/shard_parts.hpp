// The files of a shard-local publish (sync/shard_publish.hpp) and how readers put them together.
//
// Delta part: an ordinary delta file (any layout) over the tensors the rank changed -- its tensor
// table, tensor_shapes and changed_params name only those, with their full shapes, and its
// positions are full-tensor positions; its base/result digests are the rank's partials over the
// positions it holds (sums mod 2^64 of the same terms, so the parts' partials add up to the full
// digests). Parts written before manifest format 3 name every tensor of the model in
// tensor_shapes and carry one more key, which readers no longer need:
//   unchanged_digests  {tensor: partial digest} of the tensors the rank held but did not change
// A reader derives each changed tensor's full base digest from the manifest's full digest at the
// version instead: base = result - sum over the parts changing it of (part result - part base),
// which holds for both kinds of parts (docs/stores.md).
// Anchor part holding slices: each tensor the rank holds, as its local elements (1-D), with
//   placements     {tensor: {"shape": [full shape], "placement": [first, run_length, run_stride,
//                  run_count]}}
//   slice_digests  {tensor: partial digest of the slice, in full positions}
// A reader never needs to know the sharding: combine_delta_parts turns a version's parts into
// the patches and promises of one delta, and assemble_anchor_slices the slices into full tensors.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/placement.hpp"
#include "core/tensor_meta.hpp"
#include "engine/integrity.hpp"
#include "codec/delta_io.hpp"
#include "format/safetensors.hpp"
#include "sync/protocol.hpp"

namespace deltasync {

namespace shard_keys {
inline constexpr const char* kUnchangedDigests = "unchanged_digests";
inline constexpr const char* kPlacements = "placements";
inline constexpr const char* kSliceDigests = "slice_digests";
}  // namespace shard_keys

// A placement as manifests, receipts and anchor metadata write it: [first, run_length,
// run_stride, run_count]. Reading gives nullopt for anything but 4 non-negative integers.
nlohmann::json placement_to_json(const Placement& placement);
std::optional<Placement> placement_from_json(const nlohmann::json& j);

// One version's delta as the verified apply takes it: patches[t] for base tensor t (positions
// ascending, int64), pointing into this object's own storage.
struct CombinedDelta {
  integrity::DeltaDigests digests;
  // Compact parts decoded without host base bits (compact_two_phase.hpp): values are "unbased",
  // to be rebased on the receiver's current bits at the same positions where those live.
  bool relative = false;
  std::vector<PatchRef> patches;
  uint64_t changed_elements = 0;
  std::vector<std::vector<int64_t>> positions;
  std::vector<std::vector<uint8_t>> values;
};

// Position k of a patch (int32 or int64 indices).
inline uint64_t patch_index(const PatchRef& p, uint64_t k) {
  if (p.index_width == 4) return static_cast<uint64_t>(static_cast<const int32_t*>(p.indices)[k]);
  return static_cast<uint64_t>(static_cast<const int64_t*>(p.indices)[k]);
}

// One delta part (or a whole delta: its placements whole) resolved for a reader of `base_meta`
// and checked against its manifest entry (delta_promises: versions, digests present) and its
// placements (`held(t)`: the part's placement of tensor t; a change outside it is a BadInputError
// naming the part and tensor). Compact parts without `base_bits` decode unbased (`relative`).
struct ResolvedPart {
  ResolvedDelta delta;  // its storage; delta.patches is emptied (a part changes few tensors)
  integrity::DeltaDigests promises;  // the part's partials of the tensors it changes
  bool relative = false;
  std::vector<std::pair<size_t, PatchRef>> patches;  // (base tensor, its changes) for each tensor changed, ascending
};
void resolve_delta_part(const protocol::Manifest& manifest, const st::File& file, std::span<const TensorMeta> base_meta,
                        std::span<const ConstTensorRef> base_bits, const std::function<Placement(size_t)>& held, ResolvedPart& out);

// Combines the delta parts of `manifest` (files[k] is manifest.delta_parts[k]'s bytes, SHA-checked)
// for a receiver holding `base_meta`. `base_bits` are the receiver's current bits in host memory
// (compact parts code values relative to them); empty when the weights are elsewhere: compact
// parts are then decoded unbased (`relative`), for the receiver to rebase where its bits live.
// Checks, each a BadInputError naming the tensor and part, before anything is applied: the
// parts' placements tile every tensor exactly (no overlap, no gap, no tensor the model lacks;
// once per placement pattern and tensor size, never parts x tensors); every part's file matches
// its manifest entry (versions, digests present; its positions inside its placement); no two
// parts change one position; every part that changes a tensor records its partials, and the
// manifest records the tensor's digest. Promises: the result is the manifest's digest, the base
// that minus the parts' changes of it.
CombinedDelta combine_delta_parts(const protocol::Manifest& manifest, std::span<const st::File> files,
                                  std::span<const TensorMeta> base_meta, std::span<const ConstTensorRef> base_bits);

// One rank's anchor part: its slices of the tensors it holds. local[k] holds the elements of
// tensors[k] at placements[k] (numel equal). Returns the file's bytes.
std::vector<uint8_t> serialize_anchor_slices(std::span<const TensorMeta> tensors, std::span<const Placement> placements,
                                             std::span<const std::span<const uint8_t>> local, uint64_t version,
                                             const std::string& part_label);
// True when an anchor part holds slices (its metadata has `placements`).
bool holds_anchor_slices(const st::File& file);

// The tensors of one anchor part (already SHA-checked) as slices of the full tensors: a part of
// slices as its placements say, each slice's digest checked against slice_digests and its
// placement against the full shape (BadInputError naming the part and tensor); an ordinary
// part's tensors whole. `bytes` point into `file`.
struct AnchorSlice {
  TensorMeta full;
  Placement placement;
  std::span<const uint8_t> bytes;
};
std::vector<AnchorSlice> anchor_part_slices(const st::File& file);

// Full tensors assembled from the slices of several anchor parts (held in `storage`).
struct AssembledTensors {
  std::vector<TensorMeta> tensors;
  std::vector<std::vector<uint8_t>> storage;
};
// Every slice's digest is checked against its slice_digests entry, the dtype and full shape of a
// tensor must agree across parts, and its slices must tile it (check_tiling). Throws
// BadInputError("LABEL: ...") naming the tensor and part.
AssembledTensors assemble_anchor_slices(std::span<const st::File* const> parts, const std::string& label);

}  // namespace deltasync
