// A receiver whose weights are not the published tensors but an inference engine's runtime
// parameters: fused (q/k/v, gate/up, MoE experts), sharded for tensor/expert parallelism,
// padded. Where each published ("HF") element lives is given once as runs (learned from the
// engine's own loaders, torch_ext/python/deltasync/vllm/index_map.py); every delta is then applied
// in O(changed): positions mapped through the runs, old bits gathered where the parameters live,
// new bits (rebased for the compact layout) scattered, digests verified. An anchor is written
// through the same runs (every element), all or nothing across the ranks: checked in host memory
// and agreed by every rank before any rank writes.
//
// Digests under parallelism: a tensor's digest is Σ mix(i, bits_i) mod 2^64 over its HF
// elements, so each rank hashes the elements it *owns* -- the HF elements it holds, each
// replicated element owned by exactly one rank -- and `combine` sums the partials across ranks
// (an all-reduce; identity on one rank). Every rank sees the same combined result, so a
// mismatch rolls back on every rank alike. A delta goes through the one verified apply,
// integrity::apply_verified, with this receiver's transaction: write = map, gather, scatter,
// owned shifts; agreement = combine; undo = the gathered bits scattered back.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/engine.hpp"
#include "sync/receiver.hpp"

namespace deltasync {

// Runs of one HF tensor inside one runtime parameter: hf elements [hf_start[r], +length[r])
// sit at runtime positions [rt_start[r], +length[r]). Sorted by hf_start, non-overlapping.
struct MappedRuns {
  uint32_t hf_tensor = 0;  // index into the HF description
  uint32_t param = 0;      // index into the runtime parameters
  std::vector<int64_t> hf_start, length, rt_start;
};

// HF elements [start[r], +length[r]) of one HF tensor that this rank owns for digests.
struct OwnedRanges {
  uint32_t hf_tensor = 0;
  std::vector<int64_t> start, length;
};

struct MappedModel {
  std::vector<TensorMeta> hf;            // the published tensors (names, dtypes, shapes)
  std::vector<TensorMeta> params_meta;   // runtime parameters (names for errors, dtypes, shapes)
  std::vector<TensorRef> params;         // their memory, where the engine runs
  std::vector<MappedRuns> runs;          // every (HF tensor, parameter) pair with elements
  std::vector<OwnedRanges> owned;        // one entry per HF tensor this rank owns elements of
  // HF tensors no rank serves (the engine's loader drops them, as vLLM drops the lm_head of a
  // tied model): nothing is written for them, and their digests are the store's promises (the
  // anchor's, then each delta's result) since no runtime parameter holds their bits.
  std::vector<uint32_t> unserved;
};

// Sums per-tensor partial digests (mod 2^64) across the ranks in place.
using CombinePartials = std::function<void(std::span<uint64_t>)>;

// Where the last applies' seconds went (summed until reset): the mapping of HF positions onto
// runtime positions against the scatter that writes them, and the rest of the pipeline.
struct MappedTimings {
  double parse = 0;    // delta file -> positions and values (compact decode or TRL parse), base check
  double map = 0;      // HF positions -> runtime positions through the runs
  double gather = 0;   // the bits each write replaces
  double pack = 0;     // per-row old bits, compact rebase, new bits in write order
  double scatter = 0;  // the new bits into the runtime parameters
  double digest = 0;   // owned digest shifts, the all-reduce, the result check
  double anchor_check = 0;  // an anchor's owned digests in host memory, agreed across the ranks
  double anchor_write = 0;  // its bytes into the runtime parameters, run by run
  double anchor_audit = 0;  // digests recomputed from the runtime parameters
};

// One run as its parameter sees it (a parameter's runs are kept sorted by rt_start, disjoint).
struct ParamRun {
  uint32_t hf_tensor;
  int64_t hf_start, length, rt_start;
};

class MappedReceiver final : public Receiver {
 public:
  // Throws Error naming the tensor when a run leaves its parameter or HF tensor, an HF tensor's
  // dtype differs from a parameter it lands in (its bits are written as they are), or runs of
  // one parameter overlap.
  MappedReceiver(MappedModel model, engine::SyncEngine& engine, CombinePartials combine);
  ~MappedReceiver() override;

