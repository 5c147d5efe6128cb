// The engine's side of the kernels' error convention: kernels/ returns cudaError_t (and, for
// arguments it refuses, a reason in take_refusal()) and reports verdicts as data; these turn
// them into the project's Error, worded as the CPU twin words them. Everything that throws on
// behalf of a kernel call goes through here (the sync engine, the tests, the benchmarks, the
// torch extension).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "codec/compact_format.hpp"
#include "core/tensor.hpp"
#include "core/tensor_meta.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"

namespace deltasync::cuda {

// No-op on cudaSuccess. A refusal (cudaErrorInvalidValue with a reason) throws Error(reason);
// any other error Error("WHAT: cudaErrorName (text)").
void check(cudaError_t err, const char* what);

// An invalid patch's message, as cpu::validate words it ("tensor NAME: index 9 out of range [0, 8)").
std::string describe(const ApplyStatus& status, std::span<const TensorRef> targets);

// applier.apply, one synchronization of `stream`, then Error(describe(...)) for an invalid patch
// (nothing written). Adds the applier's counters and the wait to `transfer` when given.
void apply_checked(Applier& applier, std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                   cudaStream_t stream, TransferCounters* transfer = nullptr);

// Digests of device tensors, returned on the host: one launch, one synchronization.
std::vector<uint64_t> digest_device_tensors(std::span<const ConstTensorRef> tensors, cudaStream_t stream = nullptr);

// CompactEncoder::encode, checked (compact::encode's errors).
std::vector<compact::EncodedTensor> encode_compact(CompactEncoder& encoder, std::span<const TensorMeta> tensors,
                                                   const DeviceDeltaView& delta, cudaStream_t stream,
                                                   const compact::Options& options = {});
std::vector<compact::EncodedTensor> encode_compact(CompactEncoder& encoder, std::span<const TensorMeta> tensors,
                                                   const DeviceDeltaView& delta, std::span<const uint64_t> host_offsets,
                                                   std::span<const uint64_t> host_value_offsets, cudaStream_t stream,
                                                   const compact::Options& options = {});

}  // namespace deltasync::cuda
