// Host dispatch of the GPU compact decoder (kernels: compact_decode_kernels.cuh). The block
// index is small (32 bytes per 16K changes) and decides every output size, so the caller has
// validated it on the host with the parser the CPU codec uses (compact::parse_encoded_tensors);
// the payloads are uploaded in one copy and the blocks decoded on the device. Tensors with column
// bands decode into scratch in coded order and are put in flat order on the base bits by
// compact_tile_kernels.cuh. The caller's one synchronization brings the status; finish()
// fetches the details of a bad block.
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "compact_decode_kernels.cuh"
#include "compact_fault_text.hpp"
#include "compact_tile_kernels.cuh"
#include "codec/compact_block_index.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/engine.hpp"
#include "device_buffers.cuh"
#include "nvtx_ranges.cuh"
#include "refusal.cuh"

namespace deltasync::cuda {

using detail::CompactBlockFault;
using detail::CompactDecodeStatus;
using detail::CompactDecodeTask;
namespace coder = detail::compact_coder;

namespace {

struct BlockOrigin {
  size_t base_index;
  uint32_t block;
};

}  // namespace

struct CompactDecoder::State {
  PinnedArray<uint8_t> upload;  // payloads back to back, then the task table
  DeviceArray<uint8_t> payload;
  DeviceArray<CompactDecodeTask> tasks;
  DeviceArray<CompactBlockFault> faults;
  DeviceArray<CompactDecodeStatus> status;
  PinnedArray<CompactDecodeStatus> status_host;
  PinnedArray<CompactBlockFault> fault_host;
  PinnedArray<int64_t> positions_host;  // the two positions of an unordered block boundary
  DeviceArray<int64_t> indices;
  DeviceArray<uint8_t> values;
  DeviceArray<uint8_t> base_values;
  // Banded tensors: their blocks' output in coded order, the reorder's table and segment scan.
  DeviceArray<int64_t> coded_indices;
  DeviceArray<uint8_t> coded_values;
  DeviceArray<uint8_t> coded_base_values;
  PinnedArray<detail::TiledTensor> banded_host;
  DeviceArray<detail::TiledTensor> banded;
  DeviceArray<uint64_t> segments;  // counts, then (in place) their exclusive scan
  DeviceArray<uint8_t> cub_temp;
  DeviceDecodedDelta result;
  CompactDecodeFault fault;
  TransferCounters transfer;  // the last decode
  // What finish() needs to judge the queued decode and word its fault.
  bool pending = false;
  std::vector<BlockOrigin> origins;
  uint64_t tasks_at = 0;
};

CompactDecoder::CompactDecoder() : state_(new State) {}
CompactDecoder::~CompactDecoder() { delete state_; }

const TransferCounters& CompactDecoder::transfer() const { return state_->transfer; }

size_t CompactDecoder::workspace_bytes() const {
  const State& s = *state_;
  return s.payload.bytes() + s.tasks.bytes() + s.faults.bytes() + s.status.bytes() + s.indices.bytes() +
         s.values.bytes() + s.base_values.bytes() + s.coded_indices.bytes() + s.coded_values.bytes() +
         s.coded_base_values.bytes() + s.banded.bytes() + s.segments.bytes() + s.cub_temp.bytes();
}

std::vector<PatchRef> DeviceDecodedDelta::patches(std::span<const TensorMeta> base_meta) const {
  std::vector<PatchRef> out(base_meta.size());
  for (size_t t = 0; t < base_meta.size() && t + 1 < offsets.size(); ++t)
    out[t] = PatchRef{offsets[t + 1] - offsets[t], indices + offsets[t], 8, values + value_offsets[t],
                      base_meta[t].width()};
  return out;
}

const CompactDecodeFault& CompactDecoder::fault() const { return state_->fault; }
const DeviceDecodedDelta& CompactDecoder::result() const { return state_->result; }

cudaError_t CompactDecoder::queue(std::span<const compact::ParsedBlockIndex> parsed, std::span<const uint64_t> offsets,
                                  std::span<const uint64_t> value_offsets, std::span<const ConstTensorRef> base,
                                  cudaStream_t stream) {
  detail::scoped_range range{"compact decode"};
  State& s = *state_;
  s.transfer = {};
  s.pending = false;
  s.fault = {};
  const size_t T = base.size();
  if (offsets.size() != T + 1 || value_offsets.size() != T + 1)
    return detail::refuse("compact decode: " + std::to_string(offsets.size()) + " offsets for " + std::to_string(T) +
                          " base tensors");
  for (const compact::ParsedBlockIndex& p : parsed) {
    if (p.base_index >= T) return detail::refuse("compact decode: block index of base tensor #" + std::to_string(p.base_index) +
                                                 ", the base has " + std::to_string(T));
    if (base[p.base_index].data == nullptr)
      return detail::refuse("tensor " + std::string(base[p.base_index].name) + ": null device pointer for the base");
  }

  // Output layout per base tensor, as the caller laid it out.
  DeviceDecodedDelta& out = s.result;
  out.offsets.assign(offsets.begin(), offsets.end());
  out.value_offsets.assign(value_offsets.begin(), value_offsets.end());
  const uint64_t total = out.offsets[T];
  const uint64_t total_value_bytes = out.value_offsets[T];
  for (const cudaError_t err : {s.indices.reserve(std::max<uint64_t>(total, 1)),
                                s.values.reserve(std::max<uint64_t>(total_value_bytes, 1)),
                                s.base_values.reserve(std::max<uint64_t>(total_value_bytes, 1))})
    DELTASYNC_RETURN_IF_ERROR(err);
  out.indices = s.indices.data();
  out.values = s.values.data();
  out.base_values = s.base_values.data();

  // Banded tensors decode into the coded-order scratch first, laid out in parsed order.
  std::vector<detail::TiledTensor> banded;
  uint64_t banded_changes = 0, banded_bytes = 0, segments = 0;
  std::vector<uint64_t> coded_at(parsed.size(), 0), coded_byte_at(parsed.size(), 0);
  for (size_t i = 0; i < parsed.size(); ++i) {
    const compact::ParsedBlockIndex& p = parsed[i];
    if (p.tiles.bands == 1) continue;
    const size_t t = p.base_index;
    coded_at[i] = banded_changes;
    coded_byte_at[i] = banded_bytes;
    detail::TiledTensor tt{};
    tt.n = out.offsets[t + 1] - out.offsets[t];
    tt.first_change = banded_changes;
    tt.first_segment = segments;
    tt.tiles = p.tiles;
    tt.width = base[t].width;
    tt.base = static_cast<const uint8_t*>(base[t].data);
    banded.push_back(tt);
    banded_changes += tt.n;
    banded_bytes += tt.n * tt.width;
    segments += p.tiles.rows * p.tiles.bands;
  }
  if (!banded.empty()) {
    size_t cub_bytes = 0;
    DELTASYNC_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(nullptr, cub_bytes, s.segments.data(), s.segments.data(),
                                                            static_cast<int64_t>(segments) + 1, stream));
    for (const cudaError_t err : {s.coded_indices.reserve(banded_changes), s.coded_values.reserve(banded_bytes),
                                  s.coded_base_values.reserve(banded_bytes), s.banded_host.reserve(banded.size()),
                                  s.banded.reserve(banded.size()), s.segments.reserve(segments + 1),
                                  s.cub_temp.reserve(std::max<size_t>(cub_bytes, 1))})
      DELTASYNC_RETURN_IF_ERROR(err);
    size_t j = 0;
    for (size_t i = 0; i < parsed.size(); ++i) {
      if (parsed[i].tiles.bands == 1) continue;
      const size_t t = parsed[i].base_index;
      detail::TiledTensor& tt = banded[j++];
      tt.positions = s.coded_indices.data() + coded_at[i];
      tt.new_bits = s.coded_values.data() + coded_byte_at[i];
      tt.base_bits = s.coded_base_values.data() + coded_byte_at[i];
      tt.out_positions = s.indices.data() + out.offsets[t];
      tt.out_new_bits = s.values.data() + out.value_offsets[t];
      tt.out_base_bits = s.base_values.data() + out.value_offsets[t];
    }
  }

