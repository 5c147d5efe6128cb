// The sync engine: everything that must run where the weights live, behind one interface with
// two implementations -- the CPU twin (host tensors; engine/cpu_sync_engine.cpp) and CUDA
// (device tensors on an explicit stream; engine/cuda/cuda_sync_engine.cpp, which adapts
// kernels/). The Publisher and the Subscriber (sync/) are written once against it; the CLI and
// the Python bindings only say where the tensors live (engine/select.hpp picks the engine).
//
// Data never leaves the weights' memory except what must be shipped: an encode stages the
// change set (or, where the engine codes on its device, only the coded bytes) in host memory;
// an apply uploads the delta file's tensors, decodes and verifies where the weights are.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "codec/compact_codec.hpp"
#include "core/sparse_delta.hpp"
#include "core/tensor.hpp"
#include "core/transfer_counters.hpp"
#include "engine/integrity.hpp"
#include "format/delta_file.hpp"
#include "format/safetensors.hpp"

namespace deltasync::engine {

enum class Device { kCpu, kCuda };
std::string_view device_name(Device device);

// What the shadow (the bits last published) keeps of each element.
enum class ShadowKind {
  kFull,     // every bit: deltas carry base values, digests update in O(changed), deltas merge
  kLowByte,  // the low byte of 2-byte elements only (half the memory): a change that leaves the
             // low byte equal is missed, so the publisher hashes the full weights every version
             // and such a version becomes an anchor (sync/publisher.hpp)
};

// Counters an engine call adds to, reported per version (VersionStats, SyncReport).
using ::deltasync::TransferCounters;

// A publish's change set, staged in host memory for the publisher's background thread.
struct StagedDelta {
  // counts[t]: changed elements of tensor t (always filled).
  std::vector<uint64_t> counts;
  // The raw change set: positions, new bits and (full shadow only) base bits. Empty when
  // `coded_on_device` is set: the raw changes then stayed in device memory.
  SparseDelta changes;
  bool has_base_values = false;
  // Compact-layout tensors already coded by the engine (byte-identical to compact::encode of the
  // same change set), for every tensor with a change, in tensor order.
  bool coded_on_device = false;
  std::vector<compact::EncodedTensor> coded;
  // digest_shifts[t]: digest(after) - digest(before) mod 2^64 for every tensor, computed by the
  // engine where the weights live. Empty: the publisher computes them from base and new values.
  std::vector<uint64_t> digest_shifts;
  TransferCounters transfer;

  uint64_t total_changed() const;
  void clear();
  // changes.offsets / value_offsets from `counts` when the positions stayed on the device (the
  // file's metadata needs the counts only); a no-op when they are there.
  void fill_offsets(std::span<const TensorMeta> tensors);
  // digests[t] (before this delta) += the shift of tensor t: from digest_shifts when the engine
  // computed them, else from the staged base and new values (integrity::advance_digests).
  void advance_digests(std::span<uint64_t> digests, std::span<const TensorMeta> tensors) const;
};

struct EncodeRequest {
  // Ask the engine to code the compact layout where the weights live, when it can (CUDA does;
  // the CPU engine leaves coding to the publisher's background thread, off the caller's path).
  bool want_coded = false;
  compact::Options compact;
  // The tensors as the delta file describes them (their shapes decide the compact layout's tiles,
  // codec/compact_tiles.hpp); empty: one dimension of each current tensor's size.
  std::span<const TensorMeta> tensors;
};

// One delta object to apply, as its manifest describes it.
struct DeltaToApply {
  const st::File* file = nullptr;  // SHA-checked bytes of the delta (host memory)
  uint64_t model_version = 0;      // the manifest's version: the file must say the same
  std::optional<uint64_t> base_version;  // the manifest's base: the file must say the same
};

// What every engine checks once a delta file is resolved, before touching the weights: the
// file's versions equal its manifest's, and it carries base and result digests (a delta without
// them is refused rather than applied unverified). Returns the promises to verify against.
// Throws Error("LABEL: ...").
integrity::DeltaDigests delta_promises(const DeltaToApply& delta, const DeltaInfo& info);

// Shadow checks every engine makes, in one wording. Throw Error naming the tensor.
// A low-byte shadow covers 2-byte tensors only:
void check_low_byte_shadow(std::span<const ConstTensorRef> current);
// The tensors of an encode are the shadow's (count, elements and widths recorded at reset):
void check_matches_shadow(std::span<const ConstTensorRef> current, std::span<const uint64_t> numel,
                          std::span<const uint32_t> width);

// A block of the engine's memory (host memory for the CPU engine, device memory for CUDA), for
// callers whose tensors come from files (the CLI): filled with write(), read back with read().
class EngineMemory {
 public:
  virtual ~EngineMemory() = default;
  virtual void* data() const = 0;
};

class SyncEngine {
 public:
  virtual ~SyncEngine() = default;
  virtual Device device() const = 0;

