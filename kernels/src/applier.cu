// Host dispatch of the apply pipeline (see apply_kernels.cuh): checks what the host can see,
// fills the patch table in pinned memory, copies it to the device in one transfer and queues
// validate + finalize + scatter. The table buffers are reused across calls and only grow.
#include <algorithm>
#include <cstring>
#include <string>

#include "apply_kernels.cuh"
#include "deltasync/cuda/engine.hpp"
#include "device_buffers.cuh"
#include "nvtx_ranges.cuh"
#include "patch_headers.hpp"
#include "refusal.cuh"

namespace deltasync::cuda {

using detail::PatchTableHeader;
using detail::PatchTableLayout;
using detail::PatchTarget;

struct Applier::State {
  int sm_count = 1;
  PinnedArray<uint8_t> table_host;
  DeviceArray<uint8_t> table_device;
  DeviceArray<ApplyStatus> status_device;
  PinnedArray<ApplyStatus> status_host;
  // Recorded after the table upload: the pinned table must not be rewritten before the copy
  // of the previous call has read it.
  cudaEvent_t upload_done = nullptr;
  bool upload_pending = false;
  // Recorded after the status copy, the last use of the device table and status: a call on
  // another stream makes its stream wait for it before overwriting them (a no-op on one stream).
  cudaEvent_t apply_done = nullptr;
  TransferCounters transfer;  // the last call
};

namespace detail {

cudaError_t check_patch_headers(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                int64_t& width_mismatch) {
  width_mismatch = -1;
  if (targets.size() != patches.size())
    return detail::refuse("apply: " + std::to_string(patches.size()) + " patches for " +
                          std::to_string(targets.size()) + " tensors");
  for (size_t t = 0; t < targets.size(); ++t) {
    const std::string name(targets[t].name);
    const uint32_t width = targets[t].width;
    if (width != 1 && width != 2 && width != 4)
      return detail::refuse("tensor " + name + ": element width " + std::to_string(width) + " is not 1, 2 or 4 bytes");
    const PatchRef& p = patches[t];
    if (p.count == 0) continue;
    if (p.value_width != width) {
      width_mismatch = static_cast<int64_t>(t);
      return cudaSuccess;
    }
    if (p.index_width != 4 && p.index_width != 8)
      return detail::refuse("tensor " + name + ": index width " + std::to_string(p.index_width) +
                            " is not 4 or 8 bytes");
    if (p.count > targets[t].numel)
      return detail::refuse("tensor " + name + ": " + std::to_string(p.count) + " changes for " +
                            std::to_string(targets[t].numel) + " elements");
    if (targets[t].data == nullptr || p.indices == nullptr || p.values == nullptr)
      return detail::refuse("tensor " + name + ": null device pointer");
    if (reinterpret_cast<uintptr_t>(targets[t].data) % width != 0 ||
        reinterpret_cast<uintptr_t>(p.indices) % p.index_width != 0)
      return detail::refuse("tensor " + name + ": misaligned device pointer");
  }
  return cudaSuccess;
}

}  // namespace detail

Applier::Applier() : state_(new State) {
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&state_->sm_count, cudaDevAttrMultiProcessorCount, device);
  cudaGetLastError();  // a failed query must not leave a sticky error for the caller
  if (state_->sm_count <= 0) state_->sm_count = 1;
}

Applier::~Applier() {
  if (state_->upload_done != nullptr) cudaEventDestroy(state_->upload_done);
  if (state_->apply_done != nullptr) cudaEventDestroy(state_->apply_done);
  delete state_;
}

