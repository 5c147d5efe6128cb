#include "engine/cuda/cuda_patch_transaction.hpp"

#include <algorithm>
#include <utility>

#include "core/error.hpp"
#include "engine/cuda/cuda_calls.hpp"

namespace deltasync::engine {

CudaPatchTransaction::CudaPatchTransaction(cuda::SavingApplier& applier, cudaStream_t stream,
                                           std::function<void()> check_inputs)
    : applier_(applier), stream_(stream), check_inputs_(std::move(check_inputs)) {}

void CudaPatchTransaction::write(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                 std::span<uint64_t> shifts) {
  // Save, validate + scatter, shifts: all queued, one synchronization. If queuing fails half
  // way, the stream is drained before the error propagates, so that nothing still reads the
  // pinned job table the next call rewrites.
  const cudaError_t queued = applier_.apply(targets, patches, stream_);
  transfer_.add(applier_.transfer());
  const cudaError_t waited = cudaStreamSynchronize(stream_);
  ++transfer_.host_syncs;
  cuda::check(queued, "verified apply");
  cuda::check(waited, "verified apply: synchronize");
  const cuda::ApplyStatus status = applier_.status();
  if (check_inputs_) {
    // Inputs made on the device in the same stream are judged first: a bad one may have been
    // scattered (when its positions passed validation), so those writes are undone.
    try {
      check_inputs_();
    } catch (...) {
      if (status.bad_tensor < 0) undo(targets);
      throw;
    }
  }
  if (status.bad_tensor >= 0) throw Error(cuda::describe(status, targets));  // nothing was written
  std::copy(applier_.shifts(), applier_.shifts() + targets.size(), shifts.begin());
}

void CudaPatchTransaction::undo(std::span<const TensorRef> targets) {
  const cudaError_t queued = applier_.restore(targets, stream_);
  transfer_.add(applier_.transfer());
  const cudaError_t waited = cudaStreamSynchronize(stream_);
  ++transfer_.host_syncs;
  cuda::check(queued, "verified apply: restore");
  cuda::check(waited, "verified apply: restore");
}

}  // namespace deltasync::engine
