// The GPU twin of the compact delta codec (docs/compact-format.md; CPU: compact_codec.hpp).
// Encode turns a device-resident change set (cuda::Encoder's output) into exactly the
// NAME.cindex / NAME.cdata bytes the CPU codec writes; decode turns those bytes plus a
// device-resident base into validated positions, new bits and base bits on the device, ready
// for cuda::Applier. Both refuse bad input with the CPU twin's one-line reasons, as results
// (take_refusal(), fault()): the engine (engine/cuda/cuda_calls.hpp, compact_decode.hpp) runs
// the CPU codec's host checks first and throws.
//
// Work split: every compact block (block_elements changes of one tensor) is coded by one CUDA
// thread block. Encode: tokens, histograms and raw bits use all its threads; the four rANS
// lanes are independent chains, run by four threads in lockstep, and their bytes are placed
// by a scan. Decode: one warp per block; compact_version 2's 32 interleaved rANS lanes run one
// per thread, version 1's shared four-lane stream is decoded by one thread; then the warp
// gathers the base bits (compact_decode_kernels.cuh).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "codec/compact_block_index.hpp"  // header-only here: the ParsedBlockIndex record
#include "codec/compact_format.hpp"
#include "core/tensor.hpp"
#include "core/tensor_meta.hpp"
#include "deltasync/cuda/engine.hpp"

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

  // Encodes every tensor with at least one change into `out`, in `tensors` order,
  // byte-identical to compact::encode() on the same change set, shapes and options
  // (options.parallel is ignored; tiles follow the tensors' shapes as on the CPU). Synchronizes
  // `stream` three times: to read the offsets (block planning), to read the block sizes (output
  // allocation), and after the download; once more when some tensor is cut into tiles (where
  // each tile starts plans its blocks). Arguments compact::encode refuses are refused with its
  // message (cudaErrorInvalidValue, take_refusal()).
  cudaError_t encode(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta, cudaStream_t stream,
                     const compact::Options& options, std::vector<compact::EncodedTensor>& out);

  // Same, with the change set's offsets and value offsets already on the host (T + 1 entries
  // each, e.g. Encoder::host_offsets() after its synchronization): the first synchronization
  // is skipped, two (or three) remain.
  cudaError_t encode(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta,
                     std::span<const uint64_t> host_offsets, std::span<const uint64_t> host_value_offsets,
                     cudaStream_t stream, const compact::Options& options, std::vector<compact::EncodedTensor>& out);

  size_t workspace_bytes() const;
  // The last encode().
  const TransferCounters& transfer() const;

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

  // patches[t] applies to base tensor t (device pointers, int64 indices).
  std::vector<PatchRef> patches(std::span<const TensorMeta> base_meta) const;
};

// The first block the device found corrupt, or none: the block, and the reason in the CPU
// codec's words ("block 3: rANS stream truncated", "block 3 starts at position P, not after the
// previous block's last (Q)"), for the engine to prefix with the file and tensor.
struct CompactDecodeFault {
  bool found = false;
  size_t base_index = 0;  // the base tensor (the caller's numbering)
  std::string what;
};

// Compact decoding on the device, with scratch reused across calls (it only grows).
class CompactDecoder {
 public:
  CompactDecoder();
  ~CompactDecoder();
  CompactDecoder(const CompactDecoder&) = delete;
  CompactDecoder& operator=(const CompactDecoder&) = delete;

  // Queues the decode of block indexes the caller has validated on the host with the CPU
  // codec's own parser (`parsed`: compact::parse_encoded_tensors, in file order) and laid out
  // (`offsets`, `value_offsets`: compact::layout_offsets, T + 1 entries each) against `base`
  // (device pointers, base[t] the tensor parsed[k].base_index == t names; only read, at
  // validated positions). The payloads go up in one copy; nothing waits. The result's layout is
  // valid at once, its device arrays once `stream` reaches this point -- and only if finish()
  // reports no fault: until then the decoded arrays (positions included) may hold anything.
  // Refuses a null base pointer (cudaErrorInvalidValue, take_refusal()).
  cudaError_t queue(std::span<const compact::ParsedBlockIndex> parsed, std::span<const uint64_t> offsets,
                    std::span<const uint64_t> value_offsets, std::span<const ConstTensorRef> base,
                    cudaStream_t stream);
  // After the caller has synchronized `stream` (its wait, not counted here): reads the verdict
  // into fault(); a bad block's details take one more synchronization (counted).
  cudaError_t finish(cudaStream_t stream);
  const CompactDecodeFault& fault() const;
  const DeviceDecodedDelta& result() const;

  size_t workspace_bytes() const;
  // The last queue() + finish() (the caller's wait between them not included).
  const TransferCounters& transfer() const;

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
