// A receiver whose weights are not the published tensors but an inference engine's runtime
// parameters: fused (q/k/v, gate/up, MoE experts), sharded for tensor/expert parallelism,
// padded. Where each published ("HF") element lives is given once as runs (learned from the
// engine's own loaders, torch_ext/python/deltasync/vllm/index_map.py); every delta is then applied
// in O(changed): positions mapped through the runs, old bits gathered where the parameters live,
// new bits (rebased for the compact layout) scattered, digests verified.
//
// Digests under parallelism: a tensor's digest is Σ mix(i, bits_i) mod 2^64 over its HF
// elements, so each rank hashes the elements it *owns* -- the HF elements it holds, each
// replicated element owned by exactly one rank -- and `combine` sums the partials across ranks
// (an all-reduce; identity on one rank). Every rank sees the same combined result, so a
// mismatch rolls back on every rank alike.
#pragma once
#include <cstdint>
#include <functional>
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
// Writes a whole anchor into the runtime parameters (the engine's own loader); bytes[t] holds
// hf[t]'s bits in host memory.
using LoadFull = std::function<void(std::span<const TensorMeta>, std::span<const std::span<const uint8_t>>)>;

class MappedReceiver final : public Receiver {
 public:
  // Throws Error naming the tensor when a run leaves its parameter or HF tensor, an HF tensor's
  // dtype differs from a parameter it lands in (its bits are written as they are), or runs of
  // one parameter overlap.
  MappedReceiver(MappedModel model, engine::SyncEngine& engine, CombinePartials combine, LoadFull load_full);

  std::vector<TensorMeta> tensors() const override { return model_.hf; }
  std::optional<uint64_t> version() const override { return version_; }
  std::vector<uint64_t> digests() const override { return digests_; }
  // Partials over the owned runs (read where the parameters live), combined across ranks.
  void recompute_digests() override;
  // Through the engine's loader, then audited: the recomputed digests must equal the anchor's
  // (so a map or loader that does not reproduce the published bits is caught at once).
  void load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                   std::span<const uint64_t> digests, uint64_t version) override;
  uint64_t apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) override;

  uint64_t map_runs() const;   // runs held (memory of the map: 24 bytes each)

 private:
  struct Layer;
  MappedModel model_;
  engine::SyncEngine& engine_;
  CombinePartials combine_;
  LoadFull load_full_;
  std::vector<std::vector<const MappedRuns*>> targets_;  // per HF tensor: its runs, by parameter
  std::vector<bool> served_;                              // per HF tensor: false when in model_.unserved
  std::optional<uint64_t> version_;
  std::vector<uint64_t> digests_;
};

}  // namespace deltasync
