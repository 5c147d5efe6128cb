// Shard-local publish: every trainer rank encodes its own shard against its own shadow, uploads
// its part of the version (sync/shard_parts.hpp says what a part holds) and returns a small
// receipt; rank 0 gathers the receipts (torch.distributed in the Python layer), checks that the
// parts tile every tensor, and commits the version once through protocol::commit_version. The
// outcome goes back to every rank (conclude), so all of them know whether the version is visible.
//
//   rank 0:  claim = claim_for_group(store, options)            once, at the group's start-up
//   all:     publisher = ShardPublisher(..., broadcast claim, ...)  (the refusal, on every rank)
//   all:     a restart resuming: adopt(all-gathered recover())   (sync/shard_resume.hpp)
//   rank r:  receipt = publisher.publish_part(V, local shards, publisher.anchor_due(V))
//   rank 0:  outcome = commit_parts(store, gathered receipts, ..., publisher.fence())
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

// One tensor of the model as this rank holds it: the full tensor's name, dtype and shape, and
// where the local elements sit (an empty placement: the rank publishes none of it -- an empty
// shard, or a replicated tensor on a rank other than the first).
struct ShardTensor {
  TensorMeta full;
  Placement placement;
};

// What a rank reports to rank 0 after uploading its part(s) of a version.
struct PartReceipt {
  struct Tensor {
    std::string name;
    DType dtype = DType::BF16;
    std::vector<uint64_t> shape;  // the full tensor's
    Placement placement;
    uint64_t digest = 0;   // partial digest at the version, over the placement's full positions
    uint64_t changed = 0;  // changed elements in this rank's part
  };
  uint64_t rank = 0;
  uint64_t version = 0;
  std::optional<uint64_t> base_version;
  bool anchor = false;
  std::string error;  // non-empty: this rank failed the version (the rest is not meaningful)
  bool fenced = false;  // the failure: this rank found its group's fence no longer holds the store
  std::optional<protocol::ObjectRef> delta;  // absent for an anchor-only version or a rank holding nothing
  std::string delta_format;
  std::vector<protocol::ObjectRef> anchor_parts;
  std::vector<Tensor> tensors;  // every tensor of the model, in model order
};
std::string receipt_to_json(const PartReceipt& receipt);
PartReceipt receipt_from_json(std::string_view text, const std::string& label);
// A receipt saying that `rank` failed `version` (the gather still takes place); `fenced`: because
// its group's fence no longer holds the store.
PartReceipt failed_receipt(uint64_t rank, uint64_t version, const std::string& error, bool fenced = false);

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

// What rank 0 tells every rank after a commit attempt.
struct CommitOutcome {
  uint64_t version = 0;
  bool committed = false;
  std::string error;  // why not, when !committed
  bool fenced = false;  // not committed because the group's fence no longer holds the store
  bool anchor = false;
  uint64_t delta_bytes = 0;   // summed over the parts
  uint64_t anchor_bytes = 0;
  uint64_t changed_elements = 0;
};
std::string outcome_to_json(const CommitOutcome& outcome);
CommitOutcome outcome_from_json(std::string_view text, const std::string& label);

// The manifest of one version from every rank's receipt (rank order). BadInputError("version V:
// ...") naming the rank and tensor when a rank failed, ranks disagree about the version, its base
// or anchor, a tensor's name, dtype or shape, or the placements overlap or leave a gap.
// `latest_anchor` is the newest anchor before this version.
protocol::Manifest manifest_from_receipts(std::span<const PartReceipt> receipts, std::optional<uint64_t> latest_anchor);
// Rank 0: manifest_from_receipts with the group's `fence`, every object it names present in the
// store (a part missing: NotFoundError naming it and its rank), then protocol::commit_version.
// Never throws: a failure is the outcome's error, with nothing visible; `fenced` when a rank found
// the fence gone or commit_version refused it (FencedError).
CommitOutcome commit_parts(Store& store, std::span<const PartReceipt> receipts, std::optional<uint64_t> latest_anchor,
                           const protocol::Fence& fence);

class ShardPublisher {
 public:
  // `tensors`: the whole model in the order local shards are passed (every rank lists the same
  // full tensors); `rank` numbers this rank's objects. `claim`: rank 0's claim_for_group, the
  // same on every rank; a refusal throws FencedError with its message. The engine holds the
  // shadow of the local shards it publishes (the CPU twin when omitted). Options: anchor_every,
  // anchor_share, format and keep_anchors apply (run_id and take_over went into the claim);
  // merging and background uploads do not (see above).
  ShardPublisher(std::shared_ptr<Store> store, std::vector<ShardTensor> tensors, uint64_t rank, const ClaimOutcome& claim,
                 std::unique_ptr<engine::SyncEngine> engine, PublisherOptions options = {});
  ~ShardPublisher();

  // Resume (sync/shard_resume.hpp), before the first publish, on every rank. recover(): this
  // rank's shard at the fence's `since`, read from the store; the receipt (never throws: a
  // failure is its error) goes to every rank (an all-gather). adopt(every rank's receipt, rank
  // order): the same verdict on every rank -- Error with one line when a rank failed or the
  // recovered shards do not sum to the manifest's digests, nothing changed -- else the shadow
  // holds the store's bits at `since` and the next version is a delta against it. Returns
  // `since`; nullopt (nothing done) when the store had no version at the claim.
  PartReceipt recover();
  std::optional<uint64_t> adopt(std::span<const PartReceipt> receipts);
  // What this rank's recover() read and how long it took (zeros before).
  ResumeCounters resume_counters() const { return resume_counters_; }

  // True when version `version` must be an anchor: no committed version yet, the last version
  // failed, anchor_every versions since the last anchor, or the committed delta bytes since it
  // passed anchor_share of the model. The same on every rank.
  bool anchor_due(uint64_t version) const;
  // Encodes this rank's shards (local[t] for tensors[t]: placement.numel() elements; anything
  // for an empty placement), uploads its delta part (and its anchor slices when `anchor`) and
  // returns the receipt. Throws Error on bad input (nothing uploaded) or a failed upload, and
  // FencedError, uploading nothing, once the fence no longer holds (checked in LATEST first).
  PartReceipt publish_part(uint64_t version, std::span<const ConstTensorRef> local, bool anchor);
  // The receipt of a version this rank failed with `error` (fenced when publish_part found the
  // fence gone).
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
