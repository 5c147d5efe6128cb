// Host dispatch of the GPU compact encoder (kernels: compact_encode_kernels.cuh). Plans the
// blocks on the host from the per-tensor offsets and, for tensors cut into tiles
// (codec/compact_tiles.hpp: the CPU codec's rule, on the same shapes), from where each tile
// starts (compact_tile_kernels.cuh puts banded tensors in coded order and finds the tile
// starts: one more synchronization when any tensor has tiles); encodes every block on the
// device, scans the block sizes with CUB, writes the block index and gathers the payloads on the
// device, and downloads the result. Every buffer is reused across calls and only grows; each
// call ends synchronized, so growing never races a queued kernel.
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "compact_encode_kernels.cuh"
#include "compact_tile_kernels.cuh"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/engine.hpp"
#include "core/parallel.hpp"
#include "device_buffers.cuh"
#include "nvtx_ranges.cuh"
#include "refusal.cuh"

namespace deltasync::cuda {

using detail::CompactBlockSizes;
using detail::CompactEncodeTask;
using detail::CompactScratchLayout;
using detail::refuse;

struct CompactEncoder::State {
  PinnedArray<uint64_t> offsets_host;  // offsets then value_offsets (2 * (T + 1))
  PinnedArray<CompactEncodeTask> tasks_host;
  DeviceArray<CompactEncodeTask> tasks;
  DeviceArray<uint8_t> scratch;
  DeviceArray<CompactBlockSizes> sizes;
  DeviceArray<uint64_t> block_bytes;      // num_blocks + 1 (the last is 0, so the scan yields the total)
  DeviceArray<uint64_t> payload_offsets;  // num_blocks + 1
  PinnedArray<uint64_t> payload_offsets_host;
  DeviceArray<uint8_t> cub_temp;
  DeviceArray<uint8_t> index;
  DeviceArray<uint8_t> payload;
  PinnedArray<uint8_t> download;  // index bytes, then payload bytes
  // Tiled tensors: banded ones in coded order, the reorder's segment scan, every tile's start.
  DeviceArray<int64_t> coded_indices;
  DeviceArray<uint8_t> coded_values;
  DeviceArray<uint8_t> coded_base_values;
  PinnedArray<detail::TiledTensor> tiled_host;  // banded tensors first, then the others with tiles
  DeviceArray<detail::TiledTensor> tiled;
  DeviceArray<uint64_t> segments;
  DeviceArray<uint64_t> tile_starts;
  PinnedArray<uint64_t> tile_starts_host;
  TransferCounters transfer;      // the last encode

  // Banded tensors into coded order and every tiled tensor's tile starts on the host (one
  // synchronization); `tiles` per tensor (1 x 1 where untiled). Fills tile_starts_host.
  cudaError_t place_tiles(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta, const uint64_t* offsets,
                          const uint64_t* value_offsets, std::span<const compact::TileGeometry> tiles, cudaStream_t stream,
                          std::vector<uint64_t>& first_tile);

