// The Python extension module deltasync._deltasync_ops: one shared library that registers
// torch.ops.deltasync (the tensor operators, ops_*.cpp) when it is loaded and binds the C++
// Publisher and Subscriber (this folder) for the Python package's DeltaPublisher and
// DeltaSubscriber, which only choose where the tensors live and pass them in.
#pragma once
#include <pybind11/pybind11.h>

namespace deltasync::torch_ext {

void bind_errors(pybind11::module_& m);
void bind_publisher(pybind11::module_& m);
void bind_shard_publisher(pybind11::module_& m);
void bind_subscriber(pybind11::module_& m);
void bind_mapped_receiver(pybind11::module_& m);
void bind_store_watcher(pybind11::module_& m);
void bind_dtypes(pybind11::module_& m);
void bind_files(pybind11::module_& m);
void bind_numbers(pybind11::module_& m);

}  // namespace deltasync::torch_ext
