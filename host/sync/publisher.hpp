// The writer side of the store protocol, one implementation for every caller (the CLI, the
// Python DeltaPublisher, tests) and for weights in host or device memory.
//
// publish(version, weights) runs the engine where the weights live (engine/engine.hpp): a bitwise
// diff against the engine's shadow (the bits last published), and stages the change set in host
// memory -- on a GPU engine with the compact layout only the coded bytes and per-tensor digest
// shifts cross PCIe. Then it returns; a background thread serializes (and codes the compact
// layout when the engine did not), uploads the objects and commits the manifest and LATEST.
// When uploads fall behind, staged versions with a raw change set are merged into one delta
// (union of the changed positions, newest values, oldest base values), so memory stays bounded
// by `max_pending` deltas however slow the store is; staged versions that cannot merge (coded on
// the device, low-memory deltas without base bits) make publish() wait for the oldest upload
// instead. A version also becomes an anchor (full weights) every `anchor_every` versions and
// whenever the delta bytes since the last anchor pass `anchor_share` of the model's size.
//
// Low-memory shadow (engine::ShadowKind::kLowByte): the shadow holds the low byte of each
// 2-byte element, so a change that leaves the low byte equal is not seen. Every publish then
// hashes the full weights (one extra read where they live) and the delta records those as its
// result digests: a tensor whose digest moved without a seen change makes the version an
// anchor; a tensor with seen changes and a missed one fails the subscriber's result check,
// which refuses the delta and recovers from the next anchor.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.hpp"
#include "engine/host_model.hpp"
#include "format/delta_file.hpp"
#include "codec/delta_io.hpp"
#include "core/sparse_delta.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "core/fields.hpp"
#include "core/tensor.hpp"