  // Payloads back to back, then the task table, in one pinned upload buffer.
  uint64_t payload_total = 0;
  size_t num_blocks = 0;
  for (const compact::ParsedBlockIndex& p : parsed) {
    payload_total += p.payload.size();
    num_blocks += p.blocks.size();
  }
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks >= (uint64_t{1} << 31)) return detail::refuse("compact decode: more than 2^31 blocks");
  const uint64_t tasks_at = (payload_total + 15) / 16 * 16;
  const uint64_t upload_bytes = tasks_at + num_blocks * sizeof(CompactDecodeTask);
  for (cudaError_t err : {s.upload.reserve(upload_bytes), s.payload.reserve(std::max<uint64_t>(payload_total, 1)),
                          s.tasks.reserve(num_blocks), s.faults.reserve(num_blocks), s.status.reserve(1),
                          s.status_host.reserve(1), s.fault_host.reserve(1), s.positions_host.reserve(2)})
    DELTASYNC_RETURN_IF_ERROR(err);
  std::vector<BlockOrigin>& origins = s.origins;
  origins.clear();
  origins.reserve(num_blocks);
  {
    uint8_t* host = s.upload.data();
    auto* tasks = reinterpret_cast<CompactDecodeTask*>(host + tasks_at);
    uint64_t payload_at = 0;
    size_t k = 0;
    for (const compact::ParsedBlockIndex& p : parsed) {
      if (!p.payload.empty()) std::memcpy(host + payload_at, p.payload.data(), p.payload.size());
      const size_t t = p.base_index;
      const uint32_t width = base[t].width;
      // A banded tensor's blocks write coded positions (and bits decoded against the base at
      // them) to the scratch, which the reorder below reads.
      const bool coded = p.tiles.bands > 1;
      int64_t* indices = coded ? s.coded_indices.data() + coded_at[&p - parsed.data()] : s.indices.data() + out.offsets[t];
      uint8_t* values = coded ? s.coded_values.data() + coded_byte_at[&p - parsed.data()] : s.values.data() + out.value_offsets[t];
      uint8_t* base_values =
          coded ? s.coded_base_values.data() + coded_byte_at[&p - parsed.data()] : s.base_values.data() + out.value_offsets[t];
      uint64_t first = 0;
      for (size_t b = 0; b < p.blocks.size(); ++b, ++k) {
        const compact::BlockRecord& r = p.blocks[b];
        tasks[k] = CompactDecodeTask{s.payload.data() + payload_at + r.payload_offset,
                                     static_cast<const uint8_t*>(base[t].data),
                                     indices + first,
                                     values + first * width,
                                     base_values + first * width,
                                     r.first_position,
                                     base[t].numel,
                                     r.count,
                                     r.table_bytes,
                                     r.rans_bytes,
                                     r.bits_bytes,
                                     width,
                                     static_cast<uint32_t>(b),
                                     p.version,
                                     p.tiles};
        origins.push_back({t, static_cast<uint32_t>(b)});
        first += r.count;
      }
      payload_at += p.payload.size();
    }
  }

  const auto blocks = static_cast<uint32_t>(num_blocks);
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.payload.data(), s.upload.data(), payload_total, cudaMemcpyHostToDevice, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.tasks.data(), s.upload.data() + tasks_at, num_blocks * sizeof(CompactDecodeTask),
                        cudaMemcpyHostToDevice, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemsetAsync(s.status.data(), 0xFF, sizeof(CompactDecodeStatus), stream));
  uint64_t largest_streams = 0;
  for (const compact::ParsedBlockIndex& p : parsed)
    for (const compact::BlockRecord& r : p.blocks) largest_streams = std::max<uint64_t>(largest_streams, uint64_t{r.rans_bytes} + r.bits_bytes);
  DELTASYNC_RETURN_IF_ERROR(detail::launch_compact_decode(s.tasks.data(), blocks, largest_streams, s.faults.data(), s.status.data(), stream));
  if (!banded.empty()) {
    // Banded tensors into flat order (after a fault the counts are zeros and the reorder does
    // nothing).
    std::memcpy(s.banded_host.data(), banded.data(), banded.size() * sizeof(detail::TiledTensor));
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.banded.data(), s.banded_host.data(), banded.size() * sizeof(detail::TiledTensor),
                                              cudaMemcpyHostToDevice, stream));
    const auto num_banded = static_cast<uint32_t>(banded.size());
    DELTASYNC_RETURN_IF_ERROR(
        detail::launch_tile_segment_counts(false, s.banded.data(), num_banded, segments, s.segments.data(), s.status.data(), stream));
    size_t cub_bytes = s.cub_temp.bytes();
    DELTASYNC_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(s.cub_temp.data(), cub_bytes, s.segments.data(), s.segments.data(),
                                                            static_cast<int64_t>(segments) + 1, stream));
    DELTASYNC_RETURN_IF_ERROR(
        detail::launch_tile_reorder(false, s.banded.data(), num_banded, banded_changes, s.segments.data(), s.status.data(), stream));
    s.transfer.host_to_device_bytes += banded.size() * sizeof(detail::TiledTensor);
  }
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.status_host.data(), s.status.data(), sizeof(CompactDecodeStatus), cudaMemcpyDeviceToHost,
                        stream));
  s.transfer.host_to_device_bytes += payload_total + num_blocks * sizeof(CompactDecodeTask);
  s.transfer.device_to_host_bytes += sizeof(CompactDecodeStatus);
  s.pending = true;
  s.tasks_at = tasks_at;
  return cudaSuccess;
}

