// Shard-local publish: every trainer rank encodes its own shard against its own shadow, uploads
// its part of the version (sync/shard_parts.hpp says what a part holds) and returns a small
// receipt (sync/shard_receipts.hpp); rank 0 gathers the receipts and the summed partial digests
// (torch.distributed in the Python layer), checks that the parts tile every tensor, and commits
// the version once through protocol::commit_version (sync/shard_commit.hpp). The outcome goes
// back to every rank (conclude), so all of them know whether the version is visible.
//
//   rank 0:  claim = claim_for_group(store, options)            once, at the group's start-up
//   all:     publisher = ShardPublisher(..., broadcast claim, ...)  (the refusal, on every rank)
//   all:     a restart resuming: adopt(all-gathered recover())   (sync/shard_resume.hpp)
//   rank r:  receipt = publisher.publish_part(V, local shards, publisher.anchor_due(V))
//   all:     reduce split_partials(receipt.partials) to rank 0; gather receipt_to_bytes(receipt)
//   rank 0:  outcome = commit_parts(store, {receipts, join_partials(sums), publisher.tensors()}, ...)
//            (outcome.needs_tables: gather every rank's table_to_bytes(tensors()), commit again)
//   all:     publisher.conclude(V, broadcast outcome)
//
// Fencing (protocol.hpp) is the single publisher's: the group claims the store once, on rank 0,
// and every version's manifest carries that fence, so commit_version refuses a fenced-off group
// and LATEST keeps naming its owner. Every rank checks the fence before it uploads (one read of
// LATEST) and a refusal at commit is in the outcome: from then on every rank refuses to publish.
//
// Decisions the ranks must share are made from state they share: anchor_due() depends only on
// versions and on the committed delta bytes each outcome carries, so every rank decides alike.
// A version that did not commit (any rank failed, or the commit did) leaves each shadow ahead of
// the store, so the next version is an anchor on every rank. No pending versions are merged:
// publish_part uploads before it returns (a rank's part is small: its share of the changes).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/placement.hpp"
#include "core/tensor_meta.hpp"
#include "engine/engine.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "sync/publisher.hpp"
#include "sync/shard_commit.hpp"
#include "sync/shard_receipts.hpp"

namespace deltasync {

struct ShardRecovery;  // sync/shard_resume.hpp

// What one rank's resume read from the store (ShardPublisher::recover).
struct ResumeCounters {
  uint64_t bytes_read = 0;     // object bytes fetched: headers, whole parts, ranges (not manifests)
  uint64_t header_reads = 0;   // ranged reads of anchor part headers (two per part: length, header)
  uint64_t whole_objects = 0;  // parts read whole (SHA-256 checked)
  uint64_t ranged_reads = 0;   // ranged reads of anchor slices
  double seconds = 0;
};

// What rank 0 tells every rank after claiming the store at the group's start-up: the fence, or
// the refusal's one line (nothing was written).
struct ClaimOutcome {
  std::optional<protocol::Fence> fence;
  std::string error;  // why not, when !fence
};
std::string claim_to_json(const ClaimOutcome& claim);
ClaimOutcome claim_from_json(std::string_view text, const std::string& label);
// Rank 0, once per group start-up: claim_store_for(store, options) (a new epoch of options'
// run). Never throws: a refusal is the outcome's error.
ClaimOutcome claim_for_group(Store& store, const PublisherOptions& options);

class ShardPublisher {
 public:
  // `tensors`: the whole model in the order local shards are passed (every rank lists the same
  // full tensors; a tensor's rule, when it has one, must give its placement at its coordinate);
  // `rank` numbers this rank's objects. `claim`: rank 0's claim_for_group, the
  // same on every rank; a refusal throws FencedError with its message. The engine holds the
  // shadow of the local shards it publishes (the CPU twin when omitted). Options: anchor_every,
  // anchor_share, format and keep_anchors apply (run_id and take_over went into the claim);
  // merging and background uploads do not (see above).
  ShardPublisher(std::shared_ptr<Store> store, std::vector<ShardTensor> tensors, uint64_t rank, const ClaimOutcome& claim,
                 std::unique_ptr<engine::SyncEngine> engine, PublisherOptions options = {});
  ~ShardPublisher();

