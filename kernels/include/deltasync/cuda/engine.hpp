// Public entry points of the CUDA backend, includable from plain C++ (only the CUDA runtime
// API header is needed). Layering follows CUB: these classes are the host dispatch layer that
// owns workspace and orders launches; the kernels and their launchers live in kernels/src and
// take an explicit stream. Nothing here synchronizes unless its comment says so.
//
// kernels/ depends on host/core only (and the codec's header-only format constants): the engine
// (host/engine/cuda) wires these classes into the host library and decides what their results
// mean. One error convention, CUB's: every entry point returns cudaError_t; none throws (but
// std::bad_alloc from host-side tables).
// Arguments a dispatcher cannot take (a width it does not handle, a null or misaligned pointer,
// a tensor count past its limits) return cudaErrorInvalidValue with a one-line reason naming
// the tensor, in the CPU twin's words, that take_refusal() returns; results that judge the input
// (an invalid patch, a corrupt compact block) are data (ApplyStatus, CompactDecodeFault) that
// the engine words and throws.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/tensor.hpp"
#include "core/transfer_counters.hpp"

namespace deltasync::cuda {

// What a call moved between host and device and how often it made the host wait for the
// device (stream synchronizations; an event wait on work the call's contract says is long
// finished -- e.g. the previous call's small descriptor upload -- is not counted). Every class
// below reports its last call through transfer(); callers add these up per version.
using ::deltasync::TransferCounters;

// True when at least one CUDA device can be used.
bool device_available();

// The reason of the last cudaErrorInvalidValue a dispatcher on this thread returned for its
// arguments ("tensor NAME: null device pointer"), or "" (a plain CUDA error); clears it, as
// cudaGetLastError clears the runtime's error.
std::string take_refusal();

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
  // Host copies of the device offsets / value offsets (T + 1 entries each), read in encode()'s
  // one synchronization: callers plan on them without another wait (CompactEncoder's overload).
  const uint64_t* host_offsets() const;
  const uint64_t* host_value_offsets() const;
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

  // The last encode() and the stage() calls after it (an encode that grows its output reruns
  // and synchronizes once more; that shows here).
  const TransferCounters& transfer() const;

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
// The engine words these as the CPU twin does (engine/cuda/cuda_calls.hpp, describe()).
enum ApplyReason : int32_t { kApplyOk = 0, kIndexOutOfRange = 1, kIndexNotAscending = 2, kWidthMismatch = 3 };

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

  // The last apply() (the caller's wait for status() is the caller's to count).
  const TransferCounters& transfer() const;

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
