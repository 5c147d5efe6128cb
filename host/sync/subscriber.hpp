// The reader side of the store protocol: find the newest version cheaply, plan the cheapest
// catch-up by bytes, fetch in parallel, verify every object (SHA-256 against the manifest) and
// every apply (integrity digests), and on any failure keep consistent weights and recover from
// the newest anchor.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "core/fields.hpp"
#include "engine/engine.hpp"
#include "engine/host_model.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "sync/receiver.hpp"

namespace deltasync {

struct SubscriberOptions {
  unsigned parallel_fetches = 4;  // objects downloaded at once
  // A receiver reading parts of a delta by ranges (a tensor-parallel rank) reads two ranges at
  // most this many bytes apart as one request (ranged::merge_gaps: a request costs about as much
  // as this many bytes of transfer).
  uint64_t range_gap_bytes = ranged::kDefaultGapBytes;
  // Called with a one-line note (plan chosen, recovery started); may be empty.
  std::function<void(const std::string&)> log;
};

struct SyncReport {
  std::optional<uint64_t> from;  // version before (nullopt: nothing usable)
  uint64_t to = 0;
  protocol::CatchUpPlan plan;    // the plan that succeeded
  bool recovered = false;        // the first plan failed (or the weights did not match their
  std::string recovery_reason;   // version) and the model was rebuilt from an anchor
  std::optional<uint64_t> anchor;  // the anchor loaded (if any)
  std::vector<uint64_t> deltas;    // the deltas applied, in order
  uint64_t bytes_fetched = 0;      // what this receiver (rank) read from the store
  uint64_t delta_bytes = 0;        // the applied deltas' objects, whole (a rank may read less)
  uint64_t changed_elements = 0;   // changes the applied deltas carry
  uint64_t applied_elements = 0;   // elements written into the weights here
  double fetch_seconds = 0, apply_seconds = 0, total_seconds = 0;
  double pause_seconds = 0;        // inside the receiver: the weights being written and verified
  engine::TransferCounters transfer;  // host <-> device traffic and host syncs of the applies
  // Requests to the store since the previous report (the polls that found nothing new included):
  // what this version cost this replica.
  uint64_t store_requests = 0;
};

// SyncReport as callers see it, listed once: the Python binding's dicts and the UpdateReport
// dataclass derive from this list (the names are the Python ones).
inline auto sync_report_fields() {
  using R = SyncReport;
  return std::make_tuple(
      fields::member("from_version", &R::from, "version before (None: nothing usable)"),
      fields::member("to_version", &R::to), fields::member("anchor", &R::anchor, "the anchor loaded, if any"),
      fields::member("deltas", &R::deltas, "the deltas applied, in order"),
      fields::member("changed_elements", &R::changed_elements),
      fields::member("applied_elements", &R::applied_elements, "elements written here (a TP rank writes its share)"),
      fields::member("bytes_fetched", &R::bytes_fetched, "what this rank read from the store"),
      fields::member("delta_bytes", &R::delta_bytes, "the applied deltas' objects, whole (a TP rank reads only its ranges)"),
      fields::member("fetch_seconds", &R::fetch_seconds),
      fields::member("apply_seconds", &R::apply_seconds, "parse + verify + write"),
      fields::member("pause_seconds", &R::pause_seconds, "the weights being written and verified"),
      fields::member("total_seconds", &R::total_seconds),
      fields::computed<R>("recovered", [](const R& r) { return r.recovered ? std::optional<std::string>(r.recovery_reason) : std::nullopt; },
                          "why the first plan failed and an anchor was loaded"),
      fields::computed<R>("plan", [](const R& r) { return r.plan.describe(); }),
      fields::computed<R>("host_to_device_bytes", [](const R& r) { return r.transfer.host_to_device_bytes; }),
      fields::computed<R>("device_to_host_bytes", [](const R& r) { return r.transfer.device_to_host_bytes; }),
      fields::computed<R>("host_syncs", [](const R& r) { return r.transfer.host_syncs; }),
      fields::member("store_requests", &R::store_requests, "requests to the store since the previous report, polls included"));
}
// 17 members (recovered + recovery_reason listed as one, `transfer` as its three counters): a
// member added to SyncReport changes the count and needs an entry above.
static_assert(fields::member_count<SyncReport>() == 17, "a SyncReport member needs an entry in sync_report_fields()");

class Subscriber {
 public:
  explicit Subscriber(Store& store, SubscriberOptions options = {});

  // The newest visible version. Reads LATEST with a conditional GET (no body moves while it is
  // unchanged) and confirms the manifest exists; falls back to listing manifests when LATEST is
  // absent or names a version without a manifest. nullopt: the store has no versions.
  std::optional<uint64_t> poll();

