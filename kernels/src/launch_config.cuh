// Launch geometry shared by the grid-stride kernels of the CUDA backend.
#pragma once

namespace deltasync::cuda::detail {

// Grid size for a grid-stride kernel over `items` work items: enough blocks to fill the device
// several times over, never more than the items need, never zero.
inline unsigned grid_for(unsigned long long items, unsigned threads, int sm_count) {
  const unsigned long long needed = (items + threads - 1) / threads;
  const unsigned long long cap = static_cast<unsigned long long>(sm_count > 0 ? sm_count : 1) * 32ull;
  const unsigned long long blocks = needed < cap ? needed : cap;
  return blocks == 0 ? 1u : static_cast<unsigned>(blocks);
}

}  // namespace deltasync::cuda::detail
