// Binding of the mapped receiver (sync/mapped_receiver.hpp) for inference engines (vLLM): the
// Python side learns the index map through the engine's own loaders and passes it in as runs,
// with the runtime parameters, the ownership of replicated elements, the all-reduce that
// combines per-rank digest partials, and the engine's loader for anchors. Fetching, verifying,
// mapping and the transactional apply run in C++.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "bindings/log_callback.hpp"
#include "bindings/module.hpp"
#include "bindings/py_holder.hpp"
#include "bindings/subscriber_binding.hpp"
#include "bindings/tensor_set.hpp"
#include "core/error.hpp"
#include "sync/mapped_receiver.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {
namespace {

std::vector<int64_t> int64_list(const at::Tensor& t, const char* what) {
  if (t.scalar_type() != at::kLong || t.dim() != 1) throw Error(std::string("mapped receiver: ") + what + " must be a 1-D int64 tensor");
  const at::Tensor c = t.to(at::kCPU).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

c10::ScalarType scalar_type_of(DType d) {
  switch (d) {
    case DType::BF16: return at::kBFloat16;
    case DType::F16: return at::kHalf;
    case DType::F32: return at::kFloat;
    case DType::F8_E4M3: return at::kFloat8_e4m3fn;
    case DType::F8_E5M2: return at::kFloat8_e5m2;
    default: throw Error("mapped receiver: no torch dtype for " + std::string(dtype_name(d)));
  }
}

using RunTuple = std::tuple<uint32_t, uint32_t, at::Tensor, at::Tensor, at::Tensor>;
using OwnedTuple = std::tuple<uint32_t, at::Tensor, at::Tensor>;
using HfTuple = std::tuple<std::string, std::string, std::vector<uint64_t>>;

class MappedSubscriber final : public SubscriberBinding {
 public:
  MappedSubscriber(const std::string& store, const std::vector<HfTuple>& hf, const std::vector<std::string>& param_names,
                   const std::vector<at::Tensor>& params, const std::vector<RunTuple>& runs, const std::vector<OwnedTuple>& owned,
                   const std::vector<uint32_t>& unserved, py::object combine, py::object load_full, py::object log)
      : SubscriberBinding(store, std::move(log)), set_(tensor_set(param_names, params, "deltasync.vllm receiver")) {
    MappedModel model;
    for (const auto& [name, dtype, shape] : hf) {
      const auto d = dtype_from_name(dtype);
      if (!d || !is_weight_dtype(*d)) throw BadInputError("deltasync.vllm receiver: tensor " + name + " has dtype " + dtype);
      model.hf.push_back(TensorMeta{name, *d, shape});
    }
    model.params_meta = set_.meta;
    model.params = set_.refs;
    for (const auto& [hf_i, param_i, hf_start, length, rt_start] : runs)
      model.runs.push_back(MappedRuns{hf_i, param_i, int64_list(hf_start, "hf_start"), int64_list(length, "length"),
                                      int64_list(rt_start, "rt_start")});
    for (const auto& [hf_i, start, length] : owned)
      model.owned.push_back(OwnedRanges{hf_i, int64_list(start, "owned start"), int64_list(length, "owned length")});
    model.unserved = unserved;
    engine_ = engine_for(set_, {});
    receiver_ = std::make_unique<MappedReceiver>(std::move(model), *engine_, combiner(std::move(combine)), loader(std::move(load_full)));
  }
  ~MappedSubscriber() override {
    py::gil_scoped_release nogil;
    receiver_.reset();
    engine_.reset();
  }

  uint64_t map_runs() const { return receiver_->map_runs(); }

 private:
  Receiver& receiver() override { return *receiver_; }
  void prepare() override { use_current_stream(*engine_, set_); }

  // The all-reduce of the digest partials, in Python (torch.distributed over the TP group).
  static CombinePartials combiner(py::object fn) {
    if (fn.is_none()) return {};
    auto holder = hold_with_gil(std::move(fn));
    return [holder](std::span<uint64_t> partials) {
      py::gil_scoped_acquire gil;
      py::list in;
      for (uint64_t p : partials) in.append(py::int_(p));
      py::object out = (*holder)(in);
      const auto summed = py::cast<std::vector<py::int_>>(out);
      if (summed.size() != partials.size()) throw Error("deltasync.vllm receiver: the digest all-reduce returned the wrong number of values");
      for (size_t i = 0; i < partials.size(); ++i) {
        // Python ints of any sign, reduced mod 2^64.
        py::object masked = summed[i].attr("__and__")(py::int_(~0ull));
        partials[i] = py::cast<uint64_t>(masked);
      }
    };
  }

  // The engine's loader for full weights: called with (name, tensor) pairs whose tensors view
  // the verified host bytes (valid during the call).
  static LoadFull loader(py::object fn) {
    auto holder = hold_with_gil(std::move(fn));
    return [holder](std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes) {
      py::gil_scoped_acquire gil;
      py::list pairs;
      for (size_t t = 0; t < meta.size(); ++t) {
        std::vector<int64_t> shape(meta[t].shape.begin(), meta[t].shape.end());
        at::Tensor view = torch::from_blob(const_cast<uint8_t*>(bytes[t].data()), shape,
                                           torch::TensorOptions().dtype(scalar_type_of(meta[t].dtype)));
        pairs.append(py::make_tuple(meta[t].name, view));
      }
      (*holder)(pairs);
    };
  }

  TensorSet set_;
  std::unique_ptr<engine::SyncEngine> engine_;
  std::unique_ptr<MappedReceiver> receiver_;
};

}  // namespace

void bind_mapped_receiver(py::module_& m) {
  py::class_<MappedSubscriber, SubscriberBinding>(m, "MappedSubscriber")
      .def(py::init<const std::string&, const std::vector<HfTuple>&, const std::vector<std::string>&,
                    const std::vector<at::Tensor>&, const std::vector<RunTuple>&, const std::vector<OwnedTuple>&,
                    const std::vector<uint32_t>&, py::object, py::object, py::object>(),
           py::arg("store"), py::arg("hf"), py::arg("param_names"), py::arg("params"), py::arg("runs"), py::arg("owned"),
           py::arg("unserved"), py::arg("combine"), py::arg("load_full"), py::arg("log") = py::none())
      .def_property_readonly("map_runs", &MappedSubscriber::map_runs);
  m.def(
      "published_tensors",
      [](const std::string& store_url, std::optional<uint64_t> version) {
        std::vector<HfTuple> out;
        {
          py::gil_scoped_release nogil;
          auto store = open_store(store_url);
          Subscriber sub(*store);
          for (const auto& t : sub.published_tensors(version))
            out.emplace_back(t.name, std::string(dtype_name(t.dtype)), t.shape);
        }
        return out;
      },
      py::arg("store"), py::arg("version") = py::none(),
      "(name, safetensors dtype, shape) of every published tensor, from the headers of the anchor the catch-up to "
      "`version` starts from.");
}

}  // namespace deltasync::torch_ext
