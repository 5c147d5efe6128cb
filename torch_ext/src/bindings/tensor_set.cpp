#include "bindings/tensor_set.hpp"

#include "core/error.hpp"
#include "engine/select.hpp"

namespace deltasync::torch_ext {

// Defined in current_stream_cuda.cpp when the CUDA operators are built, else here.
void* current_cuda_stream(int device_index);
#ifndef DELTASYNC_TORCH_WITH_CUDA
void* current_cuda_stream(int) { return nullptr; }
#endif

namespace {

DType weight_dtype(const at::Tensor& t, const std::string& name, const char* what) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    case at::kFloat: return DType::F32;
    case at::kFloat8_e4m3fn: return DType::F8_E4M3;
    case at::kFloat8_e5m2: return DType::F8_E5M2;
    default:
      throw BadInputError(std::string(what) + ": tensor " + name + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                          "; deltasync ships bfloat16, float16, float32 and float8 weights");
  }
}

}  // namespace

std::vector<ConstTensorRef> TensorSet::const_refs() const {
  std::vector<ConstTensorRef> out;
  out.reserve(refs.size());
  for (const auto& r : refs) out.push_back(ConstTensorRef{r.name, r.data, r.numel, r.width});
  return out;
}

TensorSet tensor_set(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, const char* what) {
  if (names.size() != tensors.size())
    throw Error(std::string(what) + ": " + std::to_string(names.size()) + " names for " + std::to_string(tensors.size()) + " tensors");
  if (tensors.empty()) throw Error(std::string(what) + ": no tensors");
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
    if (x.device() != first)
      throw Error(std::string(what) + ": tensor " + names[t] + " is on " + x.device().str() + ", tensor " + names[0] + " on " +
                  first.str() + "; all tensors must live on one device");
    if (!x.is_contiguous()) throw BadInputError(std::string(what) + ": tensor " + names[t] + " is not contiguous");
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
    throw Error(std::string(what) + ": the tensors moved to another device since the first call");
  for (size_t t = 0; t < set.meta.size(); ++t)
    if (set.meta[t].dtype != described.meta[t].dtype || set.meta[t].shape != described.meta[t].shape)
      throw BadInputError(std::string(what) + ": tensor " + set.meta[t].name + " changed dtype or shape since the first call");
  return set;
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
