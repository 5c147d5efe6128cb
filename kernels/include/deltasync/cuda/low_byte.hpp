// The encoder of the low-memory shadow (engine::ShadowKind::kLowByte) on the device: 2-byte
// elements (bfloat16, float16) are compared with a shadow that keeps only their low byte (half
// the memory of a full shadow). A change that leaves the low byte equal is missed by design; the
// publisher hashes the full weights every version and turns such a version into an anchor.
// Output equals engine::CpuSyncEngine's low-byte encode byte for byte: per tensor the ascending
// positions whose low byte differs, with the element's full current bits (no base bits: the
// shadow does not have them).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "core/tensor.hpp"
#include "deltasync/cuda/engine.hpp"

namespace deltasync::cuda {

class LowByteEncoder {
 public:
  LowByteEncoder();
  ~LowByteEncoder();
  LowByteEncoder(const LowByteEncoder&) = delete;
  LowByteEncoder& operator=(const LowByteEncoder&) = delete;

  // items[t].current: numel 2-byte elements (device); items[t].shadow: numel bytes (device),
  // the low bytes last published, brought up to date here. Queued on `stream`: a count pass,
  // then CUB's select of the changed positions, then the gather of their bits and the shadow
  // update. Synchronizes `stream` once, to read the number of changed elements (it sizes the
  // output). Refuses (cudaErrorInvalidValue, take_refusal() naming the tensor) an element
  // width other than 2 or a misaligned or null pointer.
  cudaError_t encode(std::span<const EncodeItem> items, cudaStream_t stream);

  // Queues shadow := the low bytes of current for every item (a new chain). No wait.
  cudaError_t take_shadow(std::span<const EncodeItem> items, cudaStream_t stream);

  uint64_t total_changed() const;

  // Queues copies of the last encode()'s offsets, value offsets, positions and values into
  // pinned host buffers owned by the encoder, after that encode's kernels (`stream` may differ
  // from the encode's); staged() (base_values empty) is valid once `stream` is synchronized.
  // Refused (cudaErrorInvalidValue, take_refusal()) without an encode since the last
  // take_shadow().
  cudaError_t stage(cudaStream_t stream);
  DeltaView staged() const;

  // The last encode() and the stage() after it.
  const TransferCounters& transfer() const;

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