  // Everything after the offsets are on the host: two synchronizations.
  cudaError_t encode_planned(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta,
                             const uint64_t* offsets, const uint64_t* value_offsets, cudaStream_t stream,
                             const compact::Options& options, std::vector<compact::EncodedTensor>& out);
};

namespace {

// compact::encode()'s checks of the arguments, with its messages and in its order (refused:
// cudaErrorInvalidValue, the message for take_refusal()).
cudaError_t check_arguments(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta,
                            const compact::Options& options) {
  if (options.block_elements == 0 || options.block_elements > (1u << 24))
    return refuse("compact: block_elements must be in 1..16777216, got " + std::to_string(options.block_elements));
  // The device encoder codes compact_version 1 only (its output's EncodedTensor::version).
  if (options.version != compact::kFormatVersion1)
    return refuse("compact: the GPU encoder writes compact_version 1 only, got " + std::to_string(options.version));
  if (!compact::is_tile_count(options.max_tiles))
    return refuse("compact: max_tiles must be 1, 2, 4 or 8, got " + std::to_string(options.max_tiles));
  if (delta.num_tensors != tensors.size())
    return refuse("compact: delta has " + std::to_string(delta.num_tensors) + " tensors, model has " +
                  std::to_string(tensors.size()));
  return cudaSuccess;
}

}  // namespace

CompactEncoder::CompactEncoder() : state_(new State) {}
CompactEncoder::~CompactEncoder() { delete state_; }

size_t CompactEncoder::workspace_bytes() const {
  const State& s = *state_;
  return s.tasks.bytes() + s.scratch.bytes() + s.sizes.bytes() + s.block_bytes.bytes() + s.payload_offsets.bytes() +
         s.cub_temp.bytes() + s.index.bytes() + s.payload.bytes() + s.coded_indices.bytes() + s.coded_values.bytes() +
         s.coded_base_values.bytes() + s.tiled.bytes() + s.segments.bytes() + s.tile_starts.bytes();
}

cudaError_t CompactEncoder::encode(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta,
                                   cudaStream_t stream, const compact::Options& options,
                                   std::vector<compact::EncodedTensor>& out) {
  detail::scoped_range range{"compact encode"};
  State& s = *state_;
  s.transfer = {};
  out.clear();
  DELTASYNC_RETURN_IF_ERROR(check_arguments(tensors, delta, options));
  if (tensors.empty()) return cudaSuccess;
  const size_t T = tensors.size();

  // Sync 1: the offsets, to plan the blocks.
  DELTASYNC_RETURN_IF_ERROR(s.offsets_host.reserve(2 * (T + 1)));
  uint64_t* offsets = s.offsets_host.data();
  uint64_t* value_offsets = offsets + T + 1;
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(offsets, delta.offsets, (T + 1) * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(value_offsets, delta.value_offsets, (T + 1) * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                        stream));
  DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  s.transfer.device_to_host_bytes += 2 * (T + 1) * sizeof(uint64_t);
  s.transfer.host_syncs += 1;
  return s.encode_planned(tensors, delta, offsets, value_offsets, stream, options, out);
}

cudaError_t CompactEncoder::encode(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta,
                                   std::span<const uint64_t> host_offsets, std::span<const uint64_t> host_value_offsets,
                                   cudaStream_t stream, const compact::Options& options,
                                   std::vector<compact::EncodedTensor>& out) {
  detail::scoped_range range{"compact encode"};
  State& s = *state_;
  s.transfer = {};
  out.clear();
  DELTASYNC_RETURN_IF_ERROR(check_arguments(tensors, delta, options));
  if (tensors.empty()) return cudaSuccess;
  if (host_offsets.size() != tensors.size() + 1 || host_value_offsets.size() != tensors.size() + 1)
    return refuse("compact: " + std::to_string(host_offsets.size()) + " offsets for " + std::to_string(tensors.size()) +
                  " tensors");
  return s.encode_planned(tensors, delta, host_offsets.data(), host_value_offsets.data(), stream, options, out);
}

const TransferCounters& CompactEncoder::transfer() const { return state_->transfer; }

cudaError_t CompactEncoder::State::encode_planned(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta,
                                                  const uint64_t* offsets, const uint64_t* value_offsets,
                                                  cudaStream_t stream, const compact::Options& options,
                                                  std::vector<compact::EncodedTensor>& out) {
  State& s = *this;
  const size_t T = tensors.size();
  if (offsets[T] > 0 && delta.base_values == nullptr)
    return refuse("compact: delta lacks the base values the compact format encodes against");

  // compact::encode()'s checks of each tensor, then its tiles by the same rule.
  std::vector<compact::TileGeometry> tiles(T);
  for (size_t t = 0; t < T; ++t) {
    const uint64_t n = offsets[t + 1] - offsets[t];
    const uint32_t width = tensors[t].width();
    if (n == 0) continue;
    if (width != 1 && width != 2 && width != 4)
      return refuse("compact: tensor " + tensors[t].name + ": unsupported element width " + std::to_string(width));
    if (value_offsets[t + 1] - value_offsets[t] != n * width)
      return refuse("compact: tensor " + tensors[t].name + ": value bytes do not match " + std::to_string(n) +
                    " changes of width " + std::to_string(width));
    tiles[t] = compact::choose_tiles(tensors[t].shape, n, options.block_elements, options.max_tiles);
  }
  std::vector<uint64_t> first_tile;
  DELTASYNC_RETURN_IF_ERROR(s.place_tiles(tensors, delta, offsets, value_offsets, tiles, stream, first_tile));

  // Blocks of block_elements changes, none crossing a tile (compact::encode's plan).
  const uint32_t header_bytes = static_cast<uint32_t>(compact::index_header_bytes(options.index_version()));
  std::vector<CompactEncodeTask> tasks;
  std::vector<size_t> first_task(T + 1, 0);
  std::vector<uint64_t> index_offset(T + 1, 0);
  uint64_t scratch_bytes = 0;
  uint64_t coded_at = 0;  // a banded tensor's changes in the coded-order scratch
  for (size_t t = 0; t < T; ++t) {
    first_task[t] = tasks.size();
    index_offset[t + 1] = index_offset[t];
    const uint64_t n = offsets[t + 1] - offsets[t];
    const uint32_t width = tensors[t].width();
    if (n == 0) continue;
    std::vector<uint64_t> starts{0, n};
    if (tiles[t].tiles() > 1) {
      starts.assign(s.tile_starts_host.data() + first_tile[t], s.tile_starts_host.data() + first_tile[t] + tiles[t].tiles());
      starts.push_back(n);
    }
    uint64_t num_blocks = 0;
    for (size_t j = 0; j + 1 < starts.size(); ++j)
      num_blocks += (starts[j + 1] - starts[j] + options.block_elements - 1) / options.block_elements;
    if (tasks.size() + num_blocks >= (uint64_t{1} << 31)) return refuse("compact encode: more than 2^31 blocks");
    index_offset[t + 1] = index_offset[t] + header_bytes + num_blocks * detail::compact_coder::kRecordBytes;
    const bool banded = tiles[t].bands > 1;
    const int64_t* positions = banded ? s.coded_indices.data() + coded_at : delta.indices + offsets[t];
    const uint8_t* new_bits = banded ? s.coded_values.data() + coded_at * width : delta.values + value_offsets[t];
    const uint8_t* base_bits = banded ? s.coded_base_values.data() + coded_at * width : delta.base_values + value_offsets[t];
    if (banded) coded_at += n;
    const auto first_block = static_cast<uint32_t>(tasks.size());
    uint32_t b = 0;
    for (size_t j = 0; j + 1 < starts.size(); ++j) {
      for (uint64_t first = starts[j]; first < starts[j + 1]; first += options.block_elements, ++b) {
        const auto count = static_cast<uint32_t>(std::min<uint64_t>(options.block_elements, starts[j + 1] - first));
        tasks.push_back(CompactEncodeTask{positions + first, new_bits + first * width, base_bits + first * width, scratch_bytes,
                                          index_offset[t], n, count, width, b, static_cast<uint32_t>(num_blocks), first_block,
                                          options.block_elements, header_bytes, tiles[t].bands, tiles[t].stripes});
        scratch_bytes += CompactScratchLayout::for_count(count).total;
      }
    }
  }
  first_task[T] = tasks.size();
  const auto num_blocks = static_cast<uint32_t>(tasks.size());
  if (num_blocks == 0) return cudaSuccess;
  const uint64_t index_bytes = index_offset[T];

  size_t cub_bytes = 0;
  DELTASYNC_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(nullptr, cub_bytes, s.block_bytes.data(), s.payload_offsets.data(),
                                      static_cast<int64_t>(num_blocks) + 1, stream));
  for (const cudaError_t err :
       {s.tasks_host.reserve(num_blocks), s.tasks.reserve(num_blocks), s.scratch.reserve(scratch_bytes),
        s.sizes.reserve(num_blocks), s.block_bytes.reserve(num_blocks + 1), s.payload_offsets.reserve(num_blocks + 1),
        s.payload_offsets_host.reserve(num_blocks + 1), s.cub_temp.reserve(std::max<size_t>(cub_bytes, 1)),
        s.index.reserve(index_bytes)})
    DELTASYNC_RETURN_IF_ERROR(err);
  std::memcpy(s.tasks_host.data(), tasks.data(), tasks.size() * sizeof(CompactEncodeTask));