  // `bytes` of the engine's memory, freed with the handle. Throws Error when it is exhausted.
  virtual std::unique_ptr<EngineMemory> allocate(uint64_t bytes) = 0;

  // Where the engine's work is queued (a cudaStream_t for CUDA; ignored on the CPU). Every call
  // below is ordered on it; a call that must read a result on the host synchronizes it and
  // counts that in TransferCounters::host_syncs.
  virtual void set_stream(void* stream) = 0;

  // ---- publish side --------------------------------------------------------------------------

  // shadow := current (first version, or after a restart of the chain). Allocates the shadow
  // in the weights' memory (kind as constructed).
  virtual void reset_shadow(std::span<const ConstTensorRef> current) = 0;
  virtual bool has_shadow() const = 0;
  virtual ShadowKind shadow_kind() const = 0;
  // Memory the shadow takes (bytes, in the engine's memory).
  virtual uint64_t shadow_bytes() const = 0;
  // Tensor t of a full shadow, in the engine's memory (for read()): the bits of the last
  // version encoded, which anchors stream from. Throws for a low-byte shadow or no shadow.
  virtual ConstTensorRef shadow_tensor(size_t t) const = 0;

  // Diffs current against the shadow bitwise, brings the shadow up to date and stages the
  // change set into `out` (host memory, valid when this returns). Throws Error naming the
  // tensor on a size mismatch with the shadow.
  virtual void encode(std::span<const ConstTensorRef> current, const EncodeRequest& request, StagedDelta& out) = 0;

  // Copies `count` bytes of tensor `source` (in the engine's memory) starting at byte `offset`
  // into host memory; anchors stream through this in parts.
  virtual void read(const ConstTensorRef& source, uint64_t offset, std::span<uint8_t> out) = 0;

  // ---- both sides ----------------------------------------------------------------------------

  // Full digest of every tensor (one read of the weights where they live).
  virtual std::vector<uint64_t> digests(std::span<const ConstTensorRef> tensors) = 0;

  // ---- subscribe side ------------------------------------------------------------------------

  // Writes host bytes into a tensor's memory (an anchor, already verified by the caller).
  virtual void write(const TensorRef& target, uint64_t offset, std::span<const uint8_t> bytes) = 0;

  // Element-wise pieces for receivers whose tensors are not the published ones (the mapped
  // receiver of fused, sharded parameters), all O(changed). `positions[t]` are host patches
  // whose values are ignored by gather: gather copies sources[t]'s bits at those positions into
  // host memory `out` (patch order, tensors back to back); scatter validates every patch (host
  // positions and values) and writes them, or writes nothing and throws naming the tensor.
  virtual void gather(std::span<const ConstTensorRef> sources, std::span<const PatchRef> positions, std::span<uint8_t> out,
                      TransferCounters& transfer) = 0;
  virtual void scatter(std::span<const TensorRef> targets, std::span<const PatchRef> patches, TransferCounters& transfer) = 0;

  // Verified, transactional in-place apply of one delta (either layout; a compact delta is
  // decoded against `targets`' current bits where they live). Order: resolve the file against
  // `meta` (names, dtypes, shapes; corrupt input refused), check versions and base digests
  // (integrity::check_before_apply), validate + scatter, compute the result digests in
  // O(changed), compare. Any failure throws Error("LABEL: ...") with every target bit-for-bit
  // as before. On success `digests` (one per target, the receiver's current digests) advance.
  virtual integrity::ApplyReport apply(const DeltaToApply& delta, std::span<const TensorMeta> meta,
                                       std::span<const TensorRef> targets, std::span<uint64_t> digests,
                                       std::optional<uint64_t> current_version, TransferCounters& transfer) = 0;

  // The same verified, transactional apply for patches already resolved in host memory
  // (positions and values), e.g. one shard's part of a delta the caller resolved itself (the
  // CLI): integrity::apply_verified with the engine's transaction, as apply() runs it. Same
  // contract: any failure throws with every target bit-for-bit as before.
  virtual integrity::ApplyReport apply_patches(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                               const integrity::DeltaDigests& expected, std::span<uint64_t> digests,
                                               std::optional<uint64_t> current_version, TransferCounters& transfer) = 0;
};

struct EngineOptions {
  ShadowKind shadow = ShadowKind::kFull;
  int cuda_device = 0;  // the device the tensors live on (CUDA)
};

}  // namespace deltasync::engine
