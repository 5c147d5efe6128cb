// The host-side checks of a patch set before anything is queued (defined in applier.cu): the
// Applier runs them before its table upload, and the SavingApplier before its save, which reads
// the same positions.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "core/tensor.hpp"

namespace deltasync::cuda::detail {

// The header checks of cpu::validate, in its order. Sets `width_mismatch` to the first tensor
// whose values have the wrong width (reported through the status, like index errors, and the
// tensors after it are not checked), or -1; refuses (cudaErrorInvalidValue, reason for
// take_refusal()) the errors that are the caller's bug rather than a bad delta: element or index
// widths, more changes than elements, null or misaligned device pointers.
cudaError_t check_patch_headers(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                int64_t& width_mismatch);

}  // namespace deltasync::cuda::detail
