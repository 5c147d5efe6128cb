// The weights `pull` brings up to date are a checkpoint on disk (OUT), never a model in memory:
// a Receiver that reads them one tensor at a time and writes each new version as a complete
// checkpoint under temporary names (StreamedOutput), which commit() puts in OUT's place.
//
//   anchor  streamed part by part (Subscriber::stream_anchor) into a staged output;
//   delta   one pass over the current weights (OUT, or the staged output of the step before):
//           each tensor read, patched when the delta changes it (the verified apply `apply`
//           runs on a checkpoint's shards, tensor_patch.hpp, here on one tensor), checked
//           against the digest the version's manifest records, and written to a new staged
//           output; the previous staged output is dropped once the new one is complete.
//
// Host memory: the tensor being patched (plus the delta, which the subscriber holds), never the
// model; the current weights are read through their mapping, whose pages are released after
// each tensor. The cost is disk traffic: each delta of a catch-up rewrites the model once (a
// follower pays what it paid before, one write per version). Every step is transactional: a
// failed one leaves the staged weights of the step before, and OUT is only replaced by commit().
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/cpu_sync_engine.hpp"
#include "format/checkpoint_folder.hpp"
#include "model_files.hpp"
#include "streamed_output.hpp"
#include "sync/protocol.hpp"
#include "sync/receiver.hpp"

namespace deltasync::cli {

class CheckpointReceiver final : public Receiver {
 public:
  // OUT as it is (a checkpoint at a recorded version, one without a version, or nothing:
  // nothing to start from, the weights then take their shape from an anchor). `catalog`
  // gives each version's manifest, whose digests each written version records. An unreadable
  // OUT starts from nothing; `unreadable` (when given) receives why.
  CheckpointReceiver(std::string out_path, uint64_t max_shard_bytes, protocol::Catalog& catalog, std::string* unreadable = nullptr);

  std::vector<TensorMeta> tensors() const override { return meta_; }
  // OUT's digests are computed from its bits (recompute_digests, one read), not taken from its
  // headers: the audit of the version OUT records is of what it holds.
  std::optional<uint64_t> version() const override { return version_; }
  std::vector<uint64_t> digests() const override { return digests_; }
  void recompute_digests() override;

  void load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                   std::span<const uint64_t> digests, uint64_t version) override;
  bool streams_anchors() const override { return true; }
  void begin_anchor(std::span<const TensorMeta> table, uint64_t version) override;
  void write_anchor_part(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes) override;
  void finish_anchor(std::span<const uint64_t> digests, uint64_t version) override;
  void abort_anchor() override { pending_.reset(); }

  uint64_t apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) override;
  uint64_t apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                         engine::TransferCounters& transfer) override;
  // host_bits(): none (the weights are on disk): compact parts come unbased and are rebased here.

  // True when the weights differ from what OUT holds (a step was staged since the last commit).
  bool staged() const { return staged_ != nullptr; }
  // The staged weights take OUT's place (atomically); no-op when nothing is staged.
  void commit();

 private:
  // A new staged output for `version` with the digests its manifest records (in meta_ order;
  // empty when it records none).
  std::unique_ptr<StreamedOutput> new_output(std::span<const TensorMeta> tensors, uint64_t version, std::vector<uint64_t>* digests);
  // The staged output becomes the current weights (read from where it is staged).
  void take(std::unique_ptr<StreamedOutput> output);
  // Tensor t's bits in the current weights (mapped; the pass releases their pages after use).
  std::span<const uint8_t> bits(size_t t) const;

  std::string out_path_;
  uint64_t max_shard_bytes_;
  protocol::Catalog& catalog_;
  std::optional<FolderLayout> layout_;         // OUT's split, kept
  std::optional<Checkpoint> current_;          // where the weights are read: OUT, or staged_
  std::unique_ptr<StreamedOutput> staged_;     // complete, not yet in OUT's place
  std::unique_ptr<StreamedOutput> pending_;    // an anchor being streamed
  std::vector<TensorMeta> pending_meta_;       // its table
  std::vector<TensorMeta> meta_;
  std::optional<uint64_t> version_;
  std::vector<uint64_t> digests_;
  engine::CpuSyncEngine engine_;
};

}  // namespace deltasync::cli
