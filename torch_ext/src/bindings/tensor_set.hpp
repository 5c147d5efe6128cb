// PyTorch tensors as the plain descriptions the engine takes (TensorMeta + TensorRef), with the
// checks that every binding needs (tensor_checks.hpp: dense, contiguous, within its storage, no
// subclass), one device for the whole set, a weight dtype.
// The at::Tensor handles are kept alongside the raw pointers so the memory stays alive.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "engine/engine.hpp"
#include "format/delta_file.hpp"

namespace deltasync::torch_ext {

struct TensorSet {
  std::vector<at::Tensor> tensors;  // keeps the storage alive
  std::vector<TensorMeta> meta;     // names as given, dtypes, shapes
  std::vector<TensorRef> refs;      // raw pointers into `tensors`
  engine::Device device = engine::Device::kCpu;
  int device_index = 0;

  std::vector<ConstTensorRef> const_refs() const;
  // Throws naming the tensor when one no longer is what the refs describe: resized, given new
  // memory (assigned .data, set_()) or its storage freed since the set was made. Called before
  // every use of refs made earlier (the subscribers' updates).
  void check_unchanged(const char* what) const;
};

// Throws deltasync::Error naming the tensor (`what` names the caller in the message).
TensorSet tensor_set(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, const char* what);

// `current` has the same devices, dtypes and shapes as `described` (a publish after the first).
TensorSet same_layout(const TensorSet& described, const std::vector<at::Tensor>& current, const char* what);

// The caller's current CUDA stream for a set on a CUDA device (nullptr for host tensors): engine
// work queues behind what the caller already queued there.
void* current_stream_for(const TensorSet& set);
// The engine for the set's device, ordered on the caller's current stream there.
std::unique_ptr<engine::SyncEngine> engine_for(const TensorSet& set, const engine::EngineOptions& options);
// Points an engine at the current stream of the set's device (CUDA; a no-op on the CPU).
void use_current_stream(engine::SyncEngine& engine, const TensorSet& set);

}  // namespace deltasync::torch_ext
