// The device mechanics of the one verified apply (integrity::apply_verified is the policy):
// cuda::SavingApplier's save + validate + scatter + shifts under one synchronization, and its
// restore. Device tensors and device patches on one stream.
#pragma once
#include <cuda_runtime_api.h>

#include <functional>
#include <span>

#include "deltasync/cuda/saving_apply.hpp"
#include "engine/integrity.hpp"

namespace deltasync::engine {

class CudaPatchTransaction final : public integrity::PatchTransaction {
 public:
  // `check_inputs` is for patches produced on the device in the same stream whose validity is
  // known only once it is synchronized (a queued DeviceCompactDecode): it runs right after the
  // one synchronization, before the patches are judged. If it throws, whatever the scatter wrote
  // is restored (a second synchronization) and its error propagates unchanged, so the targets
  // are bit for bit as before and the caller sees the input's own error.
  CudaPatchTransaction(cuda::SavingApplier& applier, cudaStream_t stream, std::function<void()> check_inputs = {});

  // Synchronizes `stream` once; an invalid patch throws with nothing written.
  void write(std::span<const TensorRef> targets, std::span<const PatchRef> patches, std::span<uint64_t> shifts) override;
  // Queues the saved bits back and synchronizes once more.
  void undo(std::span<const TensorRef> targets) override;

  // write() and undo() so far: one synchronization, two after a restore.
  const TransferCounters& transfer() const { return transfer_; }

 private:
  cuda::SavingApplier& applier_;
  cudaStream_t stream_;
  std::function<void()> check_inputs_;
  TransferCounters transfer_;
};

}  // namespace deltasync::engine
