#include "engine/cuda/compact_decode.hpp"

#include "core/error.hpp"
#include "engine/cuda/cuda_calls.hpp"

namespace deltasync::engine {

const cuda::DeviceDecodedDelta& DeviceCompactDecode::decode(std::span<const compact::EncodedTensorView> encoded,
                                                            std::span<const TensorMeta> base_meta,
                                                            std::span<const ConstTensorRef> base,
                                                            const std::string& label, cudaStream_t stream) {
  const cuda::DeviceDecodedDelta& out = queue(encoded, base_meta, base, label, stream);
  if (pending_) {
    cuda::check(cudaStreamSynchronize(stream), "compact decode: synchronize");
    try {
      finish(stream);
    } catch (...) {
      transfer_.host_syncs += 1;
      throw;
    }
    transfer_.host_syncs += 1;
  }
  return out;
}

const cuda::DeviceDecodedDelta& DeviceCompactDecode::queue(std::span<const compact::EncodedTensorView> encoded,
                                                           std::span<const TensorMeta> base_meta,
                                                           std::span<const ConstTensorRef> base,
                                                           const std::string& label, cudaStream_t stream) {
  transfer_ = {};
  pending_ = false;
  // The host checks of compact::decode(), by the same code, and its layout.
  const std::vector<compact::ParsedBlockIndex> parsed = compact::parse_encoded_tensors(encoded, base_meta, base, label);
  std::vector<uint64_t> offsets, value_offsets;
  compact::layout_offsets(parsed, base_meta, offsets, value_offsets);
  const cudaError_t queued = decoder_.queue(parsed, offsets, value_offsets, base, stream);
  transfer_ = decoder_.transfer();
  if (queued == cudaErrorInvalidValue) {
    const std::string reason = cuda::take_refusal();
    if (!reason.empty()) throw Error(label + ": " + reason);
  }
  cuda::check(queued, "compact decode");
  label_ = label;
  names_.clear();
  for (const TensorMeta& m : base_meta) names_.push_back(m.name);
  pending_ = true;
  return decoder_.result();
}

void DeviceCompactDecode::finish(cudaStream_t stream) {
  if (!pending_) return;
  pending_ = false;
  const cudaError_t err = decoder_.finish(stream);
  transfer_ = decoder_.transfer();  // the queue's and the finish's
  cuda::check(err, "compact decode");
  const cuda::CompactDecodeFault& fault = decoder_.fault();
  if (fault.found) throw BadInputError(label_ + ": tensor " + names_[fault.base_index] + ": " + fault.what);
}

}  // namespace deltasync::engine
