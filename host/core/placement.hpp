// Where a trainer rank's local shard sits in the full tensor: its flat elements (row-major,
// local order) are the full tensor's flat positions
//   first + r * run_stride + j     for run r < run_count, j < run_length,
// in that order. One description covers every sharding a trainer hands us:
//   - DTensor Shard(d) on any dimension (FSDP2's Shard(0) is one run; Shard(1) of a [R, C] tensor
//     is R runs of the rank's columns), uneven as torch.chunk cuts it (trailing ranks may be empty);
//   - a plain per-rank tensor with an explicit global offset (one run);
//   - Replicate(): the whole tensor, published by the rank whose mesh coordinate is 0 only.
// Positions map in O(1) each and stay ascending (run_stride >= run_length), so a shard's sorted
// changed positions translate to sorted full positions in O(changed).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace deltasync {

struct Placement {
  uint64_t first = 0;
  uint64_t run_length = 0;
  uint64_t run_stride = 0;
  uint64_t run_count = 0;

  uint64_t numel() const { return run_length * run_count; }
  bool empty() const { return numel() == 0; }
  // Full flat position of local element `local` (< numel()).
  uint64_t full_position(uint64_t local) const {
    return first + (local / run_length) * run_stride + local % run_length;
  }
  // True when full position `position` is one of the shard's.
  bool contains(uint64_t position) const;
  // Local element of full position `position` (which contains()): full_position's inverse.
  uint64_t local_position(uint64_t position) const {
    const uint64_t at = position - first;
    return (at / run_stride) * run_length + at % run_stride;
  }
  // One past the last full position covered (first for an empty shard).
  uint64_t end() const { return empty() ? first : first + (run_count - 1) * run_stride + run_length; }
  bool operator==(const Placement&) const = default;
};

// How a trainer places a tensor across its ranks, when a rule does (what rank 0 of a sharded group
// derives every rank's placement from, given each rank's mesh coordinate):
//   kShard      DTensor Shard(dim) over a 1-D mesh of mesh_size ranks (torch.chunk's cut);
//   kReplicate  Replicate(): the whole tensor, published by coordinate 0 only;
//   kExplicit   no rule (a per-rank offset, or anything else): the placement is only the rank's.
struct PlacementRule {
  enum class Kind : uint8_t { kExplicit = 0, kShard = 1, kReplicate = 2 };
  Kind kind = Kind::kExplicit;
  uint32_t dim = 0;         // kShard
  uint64_t mesh_size = 0;   // kShard
  uint64_t coordinate = 0;  // kShard, kReplicate: the rank's coordinate on the mesh
  bool operator==(const PlacementRule&) const = default;
};
// The placement `rule` gives a tensor of `shape` at mesh coordinate `coordinate` (its own
// coordinate aside); empty for kExplicit. Throws Error for a Shard of a dim or coordinate out of
// range.
Placement rule_placement(const PlacementRule& rule, std::span<const uint64_t> shape, uint64_t coordinate);

// The whole tensor of `numel` elements (also Replicate()).
Placement whole_placement(uint64_t numel);
// A contiguous shard of `numel` elements starting at full flat position `offset`.
Placement offset_placement(uint64_t offset, uint64_t numel);
// Rank `index` of `parts` of a Shard(dim) of a tensor of `shape`, cut as torch.chunk does: each
// part gets ceil(size / parts) rows of dimension `dim`, the last non-empty one the rest, the ones
// after it none. Throws Error for a dim out of range or index >= parts.
Placement shard_placement(std::span<const uint64_t> shape, size_t dim, uint64_t index, uint64_t parts);
// Full positions of ascending local positions, in place (ascending stays ascending). Throws
// Error naming `tensor` for a position outside the shard.
void to_full_positions(std::span<int64_t> positions, const Placement& placement, const std::string& tensor);

// Where two placements of one tensor share full positions, in ascending order: fn(a_local,
// b_local, count) for each stretch of `count` consecutive positions held by both, starting at
// local element a_local of `a` and b_local of `b`. O(runs of a + runs of b). Returns the
// positions shared. What a restarted rank uses to take its shard out of another sharding's parts.
uint64_t for_each_overlap(const Placement& a, const Placement& b,
                          const std::function<void(uint64_t a_local, uint64_t b_local, uint64_t count)>& fn);

// "[first, run_length, run_stride, run_count]" (manifests, receipts, anchor metadata).
std::string placement_text(const Placement& placement);

// The placements of one tensor's parts (one per rank or part) tile its `numel` flat positions
// exactly: every position covered once. Throws BadInputError("LABEL: tensor NAME: parts A and B
// overlap at position P" / "...: no part covers positions P..Q") otherwise. `part_names[k]` names
// placements[k] in the message. O(runs log runs).
void check_tiling(std::span<const Placement> placements, std::span<const std::string> part_names, uint64_t numel,
                  const std::string& tensor, const std::string& label);

}  // namespace deltasync
