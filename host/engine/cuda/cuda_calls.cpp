#include "engine/cuda/cuda_calls.hpp"

#include "core/error.hpp"
#include "deltasync/cuda/buffers.hpp"

namespace deltasync::cuda {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  if (err == cudaErrorInvalidValue) {
    std::string reason = take_refusal();
    if (!reason.empty()) throw Error(reason);
  }
  throw Error(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

std::string describe(const ApplyStatus& status, std::span<const TensorRef> targets) {
  if (status.bad_tensor < 0) return "all patches valid";
  const auto t = static_cast<size_t>(status.bad_tensor);
  // Appended piece by piece: GCC 12's -Wrestrict misfires on `"literal" + std::string&&`.
  std::string label = "tensor ";
  if (t < targets.size()) label += targets[t].name; else label += '#' + std::to_string(t);
  label += ": ";
  const uint64_t numel = t < targets.size() ? targets[t].numel : 0;
  const uint32_t width = t < targets.size() ? targets[t].width : 0;
  switch (status.reason) {
    case kIndexOutOfRange:
      return label + "index " + std::to_string(status.bad_position) + " out of range [0, " + std::to_string(numel) +
             ")";
    case kIndexNotAscending:
      return label + "indices not strictly ascending at position " + std::to_string(status.bad_position);
    case kWidthMismatch:
      // bad_position carries the width of the offending values.
      return label + "values are " + std::to_string(status.bad_position) + "-byte but the tensor is " +
             std::to_string(width) + "-byte";
    default:
      return label + "invalid patch (reason " + std::to_string(status.reason) + ")";
  }
}

void apply_checked(Applier& applier, std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                   cudaStream_t stream, TransferCounters* transfer) {
  const cudaError_t queued = applier.apply(targets, patches, stream);
  if (transfer != nullptr) transfer->add(applier.transfer());
  check(queued, "apply");
  check(cudaStreamSynchronize(stream), "apply: synchronize");
  if (transfer != nullptr) ++transfer->host_syncs;
  const ApplyStatus result = applier.status();
  if (result.bad_tensor >= 0) throw Error(describe(result, targets));
}

std::vector<uint64_t> digest_device_tensors(std::span<const ConstTensorRef> tensors, cudaStream_t stream) {
  std::vector<uint64_t> out(tensors.size(), 0);
  if (tensors.empty()) return out;
  Digester digester;
  DeviceArray<uint64_t> result;
  check(result.reserve(tensors.size()), "digest: cudaMalloc");
  check(digester.digest(tensors, result.data(), stream), "digest");
  check(cudaMemcpyAsync(out.data(), result.data(), out.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream),
        "digest: copy to host");
  check(cudaStreamSynchronize(stream), "digest");
  return out;
}

std::vector<compact::EncodedTensor> encode_compact(CompactEncoder& encoder, std::span<const TensorMeta> tensors,
                                                   const DeviceDeltaView& delta, cudaStream_t stream,
                                                   const compact::Options& options) {
  std::vector<compact::EncodedTensor> out;
  check(encoder.encode(tensors, delta, stream, options, out), "compact encode");
  return out;
}

std::vector<compact::EncodedTensor> encode_compact(CompactEncoder& encoder, std::span<const TensorMeta> tensors,
                                                   const DeviceDeltaView& delta, std::span<const uint64_t> host_offsets,
                                                   std::span<const uint64_t> host_value_offsets, cudaStream_t stream,
                                                   const compact::Options& options) {
  std::vector<compact::EncodedTensor> out;
  check(encoder.encode(tensors, delta, host_offsets, host_value_offsets, stream, options, out), "compact encode");
  return out;
}

}  // namespace deltasync::cuda
