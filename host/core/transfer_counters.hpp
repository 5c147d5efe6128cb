// What a call moved between host and device memory and how often it made the host wait for the
// device. Every CUDA kernel dispatcher reports its last call this way (kernels/), and the
// engines add these up per version (VersionStats, SyncReport); the CPU engine reports zeros.
#pragma once
#include <cstdint>

namespace deltasync {

struct TransferCounters {
  uint64_t host_to_device_bytes = 0;
  uint64_t device_to_host_bytes = 0;
  uint64_t host_syncs = 0;  // host waits for the device (0 on the CPU engine)
  void add(const TransferCounters& o) {
    host_to_device_bytes += o.host_to_device_bytes;
    device_to_host_bytes += o.device_to_host_bytes;
    host_syncs += o.host_syncs;
  }
};

}  // namespace deltasync
