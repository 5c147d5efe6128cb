// The GPU compact decode as the engine runs it: the CPU codec's own host checks and layout
// (compact::parse_encoded_tensors, compact::layout_offsets), the kernels' decode
// (cuda::CompactDecoder), and its verdict thrown with the CPU twin's message.
#pragma once
#include <cuda_runtime_api.h>

#include <span>
#include <string>
#include <vector>

#include "codec/compact_codec.hpp"
#include "deltasync/cuda/compact.hpp"

namespace deltasync::engine {

class DeviceCompactDecode {
 public:
  // Decodes `encoded` (host bytes, uploaded once) against `base` (device pointers, base[t]
  // described by base_meta[t]): the checks and messages of compact::decode(). Synchronizes
  // `stream` once (twice when a block is bad). Throws BadInputError("LABEL: tensor NAME: ...").
  const cuda::DeviceDecodedDelta& decode(std::span<const compact::EncodedTensorView> encoded,
                                         std::span<const TensorMeta> base_meta, std::span<const ConstTensorRef> base,
                                         const std::string& label, cudaStream_t stream);

  // decode() in two steps, for a caller that folds the decode's wait into its own (the sync
  // engine: one wait per compact delta for decode + verified apply). queue() makes the host
  // checks and throws their errors, then queues the decode without waiting: the result's layout
  // (host offsets) is valid at once, its device arrays once `stream` reaches this point. After
  // the caller has synchronized `stream`, finish() throws the decode's error if a block was bad
  // (waiting once more to fetch its details). Until then the decoded arrays may hold anything.
  const cuda::DeviceDecodedDelta& queue(std::span<const compact::EncodedTensorView> encoded,
                                        std::span<const TensorMeta> base_meta, std::span<const ConstTensorRef> base,
                                        const std::string& label, cudaStream_t stream);
  void finish(cudaStream_t stream);

  size_t workspace_bytes() const { return decoder_.workspace_bytes(); }
  // The last decode(), or queue() + finish() (the caller's wait between them not included).
  const TransferCounters& transfer() const { return transfer_; }

 private:
  cuda::CompactDecoder decoder_;
  TransferCounters transfer_;
  bool pending_ = false;
  std::string label_;
  std::vector<std::string> names_;  // base tensor names, for the fault's message
};

}  // namespace deltasync::engine
