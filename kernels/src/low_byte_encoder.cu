// Host dispatch of the low-byte shadow encoder (kernels: low_byte_kernels.cuh): the tensor
// table, CUB's count and select over all tensors' ids, the output buffers and the pinned
// staging buffers, all reused across steps and grown only when a step needs more.
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <cub/device/device_reduce.cuh>
#include <cub/device/device_select.cuh>
#include <algorithm>
#include <string>
#include <vector>

#include "deltasync/cuda/low_byte.hpp"
#include "device_buffers.cuh"
#include "launch_config.cuh"
#include "low_byte_kernels.cuh"
#include "nvtx_ranges.cuh"
#include "refusal.cuh"

namespace deltasync::cuda {

using detail::LowByteTensor;

namespace {

constexpr unsigned kThreads = 256;

// Refuses (cudaErrorInvalidValue, reason for take_refusal()) what the kernels cannot take.
cudaError_t check_items(std::span<const EncodeItem> items) {
  if (items.size() >= uint64_t{1} << 32) return detail::refuse("low-byte encode: more than 2^32 tensors");
  for (const EncodeItem& item : items) {
    const auto fail = [&](const std::string& reason) { return detail::refuse("tensor " + std::string(item.name) + ": " + reason); };
    if (item.width != 2) return fail(std::to_string(item.width) + "-byte elements; the low-byte shadow needs 2-byte dtypes");
    if (item.numel == 0) continue;
    if (item.current == nullptr || item.shadow == nullptr) return fail("null device pointer");
    if (reinterpret_cast<uintptr_t>(item.current) % 2 != 0) return fail("data not aligned to its 2-byte elements");
  }
  return cudaSuccess;
}

}  // namespace

struct LowByteEncoder::State {
  int sm_count = 1;
  PinnedArray<uint8_t> table_upload;  // LowByteTensor[T] then uint64_t starts[T + 1]
  DeviceArray<uint8_t> table;
  uint32_t num_tensors = 0;
  uint64_t total_elements = 0;
  DeviceArray<int64_t> count;         // [0]: count pass, [1]: select's num_selected
  PinnedArray<int64_t> count_host;
  DeviceArray<uint8_t> cub_temp;
  DeviceArray<int64_t> ids;           // selected global ids, then local positions
  DeviceArray<uint16_t> values;
  DeviceArray<uint64_t> offsets;      // offsets then value_offsets, T + 1 each
  uint64_t changed = 0;
  // What stage() copies: the last encode()'s tensor count, or -1 when there is none (none yet,
  // or a take_shadow() since, whose table replaced the encode's).
  int64_t encoded_tensors = -1;
  // Recorded after the last encode's kernels and after the last stage's copies: a call waits
  // for them before it rewrites or grows what they read or write (normally long done: callers
  // synchronize before reading staged()), so a wait here is not counted as a host sync.
  cudaEvent_t encode_done = nullptr;
  cudaEvent_t stage_done = nullptr;
  PinnedArray<uint64_t> staged_offsets;  // offsets then value_offsets
  PinnedArray<int64_t> staged_indices;
  PinnedArray<uint16_t> staged_values;
  uint32_t staged_tensors = 0;
  uint64_t staged_changed = 0;
  bool staged_any = false;
  TransferCounters transfer;

  // The tensor table (T descriptors and T + 1 starts, a few KiB), rebuilt and uploaded every
  // call; the caller has waited for the previous call's work.
  cudaError_t upload_table(std::span<const EncodeItem> items, cudaStream_t stream) {
    const auto T = static_cast<uint32_t>(items.size());
    const size_t tensor_bytes = T * sizeof(LowByteTensor);
    const size_t table_bytes = tensor_bytes + (T + 1) * sizeof(uint64_t);
    DELTASYNC_RETURN_IF_ERROR(table_upload.reserve(table_bytes));
    DELTASYNC_RETURN_IF_ERROR(table.reserve(table_bytes));
    auto* host_tensors = reinterpret_cast<LowByteTensor*>(table_upload.data());
    auto* host_starts = reinterpret_cast<uint64_t*>(table_upload.data() + tensor_bytes);
    uint64_t total = 0;
    for (uint32_t t = 0; t < T; ++t) {
      host_tensors[t] = LowByteTensor{static_cast<const uint16_t*>(items[t].current), static_cast<uint8_t*>(items[t].shadow),
                                      total};
      host_starts[t] = total;
      total += items[t].numel;
    }
    host_starts[T] = total;
    num_tensors = T;
    total_elements = total;
    transfer.host_to_device_bytes += table_bytes;
    return cudaMemcpyAsync(table.data(), table_upload.data(), table_bytes, cudaMemcpyHostToDevice, stream);
  }

