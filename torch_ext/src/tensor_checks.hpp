// The one check every entry point that takes tensors makes before it touches their memory (the
// operators through tensor_lists.cpp, the Publisher, Subscriber and vLLM receiver bindings through
// bindings/tensor_set.cpp): deltasync reads and writes a tensor as numel() consecutive elements
// at data_ptr(), so anything else is refused here with one line naming the tensor and the
// reason, never read or written past its storage.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <string_view>

namespace deltasync::torch_ext {

// Why `t` is not a dense, contiguous tensor backed by enough storage, or nullopt when it is:
// a tensor subclass (DTensor: sharded support does not reach the publisher and subscriber),
// meta, sparse or another layout, quantized, not contiguous, or a storage smaller than its
// elements (resized or freed). `subclass` names a subclass in the message (its Python type,
// where the caller knows it). The device is the caller's to check (against its peers).
std::optional<std::string> unusable_reason(const at::Tensor& t, std::string_view subclass = "a tensor subclass");

// True for a tensor whose operations go to Python first (DTensor and other __torch_dispatch__
// subclasses): its data pointer is not the data.
bool is_tensor_subclass(const at::Tensor& t);

}  // namespace deltasync::torch_ext
