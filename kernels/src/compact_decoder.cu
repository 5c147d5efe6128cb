// Host dispatch of the GPU compact decoder (kernels: compact_decode_kernels.cuh). The block
// index is small (32 bytes per 16K changes) and decides every output size, so it is validated
// here on the host by the parser the CPU codec uses (compact::parse_block_index); the payloads are uploaded in one copy and the blocks decoded on the device.
// One synchronization reads the status; a second one fetches the details of a bad block.
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "compact_decode_kernels.cuh"
#include "compact_fault_text.hpp"
#include "codec/compact_block_index.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/engine.hpp"
#include "core/error.hpp"
#include "device_buffers.cuh"
#include "nvtx_ranges.cuh"

namespace deltasync::cuda {

using detail::CompactBlockFault;
using detail::CompactDecodeStatus;
using detail::CompactDecodeTask;
using detail::DeviceArray;
using detail::PinnedArray;
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
  DeviceDecodedDelta result;
};

CompactDecoder::CompactDecoder() : state_(new State) {}
CompactDecoder::~CompactDecoder() { delete state_; }

size_t CompactDecoder::workspace_bytes() const {
  const State& s = *state_;
  return s.payload.bytes() + s.tasks.bytes() + s.faults.bytes() + s.status.bytes() + s.indices.bytes() +
         s.values.bytes() + s.base_values.bytes();
}

std::vector<PatchRef> DeviceDecodedDelta::patches(std::span<const TensorMeta> base_meta) const {
  std::vector<PatchRef> out(base_meta.size());
  for (size_t t = 0; t < base_meta.size() && t + 1 < offsets.size(); ++t)
    out[t] = PatchRef{offsets[t + 1] - offsets[t], indices + offsets[t], 8, values + value_offsets[t],
                      base_meta[t].width()};
  return out;
}

