// The compact JSON form of a sharded version's placements (manifest format_version 2): which
// full positions of each tensor each delta part holds, written once per distinct pattern instead
// of once per part and tensor. A 1T MoE model has ~70k tensors; published by 256 trainer ranks,
// the per-part form (format 1) lists ~18M placements, while trainers shard by rules (FSDP2's
// Shard(0) chunks, Shard(d), replicated, per-rank offsets) whose placements are arithmetic in the
// part index and shared by every tensor of one shape.
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
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sync/protocol.hpp"

namespace deltasync::protocol {

// The "part_placements" object of `parts` (their placements maps, in part order).
nlohmann::json part_placements_json(const std::vector<DeltaPart>& parts);

// Fills parts[k].placements from a "part_placements" object. Strict: BadInputError("LABEL: ...")
// for a malformed pattern or segment, a part index past `parts`, a part named twice in one
// pattern, a pattern index out of range, or a pattern whose placements overlap or leave a gap
// (checked once per pattern, up to the end of its last run; the tensor's full size is checked
// against the model where the parts are combined).
void read_part_placements(const nlohmann::json& j, std::vector<DeltaPart>& parts, const std::string& label);

// The placements of one tensor over the parts (part_names[k] names parts[k] in messages) overlap
// or leave a gap below the end of their last run: BadInputError("LABEL: tensor NAME: ..."). Both
// manifest forms check this when read.
void check_parts_tile(const std::vector<Placement>& placements, const std::vector<std::string>& part_names, const std::string& tensor,
                      const std::string& label);

}  // namespace deltasync::protocol
