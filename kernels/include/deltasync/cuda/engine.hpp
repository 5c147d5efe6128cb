// Public entry points of the CUDA backend, includable from plain C++ (only the CUDA runtime
// API header is needed). Layering follows CUB: these classes are the host dispatch layer that
// owns workspace and orders launches; the kernels and their launchers live in kernels/src and
// take an explicit stream. Nothing here synchronizes unless its comment says so.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/tensor.hpp"

namespace deltasync::cuda {

// True when at least one CUDA device can be used.
bool device_available();

// Turns a cudaError_t into a deltasync::Error with `what` as context; no-op on cudaSuccess.
void check(cudaError_t err, const char* what);

// How the encoder finds and compacts the changed elements (both give identical results).
enum class SelectStrategy {
  // Count pass, scan, write pass: streams the inputs at memory bandwidth, and re-reads only the
  // sectors holding changed elements. Workspace: 1 bit per element (1/16 of a bf16 model).
  kTwoPass,
  // One pass with a decoupled look-back across chunks: reads the inputs once and needs no
  // workspace proportional to the model, but each chunk waits for its predecessors' counts
  // (measured slower on an H200: benchmarks/results/).
  kSinglePass,
};

struct EncoderOptions {
  SelectStrategy select = SelectStrategy::kTwoPass;
};

// Diff + compaction + shadow update for a set of device tensors, with workspace reused across
// steps (grown only when a step has more changed elements than any before).
class Encoder {
 public:
  Encoder();
  explicit Encoder(EncoderOptions options);
  ~Encoder();
  Encoder(const Encoder&) = delete;
  Encoder& operator=(const Encoder&) = delete;

  // Compares items[t].current with items[t].shadow bitwise (device pointers), compacts the
  // changed positions of every tensor in ascending order with their current bits (and the
  // shadow's bits before, as base values: gather them before scattering), and brings the
  // shadows up to date. All work is queued on `stream`; the call synchronizes `stream` exactly
  // once, to read the number of changed elements (needed to size the output), whatever the
  // number of tensors. The results stay in device memory until the next encode.
  cudaError_t encode(std::span<const EncodeItem> items, cudaStream_t stream);

  uint64_t total_changed() const;
  size_t num_tensors() const;
  // Device arrays laid out exactly like DeltaView (offsets / value_offsets have T + 1 entries).
  const uint64_t* device_offsets() const;
  const uint64_t* device_value_offsets() const;
  const int64_t* device_indices() const;
  const uint8_t* device_values() const;
  const uint8_t* device_base_values() const;  // the shadow's bits before this encode

  // Queues copies of the results into pinned host buffers owned by the encoder (reused across
  // steps) on `stream`. staged() is valid once `stream` has been synchronized by the caller.
  cudaError_t stage(cudaStream_t stream);
  DeltaView staged() const;

  // Device bytes currently held as workspace (outputs + CUB temporary storage), and the most
  // ever held.
  size_t workspace_bytes() const;
  size_t peak_workspace_bytes() const;

 private:
  struct State;
  State* state_;
};

// Outcome of a device-side validation: bad_tensor < 0 means every patch is valid.
struct ApplyStatus {
  int64_t bad_tensor = -1;
  int32_t reason = 0;  // ApplyReason
  int64_t bad_position = 0;
};
enum ApplyReason : int32_t { kApplyOk = 0, kIndexOutOfRange = 1, kIndexNotAscending = 2, kWidthMismatch = 3 };
std::string describe(const ApplyStatus& status, std::span<const TensorRef> targets);

// Scatters patches[t] into targets[t] for all t in one launch (device pointers everywhere).
// Validation runs first on the device; if any patch is invalid no element of any tensor is
// written. Apply needs no workspace proportional to the model: a table of T patch descriptors
// and a status word.
class Applier {
 public:
  Applier();
  ~Applier();
  Applier(const Applier&) = delete;
  Applier& operator=(const Applier&) = delete;

  // Asynchronous: queues validation + scatter on `stream`; the outcome is available through
  // status() once `stream` has been synchronized.
  cudaError_t apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches, cudaStream_t stream);
  ApplyStatus status() const;

  // Convenience: apply, synchronize `stream`, and throw deltasync::Error naming the tensor on an
  // invalid patch.
  void apply_checked(std::span<const TensorRef> targets, std::span<const PatchRef> patches, cudaStream_t stream);

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