  // Brings `weights` to `target` (default: the newest version). Weights with a version are
  // first audited: their digests (computed if missing) must equal those their version's
  // manifest records; otherwise they are treated as having nothing and rebuilt from an anchor.
  // On success weights.version() == target and its digests match the target's manifest. On
  // failure throws Error; the weights then hold consistent bits at weights.version() (possibly
  // advanced part way, never half a delta).
  SyncReport sync(Receiver& weights, std::optional<uint64_t> target = std::nullopt);
  // Same for a HostModel (an empty one takes its tensors from the anchor).
  SyncReport sync(HostModel& model, std::optional<uint64_t> target = std::nullopt);

  // The tensors (names, dtypes, shapes, in anchor order) of the model as published at `target`
  // (default: the newest version), read from the headers of the anchor its catch-up starts
  // from -- a ranged read of each part's header, not the weights. What a receiver that maps the
  // published tensors onto its own parameters learns its map from.
  std::vector<TensorMeta> published_tensors(std::optional<uint64_t> target = std::nullopt);

  // Anchor `version`'s tensors handed to `write` one part at a time: each part is fetched,
  // checked against the manifest's SHA-256, and its tensors' digests recomputed and compared
  // with those the part and the manifest record before `write` sees it; then it is dropped, so
  // host memory is bounded by one part, not the model. Only when every tensor of the manifest
  // has come exactly once does this return (else Error): until then the caller keeps what
  // `write` wrote staged (temp names). An anchor of slices (a shard-local publish) streams too,
  // in groups of full tensors assembled from every part's slices (sync/slice_anchor_stream.hpp:
  // each slice's digest checked before `write` sees it, each part's SHA-256 once its last byte
  // has streamed, before this returns). Error kUnsupported for the rare anchor that cannot
  // stream (parts of whole tensors and of slices mixed, parts in different tensor orders),
  // which callers load whole; `write` may have been called before it.
  // write(tensors, their bits, their digests) for one part (one group of an anchor of slices).
  using AnchorPartWriter = std::function<void(std::span<const TensorMeta>, std::span<const std::span<const uint8_t>>,
                                              std::span<const uint64_t>)>;
  SyncReport stream_anchor(uint64_t version, const AnchorPartWriter& write);

  protocol::Catalog& catalog() { return catalog_; }

  // How long a follower waits before its next poll: `interval_s` (at least kMinPollSeconds)
  // jittered uniformly by +-50%, so many replicas of one store do not poll in step. Every
  // follower (the CLI's pull --follow, the vLLM follow mode) waits this long between polls.
  static constexpr double kMinPollSeconds = 0.05;
  static double next_poll_delay(double interval_s);

 private:
  void execute(const protocol::CatchUpPlan& plan, Receiver& weights, SyncReport& report);
  // An anchor part by part into a receiver that streams anchors; false (nothing written) for an
  // anchor of slices, which is loaded whole.
  bool stream_anchor_into(const protocol::Manifest& anchor, Receiver& weights, SyncReport& report);
  // The tensors of an anchor, from ranged reads of its parts' headers (published_tensors).
  std::vector<TensorMeta> anchor_table(const protocol::Manifest& anchor);
  std::vector<std::vector<uint8_t>> fetch_all(const std::vector<protocol::ObjectRef>& objects, SyncReport& report);
  // fetch_all for a plan's objects (`anchor_parts` anchor parts first, then the deltas of
  // `chain` in order), reading only the needed ranges of each sealed compact delta when the
  // receiver holds part of the model (subscriber_ranged.cpp); counts delta_bytes.
  std::vector<std::vector<uint8_t>> fetch_planned(const std::vector<protocol::ObjectRef>& objects, size_t anchor_parts,
                                                  const std::vector<const protocol::Manifest*>& chain, const Receiver& weights,
                                                  SyncReport& report);
  void note(const std::string& line) const;
  uint64_t take_requests();  // the store's requests since the last call (or construction)

  Store& store_;
  SubscriberOptions options_;
  protocol::Catalog catalog_;
  std::string latest_etag_;
  std::optional<uint64_t> latest_seen_;
  bool can_list_ = true;
  uint64_t requests_reported_ = 0;
};

// An anchor's parts, parsed and verified in host memory before any of it reaches the weights:
// parts in order, every tensor once, each tensor's digest recomputed and compared with the
// digests the parts and the manifest record. `tensors[t]`'s bits are `bytes[t]` (pointing into
// `files`).
struct VerifiedAnchor {
  std::vector<st::File> files;
  std::vector<TensorMeta> tensors;
  std::vector<std::span<const uint8_t>> bytes;
  std::vector<uint64_t> digests;
  // Full tensors assembled from anchor parts that hold slices (sync/shard_parts.hpp); `bytes`
  // points into them for those tensors.
  std::vector<std::vector<uint8_t>> assembled;
};
VerifiedAnchor verify_anchor(const protocol::Manifest& manifest, std::vector<std::vector<uint8_t>> parts,
                             const std::string& label);

}  // namespace deltasync
