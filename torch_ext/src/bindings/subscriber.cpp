// Binding of deltasync::Subscriber over the tensors of a PyTorch model (host or device memory):
// the Python DeltaSubscriber passes the tensors; polling, planning, fetching, verifying,
// applying and recovering run in C++. The GIL is released while it works.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "bindings/log_callback.hpp"
#include "bindings/module.hpp"
#include "bindings/records.hpp"
#include "bindings/subscriber_binding.hpp"
#include "bindings/tensor_set.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {

py::dict report_dict(const SyncReport& r) { return record_dict(r, sync_report_fields()); }

SubscriberBinding::SubscriberBinding(const std::string& store_url, py::object log) : store_(open_store(store_url)) {
  SubscriberOptions o;
  o.log = log_callback(std::move(log));
  subscriber_ = std::make_unique<Subscriber>(*store_, std::move(o));
}

SubscriberBinding::~SubscriberBinding() {
  py::gil_scoped_release nogil;
  subscriber_.reset();
}

std::optional<uint64_t> SubscriberBinding::poll() {
  py::gil_scoped_release nogil;
  return subscriber_->poll();
}

py::dict SubscriberBinding::update(std::optional<uint64_t> version, bool audit) {
  SyncReport report;
  {
    py::gil_scoped_release nogil;
    prepare();
    if (audit) receiver().recompute_digests();
    report = subscriber_->sync(receiver(), version);
  }
  return report_dict(report);
}

bool SubscriberBinding::has_version(uint64_t version) {
  py::gil_scoped_release nogil;
  return subscriber_->catalog().find(version) != nullptr;
}

std::optional<uint64_t> SubscriberBinding::version() { return receiver().version(); }

py::dict SubscriberBinding::digests() {
  py::dict d;
  const auto meta = receiver().tensors();
  const auto values = receiver().digests();
  for (size_t t = 0; t < values.size() && t < meta.size(); ++t) d[py::str(meta[t].name)] = values[t];
  return d;
}

void SubscriberBinding::recompute_digests() {
  py::gil_scoped_release nogil;
  prepare();
  receiver().recompute_digests();
}

namespace {

// A subscriber over tensors the caller owns, through the engine for their device.
class TensorSubscriber final : public SubscriberBinding {
 public:
  TensorSubscriber(const std::string& store, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                   py::object log)
      : SubscriberBinding(store, std::move(log)), set_(tensor_set(names, tensors, "deltasync.DeltaSubscriber")) {
    engine_ = engine_for(set_, {});
    receiver_ = std::make_unique<TensorReceiver>(set_.meta, set_.refs, *engine_);
  }
  ~TensorSubscriber() override {
    py::gil_scoped_release nogil;
    receiver_.reset();
    engine_.reset();
  }
  std::string device() const { return std::string(engine::device_name(set_.device)); }

 private:
  Receiver& receiver() override { return *receiver_; }
  void prepare() override {
    set_.check_unchanged("deltasync.DeltaSubscriber");
    use_current_stream(*engine_, set_);
  }

  TensorSet set_;
  std::unique_ptr<engine::SyncEngine> engine_;
  std::unique_ptr<TensorReceiver> receiver_;
};

}  // namespace

void bind_subscriber(py::module_& m) {
  py::class_<SubscriberBinding>(m, "SubscriberBase")
      .def("poll", &SubscriberBinding::poll)
      .def("update", &SubscriberBinding::update, py::arg("version") = py::none(), py::arg("audit") = false)
      .def("has_version", &SubscriberBinding::has_version)
      .def_property_readonly("version", &SubscriberBinding::version)
      .def("digests", &SubscriberBinding::digests)
      .def("recompute_digests", &SubscriberBinding::recompute_digests);
  py::class_<TensorSubscriber, SubscriberBinding>(m, "Subscriber")
      .def(py::init<const std::string&, const std::vector<std::string>&, const std::vector<at::Tensor>&, py::object>(),
           py::arg("store"), py::arg("names"), py::arg("tensors"), py::arg("log") = py::none())
      .def_property_readonly("device", &TensorSubscriber::device);
  m.def("update_report_fields", [] { return describe_fields<SyncReport>(sync_report_fields()); },
        "(name, type, default, help) of every field of an update's report (UpdateReport).");
}

}  // namespace deltasync::torch_ext
