// A publisher's fence for Python (DeltaPublisher.fence, ShardedDeltaPublisher.fence): run_id,
// epoch, since (None for a store that was empty when the epoch started).
#pragma once
#include <pybind11/pybind11.h>

#include "sync/protocol.hpp"

namespace deltasync::torch_ext {

inline pybind11::dict fence_dict(const protocol::Fence& f) {
  pybind11::dict d;
  d["run_id"] = f.run_id;
  d["epoch"] = f.epoch;
  d["since"] = f.since ? pybind11::object(pybind11::int_(*f.since)) : pybind11::none();
  return d;
}

}  // namespace deltasync::torch_ext
