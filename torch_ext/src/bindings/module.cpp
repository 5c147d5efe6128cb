#include "bindings/module.hpp"

#include "engine/select.hpp"

PYBIND11_MODULE(_deltasync_ops, m) {
  m.doc() = "deltasync native library: torch.ops.deltasync and the sync engine's Publisher/Subscriber";
  deltasync::torch_ext::bind_errors(m);
  deltasync::torch_ext::bind_publisher(m);
  deltasync::torch_ext::bind_shard_publisher(m);
  deltasync::torch_ext::bind_subscriber(m);
  deltasync::torch_ext::bind_mapped_receiver(m);
  deltasync::torch_ext::bind_store_watcher(m);
  deltasync::torch_ext::bind_dtypes(m);
  deltasync::torch_ext::bind_files(m);
  deltasync::torch_ext::bind_numbers(m);
  m.def("cuda_available", &deltasync::engine::cuda_available, "True when the CUDA engine is built and a device can be used.");
}