cudaError_t Applier::apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                           cudaStream_t stream) {
  detail::scoped_range range{"apply"};
  int64_t width_mismatch = -1;
  if (const cudaError_t refused = detail::check_patch_headers(targets, patches, width_mismatch); refused != cudaSuccess)
    return refused;
  State& s = *state_;
  s.transfer = {};

  for (cudaEvent_t* event : {&s.upload_done, &s.apply_done}) {
    if (*event != nullptr) continue;
    cudaError_t err = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
    if (err != cudaSuccess) return err;
  }
  if (s.status_host.data() == nullptr) {
    cudaError_t err = s.status_host.reserve(1);
    if (err != cudaSuccess) return err;
    *s.status_host.data() = ApplyStatus{};
  }
  if (s.upload_pending) {
    cudaError_t err = cudaEventSynchronize(s.upload_done);  // normally long complete
    if (err != cudaSuccess) return err;
    s.upload_pending = false;
  }

  const uint64_t num_patches = patches.size();
  const PatchTableLayout layout = PatchTableLayout::for_patches(num_patches);
  if (layout.total_bytes > s.table_device.capacity()) {
    // Growing frees the device table, which the previous call's kernels may still read.
    cudaError_t err = cudaEventSynchronize(s.apply_done);
    if (err != cudaSuccess) return err;
  }
  for (cudaError_t err : {s.table_host.reserve(layout.total_bytes), s.table_device.reserve(layout.total_bytes),
                          s.status_device.reserve(1)}) {
    if (err != cudaSuccess) return err;
  }

  uint8_t* host = s.table_host.data();
  auto* prefix = reinterpret_cast<uint64_t*>(host + layout.prefix_offset);
  auto* descriptors = reinterpret_cast<PatchTarget*>(host + layout.patches_offset);
  uint64_t total = 0;
  for (uint64_t t = 0; t < num_patches; ++t) {
    const PatchRef& p = patches[t];
    prefix[t] = total;
    // With a width mismatch nothing is validated or written, so the table only needs to exist.
    descriptors[t] = PatchTarget{static_cast<uint8_t*>(targets[t].data), targets[t].numel, p.indices,
                                 static_cast<const uint8_t*>(p.values), targets[t].width, p.index_width};
    total += p.count;
  }
  prefix[num_patches] = total;
  PatchTableHeader header{};
  header.num_patches = num_patches;
  header.total_elements = total;
  header.width_mismatch_tensor = width_mismatch;
  header.width_mismatch_value_width = width_mismatch >= 0 ? patches[width_mismatch].value_width : 0;
  header.first_bad_element = detail::kNoBadElement;
  header.failed = 0;
  std::memcpy(host, &header, sizeof header);

  // The previous call's kernels may still read the device table (if it ran on another stream).
  cudaError_t err = cudaStreamWaitEvent(stream, s.apply_done, 0);
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(s.table_device.data(), host, layout.total_bytes, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return err;
  err = cudaEventRecord(s.upload_done, stream);
  if (err != cudaSuccess) return err;
  s.upload_pending = true;
  s.transfer.host_to_device_bytes += layout.total_bytes;

  uint8_t* device = s.table_device.data();
  const detail::PatchTableView view{reinterpret_cast<PatchTableHeader*>(device),
                                    reinterpret_cast<const uint64_t*>(device + layout.prefix_offset),
                                    reinterpret_cast<const PatchTarget*>(device + layout.patches_offset)};
  // Nothing to validate or scatter after a width mismatch: finalize alone reports it.
  err = detail::validate_and_scatter(view, width_mismatch >= 0 ? 0 : total, s.status_device.data(), s.sm_count,
                                     stream);
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(s.status_host.data(), s.status_device.data(), sizeof(ApplyStatus), cudaMemcpyDeviceToHost,
                        stream);
  if (err != cudaSuccess) return err;
  s.transfer.device_to_host_bytes += sizeof(ApplyStatus);
  return cudaEventRecord(s.apply_done, stream);
}

const TransferCounters& Applier::transfer() const { return state_->transfer; }

ApplyStatus Applier::status() const {
  return state_->status_host.data() == nullptr ? ApplyStatus{} : *state_->status_host.data();
}

}  // namespace deltasync::cuda
