// GPU twin of integrity::apply_verified: a transactional, digest-checked in-place apply into
// device tensors, built on cuda::Applier (validation + scatter) and cuda::Digester (shifts).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <span>

#include "engine/integrity.hpp"
#include "core/tensor.hpp"

namespace deltasync::cuda {

class VerifiedApplier {
 public:
  VerifiedApplier();
  ~VerifiedApplier();
  VerifiedApplier(const VerifiedApplier&) = delete;
  VerifiedApplier& operator=(const VerifiedApplier&) = delete;

  // Same contract as integrity::apply_verified, with targets' data and patches' indices and
  // values in device memory (current_digests stays on the host). Order: host-side checks
  // (integrity::check_before_apply: digests cover the changed tensors, versions and base
  // digests match) — a failure throws before anything is queued; then on `stream`: save the
  // bits at the changed positions (O(changed) device memory, reused across calls), validate +
  // scatter (cuda::Applier; an invalid patch writes nothing), hash the changed positions as
  // they now are minus as they were (Digester::shifts); one synchronization; then either an
  // invalid-patch Error, or the result-digest comparison. On a mismatch the saved bits are
  // scattered back (a second synchronization) and Error is thrown; the targets are then bit
  // for bit as before. On success current_digests is updated.
  integrity::ApplyReport apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                               const integrity::DeltaDigests& expected, std::span<uint64_t> current_digests,
                               std::optional<uint64_t> current_version, cudaStream_t stream);

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
