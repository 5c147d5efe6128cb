// The caller's current CUDA stream (torch's), on which the CUDA engine queues its work: the
// engine then orders itself after whatever the trainer or the model queued before.
#include <c10/cuda/CUDAStream.h>

namespace deltasync::torch_ext {

void* current_cuda_stream(int device_index) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index)).stream());
}

}  // namespace deltasync::torch_ext
