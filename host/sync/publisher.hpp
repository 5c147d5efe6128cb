// The writer side of the store protocol.
//
// publish(version, weights) diffs the weights against the publisher's shadow (the bits last
// published), stages the changes in host memory and returns; a background thread encodes
// (compact layout, with integrity digests), uploads the objects and commits the manifest. When
// uploads fall behind, staged versions are merged into one delta (union of the changed
// positions, newest values, oldest base values), so memory stays bounded by `max_pending`
// deltas however slow the store is. A version also becomes an anchor (full weights) every
// `anchor_every` versions and whenever the delta bytes since the last anchor pass
// `anchor_share` of the model's size.
//
// Backends: publish() runs the CPU encode against a host shadow. A GPU caller keeps the shadow
// on the device (deltasync::cuda::Encoder), stages the result itself and hands it to
// publish_staged() together with a callback that copies the full weights to host memory
// should the version become an anchor (see publish_from_encoder below, compiled when
// DELTASYNC_WITH_CUDA is defined).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "format/delta_file.hpp"
#include "engine/host_model.hpp"
#include "core/sparse_delta.hpp"
#include "store/store.hpp"
#include "core/tensor.hpp"

namespace deltasync {

struct PublisherOptions {
  uint64_t anchor_every = 20;        // versions between anchors (0: only by size / first)
  double anchor_share = 0.5;         // anchor when delta bytes since the last one exceed this share of the model
  size_t max_pending = 2;            // staged versions waiting for upload before merging starts
  // Anchors are split at tensor boundaries into parts of at most this size (one larger tensor
  // makes its own part). Parts are uploaded, downloaded and hashed in parallel.
  uint64_t anchor_part_bytes = 64ull << 20;
  unsigned parallel_uploads = 4;
  size_t keep_anchors = 3;           // retention after each anchor (0: keep everything)
  std::string delta_format = "compact";  // "compact" or "trl"
  std::function<void(const std::string&)> log;  // one-line notes; may be empty
};

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
  double throughput_bytes_per_s() const { return upload_seconds > 0 ? (delta_bytes + anchor_bytes) / upload_seconds : 0; }
};

// What a publisher must remember between processes (the CLI's --state folder).
struct PublisherState {
  std::optional<uint64_t> last_version;         // the shadow's version
  std::optional<uint64_t> last_anchor_version;
  uint64_t delta_bytes_since_anchor = 0;
};

class Publisher {
 public:
  // `tensors` describes the model (names, dtypes, shapes) in the order weights are passed.
  Publisher(std::shared_ptr<Store> store, std::vector<TensorMeta> tensors, PublisherOptions options = {});
  // Waits for the queued versions; a failed upload is not retried and its error is dropped
  // (call flush() first to see it).
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Starts from weights already published (the shadow) at state.last_version. Without a call
  // to restore the first publish is an anchor.
  void restore(HostModel shadow, const PublisherState& state);

  // CPU path: diffs `current` (one ref per tensor, in `tensors` order) against the host shadow.
  // Returns once the delta is staged. Throws Error for a version not newer than the last one
  // (nothing staged), or reports a previous background failure once — after staging this
  // version, which is uploaded with the failed one on the next try.
  void publish(uint64_t version, std::span<const ConstTensorRef> current);

  // Any backend: `staged` is the delta from the last published version to `version` (host
  // memory; copied before returning), `read_full(t, out)` fills tensor t's full bytes and is
  // called from publish_staged only when the version becomes an anchor.
  void publish_staged(uint64_t version, const DeltaView& staged,
                      const std::function<void(size_t, std::span<uint8_t>)>& read_full);

  // Waits until every version published so far is visible (or failed); rethrows the first
  // background failure not yet reported.
  void flush();

  std::vector<VersionStats> stats() const;
  PublisherState state() const;
  // The host shadow (CPU path): the weights of the last published version.
  const HostModel& shadow() const { return shadow_; }

 private:
  struct Job;
  void worker_loop();
  void upload(Job& job);
  // Bookkeeping once a version is visible: state, digests, stats, retention.
  void finish(const Job& job, const VersionStats& stats, const std::vector<uint64_t>& result_digests);
  void enqueue(std::unique_ptr<Job> job);
  bool anchor_due(uint64_t version) const;
  void note(const std::string& line) const;

  std::shared_ptr<Store> store_;
  std::vector<TensorMeta> tensors_;
  PublisherOptions options_;
  uint64_t model_bytes_ = 0;

  HostModel shadow_;  // CPU path only
  SparseDelta scratch_;

  // Publish-side view (caller thread).
  std::optional<uint64_t> staged_version_;
  std::optional<uint64_t> staged_anchor_version_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::unique_ptr<Job>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  bool paused_ = false;           // the front job failed; wait for the caller before retrying
  bool retry_requested_ = false;  // the caller published or flushed since: try again
  std::exception_ptr failure_;
  std::vector<VersionStats> stats_;
  PublisherState uploaded_;            // what is visible in the store
  std::vector<uint64_t> uploaded_digests_;  // digests at uploaded_.last_version (worker thread)
  std::thread worker_;
};

// Merges two consecutive deltas of the same model into one going from older's base to newer's
// result: positions are the union (ascending), values from the newest delta that touches the
// position, base values from the oldest. Exposed for tests.
SparseDelta merge_deltas(const DeltaView& older, const DeltaView& newer, std::span<const TensorMeta> tensors);

}  // namespace deltasync

#ifdef DELTASYNC_WITH_CUDA
#include <cuda_runtime_api.h>

#include "deltasync/cuda/engine.hpp"

namespace deltasync {
// GPU path: the shadow lives on the device inside `encoder`'s items. Diffs and stages on
// `stream`, then hands the staged delta to the publisher; full weights are copied to host only
// if this version becomes an anchor.
inline void publish_from_encoder(Publisher& publisher, cuda::Encoder& encoder, uint64_t version,
                                 std::span<const EncodeItem> items, cudaStream_t stream) {
  cuda::check(encoder.encode(items, stream), "publish: encode");
  cuda::check(encoder.stage(stream), "publish: stage");
  cuda::check(cudaStreamSynchronize(stream), "publish: synchronize");
  publisher.publish_staged(version, encoder.staged(), [&](size_t t, std::span<uint8_t> out) {
    cuda::check(cudaMemcpy(out.data(), items[t].current, out.size(), cudaMemcpyDeviceToHost), "publish: copy anchor");
  });
}
}  // namespace deltasync
#endif
