// The host fixture (host_fixture.hpp) uploaded to the device, for the CUDA benchmarks: current
// weights, the shadow an encode diffs against, and a pristine copy of the shadow to reset it
// from between samples. Sized against the free device memory first (the GPU may be shared with
// the torch baseline), so an oversized state is skipped rather than failing mid-run.
#pragma once
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "cuda_buffers.hpp"
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "harness.hpp"
#include "host_fixture.hpp"

namespace deltasync::bench {

// True when `bytes` fit in 90% of the free device memory; otherwise skips the state and says why.
inline bool fits_on_device(State& state, double bytes) {
  size_t free = 0, total = 0;
  cuda::check(cudaMemGetInfo(&free, &total), "bench: cudaMemGetInfo");
  if (bytes <= 0.9 * static_cast<double>(free)) return true;
  state.skip("needs ~" + format_bytes(bytes) + " of device memory, " + format_bytes(static_cast<double>(free)) + " free");
  return false;
}

struct DeviceFixture {
  std::unique_ptr<HostFixture> host;
  std::unique_ptr<DeviceBytes> current, shadow, base;

  std::vector<EncodeItem> encode_items() const { return host->model.encode_items(current->data(), shadow->data()); }
  // Undoes an encode's shadow update on the device (a full copy, queued on `s`).
  void reset_shadow(cudaStream_t s) const {
    cuda::check(cudaMemcpyAsync(shadow->data(), base->data(), base->size(), cudaMemcpyDeviceToDevice, s),
                "bench: reset shadow");
  }
};

// Returns nullptr after state.skip() when the host fixture does not fit, or when `device_arenas`
// copies of the weights plus `extra_device_bytes` (deltas, scratch, outputs) would not fit on the
// device.
inline std::unique_ptr<DeviceFixture> make_device_fixture(State& state, int device_arenas,
                                                          double extra_device_bytes = 0) {
  auto host = make_host_fixture(state, 2);
  if (!host) return nullptr;
  if (!fits_on_device(state, device_arenas * static_cast<double>(host->model.arena_bytes()) + extra_device_bytes))
    return nullptr;
  auto f = std::make_unique<DeviceFixture>();
  const size_t bytes = host->model.arena_bytes();
  f->current = std::make_unique<DeviceBytes>(bytes);
  f->shadow = std::make_unique<DeviceBytes>(bytes);
  f->base = std::make_unique<DeviceBytes>(bytes);
  cuda::check(cudaMemcpy(f->current->data(), host->current.data(), bytes, cudaMemcpyHostToDevice), "bench: upload");
  cuda::check(cudaMemcpy(f->base->data(), host->shadow.data(), bytes, cudaMemcpyHostToDevice), "bench: upload");
  cuda::check(cudaMemcpy(f->shadow->data(), host->shadow.data(), bytes, cudaMemcpyHostToDevice), "bench: upload");
  // A pageable upload may return before its DMA ends, and the benchmarks' stream does not wait
  // for the legacy stream: the device settles before anything is timed.
  cuda::check(cudaDeviceSynchronize(), "bench: upload");
  f->host = std::move(host);
  return f;
}

}  // namespace deltasync::bench
