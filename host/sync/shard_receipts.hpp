// What a trainer rank tells rank 0 after uploading its part of a version (shard-local publish,
// sync/shard_publish.hpp), and how rank 0 learns every rank's placements from it without a list
// of the model's tensors from every rank.
//
// Every rank holds the same tensor table (names, dtypes, full shapes) and, for most tensors, the
// same placement rule (DTensor Shard(d) over a mesh of M ranks, Replicate) at its own mesh
// coordinate, so rank 0 derives every rank's placements from its own table and rules and the
// ranks' coordinates. A receipt carries
//   - the SHA-256 of the rank's table and of its rules (rank 0 compares them with its own),
//   - the rank's mesh coordinate and the placements its rules at that coordinate do not give
//     (explicit per-rank offsets; none under FSDP2 or TP),
//   - its object references, anchor flag, versions, error and fence, and its changed elements:
// about 300 bytes plus the explicit placements, in a binary form (receipt_to_bytes). Its partial
// digests (one per tensor) are not in it: they add mod 2^64 across the ranks, so a reduce sums
// them (torch.distributed, int64), each split into two 32-bit halves that no signed sum of up to
// 2^31 ranks overflows (split_partials), joined mod 2^64 at rank 0 (join_partials). When a hash
// differs (tables_needed), rank 0 gathers every rank's whole table in a second round
// (table_to_bytes) and names the rank and tensor that disagree: the failing path may be slow, the
// common one is O(tensors) at rank 0 and O(1) per rank on the wire.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/placement.hpp"
#include "core/tensor_meta.hpp"
#include "sync/protocol.hpp"

namespace deltasync {

// One tensor of the model as a rank holds it: the full tensor's name, dtype and shape, where the
// local elements sit (an empty placement: the rank publishes none of it -- an empty shard, or a
// replicated tensor on a rank other than the first), and the rule that placed them, when one did
// (kExplicit otherwise: the placement is this rank's alone).
struct ShardTensor {
  TensorMeta full;
  Placement placement;
  PlacementRule rule = {};
};

using TableHash = std::array<uint8_t, 32>;

// What a rank reports to rank 0 after uploading its part(s) of a version (or after recovering its
// shard at a resume).
struct PartReceipt {
  uint64_t rank = 0;
  uint64_t version = 0;
  std::optional<uint64_t> base_version;
  bool anchor = false;
  std::string error;  // non-empty: this rank failed the version (the rest is not meaningful)
  bool fenced = false;  // the failure: this rank found its group's fence no longer holds the store
  std::optional<protocol::ObjectRef> delta;  // absent for an anchor-only version or a rank holding nothing
  std::string delta_format;
  std::vector<protocol::ObjectRef> anchor_parts;
  uint64_t changed = 0;   // changed elements in this rank's part
  uint64_t tensors = 0;   // tensors in its table
  TableHash table_hash{};  // of its tensors' names, dtypes and shapes, in model order
  TableHash rules_hash{};  // of its tensors' rules without coordinates (kind, dim, mesh size)
  uint64_t coordinate = 0;  // its mesh coordinate (that of its first tensor with a rule)
  // (tensor, placement) where the rule at `coordinate` does not give the rank's placement: a
  // tensor without a rule that it holds, or a rule at another coordinate. Ascending tensors.
  std::vector<std::pair<uint64_t, Placement>> placements;
  // Its partial digest of every tensor (0 where it holds none). Not in the wire form: summed
  // across the ranks by the reduce.
  std::vector<uint64_t> partials;
};

// Sets the table fields of `receipt` (tensors, hashes, coordinate, placements) from a rank's table.
void describe_table(std::span<const ShardTensor> tensors, PartReceipt& receipt);

// The wire form of a receipt (without `partials`), and its strict reader (BadInputError("LABEL:
// ...") for anything malformed or cut short).
std::vector<uint8_t> receipt_to_bytes(const PartReceipt& receipt);
PartReceipt receipt_from_bytes(std::span<const uint8_t> bytes, const std::string& label);
// A receipt saying that `rank` failed `version` (the gather still takes place); `fenced`: because
// its group's fence no longer holds the store. Its partials are zeros (`tensors` of them).
PartReceipt failed_receipt(uint64_t rank, uint64_t version, const std::string& error, bool fenced = false, size_t tensors = 0);

// A rank's whole table (names, dtypes, shapes, placements, rules): the second round's gather.
std::vector<uint8_t> table_to_bytes(std::span<const ShardTensor> tensors);
std::vector<ShardTensor> table_from_bytes(std::span<const uint8_t> bytes, const std::string& label);

// Partials as the reduce sums them: [low halves..., high halves...], each in [0, 2^32).
std::vector<int64_t> split_partials(std::span<const uint64_t> partials);
// The reduce's sums back as digests mod 2^64. BadInputError("LABEL: ...") for another length than
// 2 x `tensors` or a negative sum.
std::vector<uint64_t> join_partials(std::span<const int64_t> summed, size_t tensors, const std::string& label);

// What rank 0 (or, at a resume, every rank) holds after the gather: every rank's receipt (rank
// order), the partials summed across the ranks (per tensor of `mine`), its own table and -- after
// the second round, when tables_needed -- every rank's table (rank order).
struct GatheredReceipts {
  std::span<const PartReceipt> receipts;
  std::span<const uint64_t> digests;
  std::span<const ShardTensor> mine;
  std::span<const std::vector<ShardTensor>> tables = {};
};

// True when every rank's placements cannot be derived from `mine`: a receipt's tensor count or a
// hash differs from mine's. False when a rank failed (the failure is what gets reported).
bool tables_needed(std::span<const PartReceipt> receipts, std::span<const ShardTensor> mine);

// The model every rank holds (the first rank's, checked against every other's) and where each
// rank's elements lie: placements over the ranks (part r is receipts[r]'s rank), every tensor
// tiled exactly -- each placement pattern (a rule and a shape) checked once. BadInputError
// ("LABEL: rank R reports tensor T as BF16[..], rank 0 as ..." -- from the tables --, "LABEL:
// tensor T: rank A and rank B overlap at position P", "...: no part covers positions P..Q").
// Error when the tables are needed and absent. O(tensors + patterns x ranks) without tables.
struct RankPlacements {
  std::vector<TensorMeta> model;
  protocol::PartPlacements placements;
};
RankPlacements rank_placements(const GatheredReceipts& gathered, const std::string& label);

}  // namespace deltasync
