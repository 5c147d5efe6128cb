// CUDA implementations of torch.ops.deltasync. Plain C++: the kernels are compiled by nvcc inside
// deltasync_cuda; this file passes raw device pointers and PyTorch's current stream to its host
// API (cuda::Encoder, cuda::Applier, through the engine's checked calls: engine/cuda/cuda_calls.hpp,
// cuda::digest_device_tensors), so work is ordered with the caller's other kernels and outputs are allocated by PyTorch's caching allocator.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "tensor_lists.hpp"

namespace deltasync::torch_ext {
namespace {

// One encoder and one applier per device: they own workspace that is reused across steps (the
// encoder's grows to the largest delta seen). The encoder's results live in that workspace until
// its next encode, so `results_read` marks when the copies out of it are done; an encode on
// another stream waits for that event before overwriting them.
struct DeviceEngines {
  std::mutex mutex;
  cuda::Encoder encoder;
  cuda::Applier applier;
  cudaEvent_t results_read = nullptr;

  DeviceEngines() { cuda::check(cudaEventCreateWithFlags(&results_read, cudaEventDisableTiming), "deltasync: event"); }
  ~DeviceEngines() { cudaEventDestroy(results_read); }
};

DeviceEngines& engines_for(const c10::Device& device) {
  static std::mutex registry_mutex;
  static std::map<int, std::unique_ptr<DeviceEngines>> registry;
  std::lock_guard lock(registry_mutex);
  auto& slot = registry[device.index()];
  if (!slot) slot = std::make_unique<DeviceEngines>();  // allocates on the guarded (current) device
  return *slot;
}

void copy_device(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "deltasync.encode: copy results");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> encode_with_base_cuda(at::TensorList current,
                                                                                 at::TensorList shadow,
                                                                                 const OptionalNames& names) {
  EncodeArgs args = encode_args(current, shadow, names, c10::DeviceType::CUDA);
  const c10::Device device = current[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const auto on_device = at::TensorOptions().device(device);
  const int64_t num_tensors = static_cast<int64_t>(args.items.size());

  return translate_errors("deltasync.encode", [&] {
    DeviceEngines& engines = engines_for(device);
    std::lock_guard lock(engines.mutex);
    cuda::check(cudaStreamWaitEvent(stream, engines.results_read, 0), "deltasync.encode: order after previous encode");
    cuda::check(engines.encoder.encode(args.items, stream), "deltasync.encode");
    const auto changed = static_cast<int64_t>(engines.encoder.total_changed());

    // Value bytes: count × width when all tensors share a width; otherwise the last value offset
    // (one more 8-byte read; the encode already synchronized once).
    bool uniform = true;
    for (const EncodeItem& item : args.items) uniform = uniform && item.width == args.items[0].width;
    uint64_t value_bytes = static_cast<uint64_t>(changed) * args.items[0].width;
    if (!uniform) {
      cuda::check(cudaMemcpyAsync(&value_bytes, engines.encoder.device_value_offsets() + num_tensors, sizeof(uint64_t),
                                  cudaMemcpyDeviceToHost, stream),
                  "deltasync.encode: read value size");
      cuda::check(cudaStreamSynchronize(stream), "deltasync.encode: read value size");
    }

    at::Tensor offsets = at::empty({num_tensors + 1}, on_device.dtype(at::kLong));
    at::Tensor indices = at::empty({changed}, on_device.dtype(at::kLong));
    at::Tensor values = at::empty({static_cast<int64_t>(value_bytes)}, on_device.dtype(at::kByte));
    at::Tensor base_values = at::empty({static_cast<int64_t>(value_bytes)}, on_device.dtype(at::kByte));
    copy_device(offsets.mutable_data_ptr(), engines.encoder.device_offsets(), (num_tensors + 1) * sizeof(uint64_t), stream);
    copy_device(indices.mutable_data_ptr(), engines.encoder.device_indices(), changed * sizeof(int64_t), stream);
    copy_device(values.mutable_data_ptr(), engines.encoder.device_values(), value_bytes, stream);
    copy_device(base_values.mutable_data_ptr(), engines.encoder.device_base_values(), value_bytes, stream);
    cuda::check(cudaEventRecord(engines.results_read, stream), "deltasync.encode: record");
    at::Tensor counts = offsets.slice(0, 1) - offsets.slice(0, 0, num_tensors);
    return std::make_tuple(indices, values, base_values, counts);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_cuda(at::TensorList current, at::TensorList shadow,
                                                           const OptionalNames& names) {
  auto [indices, values, base_values, counts] = encode_with_base_cuda(current, shadow, names);
  return {indices, values, counts};
}

void apply_cuda(at::TensorList targets, const at::Tensor& indices, const at::Tensor& values, const at::Tensor& counts,
                const OptionalNames& names) {
  // Patch boundaries are needed on the host to build the descriptor table (counts is T numbers).
  const ApplyArgs args = apply_args(targets, indices, values, counts.cpu(), names, c10::DeviceType::CUDA);
  const c10::Device device = targets[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  translate_errors("deltasync.apply", [&] {
    DeviceEngines& engines = engines_for(device);
    std::lock_guard lock(engines.mutex);
    cuda::apply_checked(engines.applier, args.targets, args.patches, stream);
  });
}

at::Tensor digest_cuda(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "deltasync.digest: empty tensor list");
  const std::vector<std::string> labels = tensor_labels("tensors", tensors.size(), std::nullopt);
  const c10::Device device = tensors[0].device();
  std::vector<ConstTensorRef> refs;
  for (size_t t = 0; t < tensors.size(); ++t) {
    TORCH_CHECK(tensors[t].device() == device, "deltasync.digest: tensor ", labels[t], " is on ", tensors[t].device(),
                ", the first on ", device);
    check_usable(tensors[t], labels[t]);
    refs.push_back(ConstTensorRef{labels[t], tensors[t].const_data_ptr(), static_cast<uint64_t>(tensors[t].numel()),
                                  element_width(tensors[t], labels[t])});
  }
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const std::vector<uint64_t> digests =
      translate_errors("deltasync.digest", [&] { return cuda::digest_device_tensors(refs, stream); });
  at::Tensor out = at::empty({static_cast<int64_t>(digests.size())}, at::kLong);
  std::memcpy(out.mutable_data_ptr<int64_t>(), digests.data(), digests.size() * sizeof(uint64_t));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(deltasync, CUDA, m) {
  m.impl("encode", &encode_cuda);
  m.impl("encode_with_base", &encode_with_base_cuda);
  m.impl("apply", &apply_cuda);
  m.impl("digest", &digest_cuda);
}

}  // namespace deltasync::torch_ext
