// Kernels and launchers of the apply pipeline: validate every patch of a set, then scatter all of
// them, in a fixed number of launches whatever the number of tensors.
//
// Errors are reported exactly as the CPU twin (cpu::validate) reports them. It first checks each
// patch's header in tensor order (the host does that here: a width mismatch becomes a status, the
// other header errors are refused before anything is queued), then every index, reporting the
// lowest bad tensor and within it the lowest bad position.
//
// The patch elements of all tensors form one virtual sequence: element e belongs to patch t with
// prefix[t] <= e < prefix[t + 1] and is its (e - prefix[t])-th entry. Because that numbering
// orders elements by (tensor, position), the smallest invalid e found with atomicMin is exactly
// that first violation.
//
//   validate  every element checks its index (in range, greater than its predecessor);
//   finalize  one thread turns a host-found width mismatch, or else the smallest bad element, into
//             an ApplyStatus and raises the "failed" flag;
//   scatter   writes nothing if the flag is raised, otherwise copies every value to its place.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "deltasync/cuda/engine.hpp"
#include "element_copy.cuh"
#include "launch_config.cuh"

namespace deltasync::cuda::detail {

struct PatchTarget {
  uint8_t* target;
  uint64_t numel;
  const void* indices;
  const uint8_t* values;
  uint32_t width;        // bytes per element of the target (the values have the same width)
  uint32_t index_width;  // 4 or 8
};

constexpr unsigned long long kNoBadElement = ~0ull;

// Header of the patch table; filled by the host, updated by the kernels.
struct PatchTableHeader {
  uint64_t num_patches;
  uint64_t total_elements;
  // First tensor whose values have another width than the tensor (found on the host; it takes
  // precedence over index errors, as in the CPU twin), -1 if none, and the width of its values.
  int64_t width_mismatch_tensor;
  int64_t width_mismatch_value_width;
  unsigned long long first_bad_element;  // atomicMin target, kNoBadElement when all valid
  uint32_t failed;                       // set by finalize, read by scatter
  uint32_t padding;
};

// Layout of the table in one buffer (pinned on the host, mirrored on the device):
//   PatchTableHeader | uint64_t prefix[T + 1] | PatchTarget patches[T]
struct PatchTableLayout {
  size_t prefix_offset;
  size_t patches_offset;
  size_t total_bytes;

  static PatchTableLayout for_patches(uint64_t num_patches) {
    PatchTableLayout layout{};
    layout.prefix_offset = sizeof(PatchTableHeader);
    layout.patches_offset = layout.prefix_offset + (num_patches + 1) * sizeof(uint64_t);
    layout.total_bytes = layout.patches_offset + num_patches * sizeof(PatchTarget);
    return layout;
  }
};

struct PatchTableView {
  PatchTableHeader* header;
  const uint64_t* prefix;
  const PatchTarget* patches;
};

__device__ __forceinline__ int64_t load_index(const PatchTarget& p, uint64_t j) {
  return p.index_width == 4 ? static_cast<int64_t>(static_cast<const int32_t*>(p.indices)[j])
                            : static_cast<const int64_t*>(p.indices)[j];
}

// The patch that owns element e (e < total): last t with prefix[t] <= e.
__device__ __forceinline__ uint64_t patch_of(const uint64_t* prefix, uint64_t num_patches, uint64_t e) {
  uint64_t lo = 0, hi = num_patches + 1;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (prefix[mid] <= e) lo = mid + 1; else hi = mid;
  }
  return lo - 1;
}

// Reason element j of patch p is invalid, or kApplyOk. Range is checked before order, like the
// CPU twin, so an element that violates both is reported as out of range.
__device__ __forceinline__ int32_t element_problem(const PatchTarget& p, uint64_t j, int64_t index) {
  if (index < 0 || static_cast<uint64_t>(index) >= p.numel) return kIndexOutOfRange;
  if (j > 0 && index <= load_index(p, j - 1)) return kIndexNotAscending;
  return kApplyOk;
}

__global__ void validate_patches_kernel(PatchTableView table) {
  const uint64_t total = table.header->total_elements;
  const uint64_t num_patches = table.header->num_patches;
  if (table.header->width_mismatch_tensor >= 0) return;  // already failed, nothing to look for
  for (uint64_t e = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; e < total;
       e += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t t = patch_of(table.prefix, num_patches, e);
    const PatchTarget& p = table.patches[t];
    const uint64_t j = e - table.prefix[t];
    if (element_problem(p, j, load_index(p, j)) != kApplyOk) atomicMin(&table.header->first_bad_element, e);
  }
}

__global__ void finalize_status_kernel(PatchTableView table, ApplyStatus* status) {
  ApplyStatus result{};
  const unsigned long long bad = table.header->first_bad_element;
  if (bad != kNoBadElement) {
    const uint64_t t = patch_of(table.prefix, table.header->num_patches, bad);
    const PatchTarget& p = table.patches[t];
    const uint64_t j = bad - table.prefix[t];
    const int64_t index = load_index(p, j);
    result.bad_tensor = static_cast<int64_t>(t);
    result.reason = element_problem(p, j, index);
    // Out of range reports the offending index value, not ascending its position.
    result.bad_position = result.reason == kIndexOutOfRange ? index : static_cast<int64_t>(j);
  }
  const int64_t width_bad = table.header->width_mismatch_tensor;
  if (width_bad >= 0) {
    result.bad_tensor = width_bad;
    result.reason = kWidthMismatch;
    result.bad_position = table.header->width_mismatch_value_width;  // what describe() prints
  }
  table.header->failed = result.bad_tensor >= 0 ? 1u : 0u;
  *status = result;
}

__global__ void scatter_patches_kernel(PatchTableView table) {
  if (table.header->failed != 0) return;  // any invalid patch: write nothing at all
  const uint64_t total = table.header->total_elements;
  const uint64_t num_patches = table.header->num_patches;
  for (uint64_t e = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; e < total;
       e += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t t = patch_of(table.prefix, num_patches, e);
    const PatchTarget& p = table.patches[t];
    const uint64_t j = e - table.prefix[t];
    const uint64_t index = static_cast<uint64_t>(load_index(p, j));
    copy_element(p.values + j * p.width, p.target + index * p.width, p.width);
  }
}

// Launcher: validate + finalize + scatter for a table already resident on the device. The status
// lands in `status` (device memory). `total_elements` is the host's copy of the header field.
inline cudaError_t validate_and_scatter(PatchTableView table, uint64_t total_elements, ApplyStatus* status,
                                        int sm_count, cudaStream_t stream) {
  constexpr unsigned kThreads = 256;
  const unsigned grid = grid_for(total_elements, kThreads, sm_count);
  if (total_elements > 0) {
    validate_patches_kernel<<<grid, kThreads, 0, stream>>>(table);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  finalize_status_kernel<<<1, 1, 0, stream>>>(table, status);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || total_elements == 0) return err;
  scatter_patches_kernel<<<grid, kThreads, 0, stream>>>(table);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::detail