namespace deltasync {

// The one set of defaults (the CLI's flags and the Python DeltaPublisher's arguments start here).
struct PublisherOptions {
  uint64_t anchor_every = 20;        // versions between anchors (0: only by size / first)
  double anchor_share = 0.5;         // anchor when delta bytes since the last one exceed this share of the model
  size_t max_pending = 2;            // staged versions waiting for upload before merging starts
  // Anchors are split at tensor boundaries into parts of at most this size (one larger tensor
  // makes its own part). Parts are uploaded, downloaded and hashed in parallel.
  uint64_t anchor_part_bytes = 64ull << 20;
  unsigned parallel_uploads = 4;
  size_t keep_anchors = 3;           // retention after each anchor (0: keep everything)
  std::string delta_format = "compact";  // a delta format name: compact, trl, trl-idx or trl-idx-raw
  // Changes per compact block: smaller blocks let a tensor-parallel receiver read closer to its
  // share of a delta (it reads every block that meets its elements), at some bytes per block.
  uint32_t compact_block_elements = compact::kDefaultBlockElements;
  // Most column bands and row stripes a compact tensor is cut into (1, 2, 4 or 8; 1: no tiles):
  // a tensor-parallel receiver reads only the tiles its elements fall in (compact_tiles.hpp).
  uint32_t compact_max_tiles = compact::kDefaultMaxTiles;
  // The compact container: 2, the indexed layout (a header of one size, binary records a ranged
  // reader fetches per tensor: what receivers of a many-tensor model need), or 1, a NAME.cindex
  // and NAME.cdata entry per tensor named in the header (what deltasync wrote before).
  uint32_t compact_layout = compact::kPublisherDefaultLayout;
  // The compact layout's version (docs/compact-format.md): 1, or 2 (32 rANS lanes, which a CPU
  // core decodes with SIMD and a GPU warp in lockstep; its GPU decoder has not yet run on a GPU,
  // and the GPU encoder writes 1 only).
  uint32_t compact_version = compact::kDefaultFormatVersion;
  // Fencing (protocol.hpp): the run this publisher belongs to. Publishers that name no run are one
  // run, "unnamed": a second one is a restart and fences the first off. A store held by another
  // run is refused unless `take_over`.
  std::string run_id;
  bool take_over = false;
  std::function<void(const std::string&)> log;  // one-line notes; may be empty
};

// PublisherOptions' user-facing fields, listed once: the CLI's flags and usage (--anchor-every
// ...), the Python DeltaPublisher's keywords and publisher_defaults() are all made from this list.
// The names are the Python keywords; the CLI flag is "--" + the name with '-' for '_'.
inline auto publisher_option_fields() {
  using O = PublisherOptions;
  return std::make_tuple(
      fields::member("anchor_every", &O::anchor_every, "versions between anchors (0: only by size, and the first)"),
      fields::member("anchor_share", &O::anchor_share, "anchor when the delta bytes since the last one exceed this share of the model"),
      fields::member("max_pending", &O::max_pending, "staged versions waiting for upload before merging starts"),
      fields::member("anchor_part_bytes", &O::anchor_part_bytes, "largest anchor part (a larger tensor makes its own part)"),
      fields::member("parallel_uploads", &O::parallel_uploads, "objects uploaded at once"),
      fields::member("keep_anchors", &O::keep_anchors, "anchors kept by retention (0: keep everything)"),
      fields::member("format", &O::delta_format, "delta layout: compact, trl, trl-idx or trl-idx-raw"),
      fields::member("compact_block_elements", &O::compact_block_elements,
                     "changes per compact block (smaller: TP receivers read closer to their share)"),
      fields::member("compact_max_tiles", &O::compact_max_tiles,
                     "most column bands and row stripes per compact tensor, 1, 2, 4 or 8 (1: none; TP receivers read their tiles)"),
      fields::member("compact_layout", &O::compact_layout,
                     "compact container: 2 indexed (binary records read by ranges), 1 one NAME.cindex/NAME.cdata pair per tensor"),
      fields::member("compact_version", &O::compact_version,
                     "compact layout version, 1 or 2 (2: 32 rANS lanes, SIMD decode on CPUs; CPU encoder only)"),
      fields::member("run_id", &O::run_id, "the run this publisher belongs to (empty: \"unnamed\"); a store held by another run is refused"),
      fields::member("take_over", &O::take_over, "take over a store held by another run (never the default)"));
}
// `log` is the caller's, not an option; every other member needs an entry above.
static_assert(fields::member_count<PublisherOptions>() == std::tuple_size_v<decltype(publisher_option_fields())> + 1,
              "a PublisherOptions member needs an entry in publisher_option_fields()");

// Refuses options no publisher can work with (one line naming the option).
void check_options(const PublisherOptions& options);
// The compact codec's options the publisher's options name (block size, tiles): every encoder a
// publisher runs, on the CPU or the device, gets these.
compact::Options compact_options(const PublisherOptions& options);

struct VersionStats {
  uint64_t version = 0;
  std::optional<uint64_t> base_version;
  bool anchor = false;
  uint64_t merged_versions = 1;  // > 1 when pending versions were merged into this one
  uint64_t changed_elements = 0;
  uint64_t delta_bytes = 0;
  uint64_t anchor_bytes = 0;
  double stage_seconds = 0;    // inside publish(): diff + staging
  double encode_seconds = 0;   // background: serialization + digests
  double upload_seconds = 0;   // background: objects + manifest + LATEST
  double visible_seconds = 0;  // publish() call to manifest visible
  // Counted by the engine inside publish() (summed over merged versions): bytes between host and
  // device memory and host waits for the device (all 0 on the CPU engine).
  engine::TransferCounters transfer;
  bool coded_on_device = false;  // the compact layout was coded where the weights live
  bool visible = false;          // committed to the store (history(): false while staged)
  std::optional<uint64_t> merged_into;  // history(): folded into this later version, never uploaded alone
  double throughput_bytes_per_s() const { return upload_seconds > 0 ? (delta_bytes + anchor_bytes) / upload_seconds : 0; }
};

// VersionStats as callers see it, listed once: the Python binding's dicts and the PublishStats
// dataclass derive from this list.
inline auto version_stats_fields() {
  using S = VersionStats;
  return std::make_tuple(
      fields::member("version", &S::version), fields::member("base_version", &S::base_version),
      fields::member("anchor", &S::anchor), fields::member("visible", &S::visible, "committed to the store"),
      fields::member("merged_versions", &S::merged_versions, "> 1: this delta also carries earlier, never-uploaded versions"),
      fields::member("merged_into", &S::merged_into, "not uploaded on its own: folded into this later version"),
      fields::member("changed_elements", &S::changed_elements), fields::member("delta_bytes", &S::delta_bytes),
      fields::member("anchor_bytes", &S::anchor_bytes),
      fields::member("stage_seconds", &S::stage_seconds, "inside publish(): diff + staging"),
      fields::member("encode_seconds", &S::encode_seconds, "background: serialization, coding, digests"),
      fields::member("upload_seconds", &S::upload_seconds, "background: store writes"),
      fields::member("visible_seconds", &S::visible_seconds, "publish() call to version visible"),
      fields::computed<S>("host_to_device_bytes", [](const S& s) { return s.transfer.host_to_device_bytes; }),
      fields::computed<S>("device_to_host_bytes", [](const S& s) { return s.transfer.device_to_host_bytes; }),
      fields::computed<S>("host_syncs", [](const S& s) { return s.transfer.host_syncs; }),
      fields::member("coded_on_device", &S::coded_on_device));
}
// 15 members, `transfer` listed as its three counters: a member added to VersionStats changes
// the count and needs an entry above.
static_assert(fields::member_count<VersionStats>() == 15, "a VersionStats member needs an entry in version_stats_fields()");

// Claims the store for the run `options` name (run_id, or "unnamed" when empty) with a new epoch,
// as a publisher does at start-up: protocol::claim_store with options.take_over. FencedError
// (nothing written) when another run holds the store and take_over is false.
protocol::Fence claim_store_for(Store& store, const PublisherOptions& options);

// What a publisher must remember between processes (the CLI's --state folder).
struct PublisherState {
  std::optional<uint64_t> last_version;         // the shadow's version
  std::optional<uint64_t> last_anchor_version;
  uint64_t delta_bytes_since_anchor = 0;
  // Bookkeeping once `version` is visible: an anchor restarts the count of delta bytes.
  void record_visible(uint64_t version, bool anchor, uint64_t delta_bytes);
};

// The size rule of both publishers (Publisher, ShardPublisher): the delta bytes since the last
// anchor passed anchor_share of the model, or anchor_every versions went by since it.
bool anchor_rule_due(const PublisherOptions& options, uint64_t version, uint64_t last_anchor_version,
                     uint64_t delta_bytes_since_anchor, uint64_t model_bytes);

class Publisher {
 public:
  // `tensors` describes the model (names, dtypes, shapes) in the order weights are passed;
  // `engine` runs where they live and holds the shadow (the CPU twin when omitted). Claims the
  // store for options.run_id with a new epoch (protocol::claim_store): throws FencedError, having
  // written nothing, when another run holds it and options.take_over is false.
  Publisher(std::shared_ptr<Store> store, std::vector<TensorMeta> tensors, PublisherOptions options = {});
  Publisher(std::shared_ptr<Store> store, std::vector<TensorMeta> tensors, std::unique_ptr<engine::SyncEngine> engine,
            PublisherOptions options = {});
  // Waits for the queued versions; a failed upload is not retried and its error is dropped
  // (call flush() first to see it).
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Starts from weights already published at state.last_version: `shadow` holds them (host
  // memory; copied into the engine's shadow). Without a call to restore the first publish is an
  // anchor.
  void restore(const HostModel& shadow, const PublisherState& state);

  // Diffs `current` (one ref per tensor, in `tensors` order, in the engine's memory) against the
  // shadow and stages the delta; returns once it is staged (the store is never waited for,
  // except when staged versions cannot be merged, see above). `force_anchor` makes this version
  // an anchor. Throws Error for a version not newer than the last one (nothing staged), or
  // reports a previous background failure once -- after staging this version, which is
  // uploaded with the failed one on the next try.
  void publish(uint64_t version, std::span<const ConstTensorRef> current, bool force_anchor = false);

  // Waits until every version published so far is visible (or failed); rethrows the first
  // background failure not yet reported.
  void flush();

  // The versions made visible, in order.
  std::vector<VersionStats> stats() const;
  // Every version publish() was called with, in order: staged, visible or merged into a later one.
  std::vector<VersionStats> history() const;
  // What publish() measured for the last version staged (before its upload): stage time,
  // changes, transfer counters.
  VersionStats last_staged() const;
  PublisherState state() const;
  const engine::SyncEngine& engine() const { return *engine_; }
  // Where the engine queues its work (a cudaStream_t; engine::SyncEngine::set_stream), set
  // under the lock that orders the caller's engine calls with the upload thread's anchor reads.
  void set_stream(void* stream);
  const std::vector<TensorMeta>& tensors() const { return tensors_; }
  const PublisherOptions& options() const { return options_; }
  // The run and epoch this publisher claimed the store with at construction.
  const protocol::Fence& fence() const { return fence_; }

 private:
  struct Job;
  struct AnchorSource;
  void worker_loop();
  void upload(Job& job);
  // Bookkeeping once a version is visible: state, digests, stats, retention.
  void finish(const Job& job, const VersionStats& stats, const std::vector<uint64_t>& result_digests);
  void enqueue(std::unique_ptr<Job> job);
  bool anchor_due(uint64_t version) const;
  void stage_anchor(Job& job, std::span<const ConstTensorRef> current);
  // Copies the shadow into the host memory of the anchor still streaming from it, before an
  // encode moves the shadow on (only when the trainer outpaces the anchor's upload).
  void detach_anchor_from_shadow();
  // Reads, hashes, serializes and uploads anchor parts (a few at a time: bounded host memory).
  std::vector<protocol::ObjectRef> upload_anchor(Job& job, const std::string& nonce, std::vector<uint64_t>& digests,
                                                 VersionStats& st);
  void note(const std::string& line) const;

  std::shared_ptr<Store> store_;
  std::vector<TensorMeta> tensors_;
  std::unique_ptr<engine::SyncEngine> engine_;
  PublisherOptions options_;
  DeltaFormat format_ = DeltaFormat::Compact;  // options_.delta_format, parsed
  uint64_t model_bytes_ = 0;
  protocol::Fence fence_;

  // Publish-side view (caller thread).
  std::optional<uint64_t> staged_version_;
  std::optional<uint64_t> staged_anchor_version_;
  std::vector<uint64_t> published_digests_;  // low-memory shadow: full digests at the last publish
  std::weak_ptr<AnchorSource> shadow_source_;  // the anchor that streams from the shadow, while it uploads

  // The engine is used by the caller's thread (publish) and the upload thread (anchor parts
  // read from the shadow); this orders the two.
  std::mutex engine_mutex_;
  VersionStats last_staged_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::unique_ptr<Job>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  bool paused_ = false;           // the front job failed; wait for the caller before retrying
  bool retry_requested_ = false;  // the caller published or flushed since: try again
  std::exception_ptr failure_;
  std::vector<VersionStats> stats_;
  std::map<uint64_t, VersionStats> history_;
  PublisherState uploaded_;            // what is visible in the store
  std::vector<uint64_t> uploaded_digests_;  // digests at uploaded_.last_version (worker thread)
  std::thread worker_;
};

// Merges two consecutive deltas of the same model into one going from older's base to newer's
// result: positions are the union (ascending), values from the newest delta that touches the
// position, base values from the oldest. Exposed for tests.
SparseDelta merge_deltas(const DeltaView& older, const DeltaView& newer, std::span<const TensorMeta> tensors);

}  // namespace deltasync

