// Where each tensor of a sharded version's delta lies across its parts, and its compact JSON form
// (manifest format_version 2 and 3). A 1T MoE model has ~70k tensors; published by 256 trainer
// ranks, the per-part form (format 1) lists ~18M placements, while trainers shard by rules
// (FSDP2's Shard(0) chunks, Shard(d), replicated, per-rank offsets) whose placements are
// arithmetic in the part index and shared by every tensor of one shape. So the placements are
// held -- in memory as on the wire -- as a few patterns and one pattern index per tensor, and a
// part's placement of a tensor is computed when asked (O(log segments)); nothing is expanded to
// parts x tensors.
//
//   "part_placements": {
//     "patterns": [[[part, count, first, first_step, run_length, run_stride, run_count], ...], ...],
//     "tensors": {"tensor name": pattern index, ...}
//   }
//
// A segment [p, n, f, s, L, S, R] gives parts p .. p+n-1 (indices into delta_parts) the placements
// {first f + i*s, run_length L, run_stride S, run_count R}, i < n. A pattern's segments are in
// ascending, disjoint part order; a part a tensor's pattern does not name holds none of it.
// FSDP2's Shard(0) over N ranks is at most two segments (the full chunks, then the remainder).
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/placement.hpp"

namespace deltasync::protocol {

// Parts [part, part + count) hold {first + i * first_step, run_length, run_stride, run_count}.
struct PlacementSegment {
  uint64_t part = 0, count = 0, first = 0, first_step = 0, run_length = 0, run_stride = 0, run_count = 0;
  auto operator<=>(const PlacementSegment&) const = default;
};
// Ascending, disjoint parts; every segment's placements non-empty.
using PlacementPattern = std::vector<PlacementSegment>;

// The pattern of one tensor's placements given part by part (per_part[k]: part k's; empty: none).
PlacementPattern pattern_of(std::span<const Placement> per_part);
// Part `part`'s placement under `pattern` (empty where it names none). O(log segments).
Placement placement_in(const PlacementPattern& pattern, uint64_t part);
// Every part's placement under `pattern`, for `parts` parts. O(parts).
std::vector<Placement> expand(const PlacementPattern& pattern, size_t parts);
// The same pattern with each segment's parts renumbered through `part_of` (old index -> new),
// which must keep the parts a segment names consecutive (a caller dropping parts that hold
// nothing at all does).
PlacementPattern renumber(const PlacementPattern& pattern, std::span<const uint64_t> part_of);

class PartPlacements {
 public:
  PartPlacements() = default;
  explicit PartPlacements(size_t parts) : parts_(parts) {}

  size_t parts() const { return parts_; }
  bool empty() const { return tensors_.empty(); }
  // Index of `pattern`, added unless an equal one is held.
  size_t intern(PlacementPattern pattern);
  // Tensor `name` lies as pattern `index` says (replacing what it had).
  void assign(std::string name, size_t index);
  // Tensor `name` lies as `pattern` says; an empty pattern: no part holds any of it.
  void set(std::string name, PlacementPattern pattern);

  const std::vector<PlacementPattern>& patterns() const { return patterns_; }
  // Tensor name -> pattern index, ascending names.
  const std::map<std::string, size_t, std::less<>>& tensors() const { return tensors_; }
  // The pattern of a tensor, or nullptr when no part holds any of it.
  const PlacementPattern* find(std::string_view tensor) const;
  // Part `part`'s placement of `tensor` (empty when it holds none).
  Placement placement(std::string_view tensor, size_t part) const;

  // The per-part form (format 1, tests): part k's {tensor: placement}. O(parts x tensors).
  std::vector<std::map<std::string, Placement>> per_part() const;
  static PartPlacements from_per_part(const std::vector<std::map<std::string, Placement>>& parts);

  bool operator==(const PartPlacements&) const = default;

 private:
  size_t parts_ = 0;
  std::vector<PlacementPattern> patterns_;
  std::map<PlacementPattern, size_t> index_;
  std::map<std::string, size_t, std::less<>> tensors_;
};

// The "part_placements" object.
nlohmann::json part_placements_json(const PartPlacements& placements);

// Reads a "part_placements" object for `parts` delta parts, unexpanded. Strict:
// BadInputError("LABEL: ...") for a malformed pattern or segment, a part index past `parts`, a
// part named twice in one pattern, a pattern index out of range, or a pattern whose placements
// overlap or leave a gap (checked once per pattern, up to the end of its last run: O(patterns x
// parts); the tensor's full size is checked against the model where the parts are combined).
PartPlacements read_part_placements(const nlohmann::json& j, const std::vector<std::string>& part_names, const std::string& label);

// The placements of one tensor over the parts (part_names[k] names parts[k] in messages) overlap
// or leave a gap below the end of their last run: BadInputError("LABEL: tensor NAME: ..."). Every
// manifest form checks this when read.
void check_parts_tile(const std::vector<Placement>& placements, const std::vector<std::string>& part_names, const std::string& tensor,
                      const std::string& label);

// One tensor's placements tile its `numel` elements exactly (no overlap, no gap, nothing past
// it), checked once per distinct (pattern, numel): what a reader combining the parts checks for
// every tensor of its model, in O(patterns x parts + tensors).
class TilingChecker {
 public:
  TilingChecker(const PartPlacements& placements, std::vector<std::string> part_names, std::string label)
      : placements_(placements), part_names_(std::move(part_names)), label_(std::move(label)) {}
  // BadInputError("LABEL: tensor NAME: ...") as check_tiling words it.
  void check(const std::string& tensor, uint64_t numel);

 private:
  const PartPlacements& placements_;
  std::vector<std::string> part_names_;
  std::string label_;
  std::map<std::pair<const PlacementPattern*, uint64_t>, bool> checked_;
};

}  // namespace deltasync::protocol