cudaError_t CompactDecoder::finish(cudaStream_t stream) {
  State& s = *state_;
  if (!s.pending) return cudaSuccess;
  s.pending = false;
  const std::vector<BlockOrigin>& origins = s.origins;
  const uint64_t tasks_at = s.tasks_at;
  const CompactDecodeStatus status = *s.status_host.data();

  if (status.first_bad_block != detail::kNoBadBlock) {
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.fault_host.data(), s.faults.data() + status.first_bad_block, sizeof(CompactBlockFault),
                          cudaMemcpyDeviceToHost, stream));
    DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    s.transfer.host_syncs += 1;
    const BlockOrigin& o = origins[status.first_bad_block];
    s.fault = {true, o.base_index, "block " + std::to_string(o.block) + ": " + detail::describe_fault(*s.fault_host.data())};
    return cudaSuccess;
  }
  // Block order, then tiles, block by block: the CPU decoder's order of checks.
  if (status.first_crossing_block < status.first_unordered_block) {
    const CompactDecodeTask* task = reinterpret_cast<const CompactDecodeTask*>(s.upload.data() + tasks_at) +
                                    status.first_crossing_block;
    int64_t* ends = s.positions_host.data();
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(ends, task->positions, sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    DELTASYNC_RETURN_IF_ERROR(
        cudaMemcpyAsync(ends + 1, task->positions + task->count - 1, sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    s.transfer.host_syncs += 1;
    const BlockOrigin& o = origins[status.first_crossing_block];
    s.fault = {true, o.base_index,
               "block " + std::to_string(o.block) + " crosses a tile boundary (positions " + std::to_string(ends[0]) + " to " +
                   std::to_string(ends[1]) + ")"};
    return cudaSuccess;
  }
  if (status.first_unordered_block != detail::kNoBadBlock) {
    const CompactDecodeTask* task = reinterpret_cast<const CompactDecodeTask*>(s.upload.data() + tasks_at) +
                                    status.first_unordered_block;
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.positions_host.data(), task->positions - 1, 2 * sizeof(int64_t), cudaMemcpyDeviceToHost,
                          stream));
    DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    s.transfer.host_syncs += 1;
    const BlockOrigin& o = origins[status.first_unordered_block];
    s.fault = {true, o.base_index,
               "block " + std::to_string(o.block) + " starts at position " + std::to_string(s.positions_host.data()[1]) +
                   ", not after the previous block's last (" + std::to_string(s.positions_host.data()[0]) + ")"};
  }
  return cudaSuccess;
}

}  // namespace deltasync::cuda
