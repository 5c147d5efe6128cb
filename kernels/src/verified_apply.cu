// Transactional verified apply on the GPU: save → validate + scatter → shifts → compare →
// (restore). The only kernel of its own is the save (a gather of the bits about to be
// replaced, gather_kernels.cuh); validation and scatter are cuda::Applier's, hashing is cuda::Digester's.
#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <vector>

#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "deltasync/cuda/verified_apply.hpp"
#include "core/error.hpp"
#include "device_buffers.cuh"
#include "gather_kernels.cuh"

namespace deltasync::cuda {

struct VerifiedApplier::State {
  Applier applier;
  Digester digester;
  detail::PinnedArray<detail::SaveJob> host_jobs;
  detail::DeviceArray<detail::SaveJob> device_jobs;
  detail::DeviceArray<uint8_t> saved;        // old bits of every changed element
  detail::PinnedArray<uint64_t> shifts;      // per target
  int sm_count = 0;
  TransferCounters transfer;  // the last apply
};

VerifiedApplier::VerifiedApplier() : state_(new State) {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&state_->sm_count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
}

VerifiedApplier::~VerifiedApplier() { delete state_; }

const TransferCounters& VerifiedApplier::transfer() const { return state_->transfer; }

integrity::ApplyReport VerifiedApplier::apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                              const integrity::DeltaDigests& expected,
                                              std::span<uint64_t> current_digests,
                                              std::optional<uint64_t> current_version, cudaStream_t stream) {
  return apply(targets, patches, expected, current_digests, current_version, stream, {});
}

integrity::ApplyReport VerifiedApplier::apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                              const integrity::DeltaDigests& expected,
                                              std::span<uint64_t> current_digests,
                                              std::optional<uint64_t> current_version, cudaStream_t stream,
                                              const std::function<void()>& check_inputs) {
  state_->transfer = {};
  // Host-side checks first: nothing is queued for a delta made for another base.
  integrity::check_before_apply(targets, patches, expected, current_digests, current_version);
  const size_t T = targets.size();
  for (size_t t = 0; t < T; ++t) {
    const uint32_t w = targets[t].width;
    if (w != 1 && w != 2 && w != 4)
      throw Error("tensor " + std::string(targets[t].name) + ": " + std::to_string(w) +
                  "-byte elements; verified apply covers 1-, 2- and 4-byte elements");
  }
  State& s = *state_;

  // Layout of the saved bits and of the save tiles. The pinned job table is safe to rewrite:
  // the previous call ended with a synchronization of its stream.
  check(s.host_jobs.reserve(T), "verified apply: cudaHostAlloc");
  check(s.device_jobs.reserve(T), "verified apply: cudaMalloc");
  check(s.shifts.reserve(T), "verified apply: cudaHostAlloc");
  // Each tensor's saved bits start on a 16-byte boundary, so 2- and 4-byte elements stay aligned
  // whatever the tensors before them.
  auto aligned = [](uint64_t bytes) { return (bytes + 15) / 16 * 16; };
  uint64_t saved_bytes = 0, tiles = 0;
  for (size_t t = 0; t < T; ++t) saved_bytes += aligned(patches[t].count * targets[t].width);
  check(s.saved.reserve(saved_bytes), "verified apply: cudaMalloc");
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

  // Save, validate + scatter, shifts: all queued, one synchronization. If queuing fails half
  // way, drain the stream before the error propagates so that nothing still reads the pinned
  // job table the next call rewrites.
  try {
    check(cudaMemcpyAsync(s.device_jobs.data(), s.host_jobs.data(), T * sizeof(detail::SaveJob), cudaMemcpyHostToDevice, stream),
          "verified apply: upload");
    if (tiles > 0) {
      const uint64_t cap = static_cast<uint64_t>(s.sm_count > 0 ? s.sm_count : 1) * 8;
      detail::save_kernel<<<static_cast<unsigned>(tiles < cap ? tiles : cap), detail::kSaveThreads, 0, stream>>>(
          s.device_jobs.data(), static_cast<uint32_t>(T), tiles);
      check(cudaGetLastError(), "verified apply: save kernel");
    }
    check(s.applier.apply(targets, patches, stream), "verified apply: scatter");
    check(s.digester.shifts(views, patches, old_bits, s.shifts.data(), stream), "verified apply: digest shifts");
    check(cudaStreamSynchronize(stream), "verified apply");
    s.transfer.host_to_device_bytes += T * sizeof(detail::SaveJob);
    s.transfer.host_syncs += 1;
    for (const TransferCounters& part : {s.applier.transfer(), s.digester.transfer()}) s.transfer.add(part);
  } catch (...) {
    cudaStreamSynchronize(stream);
    throw;
  }
  const ApplyStatus status = s.applier.status();
  if (check_inputs) {
    // Inputs made on the device in the same stream are judged first: a bad one may have been
    // scattered (when its positions passed validation), so those writes are undone.
    try {
      check_inputs();
    } catch (...) {
      if (status.bad_tensor < 0) {
        s.applier.apply_checked(targets, restore, stream);  // synchronizes
        s.transfer.add(s.applier.transfer());
      }
      throw;
    }
  }
  if (status.bad_tensor >= 0) throw Error(describe(status, targets));  // nothing was written

  integrity::ApplyReport report;
  std::vector<uint64_t> result(current_digests.begin(), current_digests.end());
  integrity::DigestMap actual;
  for (size_t t = 0; t < T; ++t) {
    result[t] += s.shifts.data()[t];
    report.tensors_changed += patches[t].count > 0;
    report.elements_changed += patches[t].count;
    if (expected.result.contains(targets[t].name)) actual.emplace(std::string(targets[t].name), result[t]);
  }
  try {
    integrity::check_result(expected, actual);
  } catch (const Error& e) {
    s.applier.apply_checked(targets, restore, stream);  // synchronizes
    s.transfer.add(s.applier.transfer());
    throw Error(std::string(e.what()) + "; weights restored to their state before the delta", e.kind());
  }
  std::copy(result.begin(), result.end(), current_digests.begin());
  return report;
}

}  // namespace deltasync::cuda
