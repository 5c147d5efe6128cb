// Binding of the mapped receiver (sync/mapped_receiver.hpp) for inference engines (vLLM): the
// Python side learns the index map through the engine's own loaders (the runs found in C++,
// probe_runs below) and passes it in as runs, with the runtime parameters, the ownership of
// replicated elements and the all-reduce that combines per-rank digest partials. Fetching,
// verifying, mapping and the transactional apply of anchors and deltas run in C++.
#include <cstring>

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
#include "sync/probe_runs.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {
namespace {

std::vector<int64_t> int64_list(const at::Tensor& t, const char* what) {
  if (t.scalar_type() != at::kLong || t.dim() != 1) throw Error(std::string("mapped receiver: ") + what + " must be a 1-D int64 tensor");
  const at::Tensor c = t.to(at::kCPU).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

using RunTuple = std::tuple<uint32_t, uint32_t, at::Tensor, at::Tensor, at::Tensor>;
using OwnedTuple = std::tuple<uint32_t, at::Tensor, at::Tensor>;
using HfTuple = std::tuple<std::string, std::string, std::vector<uint64_t>>;

class MappedSubscriber final : public SubscriberBinding {
 public:
  MappedSubscriber(const std::string& store, const std::vector<HfTuple>& hf, const std::vector<std::string>& param_names,
                   const std::vector<at::Tensor>& params, const std::vector<RunTuple>& runs, const std::vector<OwnedTuple>& owned,
                   const std::vector<uint32_t>& unserved, py::object combine, py::object log)
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
    receiver_ = std::make_unique<MappedReceiver>(std::move(model), *engine_, combiner(std::move(combine)));
  }
  ~MappedSubscriber() override {
    py::gil_scoped_release nogil;
    receiver_.reset();
    engine_.reset();
  }

  uint64_t map_runs() const { return receiver_->map_runs(); }
  bool torn() const { return receiver_->torn(); }
  void fail_anchor_writes_after(std::optional<uint64_t> runs) { receiver_->fail_anchor_writes_after_for_test(runs); }

  // Seconds per stage since the last call (then reset).
  py::dict take_timings() {
    const MappedTimings t = receiver_->timings();
    receiver_->reset_timings();
    py::dict d;
    d["parse_seconds"] = t.parse;
    d["map_seconds"] = t.map;
    d["gather_seconds"] = t.gather;
    d["pack_seconds"] = t.pack;
    d["scatter_seconds"] = t.scatter;
    d["digest_seconds"] = t.digest;
    d["anchor_check_seconds"] = t.anchor_check;
    d["anchor_write_seconds"] = t.anchor_write;
    d["anchor_audit_seconds"] = t.anchor_audit;
    return d;
  }

 private:
  Receiver& receiver() override { return *receiver_; }
  void prepare() override {
    set_.check_unchanged("deltasync.vllm receiver");
    use_current_stream(*engine_, set_);
  }

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

  TensorSet set_;
  std::unique_ptr<engine::SyncEngine> engine_;
  std::unique_ptr<MappedReceiver> receiver_;
};

}  // namespace

void bind_mapped_receiver(py::module_& m) {
  py::class_<MappedSubscriber, SubscriberBinding>(m, "MappedSubscriber")
      .def(py::init<const std::string&, const std::vector<HfTuple>&, const std::vector<std::string>&,
                    const std::vector<at::Tensor>&, const std::vector<RunTuple>&, const std::vector<OwnedTuple>&,
                    const std::vector<uint32_t>&, py::object, py::object>(),
           py::arg("store"), py::arg("hf"), py::arg("param_names"), py::arg("params"), py::arg("runs"), py::arg("owned"),
           py::arg("unserved"), py::arg("combine"), py::arg("log") = py::none())
      .def_property_readonly("map_runs", &MappedSubscriber::map_runs)
      .def_property_readonly("torn", &MappedSubscriber::torn,
                             "Whether an anchor failed after its first write: the parameters partly hold it and the "
                             "receiver is at no version until a later anchor is written and audited.")
      .def("_fail_anchor_writes_after", &MappedSubscriber::fail_anchor_writes_after, py::arg("runs"),
           "Tests only: every anchor load fails after writing `runs` runs (map_runs: all, before the audit); None: off.")
      .def("take_timings", &MappedSubscriber::take_timings,
           "Seconds per stage of the applies since the last call: parse, map (HF -> runtime positions), gather, "
           "pack, scatter, digest; anchor_check, anchor_write, anchor_audit.");
  m.def(
      "probe_runs",
      [](const at::Tensor& twin, int64_t min_probe) {
        if ((twin.scalar_type() != at::kInt && twin.scalar_type() != at::kLong) || !twin.device().is_cpu() || !twin.is_contiguous())
          throw Error("probe_runs: the twin must be a contiguous int32 or int64 CPU tensor");
        ProbeRuns runs;
        {
          py::gil_scoped_release nogil;
          runs = twin.scalar_type() == at::kInt
                     ? find_probe_runs(twin.data_ptr<int32_t>(), static_cast<uint64_t>(twin.numel()), min_probe)
                     : find_probe_runs(twin.data_ptr<int64_t>(), static_cast<uint64_t>(twin.numel()), min_probe);
        }
        auto as_tensor = [](std::vector<int64_t>& v) {
          at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
          if (!v.empty()) std::memcpy(t.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
          return t;
        };
        return py::make_tuple(as_tensor(runs.start), as_tensor(runs.first), as_tensor(runs.length));
      },
      py::arg("twin"), py::arg("min_probe"),
      "(start, first, length) int64 tensors: the maximal runs of a flat integer twin whose values are >= min_probe "
      "and step by +1 (twin[start + k] == first + k). One read of the twin.");
  m.def(
      "storage_use_count", [](const at::Tensor& t) { return t.storage().use_count(); }, py::arg("tensor"),
      "How many tensors hold this tensor's storage (1: this one alone): whether a buffer handed out before is free again.");
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