  std::vector<TensorMeta> tensors() const override { return model_.hf; }
  std::optional<uint64_t> version() const override { return version_; }
  std::vector<uint64_t> digests() const override { return digests_; }
  // Partials over the owned runs (read where the parameters live), combined across ranks.
  void recompute_digests() override;
  // Every HF element written through the runs, all or nothing: the anchor's owned digests are
  // computed from its host bytes and combined with every rank's verdict before anything is
  // written; a refusal anywhere (this rank's check, another rank's, abandon() on another rank)
  // leaves every rank's parameters as they were. Then written run by run, the ranks agree that
  // every write succeeded (a failure on any rank throws on every rank and leaves every rank
  // torn), and audited: the digests recomputed from the parameters must equal the anchor's. Runtime elements no HF
  // element maps to (vocabulary padding a loader zero-filled, buffers) are left as they are.
  void load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                   std::span<const uint64_t> digests, uint64_t version) override;
  uint64_t apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) override;
  // A shard-local publish's parts combined (compact parts unbased: rebased as apply() rebases).
  uint64_t apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                         engine::TransferCounters& transfer) override;
  // This rank's refusal in the agreement the other ranks hold for the same step (an anchor's or
  // a delta's: both agree over T + 1 slots, the last one counting refusals).
  void abandon() override;
  // Every HF element a run maps (what this rank holds), and those it owns for digests; nullopt
  // when that is every element of every HF tensor (one rank: whole objects are read).
  std::optional<ranged::NeededRanges> needed_ranges() const override;

  uint64_t map_runs() const;   // runs held (memory of the map: 24 bytes each)
  // True from an anchor's first write until an anchor is written and audited: a failure in
  // between (a write, the audit) leaves the parameters partly holding the anchor and the
  // receiver at no version. The engine must not serve them until a later anchor succeeds.
  bool torn() const { return torn_; }
  // Tests of torn anchors only: every anchor load fails after writing `runs` runs (counted in
  // write order; map_runs(): all of them, failing before the audit); nullopt: no failure.
  void fail_anchor_writes_after_for_test(std::optional<uint64_t> runs) { fail_after_runs_ = runs; }
  const MappedTimings& timings() const { return timings_; }
  void reset_timings() { timings_ = {}; }

  // One stretch of a delta's writes: rows [row0, row0 + count) of HF tensor `tensor`
  // (consecutive changes inside one run) into parameter `param`, each at its HF index + shift.
  // With shift >= 0 the writes go to the parameter seen from element `shift` on, at the rows'
  // HF indices as they are; a negative shift (a rank holding a tensor's later rows) writes at
  // positions[first, +count), the indices shifted.
  struct Segment {
    uint32_t param, tensor;
    uint64_t row0, count, first;
    int64_t shift;
  };
  struct Prepared;  // a delta resolved against the map (mapped_receiver.cpp)

 private:
  MappedModel model_;
  engine::SyncEngine& engine_;
  CombinePartials combine_;
  std::vector<std::vector<const MappedRuns*>> targets_;  // per HF tensor: its runs, by parameter
  std::vector<std::vector<ParamRun>> by_param_;           // per parameter: its runs in runtime order
  MappedTimings timings_;
  std::unique_ptr<Prepared> prepared_;  // reused from delta to delta

  class Transaction;  // apply()'s mechanics under integrity::apply_verified (mapped_receiver.cpp)

  // `targets` are the HF tensors (names and sizes) the patches are checked against;
  // `decoded_here`: the patches are prepared_->decoded's (used in place, their values rebased there).
  void prepare(std::span<const TensorRef> targets, std::span<const PatchRef> patches, bool relative, bool decoded_here,
               engine::TransferCounters& transfer);
  // apply_verified over the HF tensors with `transaction`; returns the elements written.
  uint64_t apply_resolved(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, Transaction& transaction);
  std::vector<bool> served_;                              // per HF tensor: false when in model_.unserved
  std::optional<uint64_t> version_;
  std::vector<uint64_t> digests_;
  bool torn_ = false;
  std::optional<uint64_t> fail_after_runs_;
};

}  // namespace deltasync
