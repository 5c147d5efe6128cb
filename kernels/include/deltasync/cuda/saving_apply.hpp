// The device half of a verified apply: a scatter that keeps what it overwrote and measures how
// far each target's digest moved, so that the engine (integrity::apply_verified with
// engine::CudaPatchTransaction) can judge the result and undo it. Built on cuda::Applier
// (validation + scatter) and cuda::Digester (shifts); the verdicts are the engine's.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "core/tensor.hpp"
#include "deltasync/cuda/engine.hpp"

namespace deltasync::cuda {

class SavingApplier {
 public:
  SavingApplier();
  ~SavingApplier();
  SavingApplier(const SavingApplier&) = delete;
  SavingApplier& operator=(const SavingApplier&) = delete;

  // Queues on `stream`, without waiting: save the bits at the changed positions (O(changed)
  // device memory, reused across calls), validate + scatter (cuda::Applier: an invalid patch
  // writes nothing), then the digest shifts of the changed positions as they now are minus as
  // they were (Digester::shifts). Device pointers everywhere; widths 1, 2 or 4 (else refused:
  // cudaErrorInvalidValue, take_refusal()). Once the caller has synchronized `stream`: status()
  // is the Applier's verdict and shifts()[t] the shift of targets[t] (valid when status() is ok).
  // The pinned job table is rewritten by the next call: synchronize before calling again.
  cudaError_t apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches, cudaStream_t stream);
  ApplyStatus status() const;
  const uint64_t* shifts() const;

  // Queues the saved bits back into the targets of the last apply() (same targets, in the same
  // order; only after a valid one): they are then bit for bit as before it.
  cudaError_t restore(std::span<const TensorRef> targets, cudaStream_t stream);

  // The last apply() or restore() (the caller's waits not included).
  const TransferCounters& transfer() const;

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
