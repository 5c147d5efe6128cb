#include "engine/select.hpp"

#include "core/error.hpp"
#include "engine/cpu_sync_engine.hpp"
#ifdef DELTASYNC_WITH_CUDA
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/cuda_sync_engine.hpp"
#endif

namespace deltasync::engine {

bool cuda_available() {
#ifdef DELTASYNC_WITH_CUDA
  return cuda::device_available();
#else
  return false;
#endif
}

std::unique_ptr<SyncEngine> make_engine(Device device, const EngineOptions& options) {
  if (device == Device::kCpu) return std::make_unique<CpuSyncEngine>(options);
#ifdef DELTASYNC_WITH_CUDA
  if (!cuda::device_available()) throw Error("deltasync: tensors are on a CUDA device, but no CUDA device can be used");
  return std::make_unique<CudaSyncEngine>(options);
#else
  throw Error("deltasync: tensors are on a CUDA device, but this build has no CUDA backend (built without nvcc)");
#endif
}

}  // namespace deltasync::engine
