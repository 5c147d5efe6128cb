// The GPU twin of the compact delta codec (docs/compact-format.md; CPU: compact_codec.hpp).
// Encode turns a device-resident change set (cuda::Encoder's output) into exactly the
// NAME.cindex / NAME.cdata bytes the CPU codec writes; decode turns those bytes plus a
// device-resident base into validated positions, new bits and base bits on the device, ready
// for cuda::Applier. Both refuse bad input with the CPU twin's one-line messages.
//
// Work split: every compact block (block_elements changes of one tensor) is coded by one CUDA
// thread block. Encode: tokens, histograms and raw bits use all its threads; the four rANS
// lanes are independent chains, run by four threads in lockstep, and their bytes are placed
// by a scan. Decode: one warp per block; the shared rANS stream makes the token decode serial
// (one thread), then the warp gathers the base bits.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "codec/compact_codec.hpp"
#include "format/delta_file.hpp"
#include "core/tensor.hpp"

namespace deltasync::cuda {

// A change set in device memory, laid out exactly like DeltaView (cuda::Encoder's
// device_* accessors): offsets and value_offsets have num_tensors + 1 entries.
struct DeviceDeltaView {
  uint64_t num_tensors = 0;
  const uint64_t* offsets = nullptr;
  const uint64_t* value_offsets = nullptr;
  const int64_t* indices = nullptr;
  const uint8_t* values = nullptr;
  const uint8_t* base_values = nullptr;
};

// Compact encoding on the device, with scratch reused across calls (it only grows).
class CompactEncoder {
 public:
  CompactEncoder();
  ~CompactEncoder();
  CompactEncoder(const CompactEncoder&) = delete;
  CompactEncoder& operator=(const CompactEncoder&) = delete;

  // Encodes every tensor with at least one change, in `tensors` order, byte-identical to
  // compact::encode() on the same change set and options (options.parallel is ignored).
  // Synchronizes `stream` three times: to read the offsets (block planning), to read the
  // block sizes (output allocation), and after the download. Throws Error like the CPU twin.
  std::vector<compact::EncodedTensor> encode(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta,
                                             cudaStream_t stream, const compact::Options& options = {});

  size_t workspace_bytes() const;

 private:
  struct State;
  State* state_;
};

// A decoded compact delta on the device, laid out per BASE tensor like compact::DecodedDelta
// (count 0 for unchanged tensors). Valid until the next decode with the same decoder.
struct DeviceDecodedDelta {
  std::vector<uint64_t> offsets;        // host copy, base.size() + 1 entries
  std::vector<uint64_t> value_offsets;  // host copy, in bytes
  const int64_t* indices = nullptr;     // device
  const uint8_t* values = nullptr;      // device: new bits
  const uint8_t* base_values = nullptr; // device: base bits gathered at the positions
  std::vector<std::string> changed_names;

  // patches[t] applies to base tensor t (device pointers, int64 indices).
  std::vector<PatchRef> patches(std::span<const TensorMeta> base_meta) const;
};

// Compact decoding on the device, with scratch reused across calls (it only grows).
class CompactDecoder {
 public:
  CompactDecoder();
  ~CompactDecoder();
  CompactDecoder(const CompactDecoder&) = delete;
  CompactDecoder& operator=(const CompactDecoder&) = delete;

  // Decodes `encoded` (host bytes: they are uploaded once) against `base` (device pointers,
  // base[t] described by base_meta[t]). Same checks and same messages as compact::decode():
  // the block index is validated on the host before anything is uploaded, the blocks on the
  // device; the base is only read at validated positions and never written. Synchronizes
  // `stream` once (twice when a block is bad). Throws Error("LABEL: tensor NAME: ...").
  const DeviceDecodedDelta& decode(std::span<const compact::EncodedTensorView> encoded,
                                   std::span<const TensorMeta> base_meta, std::span<const ConstTensorRef> base,
                                   const std::string& label, cudaStream_t stream);

  size_t workspace_bytes() const;

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
