// The part of the Subscriber binding every receiver shares (tensors of a model here; the vLLM
// receiver's fused, sharded parameters in mapped_receiver.cpp): a store, the C++ Subscriber, and
// a receiver supplied by the subclass.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <string>

#include "store/store.hpp"
#include "sync/receiver.hpp"
#include "sync/subscriber.hpp"

namespace deltasync::torch_ext {

pybind11::dict report_dict(const SyncReport& report);

class SubscriberBinding {
 public:
  SubscriberBinding(const std::string& store_url, pybind11::object log);
  virtual ~SubscriberBinding();

  std::optional<uint64_t> poll();
  pybind11::dict update(std::optional<uint64_t> version, bool audit);
  bool has_version(uint64_t version);
  std::optional<uint64_t> version();
  pybind11::dict digests();
  void recompute_digests();

 protected:
  virtual Receiver& receiver() = 0;
  // Called (without the GIL) before each operation on the weights: e.g. pick up the caller's
  // current CUDA stream.
  virtual void prepare() {}

 private:
  std::unique_ptr<Store> store_;
  std::unique_ptr<Subscriber> subscriber_;
};

}  // namespace deltasync::torch_ext
