// Binding of the Subscriber's poll alone: the newest visible version of a store, for a process
// that follows a store without holding weights (vLLM's engine core, which schedules the
// updates its workers apply; deltasync/vllm/follow.py). A conditional GET of LATEST per poll;
// the GIL is released while it waits on the store.
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>

#include "bindings/module.hpp"
#include "store/store.hpp"
#include "sync/subscriber.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {

namespace {

class StoreWatcher {
 public:
  explicit StoreWatcher(const std::string& store_url) : url_(store_url), store_(open_store(store_url)) {
    subscriber_ = std::make_unique<Subscriber>(*store_);
  }
  ~StoreWatcher() {
    py::gil_scoped_release nogil;
    subscriber_.reset();
    store_.reset();
  }
  std::optional<uint64_t> newest() {
    py::gil_scoped_release nogil;
    return subscriber_->poll();
  }
  const std::string& url() const { return url_; }

 private:
  std::string url_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Subscriber> subscriber_;
};

}  // namespace

void bind_store_watcher(py::module_& m) {
  py::class_<StoreWatcher>(m, "StoreWatcher")
      .def(py::init<const std::string&>(), py::arg("store"))
      .def("newest", &StoreWatcher::newest, "The newest visible version (None: nothing published yet).")
      .def_static("next_delay", &Subscriber::next_poll_delay, py::arg("interval_s"),
                  "Seconds to wait before the next poll: the interval jittered by +-50% (replicas drift apart).")
      .def_property_readonly("store", &StoreWatcher::url);
}

}  // namespace deltasync::torch_ext
