// GPU twin of deltasync/digest.hpp: the same per-tensor digests (digest_mix.hpp is compiled into
// the kernels), computed for a whole set of device tensors in one launch, and the O(changed)
// digest shifts a verified apply needs. Includable from plain C++.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "core/tensor.hpp"
#include "deltasync/cuda/engine.hpp"

namespace deltasync::cuda {

// Owns the small workspace of the digest kernels (a descriptor table and one accumulator per
// tensor), reused across calls. Nothing here synchronizes, except (a) growing the workspace
// (cudaFree/cudaMalloc, first call or more tensors than ever before) and (b) waiting for the
// previous call's descriptor upload before the staging area is rewritten — a copy of a few
// bytes per tensor that is normally long finished. The workspace is shared by all calls on one
// Digester: calls on different streams must be ordered by the caller (or use one Digester per
// stream).
class Digester {
 public:
  Digester();
  ~Digester();
  Digester(const Digester&) = delete;
  Digester& operator=(const Digester&) = delete;

  // Queues on `stream` the digests of tensors[t] (device pointers, widths 1, 2 or 4) into
  // out[t]. `out` is device memory or pinned host memory with room for tensors.size() values;
  // it holds the result once `stream` has reached this point. One kernel for all tensors, then a
  // copy of T values. Equal, bit for bit, to deltasync::digest_tensors on the same bytes.
  // Returns cudaErrorInvalidValue for a width other than 1, 2, 4 or a null pointer.
  cudaError_t digest(std::span<const ConstTensorRef> tensors, uint64_t* out, cudaStream_t stream);

  // Queues the digest shifts of a scatter: for every t,
  //   out[t] = Σ_k term(i_k, targets[t][i_k]) − Σ_k term(i_k, old_bits[t][k]),  i_k = patches[t] positions,
  // i.e. how far targets[t]'s digest moved since its elements at those positions held old_bits[t]
  // (digest_after = digest_before + out[t], mod 2^64). Device pointers everywhere; patches[t]'s
  // values are not read (the targets are, so the shift hashes what was actually written).
  // Positions outside a target contribute nothing (the Applier rejects such patches anyway).
  cudaError_t shifts(std::span<const ConstTensorRef> targets, std::span<const PatchRef> patches,
                     std::span<const void* const> old_bits, uint64_t* out, cudaStream_t stream);

  // The last digest() or shifts(): the descriptor upload, and the results' copy when `out` is
  // host memory. Neither call synchronizes.
  const TransferCounters& transfer() const;

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
