#include "bindings/tensor_set.hpp"

#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/pybind11.h>

#include "core/error.hpp"
#include "tensor_checks.hpp"
#include "torch_dtype.hpp"
#include "engine/select.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {

// Defined in current_stream_cuda.cpp when the CUDA operators are built, else here.
void* current_cuda_stream(int device_index);
#ifndef DELTASYNC_TORCH_WITH_CUDA
void* current_cuda_stream(int) { return nullptr; }
#endif

namespace {

DType weight_dtype(const at::Tensor& t, const std::string& name, const char* what) {
  const std::optional<DType> d = deltasync_dtype(t.scalar_type());
  if (!d || !is_weight_dtype(*d))
    throw BadInputError(std::string(what) + ": tensor " + name + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                        "; deltasync ships bfloat16, float16, float32 and float8 weights");
  return *d;
}

}  // namespace

std::vector<ConstTensorRef> TensorSet::const_refs() const {
  std::vector<ConstTensorRef> out;
  out.reserve(refs.size());
  for (const auto& r : refs) out.push_back(ConstTensorRef{r.name, r.data, r.numel, r.width});
  return out;
}

namespace {

// The Python type of a tensor subclass ("DTensor"), for the message (the GIL is held: the
// bindings call tensor_set before they release it).
std::string subclass_name(const at::Tensor& t) {
  py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  if (!obj) {
    PyErr_Clear();
    return "a tensor subclass";
  }
  return "a " + py::cast<std::string>(py::type::handle_of(obj).attr("__name__")) + " (a tensor subclass)";
}

void refuse_unusable(const at::Tensor& x, const std::string& name, const char* what) {
  const auto reason = is_tensor_subclass(x) ? unusable_reason(x, subclass_name(x)) : unusable_reason(x);
  if (reason) throw Error(std::string(what) + ": tensor " + name + " " + *reason, ErrorKind::kInvalidArgument);
}

std::string shape_text(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t d = 0; d < shape.size(); ++d) out += (d ? ", " : "") + std::to_string(shape[d]);
  return out + "]";
}

}  // namespace

TensorSet tensor_set(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, const char* what) {
  if (names.size() != tensors.size())
    throw Error(std::string(what) + ": " + std::to_string(names.size()) + " names for " + std::to_string(tensors.size()) + " tensors");
  if (tensors.empty()) throw Error(std::string(what) + ": no tensors");
  // What deltasync cannot read as flat elements is refused first (a subclass or a meta tensor
  // also has a device, which says nothing about where its data is); then one device for all.
  refuse_unusable(tensors[0], names[0], what);
  TensorSet set;
  set.tensors = tensors;
  const c10::Device first = tensors[0].device();
  if (first.is_cuda()) {
    set.device = engine::Device::kCuda;
    set.device_index = first.index();
  } else if (!first.is_cpu()) {
    throw Error(std::string(what) + ": tensor " + names[0] + " is on " + first.str() + "; deltasync runs on cpu and cuda");
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    const at::Tensor& x = tensors[t];
    if (x.defined() && !is_tensor_subclass(x) && x.device() != first)
      throw Error(std::string(what) + ": tensor " + names[t] + " is on " + x.device().str() + ", tensor " + names[0] + " on " +
                  first.str() + "; all tensors must live on one device", ErrorKind::kInvalidArgument);
    refuse_unusable(x, names[t], what);
    TensorMeta m{names[t], weight_dtype(x, names[t], what), {}};
    for (int64_t d : x.sizes()) m.shape.push_back(static_cast<uint64_t>(d));
    set.meta.push_back(std::move(m));
  }
  // Pointers last: set.meta's names must not move any more (the refs view them).
  for (size_t t = 0; t < tensors.size(); ++t)
    set.refs.push_back(TensorRef{set.meta[t].name, set.tensors[t].data_ptr(), static_cast<uint64_t>(set.tensors[t].numel()),
                                 static_cast<uint32_t>(set.tensors[t].element_size())});
  return set;
}

TensorSet same_layout(const TensorSet& described, const std::vector<at::Tensor>& current, const char* what) {
  std::vector<std::string> names;
  for (const auto& m : described.meta) names.push_back(m.name);
  TensorSet set = tensor_set(names, current, what);
  if (set.device != described.device || set.device_index != described.device_index)
    throw Error(std::string(what) + ": the tensors moved to another device since the first call", ErrorKind::kInvalidArgument);
  for (size_t t = 0; t < set.meta.size(); ++t) {
    const TensorMeta& now = set.meta[t];
    const TensorMeta& then = described.meta[t];
    if (now.dtype != then.dtype)
      throw Error(std::string(what) + ": tensor " + now.name + " has dtype " + std::string(dtype_name(now.dtype)) +
                          ", published as " + std::string(dtype_name(then.dtype)), ErrorKind::kInvalidArgument);
    if (now.shape != then.shape)
      throw Error(std::string(what) + ": tensor " + now.name + " has shape " + shape_text(now.shape) +
                          ", shape " + shape_text(then.shape) + " when the shadow was taken", ErrorKind::kInvalidArgument);
  }
  return set;
}

void TensorSet::check_unchanged(const char* what) const {
  for (size_t t = 0; t < tensors.size(); ++t) {
    const at::Tensor& x = tensors[t];
    std::vector<uint64_t> shape;
    for (int64_t d : x.sizes()) shape.push_back(static_cast<uint64_t>(d));
    if (shape != meta[t].shape)
      throw Error(std::string(what) + ": tensor " + meta[t].name + " has shape " + shape_text(shape) + ", shape " +
                          shape_text(meta[t].shape) + " when the subscriber was made", ErrorKind::kInvalidArgument);
    if (const auto reason = unusable_reason(x))
      throw Error(std::string(what) + ": tensor " + meta[t].name + " " + *reason, ErrorKind::kInvalidArgument);
    if (const DType now = weight_dtype(x, meta[t].name, what); now != meta[t].dtype)
      throw Error(std::string(what) + ": tensor " + meta[t].name + " has dtype " + std::string(dtype_name(now)) + ", " +
                      std::string(dtype_name(meta[t].dtype)) + " when the subscriber was made",
                  ErrorKind::kInvalidArgument);
    if (x.data_ptr() != refs[t].data)
      throw Error(std::string(what) + ": tensor " + meta[t].name +
                      " was given new memory since the subscriber was made (resized or set_()); make a new subscriber",
                  ErrorKind::kInvalidArgument);
  }
}

std::unique_ptr<engine::SyncEngine> engine_for(const TensorSet& set, const engine::EngineOptions& options) {
  engine::EngineOptions o = options;
  o.cuda_device = set.device_index;
  auto engine = engine::make_engine(set.device, o);
  use_current_stream(*engine, set);
  return engine;
}

void* current_stream_for(const TensorSet& set) {
  return set.device == engine::Device::kCuda ? current_cuda_stream(set.device_index) : nullptr;
}

void use_current_stream(engine::SyncEngine& engine, const TensorSet& set) {
  if (set.device == engine::Device::kCuda) engine.set_stream(current_stream_for(set));
}

}  // namespace deltasync::torch_ext
