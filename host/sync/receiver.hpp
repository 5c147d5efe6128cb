// The weights a Subscriber brings up to date, wherever they live: a Receiver knows its tensors,
// the version and digests they are at, and writes anchors and verified deltas into them. The
// subscriber (fetching, planning, recovery) is written once against this; implementations say
// where the weights are:
//   TensorReceiver     tensors the caller owns (host or device memory), through a SyncEngine
//   HostModelReceiver  a HostModel that takes its shape from the store's first anchor (the CLI)
//   (torch_ext adds the vLLM receiver, whose weights are the engine's fused, sharded parameters)
#pragma once
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "engine/host_model.hpp"
#include "sync/ranged_plan.hpp"

namespace deltasync {

class Receiver {
 public:
  virtual ~Receiver() = default;

  // The model the weights hold, names as published. Empty: the receiver takes its shape from
  // the first anchor it loads.
  virtual std::vector<TensorMeta> tensors() const = 0;
  virtual std::optional<uint64_t> version() const = 0;
  // The weights' digests, one per tensor in tensors() order; empty while unknown.
  virtual std::vector<uint64_t> digests() const = 0;
  // Recomputes the digests from the weights (one read where they live): audits, and weights
  // written by someone else.
  virtual void recompute_digests() = 0;

  // Replaces every tensor with an anchor's: `meta` describes them (every tensor of the model),
  // `bytes[t]` holds tensor t's bits in host memory, already checked by the subscriber against
  // the manifest's SHA-256 and `digests`. A receiver with a fixed model refuses an anchor that
  // describes another one before writing anything. Afterwards version() == version and
  // digests() == digests.
  virtual void load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                           std::span<const uint64_t> digests, uint64_t version) = 0;

  // Verified, transactional apply of one delta (engine::SyncEngine::apply's contract): on
  // success version() == delta.model_version and the digests advanced; on failure throws with
  // the weights bit-for-bit as before. Returns the elements written here.
  virtual uint64_t apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) = 0;

  // The same verified, transactional apply for a delta already resolved into patches in host
  // memory (patches[t] for tensors()[t]; a shard-local publish's parts combined,
  // sync/shard_parts.hpp). `relative`: the values are compact "unbased" bits, rebased here on
  // the current bits at their positions (compact_two_phase.hpp). Same contract as apply().
  virtual uint64_t apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                                 engine::TransferCounters& transfer) = 0;
  // The weights' current bits in host memory (compact deltas are decoded against them), or empty
  // when they live elsewhere.
  virtual std::vector<ConstTensorRef> host_bits() const { return {}; }

  // Anchors part by part (Subscriber::stream_anchor), for a receiver whose host memory must
  // stay bounded by a part, not the model: begin_anchor(table) refuses a table that is not the
  // receiver's model before anything is written; write_anchor_part writes verified tensors
  // (some of the table, each once); finish_anchor makes version() == version (digests in table
  // order); abort_anchor, after a failure between begin and finish, puts back every bit the
  // parts wrote. A receiver that returns false loads anchors whole (load_anchor).
  virtual bool streams_anchors() const { return false; }
  virtual void begin_anchor(std::span<const TensorMeta> table, uint64_t version) { (void)table, (void)version; }
  virtual void write_anchor_part(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes) {
    (void)meta, (void)bytes;
  }
  virtual void finish_anchor(std::span<const uint64_t> digests, uint64_t version) { (void)digests, (void)version; }
  virtual void abort_anchor() {}

  // This rank failed a step before handing it to the receiver (a fetch, an anchor's
  // verification, a delta file that does not parse). A receiver whose ranks agree before they
  // write (the mapped receiver over a tensor-parallel group) takes part in that step's agreement
  // as a refusal, so no rank writes and none waits for this one; others have nothing to do.
  virtual void abandon() {}

  // The elements of each published tensor this receiver holds, when it holds only part of the
  // model (a tensor-parallel rank): the subscriber then reads only the byte ranges of a delta
  // that meet them (sync/ranged_fetch.hpp). nullopt: it holds everything and reads whole objects.
  virtual std::optional<ranged::NeededRanges> needed_ranges() const { return std::nullopt; }
};

// Tensors the caller owns, in the memory `engine` runs on (the engine outlives the receiver).
class TensorReceiver final : public Receiver {
 public:
  TensorReceiver(std::vector<TensorMeta> meta, std::vector<TensorRef> targets, engine::SyncEngine& engine);
  ~TensorReceiver() override { close_undo(); }

  std::vector<TensorMeta> tensors() const override { return meta_; }
  std::optional<uint64_t> version() const override { return version_; }
  std::vector<uint64_t> digests() const override { return digests_; }
  void recompute_digests() override;
  void load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                   std::span<const uint64_t> digests, uint64_t version) override;
  uint64_t apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) override;
  uint64_t apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                         engine::TransferCounters& transfer) override;
  std::vector<ConstTensorRef> host_bits() const override;

  // Streamed anchors: the bits a part replaces are first saved, tensor by tensor, to an undo
  // file (an unlinked temporary file, not host memory), so a later part's failure restores
  // every tensor written and the weights are never left part old, part new. Host memory: the
  // part being written plus one tensor's old bits.
  bool streams_anchors() const override { return true; }
  void begin_anchor(std::span<const TensorMeta> table, uint64_t version) override;
  void write_anchor_part(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes) override;
  void finish_anchor(std::span<const uint64_t> digests, uint64_t version) override;
  void abort_anchor() override;

 private:
  void close_undo();
  std::vector<TensorMeta> meta_;
  std::vector<TensorRef> targets_;
  engine::SyncEngine& engine_;
  std::optional<uint64_t> version_;
  std::vector<uint64_t> digests_;
  // A streamed anchor in progress: table position -> target, and what the undo file holds
  // (targets in write order; each one's old bits, whole, one after the other).
  std::vector<size_t> anchor_target_;
  std::unordered_map<std::string, size_t> anchor_index_;  // name -> target
  std::vector<bool> anchor_written_;
  std::optional<uint64_t> version_before_;  // what abort_anchor puts back with the bits
  std::vector<uint64_t> digests_before_;
  std::vector<size_t> undo_order_;
  std::FILE* undo_ = nullptr;
};

// A HostModel (CPU twin): an empty model takes its tensors from the first anchor; version and
// digests are the model's own fields, so a model loaded from a checkpoint starts where it is.
class HostModelReceiver final : public Receiver {
 public:
  explicit HostModelReceiver(HostModel& model) : model_(model) {}

  std::vector<TensorMeta> tensors() const override { return model_.tensors; }
  std::optional<uint64_t> version() const override { return model_.version; }
  std::vector<uint64_t> digests() const override;
  void recompute_digests() override { model_.compute_digests(); }
  void load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                   std::span<const uint64_t> digests, uint64_t version) override;
  uint64_t apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) override;
  uint64_t apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                         engine::TransferCounters& transfer) override;
  std::vector<ConstTensorRef> host_bits() const override;

 private:
  HostModel& model_;
  engine::CpuSyncEngine engine_;
};

}  // namespace deltasync