  // Resume (sync/shard_resume.hpp), before the first publish, on every rank. recover(): this
  // rank's shard at the fence's `since`, read from the store; the receipt (never throws: a
  // failure is its error) goes to every rank (an all-gather; its partials an all-reduce).
  // adopt(every rank's receipt in rank order, the summed partials, and every rank's table when
  // tables_needed): the same verdict on every rank -- Error with one line when a rank failed or
  // the recovered shards do not sum to the manifest's digests, nothing changed -- else the shadow
  // holds the store's bits at `since` and the next version is a delta against it. Returns
  // `since`; nullopt (nothing done) when the store had no version at the claim.
  PartReceipt recover();
  std::optional<uint64_t> adopt(std::span<const PartReceipt> receipts, std::span<const uint64_t> digests,
                                std::span<const std::vector<ShardTensor>> tables = {});
  // What this rank's recover() read and how long it took (zeros before).
  ResumeCounters resume_counters() const { return resume_counters_; }

  // True when version `version` must be an anchor: no committed version yet, the last version
  // failed, anchor_every versions since the last anchor, or the committed delta bytes since it
  // passed anchor_share of the model. The same on every rank.
  bool anchor_due(uint64_t version) const;
  // Encodes this rank's shards (local[t] for tensors[t]: placement.numel() elements; anything
  // for an empty placement), uploads its delta part -- the tensors it changed -- (and its anchor
  // slices when `anchor`) and returns the receipt, with this rank's partials. Throws Error on bad input (nothing uploaded) or a failed upload, and
  // FencedError, uploading nothing, once the fence no longer holds (checked in LATEST first).
  PartReceipt publish_part(uint64_t version, std::span<const ConstTensorRef> local, bool anchor);
  // The receipt of a version this rank failed with `error` (fenced when publish_part found the
  // fence gone); its partials are zeros.
  PartReceipt failed(uint64_t version, const std::string& error) const;
  // Every rank, with rank 0's outcome for the version publish_part last returned (or one that
  // failed before it returned). Retention runs on rank 0 after a committed anchor. A fenced
  // outcome stops this rank: publish_part refuses from then on.
  void conclude(const CommitOutcome& outcome);

  // The run and epoch the group claimed the store with.
  const protocol::Fence& fence() const { return fence_; }
  // Non-empty once this rank knows the fence no longer holds: why.
  const std::string& fenced() const { return fenced_; }

  PublisherState state() const { return committed_; }
  const std::vector<ShardTensor>& tensors() const { return tensors_; }
  uint64_t rank() const { return rank_; }
  const PublisherOptions& options() const { return options_; }

 private:
  std::shared_ptr<Store> store_;
  std::vector<ShardTensor> tensors_;
  PartReceipt table_receipt_;     // the fields every receipt of this rank shares (describe_table)
  std::vector<TensorMeta> full_;  // tensors_[t].full
  std::vector<size_t> held_;      // model indices of the tensors this rank publishes (engine order)
  uint64_t rank_ = 0;
  std::unique_ptr<engine::SyncEngine> engine_;
  PublisherOptions options_;
  protocol::Fence fence_;
  std::string fenced_;
  DeltaFormat format_ = DeltaFormat::Compact;
  uint64_t model_bytes_ = 0;

  PublisherState committed_;            // what the store shows (from the outcomes)
  std::vector<uint64_t> digests_;       // partials at committed_.last_version, per model tensor
  bool broken_ = false;                 // the shadow is ahead of the store: next is an anchor
  bool shadow_started_ = false;         // the engine's shadow holds the held shards (reset once)
  std::optional<uint64_t> pending_version_;
  std::vector<uint64_t> pending_digests_;
  std::unique_ptr<ShardRecovery> recovered_;  // recover()'s result until adopt()
  // The recovered bits in the engine's memory, kept until the first encode has run after the
  // shadow was reset from them (a device engine's copies are queued on its stream).
  std::vector<std::unique_ptr<engine::EngineMemory>> resume_staging_;
  ResumeCounters resume_counters_;
};

}  // namespace deltasync
