// The device half of a verified apply: save → validate + scatter → shifts, and the restore. The
// only kernel of its own is the save (a gather of the bits about to be replaced,
// gather_kernels.cuh); validation and scatter are cuda::Applier's, hashing is cuda::Digester's.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "deltasync/cuda/saving_apply.hpp"
#include "device_buffers.cuh"
#include "gather_kernels.cuh"
#include "patch_headers.hpp"
#include "refusal.cuh"

namespace deltasync::cuda {

struct SavingApplier::State {
  Applier applier;
  Digester digester;
  detail::PinnedArray<detail::SaveJob> host_jobs;
  detail::DeviceArray<detail::SaveJob> device_jobs;
  detail::DeviceArray<uint8_t> saved;    // old bits of every changed element
  detail::PinnedArray<uint64_t> shifts;  // per target
  std::vector<PatchRef> restore;         // the last apply's patches, values pointing into `saved`
  int sm_count = 0;
  TransferCounters transfer;  // the last call
};

SavingApplier::SavingApplier() : state_(new State) {
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&state_->sm_count, cudaDevAttrMultiProcessorCount, device);
  cudaGetLastError();  // a failed query must not leave a sticky error for the caller
  if (state_->sm_count <= 0) state_->sm_count = 1;
}

SavingApplier::~SavingApplier() { delete state_; }

const TransferCounters& SavingApplier::transfer() const { return state_->transfer; }
ApplyStatus SavingApplier::status() const { return state_->applier.status(); }
const uint64_t* SavingApplier::shifts() const { return state_->shifts.data(); }

cudaError_t SavingApplier::apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                 cudaStream_t stream) {
  State& s = *state_;
  s.transfer = {};
  s.restore.clear();
  const size_t T = targets.size();
  if (patches.size() != T)
    return detail::refuse("apply: " + std::to_string(patches.size()) + " patches for " + std::to_string(T) + " tensors");
  for (size_t t = 0; t < T; ++t) {
    const uint32_t w = targets[t].width;
    if (w != 1 && w != 2 && w != 4)
      return detail::refuse("tensor " + std::string(targets[t].name) + ": " + std::to_string(w) +
                            "-byte elements; verified apply covers 1-, 2- and 4-byte elements");
  }
  // The Applier's header checks come before the save, which reads the same positions: a patch
  // it refuses (index width, null or misaligned pointer) must not be read here either. After a
  // value-width mismatch (tensors past it unchecked) nothing is written, so nothing is saved:
  // the Applier reports it through its status, and no shifts are read then.
  int64_t width_mismatch = -1;
  DELTASYNC_RETURN_IF_ERROR(detail::check_patch_headers(targets, patches, width_mismatch));
  if (width_mismatch >= 0) {
    DELTASYNC_RETURN_IF_ERROR(s.applier.apply(targets, patches, stream));
    s.transfer.add(s.applier.transfer());
    return cudaSuccess;
  }
  DELTASYNC_RETURN_IF_ERROR(s.host_jobs.reserve(T));
  DELTASYNC_RETURN_IF_ERROR(s.device_jobs.reserve(T));
  DELTASYNC_RETURN_IF_ERROR(s.shifts.reserve(T));
  // Each tensor's saved bits start on a 16-byte boundary, so 2- and 4-byte elements stay aligned
  // whatever the tensors before them.
  auto aligned = [](uint64_t bytes) { return (bytes + 15) / 16 * 16; };
  uint64_t saved_bytes = 0, tiles = 0;
  for (size_t t = 0; t < T; ++t) saved_bytes += aligned(patches[t].count * targets[t].width);
  DELTASYNC_RETURN_IF_ERROR(s.saved.reserve(saved_bytes));
  std::vector<const void*> old_bits(T);
  std::vector<PatchRef> restore(patches.begin(), patches.end());
  std::vector<ConstTensorRef> views(T);
  uint64_t offset = 0;
  for (size_t t = 0; t < T; ++t) {
    const PatchRef& p = patches[t];
    uint8_t* at = s.saved.data() + offset;
    s.host_jobs.data()[t] = detail::SaveJob{static_cast<const uint8_t*>(targets[t].data), p.indices, at, p.count,
                                            targets[t].numel, tiles, targets[t].width, p.index_width};
    tiles += (p.count + detail::kSaveTile - 1) / detail::kSaveTile;
    old_bits[t] = at;
    restore[t].values = at;
    views[t] = ConstTensorRef{targets[t].name, targets[t].data, targets[t].numel, targets[t].width};
    offset += aligned(p.count * targets[t].width);
  }

  if (tiles > 0) {
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.device_jobs.data(), s.host_jobs.data(), T * sizeof(detail::SaveJob),
                                              cudaMemcpyHostToDevice, stream));
    s.transfer.host_to_device_bytes += T * sizeof(detail::SaveJob);
    const uint64_t cap = static_cast<uint64_t>(s.sm_count) * 8;
    detail::save_kernel<<<static_cast<unsigned>(tiles < cap ? tiles : cap), detail::kSaveThreads, 0, stream>>>(
        s.device_jobs.data(), static_cast<uint32_t>(T), tiles);
    DELTASYNC_RETURN_IF_ERROR(cudaGetLastError());
  }
  // From here the scatter may be queued, so a failure must not leave it behind: the saved bits
  // are queued back before the error returns (a scatter that validation stopped wrote nothing,
  // and the same positions stop its restore too), and the caller, which drains the stream
  // before it reports the error, finds every byte as it was.
  s.restore = std::move(restore);
  cudaError_t err = s.applier.apply(targets, patches, stream);
  s.transfer.add(s.applier.transfer());
  if (err == cudaSuccess) {
    err = s.digester.shifts(views, patches, old_bits, s.shifts.data(), stream);
    s.transfer.add(s.digester.transfer());
  }
  if (err != cudaSuccess) {
    s.applier.apply(targets, s.restore, stream);  // its own failure changes nothing for the caller: it fails
    s.transfer.add(s.applier.transfer());
    s.restore.clear();
    return err;
  }
  return cudaSuccess;
}

cudaError_t SavingApplier::restore(std::span<const TensorRef> targets, cudaStream_t stream) {
  State& s = *state_;
  s.transfer = {};
  if (targets.size() != s.restore.size())
    return detail::refuse("restore: " + std::to_string(targets.size()) + " targets for an apply of " +
                          std::to_string(s.restore.size()));
  DELTASYNC_RETURN_IF_ERROR(s.applier.apply(targets, s.restore, stream));
  s.transfer.add(s.applier.transfer());
  return cudaSuccess;
}

}  // namespace deltasync::cuda