  // Encode, scan, index, gather; sync 2: the payload offsets, to size the download.
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.tasks.data(), s.tasks_host.data(), tasks.size() * sizeof(CompactEncodeTask),
                        cudaMemcpyHostToDevice, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemsetAsync(s.block_bytes.data() + num_blocks, 0, sizeof(uint64_t), stream));
  DELTASYNC_RETURN_IF_ERROR(detail::launch_compact_encode_blocks(s.tasks.data(), num_blocks, s.scratch.data(), s.sizes.data(),
                                             s.block_bytes.data(), stream));
  DELTASYNC_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(s.cub_temp.data(), cub_bytes, s.block_bytes.data(), s.payload_offsets.data(),
                                      static_cast<int64_t>(num_blocks) + 1, stream));
  DELTASYNC_RETURN_IF_ERROR(detail::launch_compact_write_index(s.tasks.data(), s.sizes.data(), s.payload_offsets.data(), num_blocks,
                                           s.index.data(), stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.payload_offsets_host.data(), s.payload_offsets.data(), (num_blocks + 1) * sizeof(uint64_t),
                        cudaMemcpyDeviceToHost, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  s.transfer.host_to_device_bytes += tasks.size() * sizeof(CompactEncodeTask);
  s.transfer.device_to_host_bytes += (num_blocks + 1) * sizeof(uint64_t);
  s.transfer.host_syncs += 1;
  const uint64_t* payload_offsets = s.payload_offsets_host.data();
  const uint64_t payload_bytes = payload_offsets[num_blocks];

  // Sync 3: gather into place and download index and payloads in two copies.
  for (cudaError_t err : {s.payload.reserve(std::max<uint64_t>(payload_bytes, 1)),
                          s.download.reserve(index_bytes + payload_bytes)})
    DELTASYNC_RETURN_IF_ERROR(err);
  DELTASYNC_RETURN_IF_ERROR(detail::launch_compact_gather_payload(s.tasks.data(), s.sizes.data(), num_blocks, s.scratch.data(),
                                              s.payload_offsets.data(), s.payload.data(), stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.download.data(), s.index.data(), index_bytes, cudaMemcpyDeviceToHost, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.download.data() + index_bytes, s.payload.data(), payload_bytes, cudaMemcpyDeviceToHost,
                        stream));
  DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  s.transfer.device_to_host_bytes += index_bytes + payload_bytes;
  s.transfer.host_syncs += 1;

  // Out of the pinned buffer into the owning vectors, one task per tensor (page faults and
  // copies of a many-tensor model spread over the CPU twin's worker pool).
  std::vector<size_t> source;
  for (size_t t = 0; t < T; ++t) {
    if (first_task[t] == first_task[t + 1]) continue;
    compact::EncodedTensor& e = out.emplace_back();
    e.name = tensors[t].name;
    e.changed = offsets[t + 1] - offsets[t];
    e.index_version = options.index_version();
    source.push_back(t);
  }
  const uint8_t* index_host = s.download.data();
  const uint8_t* payload_host = s.download.data() + index_bytes;
  parallel_for(out.size(), [&](size_t i) {
    const size_t t = source[i];
    out[i].block_index.assign(index_host + index_offset[t], index_host + index_offset[t + 1]);
    out[i].payload.assign(payload_host + payload_offsets[first_task[t]],
                          payload_host + payload_offsets[first_task[t + 1]]);
  });
  return cudaSuccess;
}

cudaError_t CompactEncoder::State::place_tiles(std::span<const TensorMeta> tensors, const DeviceDeltaView& delta,
                                               const uint64_t* offsets, const uint64_t* value_offsets,
                                               std::span<const compact::TileGeometry> tiles, cudaStream_t stream,
                                               std::vector<uint64_t>& first_tile) {
  State& s = *this;
  const size_t T = tensors.size();
  first_tile.assign(T, 0);
  // The table: banded tensors first (the reorder numbers their changes and segments), then the
  // tensors with stripes only; every one numbers its tiles.
  std::vector<detail::TiledTensor> table;
  uint64_t banded_changes = 0, banded_bytes = 0, segments = 0, num_tiles = 0;
  for (const bool banded : {true, false}) {
    for (size_t t = 0; t < T; ++t) {
      if (tiles[t].tiles() == 1 || (tiles[t].bands > 1) != banded) continue;
      detail::TiledTensor tt{};
      tt.positions = delta.indices + offsets[t];
      tt.new_bits = delta.values + value_offsets[t];
      tt.base_bits = delta.base_values + value_offsets[t];
      tt.n = offsets[t + 1] - offsets[t];
      tt.width = tensors[t].width();
      tt.tiles = tiles[t];
      tt.first_tile = num_tiles;
      first_tile[t] = num_tiles;
      num_tiles += tiles[t].tiles();
      if (banded) {
        tt.first_change = banded_changes;
        tt.first_segment = segments;
        tt.out_positions = nullptr;  // set below, once the scratch exists
        banded_changes += tt.n;
        banded_bytes += tt.n * tt.width;
        segments += tiles[t].rows * tiles[t].bands;
      }
      table.push_back(tt);
    }
  }
  if (table.empty()) return cudaSuccess;
  size_t num_banded = 0;
  while (num_banded < table.size() && table[num_banded].tiles.bands > 1) ++num_banded;
  size_t cub_bytes = 0;
  DELTASYNC_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(nullptr, cub_bytes, s.segments.data(), s.segments.data(),
                                                          static_cast<int64_t>(segments) + 1, stream));
  for (const cudaError_t err :
       {s.coded_indices.reserve(std::max<uint64_t>(banded_changes, 1)), s.coded_values.reserve(std::max<uint64_t>(banded_bytes, 1)),
        s.coded_base_values.reserve(std::max<uint64_t>(banded_bytes, 1)), s.tiled_host.reserve(table.size()),
        s.tiled.reserve(table.size()), s.segments.reserve(segments + 1), s.tile_starts.reserve(num_tiles),
        s.tile_starts_host.reserve(num_tiles), s.cub_temp.reserve(std::max<size_t>(cub_bytes, 1))})
    DELTASYNC_RETURN_IF_ERROR(err);
  uint64_t at = 0;
  for (size_t i = 0; i < num_banded; ++i) {
    table[i].out_positions = s.coded_indices.data() + at;
    table[i].out_new_bits = s.coded_values.data() + at * table[i].width;
    table[i].out_base_bits = s.coded_base_values.data() + at * table[i].width;
    at += table[i].n;
  }
  std::memcpy(s.tiled_host.data(), table.data(), table.size() * sizeof(detail::TiledTensor));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.tiled.data(), s.tiled_host.data(), table.size() * sizeof(detail::TiledTensor),
                                            cudaMemcpyHostToDevice, stream));
  if (num_banded > 0) {
    const auto banded = static_cast<uint32_t>(num_banded);
    DELTASYNC_RETURN_IF_ERROR(detail::launch_tile_segment_counts(true, s.tiled.data(), banded, segments, s.segments.data(), nullptr, stream));
    size_t scan_bytes = s.cub_temp.bytes();
    DELTASYNC_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(s.cub_temp.data(), scan_bytes, s.segments.data(), s.segments.data(),
                                                            static_cast<int64_t>(segments) + 1, stream));
    DELTASYNC_RETURN_IF_ERROR(
        detail::launch_tile_reorder(true, s.tiled.data(), banded, banded_changes, s.segments.data(), nullptr, stream));
  }
  DELTASYNC_RETURN_IF_ERROR(
      detail::launch_tile_starts(s.tiled.data(), static_cast<uint32_t>(table.size()), num_tiles, s.tile_starts.data(), stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.tile_starts_host.data(), s.tile_starts.data(), num_tiles * sizeof(uint64_t),
                                            cudaMemcpyDeviceToHost, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  s.transfer.host_to_device_bytes += table.size() * sizeof(detail::TiledTensor);
  s.transfer.device_to_host_bytes += num_tiles * sizeof(uint64_t);
  s.transfer.host_syncs += 1;
  return cudaSuccess;
}

}  // namespace deltasync::cuda
