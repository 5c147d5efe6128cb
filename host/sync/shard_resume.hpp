// A restarted trainer group of the same run resumes from the store, not from local files and not
// by publishing the model again: every rank recovers the shadow of *its own shard* at the version
// the group's epoch starts from (the fence's `since`, the newest visible version when rank 0
// claimed the store), so the group's next version is a delta against it.
//
//   all:  receipt = publisher.recover()       this rank's shard, read from the store (never throws)
//   all:  all-gather the receipts, all-reduce their partials (torch.distributed in the Python
//         layer; and every rank's table when tables_needed)
//   all:  publisher.adopt(receipts, sums)      the same verdict on every rank; then the shadow
//
// What a rank reads, on the chain plan_catch_up gives from nothing to `since` (an anchor, then
// the deltas after it), and only what overlaps its own placements:
//   - of each anchor part, its tensor table (a ranged read of the header); a part holding some of
//     the rank's elements is then read whole and checked against the manifest's SHA-256 when they
//     are at least half of it (the same sharding as the publishing group's: the rank's own part),
//     else only the byte ranges that hold them;
//   - of each delta, the parts whose manifest placements overlap the rank's (a one-part delta
//     covers everything), whole, SHA-256 checked and resolved as every reader resolves them
//     (shard_parts.hpp: resolve_delta_part), then applied to the rank's elements.
// Placements are in full-tensor coordinates, so a group of another world size (or sharding) than
// the one that published resumes alike. Verification of the result: each rank's partial digests
// of its recovered shard are summed across the ranks (the all-reduce) and must equal the
// manifest's digests at `since`, tensor by tensor -- which also covers what was read by ranges. Nothing is written to the store or to the trainer's weights: the trainer's weights may
// differ from the store's (the next delta carries the difference).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "sync/publisher.hpp"
#include "sync/shard_publish.hpp"

namespace deltasync {

struct ShardRecovery {
  uint64_t version = 0;  // the version recovered (`since`)
  PublisherState state;  // the store's anchor bookkeeping at it (resumed_state)
  // Bits at `version` of each tensor this rank holds (non-empty placement), in model order: its
  // placement's elements in local order.
  std::vector<std::vector<uint8_t>> local;
  std::vector<uint64_t> partials;  // per model tensor: this rank's partial digest (0: not held)
  std::vector<uint64_t> expected;  // per model tensor: the manifest's digest at `version`
  ResumeCounters counters;
};

// This rank's shard of `tensors` at `fence.since` (which must be set). Throws Error naming the
// object or tensor: a missing or corrupt object, a tensor the store and the model disagree on
// (name, dtype, full shape), anchor parts that do not cover the rank's elements exactly.
ShardRecovery recover_shard(Store& store, std::span<const ShardTensor> tensors, const protocol::Fence& fence);

// Every rank's recovery receipt (rank order) and the summed partials against the manifest's
// digests at `version`: throws Error with one line, the same on every rank, when a rank failed
// ("resume from version V: rank R failed: ..."), the ranks' placements do not tile a tensor, or a
// tensor's partials do not sum to its digest.
void check_recovery(const GatheredReceipts& gathered, uint64_t version, std::span<const uint64_t> expected);

}  // namespace deltasync
