// Binding of deltasync::Publisher: the Python DeltaPublisher passes its parameters and options,
// the C++ publisher does the rest (diff where the tensors live, staging, background upload,
// merging, anchors, retention). The GIL is released around every call that waits or works.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>

#include "bindings/fence_dict.hpp"
#include "bindings/log_callback.hpp"
#include "bindings/module.hpp"
#include "bindings/records.hpp"
#include "bindings/tensor_set.hpp"
#include "core/error.hpp"
#include "store/store.hpp"
#include "sync/publisher.hpp"
#include "sync/publisher_resume.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {
namespace {

py::dict stats_dict(const VersionStats& s) { return record_dict(s, version_stats_fields()); }

// The DeltaPublisher's keywords: PublisherOptions' fields, plus low_memory (an engine option).
PublisherOptions options_from(const py::dict& given, bool& low_memory) {
  low_memory = given.contains("low_memory") && !given["low_memory"].is_none() && py::cast<bool>(given["low_memory"]);
  PublisherOptions o;
  for (const std::string& key : set_fields(o, publisher_option_fields(), given, "deltasync.DeltaPublisher"))
    if (key != "low_memory") throw Error("deltasync.DeltaPublisher: unknown option '" + key + "'", ErrorKind::kInvalidArgument);
  return o;
}

class PublisherBinding {
 public:
  PublisherBinding(const std::string& store_url, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                   const py::dict& options, py::object log)
      : layout_(tensor_set(names, tensors, "deltasync.DeltaPublisher")) {
    bool low_memory = false;
    PublisherOptions o = options_from(options, low_memory);
    o.log = log_callback(std::move(log));
    engine::EngineOptions eo;
    eo.shadow = low_memory ? engine::ShadowKind::kLowByte : engine::ShadowKind::kFull;
    store_ = open_store(store_url);
    auto engine = engine_for(layout_, eo);
    py::gil_scoped_release nogil;  // claiming the store waits on it (and the store may be served from this process)
    publisher_ = std::make_unique<Publisher>(store_, layout_.meta, std::move(engine), std::move(o));
    fence_ = publisher_->fence();
  }
  ~PublisherBinding() {
    // Joining the upload thread may wait for a log callback that needs the GIL.
    py::gil_scoped_release nogil;
    publisher_.reset();
  }

  py::dict publish(uint64_t version, const std::vector<at::Tensor>& tensors, bool force_anchor) {
    Publisher& p = live();
    const TensorSet current = same_layout(layout_, tensors, "deltasync.DeltaPublisher.publish");
    {
      py::gil_scoped_release nogil;
      if (current.device == engine::Device::kCuda) p.set_stream(current_stream_for(current));
      p.publish(version, current.const_refs(), force_anchor);
    }
    return stats_dict(p.last_staged());
  }

  // Continues the store's newest version (resume_from_store): its verified weights are written
  // into the model's tensors and become the shadow. Returns that version, or None for an empty
  // store (then the first publish is an anchor, as for a new store).
  py::object resume() {
    Publisher& p = live();
    if (layout_.device != engine::Device::kCpu)
      throw Error("deltasync.DeltaPublisher: resume needs the model in host memory (the store's weights are written into it)",
                  ErrorKind::kUnsupported);
    std::optional<StoreResume> resumed;
    {
      py::gil_scoped_release nogil;
      resumed = resume_from_store(*store_);
      if (resumed) {
        p.restore(resumed->shadow, resumed->state);  // refuses another model's tensors before anything is written
        for (size_t t = 0; t < layout_.refs.size(); ++t)
          std::memcpy(layout_.refs[t].data, resumed->shadow.data[t].data(), resumed->shadow.data[t].size());
      }
    }
    if (!resumed) return py::none();
    return py::int_(*resumed->state.last_version);
  }

  void flush() {
    Publisher& p = live();
    py::gil_scoped_release nogil;
    p.flush();
  }

  void close() {
    if (!publisher_) return;
    py::gil_scoped_release nogil;
    std::unique_ptr<Publisher> p = std::move(publisher_);
    // What the publisher did stays readable after close (stats of the last versions).
    auto keep = [&] {
      closed_history_ = p->history();
      closed_state_ = p->state();
    };
    try {
      p->flush();
    } catch (...) {
      keep();
      p.reset();  // stop the upload thread, then report
      throw;
    }
    keep();
  }

  py::list history() const {
    py::list out;
    for (const auto& s : publisher_ ? publisher_->history() : closed_history_) out.append(stats_dict(s));
    return out;
  }

  // The run and epoch the store was claimed with (kept after close).
  py::dict fence() const { return fence_dict(fence_); }

  py::dict state() const {
    const PublisherState s = publisher_ ? publisher_->state() : closed_state_;
    py::dict d;
    d["last_version"] = s.last_version ? py::object(py::int_(*s.last_version)) : py::none();
    d["last_anchor_version"] = s.last_anchor_version ? py::object(py::int_(*s.last_anchor_version)) : py::none();
    d["delta_bytes_since_anchor"] = s.delta_bytes_since_anchor;
    return d;
  }

  std::string device() const { return std::string(engine::device_name(live().engine().device())); }
  std::string format() const { return live().options().delta_format; }
  bool low_memory() const { return live().engine().shadow_kind() == engine::ShadowKind::kLowByte; }
  uint64_t shadow_bytes() const { return live().engine().shadow_bytes(); }

 private:
  Publisher& live() const {
    if (!publisher_) throw Error("deltasync.DeltaPublisher: the publisher is closed");
    return *publisher_;
  }

  TensorSet layout_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<Publisher> publisher_;
  std::vector<VersionStats> closed_history_;
  PublisherState closed_state_;
  protocol::Fence fence_;
};

py::dict publisher_defaults() { return record_dict(PublisherOptions{}, publisher_option_fields()); }

}  // namespace

void bind_publisher(py::module_& m) {
  py::class_<PublisherBinding>(m, "Publisher")
      .def(py::init<const std::string&, const std::vector<std::string>&, const std::vector<at::Tensor>&, const py::dict&, py::object>(),
           py::arg("store"), py::arg("names"), py::arg("tensors"), py::arg("options"), py::arg("log") = py::none())
      .def("publish", &PublisherBinding::publish, py::arg("version"), py::arg("tensors"), py::arg("force_anchor") = false)
      .def("resume", &PublisherBinding::resume)
      .def("flush", &PublisherBinding::flush)
      .def("close", &PublisherBinding::close)
      .def("history", &PublisherBinding::history)
      .def("state", &PublisherBinding::state)
      .def_property_readonly("fence", &PublisherBinding::fence)
      .def_property_readonly("device", &PublisherBinding::device)
      .def_property_readonly("format", &PublisherBinding::format)
      .def_property_readonly("low_memory", &PublisherBinding::low_memory)
      .def_property_readonly("shadow_bytes", &PublisherBinding::shadow_bytes);
  m.def("publisher_defaults", &publisher_defaults, "PublisherOptions' defaults: the one set the CLI and Python share.");
  m.def("publisher_option_fields", [] { return describe_fields<PublisherOptions>(publisher_option_fields()); },
        "(name, type, default, help) of every publisher option: the DeltaPublisher's keywords and the CLI's flags.");
  m.def("version_stats_fields", [] { return describe_fields<VersionStats>(version_stats_fields()); },
        "(name, type, default, help) of every field of a version's stats (PublishStats).");
}

}  // namespace deltasync::torch_ext