  const LowByteTensor* device_tensors() const { return reinterpret_cast<const LowByteTensor*>(table.data()); }
  const uint64_t* device_starts() const {
    return reinterpret_cast<const uint64_t*>(table.data() + num_tensors * sizeof(LowByteTensor));
  }
};

LowByteEncoder::LowByteEncoder() : state_(new State) {
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&state_->sm_count, cudaDevAttrMultiProcessorCount, device);
  cudaGetLastError();  // a failed query must not leave a sticky error for the caller
  if (state_->sm_count <= 0) state_->sm_count = 1;
}

LowByteEncoder::~LowByteEncoder() {
  for (cudaEvent_t e : {state_->encode_done, state_->stage_done})
    if (e != nullptr) cudaEventDestroy(e);
  delete state_;
}

cudaError_t LowByteEncoder::encode(std::span<const EncodeItem> items, cudaStream_t stream) {
  detail::scoped_range range{"low-byte encode"};
  DELTASYNC_RETURN_IF_ERROR(check_items(items));
  State& s = *state_;
  s.transfer = {};
  s.changed = 0;
  s.encoded_tensors = -1;
  for (cudaEvent_t* e : {&s.encode_done, &s.stage_done}) {
    if (*e == nullptr) DELTASYNC_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    DELTASYNC_RETURN_IF_ERROR(cudaEventSynchronize(*e));
  }

  DELTASYNC_RETURN_IF_ERROR(s.upload_table(items, stream));
  const uint32_t T = s.num_tensors;
  const uint64_t total = s.total_elements;
  DELTASYNC_RETURN_IF_ERROR(s.offsets.reserve(2 * (uint64_t{T} + 1)));
  DELTASYNC_RETURN_IF_ERROR(s.count.reserve(2));
  DELTASYNC_RETURN_IF_ERROR(s.count_host.reserve(1));

  const detail::LowByteChanged changed{s.device_tensors(), s.device_starts(), T};
  const auto ids = thrust::counting_iterator<int64_t>(0);
  const auto flags = thrust::make_transform_iterator(ids, detail::LowByteChangedCount{changed});
  const auto n = static_cast<int64_t>(total);

  // 1. Count, and the one wait: it sizes the output.
  if (n == 0) {
    DELTASYNC_RETURN_IF_ERROR(cudaMemsetAsync(s.count.data(), 0, 2 * sizeof(int64_t), stream));
  } else {
    size_t reduce_bytes = 0, select_bytes = 0;
    DELTASYNC_RETURN_IF_ERROR(cub::DeviceReduce::Sum(nullptr, reduce_bytes, flags, s.count.data(), n, stream));
    DELTASYNC_RETURN_IF_ERROR(cub::DeviceSelect::If(nullptr, select_bytes, ids, detail::BoundedIds{nullptr, 0},
                                                    s.count.data() + 1, n, changed, stream));
    DELTASYNC_RETURN_IF_ERROR(s.cub_temp.reserve(std::max<size_t>({reduce_bytes, select_bytes, 1})));
    DELTASYNC_RETURN_IF_ERROR(cub::DeviceReduce::Sum(s.cub_temp.data(), reduce_bytes, flags, s.count.data(), n, stream));
  }
  DELTASYNC_RETURN_IF_ERROR(
      cudaMemcpyAsync(s.count_host.data(), s.count.data(), sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
  s.transfer.device_to_host_bytes += sizeof(int64_t);
  DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  s.transfer.host_syncs += 1;
  const auto selected = static_cast<uint64_t>(*s.count_host.data());
  DELTASYNC_RETURN_IF_ERROR(s.ids.reserve(std::max<uint64_t>(selected, 1)));
  DELTASYNC_RETURN_IF_ERROR(s.values.reserve(std::max<uint64_t>(selected, 1)));

  // 2. Select (ascending ids; at most `selected` written), 3. offsets, 4. bits + shadow + local
  // positions.
  if (selected > 0) {
    const detail::BoundedIds out{s.ids.data(), static_cast<int64_t>(selected)};
    size_t select_bytes = 0;
    DELTASYNC_RETURN_IF_ERROR(cub::DeviceSelect::If(nullptr, select_bytes, ids, out, s.count.data() + 1, n, changed, stream));
    DELTASYNC_RETURN_IF_ERROR(
        cub::DeviceSelect::If(s.cub_temp.data(), select_bytes, ids, out, s.count.data() + 1, n, changed, stream));
  } else {
    DELTASYNC_RETURN_IF_ERROR(cudaMemsetAsync(s.count.data() + 1, 0, sizeof(int64_t), stream));
  }
  uint64_t* offsets = s.offsets.data();
  detail::low_byte_offsets_kernel<<<detail::grid_for(uint64_t{T} + 1, kThreads, s.sm_count), kThreads, 0, stream>>>(
      s.device_starts(), T, s.ids.data(), s.count.data() + 1, selected, offsets, offsets + T + 1);
  DELTASYNC_RETURN_IF_ERROR(cudaGetLastError());
  if (selected > 0) {
    detail::low_byte_finish_kernel<<<detail::grid_for(selected, kThreads, s.sm_count), kThreads, 0, stream>>>(
        s.device_tensors(), s.device_starts(), T, s.ids.data(), s.count.data() + 1, selected, s.values.data());
    DELTASYNC_RETURN_IF_ERROR(cudaGetLastError());
  }
  s.changed = selected;
  s.encoded_tensors = T;
  return cudaEventRecord(s.encode_done, stream);
}

cudaError_t LowByteEncoder::take_shadow(std::span<const EncodeItem> items, cudaStream_t stream) {
  DELTASYNC_RETURN_IF_ERROR(check_items(items));
  State& s = *state_;
  s.transfer = {};
  s.encoded_tensors = -1;
  for (cudaEvent_t* e : {&s.encode_done, &s.stage_done}) {
    if (*e == nullptr) DELTASYNC_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    DELTASYNC_RETURN_IF_ERROR(cudaEventSynchronize(*e));
  }
  DELTASYNC_RETURN_IF_ERROR(s.upload_table(items, stream));
  if (s.total_elements > 0) {
    detail::low_byte_take_kernel<<<detail::grid_for(s.total_elements, kThreads, s.sm_count), kThreads, 0, stream>>>(
        s.device_tensors(), s.device_starts(), s.num_tensors, s.total_elements);
    DELTASYNC_RETURN_IF_ERROR(cudaGetLastError());
  }
  s.changed = 0;
  return cudaEventRecord(s.encode_done, stream);
}

uint64_t LowByteEncoder::total_changed() const { return state_->changed; }

cudaError_t LowByteEncoder::stage(cudaStream_t stream) {
  detail::scoped_range range{"low-byte stage"};
  State& s = *state_;
  if (s.encoded_tensors < 0) return detail::refuse("low-byte stage: no encode to stage (none yet, or a take_shadow since)");
  DELTASYNC_RETURN_IF_ERROR(cudaEventSynchronize(s.stage_done));
  // The copies below read what the encode's kernels write: on another stream they wait for them.
  DELTASYNC_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, s.encode_done, 0));
  s.staged_any = false;
  const auto T = static_cast<uint64_t>(s.encoded_tensors);
  DELTASYNC_RETURN_IF_ERROR(s.staged_offsets.reserve(2 * (T + 1)));
  DELTASYNC_RETURN_IF_ERROR(s.staged_indices.reserve(std::max<uint64_t>(s.changed, 1)));
  DELTASYNC_RETURN_IF_ERROR(s.staged_values.reserve(std::max<uint64_t>(s.changed, 1)));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.staged_offsets.data(), s.offsets.data(), 2 * (T + 1) * sizeof(uint64_t),
                                            cudaMemcpyDeviceToHost, stream));
  if (s.changed > 0) {
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.staged_indices.data(), s.ids.data(), s.changed * sizeof(int64_t),
                                              cudaMemcpyDeviceToHost, stream));
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.staged_values.data(), s.values.data(), s.changed * sizeof(uint16_t),
                                              cudaMemcpyDeviceToHost, stream));
  }
  s.transfer.device_to_host_bytes += 2 * (T + 1) * sizeof(uint64_t) + s.changed * (sizeof(int64_t) + sizeof(uint16_t));
  DELTASYNC_RETURN_IF_ERROR(cudaEventRecord(s.stage_done, stream));
  s.staged_tensors = static_cast<uint32_t>(T);
  s.staged_changed = s.changed;
  s.staged_any = true;
  return cudaSuccess;
}

DeltaView LowByteEncoder::staged() const {
  const State& s = *state_;
  if (!s.staged_any) return DeltaView{};
  const uint64_t* offsets = s.staged_offsets.data();
  return DeltaView{{offsets, s.staged_tensors + size_t{1}},
                   {offsets + s.staged_tensors + 1, s.staged_tensors + size_t{1}},
                   {s.staged_indices.data(), s.staged_changed},
                   {reinterpret_cast<const uint8_t*>(s.staged_values.data()), 2 * s.staged_changed},
                   {}};
}

const TransferCounters& LowByteEncoder::transfer() const { return state_->transfer; }

}  // namespace deltasync::cuda
