// NVTX ranges of the CUDA backend live in their own "deltasync" domain, so a profile can show or
// hide them apart from CUB's and the application's ranges.
#pragma once
#include <nvtx3/nvtx3.hpp>

namespace deltasync::cuda::detail {

struct nvtx_domain {
  static constexpr char const* name{"deltasync"};
};

using scoped_range = nvtx3::scoped_range_in<nvtx_domain>;

}  // namespace deltasync::cuda::detail
