// Turning the operators' tensor-list arguments into the plain descriptions (EncodeItem,
// TensorRef, PatchRef) that the CPU twin and the CUDA backend take, after checking everything
// a kernel would otherwise trip over. Shared by the CPU and CUDA implementations so that both
// refuse the same inputs with the same messages.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace deltasync::torch_ext {

using OptionalNames = std::optional<std::vector<std::string>>;

// Labels for error messages: names[i] when the caller gave names, else "LIST[i]" (e.g.
// "targets[3]"). Stable storage for the string_views inside EncodeItem / TensorRef.
std::vector<std::string> tensor_labels(const char* list, size_t n, const OptionalNames& names);

// Bytes per element of a tensor deltasync can diff or patch (1, 2 or 4), else throws naming it.
uint32_t element_width(const at::Tensor& t, const std::string& label);

// Throws (c10::Error naming `label`) unless t can be read as numel() elements at data_ptr()
// (tensor_checks.hpp): what every operator checks of every tensor it touches.
void check_usable(const at::Tensor& t, const std::string& label);

struct EncodeArgs {
  std::vector<std::string> labels;
  std::vector<EncodeItem> items;
};

// current[i] is compared with shadow[i]: both on `device`, contiguous, same numel and element
// width. The list must not be empty (an empty list has no device to dispatch on).
EncodeArgs encode_args(at::TensorList current, at::TensorList shadow, const OptionalNames& names,
                       c10::DeviceType device);

struct ApplyArgs {
  std::vector<std::string> labels;
  std::vector<TensorRef> targets;
  std::vector<PatchRef> patches;
};

// targets[t] receives counts[t] consecutive entries of `indices` (int64 or int32) and the
// matching count × width(targets[t]) bytes of `values` (any dtype, read as raw bytes). `counts`
// must be a CPU int64 tensor (the CUDA implementation copies it to the host first); indices,
// values and targets live on `device`. Only shapes and sizes are checked here; index ranges and
// order are checked by the backend before anything is written.
ApplyArgs apply_args(at::TensorList targets, const at::Tensor& indices, const at::Tensor& values,
                     const at::Tensor& counts_host, const OptionalNames& names, c10::DeviceType device);

// Runs fn and turns a deltasync::Error into a c10::Error (RuntimeError in Python) with the same
// one-line message, prefixed by the operator's name.
template <class Fn>
decltype(auto) translate_errors(const char* op, Fn&& fn);

}  // namespace deltasync::torch_ext

#include "tensor_lists_inl.hpp"