const DeviceDecodedDelta& CompactDecoder::decode(std::span<const compact::EncodedTensorView> encoded,
                                                 std::span<const TensorMeta> base_meta,
                                                 std::span<const ConstTensorRef> base, const std::string& label,
                                                 cudaStream_t stream) {
  detail::scoped_range range{"compact decode"};
  State& s = *state_;
  // The host checks of compact::decode(), by the same code.
  const std::vector<compact::ParsedBlockIndex> parsed = compact::parse_encoded_tensors(encoded, base_meta, base, label);
  for (const compact::ParsedBlockIndex& p : parsed)
    if (base[p.base_index].data == nullptr)
      throw Error(label + ": tensor " + base_meta[p.base_index].name + ": null device pointer for the base");

  // Output layout per base tensor.
  const size_t T = base_meta.size();
  DeviceDecodedDelta& out = s.result;
  compact::layout_offsets(parsed, base_meta, out.offsets, out.value_offsets);
  out.changed_names.clear();
  for (const compact::EncodedTensorView& e : encoded) out.changed_names.emplace_back(e.name);
  const uint64_t total = out.offsets[T];
  const uint64_t total_value_bytes = out.value_offsets[T];
  for (cudaError_t err : {s.indices.reserve(std::max<uint64_t>(total, 1)),
                          s.values.reserve(std::max<uint64_t>(total_value_bytes, 1)),
                          s.base_values.reserve(std::max<uint64_t>(total_value_bytes, 1))})
    check(err, "compact decode: allocate");
  out.indices = s.indices.data();
  out.values = s.values.data();
  out.base_values = s.base_values.data();

  // Payloads back to back, then the task table, in one pinned upload buffer.
  uint64_t payload_total = 0;
  size_t num_blocks = 0;
  for (const compact::ParsedBlockIndex& p : parsed) {
    payload_total += p.payload.size();
    num_blocks += p.blocks.size();
  }
  if (num_blocks == 0) return out;
  if (num_blocks >= (uint64_t{1} << 31)) throw Error(label + ": more than 2^31 blocks");
  const uint64_t tasks_at = (payload_total + 15) / 16 * 16;
  const uint64_t upload_bytes = tasks_at + num_blocks * sizeof(CompactDecodeTask);
  for (cudaError_t err : {s.upload.reserve(upload_bytes), s.payload.reserve(std::max<uint64_t>(payload_total, 1)),
                          s.tasks.reserve(num_blocks), s.faults.reserve(num_blocks), s.status.reserve(1),
                          s.status_host.reserve(1), s.fault_host.reserve(1), s.positions_host.reserve(2)})
    check(err, "compact decode: allocate");
  std::vector<BlockOrigin> origins;
  origins.reserve(num_blocks);
  {
    uint8_t* host = s.upload.data();
    auto* tasks = reinterpret_cast<CompactDecodeTask*>(host + tasks_at);
    uint64_t payload_at = 0;
    size_t k = 0;
    for (const compact::ParsedBlockIndex& p : parsed) {
      if (!p.payload.empty()) std::memcpy(host + payload_at, p.payload.data(), p.payload.size());
      const size_t t = p.base_index;
      const uint32_t width = base_meta[t].width();
      uint64_t first = 0;
      for (size_t b = 0; b < p.blocks.size(); ++b, ++k) {
        const compact::BlockRecord& r = p.blocks[b];
        const uint64_t at = out.offsets[t] + first;
        const uint64_t byte_at = out.value_offsets[t] + first * width;
        tasks[k] = CompactDecodeTask{s.payload.data() + payload_at + r.payload_offset,
                                     static_cast<const uint8_t*>(base[t].data),
                                     s.indices.data() + at,
                                     s.values.data() + byte_at,
                                     s.base_values.data() + byte_at,
                                     r.first_position,
                                     base[t].numel,
                                     r.count,
                                     r.table_bytes,
                                     r.rans_bytes,
                                     r.bits_bytes,
                                     width,
                                     static_cast<uint32_t>(b)};
        origins.push_back({t, static_cast<uint32_t>(b)});
        first += r.count;
      }
      payload_at += p.payload.size();
    }
  }

  const auto blocks = static_cast<uint32_t>(num_blocks);
  check(cudaMemcpyAsync(s.payload.data(), s.upload.data(), payload_total, cudaMemcpyHostToDevice, stream),
        "compact decode: upload");
  check(cudaMemcpyAsync(s.tasks.data(), s.upload.data() + tasks_at, num_blocks * sizeof(CompactDecodeTask),
                        cudaMemcpyHostToDevice, stream),
        "compact decode: upload");
  check(cudaMemsetAsync(s.status.data(), 0xFF, sizeof(CompactDecodeStatus), stream), "compact decode: memset");
  uint64_t largest_streams = 0;
  for (const compact::ParsedBlockIndex& p : parsed)
    for (const compact::BlockRecord& r : p.blocks) largest_streams = std::max<uint64_t>(largest_streams, uint64_t{r.rans_bytes} + r.bits_bytes);
  check(detail::launch_compact_decode(s.tasks.data(), blocks, largest_streams, s.faults.data(), s.status.data(), stream),
        "compact decode: decode blocks");
  check(cudaMemcpyAsync(s.status_host.data(), s.status.data(), sizeof(CompactDecodeStatus), cudaMemcpyDeviceToHost,
                        stream),
        "compact decode: read status");
  check(cudaStreamSynchronize(stream), "compact decode: synchronize");
  const CompactDecodeStatus status = *s.status_host.data();

  if (status.first_bad_block != detail::kNoBadBlock) {
    check(cudaMemcpyAsync(s.fault_host.data(), s.faults.data() + status.first_bad_block, sizeof(CompactBlockFault),
                          cudaMemcpyDeviceToHost, stream),
          "compact decode: read fault");
    check(cudaStreamSynchronize(stream), "compact decode: synchronize");
    const BlockOrigin& o = origins[status.first_bad_block];
    throw Error(label + ": tensor " + base_meta[o.base_index].name + ": block " + std::to_string(o.block) + ": " +
                detail::describe_fault(*s.fault_host.data()));
  }
  if (status.first_unordered_block != detail::kNoBadBlock) {
    const CompactDecodeTask* task = reinterpret_cast<const CompactDecodeTask*>(s.upload.data() + tasks_at) +
                                    status.first_unordered_block;
    check(cudaMemcpyAsync(s.positions_host.data(), task->positions - 1, 2 * sizeof(int64_t), cudaMemcpyDeviceToHost,
                          stream),
          "compact decode: read positions");
    check(cudaStreamSynchronize(stream), "compact decode: synchronize");
    const BlockOrigin& o = origins[status.first_unordered_block];
    throw Error(label + ": tensor " + base_meta[o.base_index].name + ": block " + std::to_string(o.block) +
                " starts at position " + std::to_string(s.positions_host.data()[1]) +
                ", not after the previous block's last (" + std::to_string(s.positions_host.data()[0]) + ")");
  }
  return out;
}

}  // namespace deltasync::cuda
