// CUDA side of the CLI backends: one device allocation per command for all tensors, copies in,
// the kernels, copies out. Only built into CUDA builds.
#ifdef DELTASYNC_WITH_CUDA
#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "backend.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/engine.hpp"

namespace deltasync::cli {

namespace {

// One device buffer holding many host arrays back to back (each 256-byte aligned).
class DeviceArena {
 public:
  explicit DeviceArena(const std::vector<size_t>& sizes) {
    size_t total = 0;
    for (size_t s : sizes) {
      offsets_.push_back(total);
      total += (s + 255) / 256 * 256;
    }
    if (total) cuda::check(cudaMalloc(&base_, total), "cudaMalloc");
  }
  ~DeviceArena() {
    if (base_) cudaFree(base_);
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  uint8_t* at(size_t k) const { return static_cast<uint8_t*>(base_) + offsets_[k]; }

 private:
  void* base_ = nullptr;
  std::vector<size_t> offsets_;
};

void upload(void* dst, const void* src, size_t n, cudaStream_t s) {
  if (n) cuda::check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s), "copy to device");
}
void download(void* dst, const void* src, size_t n, cudaStream_t s) {
  if (n) cuda::check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s), "copy from device");
}

struct Stream {
  cudaStream_t s{};
  Stream() { cuda::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s); }
};

}  // namespace

void encode_cuda(std::span<const EncodeItem> items, SparseDelta& out) { encode_cuda(items, out, {}, {}, nullptr); }

void encode_cuda(std::span<const EncodeItem> items, SparseDelta& out, std::span<const TensorMeta> tensors,
                 const compact::Options& options, std::vector<compact::EncodedTensor>* encoded) {
  Stream stream;
  std::vector<size_t> sizes;
  for (const auto& it : items) {
    sizes.push_back(it.numel * it.width);  // current
    sizes.push_back(it.numel * it.width);  // shadow
  }
  DeviceArena arena(sizes);
  std::vector<EncodeItem> dev(items.begin(), items.end());
  for (size_t t = 0; t < items.size(); ++t) {
    const size_t n = items[t].numel * items[t].width;
    upload(arena.at(2 * t), items[t].current, n, stream.s);
    upload(arena.at(2 * t + 1), items[t].shadow, n, stream.s);
    dev[t].current = arena.at(2 * t);
    dev[t].shadow = arena.at(2 * t + 1);
  }
  cuda::Encoder encoder;
  cuda::check(encoder.encode(dev, stream.s), "encode");
  if (encoded != nullptr) {
    // Compacted on the device from the encoder's results (it synchronizes the stream).
    cuda::CompactEncoder compactor;
    const cuda::DeviceDeltaView view{encoder.num_tensors(),    encoder.device_offsets(), encoder.device_value_offsets(),
                                     encoder.device_indices(), encoder.device_values(),  encoder.device_base_values()};
    *encoded = compactor.encode(tensors, view, stream.s, options);
  }
  cuda::check(encoder.stage(stream.s), "stage");
  for (size_t t = 0; t < items.size(); ++t)
    download(items[t].shadow, dev[t].shadow, items[t].numel * items[t].width, stream.s);
  cuda::check(cudaStreamSynchronize(stream.s), "encode");
  const DeltaView v = encoder.staged();
  out.offsets.assign(v.offsets.begin(), v.offsets.end());
  out.value_offsets.assign(v.value_offsets.begin(), v.value_offsets.end());
  out.indices.assign(v.indices.begin(), v.indices.end());
  out.values.assign(v.values.begin(), v.values.end());
  out.base_values.assign(v.base_values.begin(), v.base_values.end());
}

void apply_cuda(std::span<const TensorRef> targets, std::span<const PatchRef> patches) {
  Stream stream;
  std::vector<size_t> sizes;
  for (size_t t = 0; t < targets.size(); ++t) {
    sizes.push_back(targets[t].numel * targets[t].width);
    sizes.push_back(patches[t].count * patches[t].index_width);
    sizes.push_back(patches[t].count * patches[t].value_width);
  }
  DeviceArena arena(sizes);
  std::vector<TensorRef> dev_targets(targets.begin(), targets.end());
  std::vector<PatchRef> dev_patches(patches.begin(), patches.end());
  for (size_t t = 0; t < targets.size(); ++t) {
    upload(arena.at(3 * t), targets[t].data, sizes[3 * t], stream.s);
    upload(arena.at(3 * t + 1), patches[t].indices, sizes[3 * t + 1], stream.s);
    upload(arena.at(3 * t + 2), patches[t].values, sizes[3 * t + 2], stream.s);
    dev_targets[t].data = arena.at(3 * t);
    dev_patches[t].indices = arena.at(3 * t + 1);
    dev_patches[t].values = arena.at(3 * t + 2);
  }
  cuda::Applier applier;
  applier.apply_checked(dev_targets, dev_patches, stream.s);  // throws before any copy back
  for (size_t t = 0; t < targets.size(); ++t) download(targets[t].data, dev_targets[t].data, sizes[3 * t], stream.s);
  cuda::check(cudaStreamSynchronize(stream.s), "apply");
}

}  // namespace deltasync::cli
#endif  // DELTASYNC_WITH_CUDA
