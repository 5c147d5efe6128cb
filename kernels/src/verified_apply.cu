// Transactional verified apply on the GPU: save → validate + scatter → shifts → compare →
// (restore). The only kernel of its own is the save (a gather of the bits about to be
// replaced); validation and scatter are cuda::Applier's, hashing is cuda::Digester's.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "deltasync/cuda/verified_apply.hpp"
#include "core/error.hpp"
#include "device_buffers.cuh"

namespace deltasync::cuda {

namespace {

constexpr unsigned kThreads = 256;
constexpr uint64_t kSaveTile = uint64_t{1} << 12;  // changed positions per block visit

struct SaveJob {
  const uint8_t* data;   // target tensor
  const void* indices;   // patch positions (int32 or int64)
  uint8_t* saved;        // where the bits at those positions go (count × width)
  uint64_t count;
  uint64_t numel;
  uint64_t first_tile;
  uint32_t width;
  uint32_t index_width;
};

__device__ uint32_t save_job_of_tile(const SaveJob* jobs, uint32_t num_jobs, uint64_t tile) {
  uint32_t lo = 0, hi = num_jobs;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (jobs[mid].first_tile <= tile) lo = mid;
    else hi = mid;
  }
  return lo;
}

// saved[k] = data[indices[k]]; positions outside the tensor (which the Applier will reject,
// writing nothing) save zeros instead of reading out of bounds.
__global__ void __launch_bounds__(kThreads) save_kernel(const SaveJob* jobs, uint32_t num_jobs, uint64_t num_tiles) {
  for (uint64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const SaveJob job = jobs[save_job_of_tile(jobs, num_jobs, tile)];
    const uint64_t begin = (tile - job.first_tile) * kSaveTile;
    const uint64_t end = min(begin + kSaveTile, job.count);
    for (uint64_t k = begin + threadIdx.x; k < end; k += kThreads) {
      const uint64_t i = job.index_width == 4
                             ? static_cast<uint64_t>(static_cast<int64_t>(static_cast<const int32_t*>(job.indices)[k]))
                             : static_cast<uint64_t>(static_cast<const int64_t*>(job.indices)[k]);
      const bool inside = i < job.numel;
      switch (job.width) {
        case 1: job.saved[k] = inside ? job.data[i] : 0; break;
        case 2:
          reinterpret_cast<uint16_t*>(job.saved)[k] = inside ? reinterpret_cast<const uint16_t*>(job.data)[i] : 0;
          break;
        default:
          reinterpret_cast<uint32_t*>(job.saved)[k] = inside ? reinterpret_cast<const uint32_t*>(job.data)[i] : 0;
          break;
      }
    }
  }
}

}  // namespace

struct VerifiedApplier::State {
  Applier applier;
  Digester digester;
  detail::PinnedArray<SaveJob> host_jobs;
  detail::DeviceArray<SaveJob> device_jobs;
  detail::DeviceArray<uint8_t> saved;        // old bits of every changed element
  detail::PinnedArray<uint64_t> shifts;      // per target
  int sm_count = 0;
};

VerifiedApplier::VerifiedApplier() : state_(new State) {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&state_->sm_count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
}

VerifiedApplier::~VerifiedApplier() { delete state_; }

integrity::ApplyReport VerifiedApplier::apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                              const integrity::DeltaDigests& expected,
                                              std::span<uint64_t> current_digests,
                                              std::optional<uint64_t> current_version, cudaStream_t stream) {
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
    s.host_jobs.data()[t] = SaveJob{static_cast<const uint8_t*>(targets[t].data), p.indices, at, p.count,
                                    targets[t].numel, tiles, targets[t].width, p.index_width};
    tiles += (p.count + kSaveTile - 1) / kSaveTile;
    old_bits[t] = at;
    restore[t].values = at;
    views[t] = ConstTensorRef{targets[t].name, targets[t].data, targets[t].numel, targets[t].width};
    offset += aligned(p.count * targets[t].width);
  }

  // Save, validate + scatter, shifts: all queued, one synchronization. If queuing fails half
  // way, drain the stream before the error propagates so that nothing still reads the pinned
  // job table the next call rewrites.
  try {
    check(cudaMemcpyAsync(s.device_jobs.data(), s.host_jobs.data(), T * sizeof(SaveJob), cudaMemcpyHostToDevice, stream),
          "verified apply: upload");
    if (tiles > 0) {
      const uint64_t cap = static_cast<uint64_t>(s.sm_count > 0 ? s.sm_count : 1) * 8;
      save_kernel<<<static_cast<unsigned>(tiles < cap ? tiles : cap), kThreads, 0, stream>>>(
          s.device_jobs.data(), static_cast<uint32_t>(T), tiles);
      check(cudaGetLastError(), "verified apply: save kernel");
    }
    check(s.applier.apply(targets, patches, stream), "verified apply: scatter");
    check(s.digester.shifts(views, patches, old_bits, s.shifts.data(), stream), "verified apply: digest shifts");
    check(cudaStreamSynchronize(stream), "verified apply");
  } catch (...) {
    cudaStreamSynchronize(stream);
    throw;
  }
  const ApplyStatus status = s.applier.status();
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
    throw Error(std::string(e.what()) + "; weights restored to their state before the delta");
  }
  std::copy(result.begin(), result.end(), current_digests.begin());
  return report;
}

}  // namespace deltasync::cuda
