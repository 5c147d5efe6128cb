// Host dispatch of the GPU compact decoder (kernels: compact_decode_kernels.cuh). The block
// index is small (32 bytes per 16K changes) and decides every output size, so it is validated
// here on the host, with the CPU twin's checks and messages (host/src/compact_codec.cpp,
// parse_index); the payloads are uploaded in one copy and the blocks decoded on the device.
// One synchronization reads the status; a second one fetches the details of a bad block.
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "compact_decode_kernels.cuh"
#include "compact_fault_text.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/engine.hpp"
#include "deltasync/error.hpp"
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

uint64_t read_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int k = 0; k < bytes; ++k) v |= static_cast<uint64_t>(p[k]) << (8 * k);
  return v;
}

struct Record {
  uint64_t first_position, payload_offset;
  uint32_t count, table_bytes, rans_bytes, bits_bytes;
  uint64_t payload_bytes() const { return uint64_t{table_bytes} + rans_bytes + bits_bytes; }
};

struct ParsedTensor {
  size_t base_index = 0;
  uint64_t changed = 0;
  std::vector<Record> blocks;
  std::span<const uint8_t> payload;
};

// The CPU twin's parse_index, check for check and message for message.
ParsedTensor parse_index(const compact::EncodedTensorView& e, size_t base_index, uint64_t numel,
                         const std::string& where) {
  ParsedTensor parsed;
  parsed.base_index = base_index;
  parsed.payload = e.payload;
  const auto& index = e.block_index;
  if (index.size() < coder::kIndexHeaderBytes)
    throw Error(where + ": block index truncated (" + std::to_string(index.size()) + " bytes)");
  const uint64_t changed = read_le(index.data(), 8);
  const uint64_t payload_bytes = read_le(index.data() + 8, 8);
  const auto block_elements = static_cast<uint32_t>(read_le(index.data() + 16, 4));
  const auto num_blocks = static_cast<uint32_t>(read_le(index.data() + 20, 4));
  if (index.size() != coder::kIndexHeaderBytes + uint64_t{num_blocks} * coder::kRecordBytes)
    throw Error(where + ": block index has " + std::to_string(index.size()) + " bytes for " +
                std::to_string(num_blocks) + " blocks");
  if (changed == 0 || num_blocks == 0) throw Error(where + ": block index lists no changes");
  if (changed > numel)
    throw Error(where + ": " + std::to_string(changed) + " changes for a tensor of " + std::to_string(numel) +
                " elements");
  if (block_elements == 0) throw Error(where + ": block index has block_elements 0");
  if (payload_bytes != e.payload.size())
    throw Error(where + ": payload has " + std::to_string(e.payload.size()) + " bytes, block index says " +
                std::to_string(payload_bytes));
  parsed.changed = changed;
  parsed.blocks.resize(num_blocks);
  uint64_t next_offset = 0;
  uint64_t total_count = 0;
  for (uint32_t b = 0; b < num_blocks; ++b) {
    const uint8_t* p = index.data() + coder::kIndexHeaderBytes + size_t{b} * coder::kRecordBytes;
    const Record r{read_le(p, 8),
                   read_le(p + 8, 8),
                   static_cast<uint32_t>(read_le(p + 16, 4)),
                   static_cast<uint32_t>(read_le(p + 20, 4)),
                   static_cast<uint32_t>(read_le(p + 24, 4)),
                   static_cast<uint32_t>(read_le(p + 28, 4))};
    const std::string block = where + ": block " + std::to_string(b);
    if (r.count == 0 || r.count > block_elements)
      throw Error(block + ": count " + std::to_string(r.count) + " outside 1.." + std::to_string(block_elements));
    if (r.payload_offset != next_offset)
      throw Error(block + ": payload offset " + std::to_string(r.payload_offset) + " (expected " +
                  std::to_string(next_offset) + ")");
    if (r.payload_bytes() > e.payload.size() - next_offset)
      throw Error(block + ": " + std::to_string(r.payload_bytes()) + " payload bytes run past the end of the payload");
    if (r.first_position >= numel)
      throw Error(block + ": first position " + std::to_string(r.first_position) + " is outside the tensor (" +
                  std::to_string(numel) + " elements)");
    if (b > 0 && r.first_position <= parsed.blocks[b - 1].first_position)
      throw Error(block + ": first position " + std::to_string(r.first_position) + " is not after the previous block's");
    next_offset += r.payload_bytes();
    total_count += r.count;
    parsed.blocks[b] = r;
  }
  if (next_offset != e.payload.size())
    throw Error(where + ": payload has " + std::to_string(e.payload.size() - next_offset) + " trailing bytes");
  if (total_count != changed)
    throw Error(where + ": block counts sum to " + std::to_string(total_count) + ", block index says " +
                std::to_string(changed));
  return parsed;
}

// Where each block's results and identity live, for messages.
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
  // Host checks of compact::decode(), in its order.
  if (base.size() != base_meta.size())
    throw Error(label + ": " + std::to_string(base.size()) + " base tensors for " + std::to_string(base_meta.size()) +
                " descriptions");
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t t = 0; t < base_meta.size(); ++t) {
    if (base[t].numel != base_meta[t].numel() || base[t].width != base_meta[t].width())
      throw Error(label + ": base tensor " + base_meta[t].name + " does not match its description");
    by_name.emplace(base_meta[t].name, t);
  }
  std::vector<ParsedTensor> parsed;
  std::vector<bool> seen(base_meta.size(), false);
  parsed.reserve(encoded.size());
  for (const compact::EncodedTensorView& e : encoded) {
    const std::string where = label + ": tensor " + std::string(e.name);
    const auto it = by_name.find(e.name);
    if (it == by_name.end()) throw Error(where + " is not in the base model");
    const size_t t = it->second;
    if (seen[t]) throw Error(where + " appears twice");
    seen[t] = true;
    const uint32_t width = base_meta[t].width();
    if (width != 1 && width != 2 && width != 4)
      throw Error(where + ": unsupported element width " + std::to_string(width));
    parsed.push_back(parse_index(e, t, base_meta[t].numel(), where));
    if (base[t].data == nullptr) throw Error(where + ": null device pointer for the base");
  }

  // Output layout per base tensor.
  const size_t T = base_meta.size();
  DeviceDecodedDelta& out = s.result;
  out.offsets.assign(T + 1, 0);
  out.value_offsets.assign(T + 1, 0);
  {
    std::vector<uint64_t> changed(T, 0);
    for (const ParsedTensor& p : parsed) changed[p.base_index] = p.changed;
    for (size_t t = 0; t < T; ++t) {
      out.offsets[t + 1] = out.offsets[t] + changed[t];
      out.value_offsets[t + 1] = out.value_offsets[t] + changed[t] * base_meta[t].width();
    }
  }
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
  for (const ParsedTensor& p : parsed) {
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
    for (const ParsedTensor& p : parsed) {
      if (!p.payload.empty()) std::memcpy(host + payload_at, p.payload.data(), p.payload.size());
      const size_t t = p.base_index;
      const uint32_t width = base_meta[t].width();
      uint64_t first = 0;
      for (size_t b = 0; b < p.blocks.size(); ++b, ++k) {
        const Record& r = p.blocks[b];
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
  for (const ParsedTensor& p : parsed)
    for (const Record& r : p.blocks) largest_streams = std::max<uint64_t>(largest_streams, uint64_t{r.rans_bytes} + r.bits_bytes);
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
