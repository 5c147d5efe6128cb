// Host dispatch of the encode pipeline (kernels: encode_kernels.cuh, and one select strategy each
// in select_two_pass.cuh and select_single_pass.cuh): owns the per-tensor-set tables, the output
// buffers and the pinned staging buffers, all reused across steps and grown only when a step
// needs more.
#include <algorithm>
#include <string>
#include <vector>

#include "deltasync/cuda/engine.hpp"
#include "device_buffers.cuh"
#include "encode_kernels.cuh"
#include "nvtx_ranges.cuh"
#include "refusal.cuh"
#include "select_single_pass.cuh"
#include "select_two_pass.cuh"

namespace deltasync::cuda {

using detail::EncodeCounts;
using detail::EncodeTensor;
using detail::kChunkElements;
using detail::refuse;

namespace {

// The first encode allocates room for this many changed elements (or the whole set if smaller):
// enough for ~1% of a 100M-element model without a rerun, 2^20 x (8 + 2 x width) bytes of device
// memory (12 MiB for 2-byte elements).
constexpr int64_t kInitialCapacity = int64_t{1} << 20;

// What identifies a tensor set for the cached device tables (names only appear in messages).
struct ItemKey {
  const void* current;
  const void* shadow;
  uint64_t numel;
  uint32_t width;
  bool operator==(const ItemKey&) const = default;
};

// Refuses (cudaErrorInvalidValue, reason for take_refusal()) what the kernels cannot take.
cudaError_t check_items(std::span<const EncodeItem> items) {
  if (items.size() >= uint64_t{1} << 32) return refuse("encode: more than 2^32 tensors");
  for (const EncodeItem& item : items) {
    const auto fail = [&](const std::string& reason) { return refuse("tensor " + std::string(item.name) + ": " + reason); };
    // Same wording as the CPU twin.
    if (item.width != 1 && item.width != 2 && item.width != 4)
      return fail("element width " + std::to_string(item.width) + " is not 1, 2 or 4 bytes");
    if (item.numel == 0) continue;
    if (item.current == nullptr || item.shadow == nullptr) return fail("null device pointer");
    const auto misaligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % item.width != 0; };
    if (misaligned(item.current) || misaligned(item.shadow))
      return fail("data not aligned to its " + std::to_string(item.width) + "-byte elements");
  }
  return cudaSuccess;
}

}  // namespace

struct Encoder::State {
  int sm_count = 1;
  SelectStrategy select = SelectStrategy::kTwoPass;

  // Tables of the current tensor set, rebuilt only when the set changes.
  std::vector<ItemKey> cached_items;
  bool have_tables = false;
  uint64_t num_tensors = 0;
  uint64_t num_chunks = 0;
  uint64_t total_elements = 0;
  uint32_t max_width = 1;
  bool uniform_width = true;  // every non-empty tensor has max_width: the select writes packed values
  PinnedArray<uint8_t> table_upload;  // EncodeTensor[T] then uint64_t starts[T + 1]
  cudaEvent_t upload_done = nullptr;  // recorded after the copy out of table_upload
  DeviceArray<EncodeTensor> tensors;
  DeviceArray<uint64_t> starts;
  DeviceArray<uint32_t> chunk_tensor;
  DeviceArray<uint64_t> chunk_prefix;  // running count per chunk (+ the total, two-pass)
  // Two-pass select: the changed masks (1 bit per element), counts per chunk, scan storage.
  DeviceArray<uint32_t> masks;
  DeviceArray<uint64_t> chunk_counts;
  DeviceArray<uint8_t> scan_temp;
  size_t scan_temp_bytes = 0;
  // Single-pass select: the look-back state.
  DeviceArray<uint8_t> tile_storage;
  size_t tile_storage_bytes = 0;

  // Outputs, sized by the largest step so far.
  int64_t capacity = 0;  // changed elements the output buffers can hold
  DeviceArray<int64_t> indices;  // local index of each changed element, tensor by tensor
  DeviceArray<uint8_t> values;
  DeviceArray<uint8_t> base_values;
  // Single-pass select of a mixed-width set only: the values at a uniform stride, packed per
  // tensor afterwards.
  DeviceArray<uint8_t> strided_values;
  DeviceArray<uint8_t> strided_base_values;
  DeviceArray<uint64_t> offsets;
  DeviceArray<uint64_t> value_offsets;
  DeviceArray<EncodeCounts> counts;
  PinnedArray<EncodeCounts> counts_readback;
  PinnedArray<uint64_t> offsets_readback;  // offsets then value_offsets, T + 1 each
  TransferCounters transfer;               // the last encode and the stages after it

  // Result of the last encode.
  size_t result_tensors = 0;
  uint64_t result_changed = 0;
  uint64_t result_value_bytes = 0;

  // Recorded after stage()'s copies. The next encode or stage, on whatever stream, waits for it
  // before it overwrites or reallocates what those copies read and write (normally long done:
  // the caller synchronizes before reading staged()).
  cudaEvent_t stage_done = nullptr;
  // Pinned copies made by stage().
  PinnedArray<uint64_t> staged_offsets;
  PinnedArray<uint64_t> staged_value_offsets;
  PinnedArray<int64_t> staged_indices;
  PinnedArray<uint8_t> staged_values;
  PinnedArray<uint8_t> staged_base_values;
  size_t staged_tensors = 0;
  uint64_t staged_changed = 0;
  uint64_t staged_value_bytes = 0;
  bool staged_any = false;

  size_t peak_workspace = 0;

  size_t workspace() const {
    return tensors.bytes() + starts.bytes() + chunk_tensor.bytes() + chunk_prefix.bytes() + masks.bytes() +
           chunk_counts.bytes() + scan_temp.bytes() + tile_storage.bytes() +
           indices.bytes() + values.bytes() + base_values.bytes() + strided_values.bytes() +
           strided_base_values.bytes() + offsets.bytes() + value_offsets.bytes() + counts.bytes();
  }
  void note_workspace() { peak_workspace = std::max(peak_workspace, workspace()); }

  cudaError_t prepare_tables(std::span<const EncodeItem> items, cudaStream_t stream);
  cudaError_t ensure_capacity(int64_t wanted);
  cudaError_t run_pipeline(cudaStream_t stream);
  cudaError_t run_two_pass(cudaStream_t stream);
  cudaError_t run_single_pass(cudaStream_t stream);
};

cudaError_t Encoder::State::prepare_tables(std::span<const EncodeItem> items, cudaStream_t stream) {
  std::vector<ItemKey> keys;
  keys.reserve(items.size());
  for (const EncodeItem& item : items) keys.push_back({item.current, item.shadow, item.numel, item.width});
  if (have_tables && keys == cached_items) return cudaSuccess;
  have_tables = false;
  // The pinned upload buffer may only be rewritten once the previous copy out of it has run
  // (normally long ago: every successful encode ends with a synchronization).
  if (upload_done == nullptr)
    DELTASYNC_RETURN_IF_ERROR(cudaEventCreateWithFlags(&upload_done, cudaEventDisableTiming));
  DELTASYNC_RETURN_IF_ERROR(cudaEventSynchronize(upload_done));

  num_tensors = items.size();
  total_elements = 0;
  max_width = 1;
  uint32_t min_width = 4;
  const size_t tensor_bytes = num_tensors * sizeof(EncodeTensor);
  DELTASYNC_RETURN_IF_ERROR(table_upload.reserve(tensor_bytes + (num_tensors + 1) * sizeof(uint64_t)));
  auto* host_tensors = reinterpret_cast<EncodeTensor*>(table_upload.data());
  auto* host_starts = reinterpret_cast<uint64_t*>(table_upload.data() + tensor_bytes);
  uint64_t chunk_cursor = 0;
  for (uint64_t t = 0; t < num_tensors; ++t) {
    const EncodeItem& item = items[t];
    host_tensors[t] = EncodeTensor{static_cast<const uint8_t*>(item.current), static_cast<uint8_t*>(item.shadow),
                                   item.numel, chunk_cursor * kChunkElements, item.width};
    host_starts[t] = chunk_cursor * kChunkElements;
    chunk_cursor += (item.numel + kChunkElements - 1) / kChunkElements;
    total_elements += item.numel;
    if (item.numel > 0) {
      max_width = std::max(max_width, item.width);
      min_width = std::min(min_width, item.width);
    }
  }
  uniform_width = min_width >= max_width;
  host_starts[num_tensors] = chunk_cursor * kChunkElements;
  num_chunks = chunk_cursor;
  // The single-pass select's tiles are indexed by int (CUB's look-back, whose status
  // initialization also counts threads, rounded up to 256, in an int): about 2^43 elements.
  constexpr uint64_t kMaxChunks = (uint64_t{1} << 31) - 257;
  if (num_chunks > kMaxChunks) return refuse("encode: more than 2^43 elements in one tensor set");

  DELTASYNC_RETURN_IF_ERROR(tensors.reserve(std::max<uint64_t>(num_tensors, 1)));
  DELTASYNC_RETURN_IF_ERROR(starts.reserve(num_tensors + 1));
  DELTASYNC_RETURN_IF_ERROR(chunk_tensor.reserve(std::max<uint64_t>(num_chunks, 1)));
  if (tensor_bytes > 0)
    DELTASYNC_RETURN_IF_ERROR(
        cudaMemcpyAsync(tensors.data(), host_tensors, tensor_bytes, cudaMemcpyHostToDevice, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(starts.data(), host_starts, (num_tensors + 1) * sizeof(uint64_t),
                                            cudaMemcpyHostToDevice, stream));
  transfer.host_to_device_bytes += tensor_bytes + (num_tensors + 1) * sizeof(uint64_t);
  DELTASYNC_RETURN_IF_ERROR(cudaEventRecord(upload_done, stream));
  DELTASYNC_RETURN_IF_ERROR(
      detail::build_chunk_table(starts.data(), num_tensors, chunk_tensor.data(), num_chunks, sm_count, stream));

  // The select's workspace depends only on the number of chunks.
  DELTASYNC_RETURN_IF_ERROR(chunk_prefix.reserve(num_chunks + 1));
  if (num_chunks > 0) {
    if (select == SelectStrategy::kTwoPass) {
      DELTASYNC_RETURN_IF_ERROR(masks.reserve(num_chunks * detail::kChunkThreads));
      DELTASYNC_RETURN_IF_ERROR(chunk_counts.reserve(num_chunks + 1));
      DELTASYNC_RETURN_IF_ERROR(detail::two_pass_scan_bytes(num_chunks, scan_temp_bytes));
      DELTASYNC_RETURN_IF_ERROR(scan_temp.reserve(std::max<size_t>(scan_temp_bytes, 1)));
    } else {
      DELTASYNC_RETURN_IF_ERROR(detail::single_pass_tile_state_bytes(num_chunks, tile_storage_bytes));
      DELTASYNC_RETURN_IF_ERROR(tile_storage.reserve(std::max<size_t>(tile_storage_bytes, 1)));
    }
  }
  DELTASYNC_RETURN_IF_ERROR(offsets.reserve(num_tensors + 1));
  DELTASYNC_RETURN_IF_ERROR(value_offsets.reserve(num_tensors + 1));
  DELTASYNC_RETURN_IF_ERROR(offsets_readback.reserve(2 * (num_tensors + 1)));

  cached_items = std::move(keys);
  have_tables = true;
  return cudaSuccess;
}

cudaError_t Encoder::State::ensure_capacity(int64_t wanted) {
  // Never more than the set has elements: a step cannot change more than that.
  wanted = std::min<int64_t>(wanted, static_cast<int64_t>(total_elements));
  if (wanted > capacity) {
    // A failed reserve has already released the old block: the capacity must say so, or the
    // next encode would hand CUB a null output buffer with a nonzero capacity.
    capacity = 0;
    DELTASYNC_RETURN_IF_ERROR(indices.reserve(static_cast<size_t>(wanted)));
    capacity = wanted;
  }
  // The value buffers also depend on the widest tensor of the current set. (A failed reserve
  // leaves them empty, and the next call's reserve allocates them again.)
  const size_t value_bytes = std::max<size_t>(static_cast<size_t>(capacity) * max_width, 1);
  DELTASYNC_RETURN_IF_ERROR(values.reserve(value_bytes));
  DELTASYNC_RETURN_IF_ERROR(base_values.reserve(value_bytes));
  if (uniform_width || select == SelectStrategy::kTwoPass) return cudaSuccess;
  DELTASYNC_RETURN_IF_ERROR(strided_values.reserve(value_bytes));
  return strided_base_values.reserve(value_bytes);
}

cudaError_t Encoder::State::run_pipeline(cudaStream_t stream) {
  if (num_chunks == 0) {  // no elements: nothing changed
    DELTASYNC_RETURN_IF_ERROR(cudaMemsetAsync(counts.data(), 0, sizeof(EncodeCounts), stream));
    DELTASYNC_RETURN_IF_ERROR(detail::compute_offsets(chunk_prefix.data(), 0, starts.data(), tensors.data(),
                                                      num_tensors, counts.data(), capacity, offsets.data(),
                                                      value_offsets.data(), sm_count, stream));
  } else {
    DELTASYNC_RETURN_IF_ERROR(select == SelectStrategy::kTwoPass ? run_two_pass(stream) : run_single_pass(stream));
  }
  // The counts size the output; the offsets come along in the same wait so that callers
  // (the compact encoder) can plan on them without another one.
  const size_t table_bytes = (num_tensors + 1) * sizeof(uint64_t);
  DELTASYNC_RETURN_IF_ERROR(
      cudaMemcpyAsync(offsets_readback.data(), offsets.data(), table_bytes, cudaMemcpyDeviceToHost, stream));
  DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(offsets_readback.data() + num_tensors + 1, value_offsets.data(),
                                            table_bytes, cudaMemcpyDeviceToHost, stream));
  transfer.device_to_host_bytes += sizeof(EncodeCounts) + 2 * table_bytes;
  return cudaMemcpyAsync(counts_readback.data(), counts.data(), sizeof(EncodeCounts), cudaMemcpyDeviceToHost,
                         stream);
}

cudaError_t Encoder::State::run_two_pass(cudaStream_t stream) {
  const detail::TwoPassParams params{chunk_tensor.data(), tensors.data(),      num_chunks,         masks.data(),
                                     chunk_counts.data(), chunk_prefix.data(), offsets.data(),     value_offsets.data(),
                                     indices.data(),      values.data(),       base_values.data(), capacity,
                                     counts.data()};
  DELTASYNC_RETURN_IF_ERROR(detail::two_pass_count(params, scan_temp.data(), scan_temp_bytes, stream));
  DELTASYNC_RETURN_IF_ERROR(detail::compute_offsets(chunk_prefix.data(), num_chunks, starts.data(), tensors.data(),
                                                    num_tensors, counts.data(), capacity, offsets.data(),
                                                    value_offsets.data(), sm_count, stream));
  return detail::two_pass_write(params, stream);
}

cudaError_t Encoder::State::run_single_pass(cudaStream_t stream) {
  // A uniform-width set gets its values packed straight from the select; a mixed one gets them
  // at the widest stride in scratch, packed by the finish kernel.
  uint8_t* select_values = uniform_width ? values.data() : strided_values.data();
  uint8_t* select_base_values = uniform_width ? base_values.data() : strided_base_values.data();
  const detail::SinglePassParams select{chunk_tensor.data(), tensors.data(), {},       num_chunks,
                                        chunk_prefix.data(), indices.data(), select_values,
                                        select_base_values,  max_width,      capacity, counts.data()};
  DELTASYNC_RETURN_IF_ERROR(detail::single_pass_select(select, tile_storage.data(), tile_storage_bytes, stream));
  DELTASYNC_RETURN_IF_ERROR(detail::compute_offsets(chunk_prefix.data(), num_chunks, starts.data(), tensors.data(),
                                                    num_tensors, counts.data(), capacity, offsets.data(),
                                                    value_offsets.data(), sm_count, stream));
  const detail::FinishParams finish{tensors.data(),
                                    num_tensors,
                                    offsets.data(),
                                    value_offsets.data(),
                                    counts.data(),
                                    capacity,
                                    indices.data(),
                                    select_values,
                                    select_base_values,
                                    max_width,
                                    uniform_width ? nullptr : values.data(),
                                    uniform_width ? nullptr : base_values.data()};
  return detail::finish_single_pass(finish, sm_count, stream);
}

Encoder::Encoder() : Encoder(EncoderOptions{}) {}

Encoder::Encoder(EncoderOptions options) : state_(new State) {
  state_->select = options.select;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&state_->sm_count, cudaDevAttrMultiProcessorCount, device);
  cudaGetLastError();  // a failed query must not leave a sticky error for the caller
  if (state_->sm_count <= 0) state_->sm_count = 1;
}

Encoder::~Encoder() {
  if (state_->upload_done != nullptr) cudaEventDestroy(state_->upload_done);
  if (state_->stage_done != nullptr) cudaEventDestroy(state_->stage_done);
  delete state_;
}

cudaError_t Encoder::encode(std::span<const EncodeItem> items, cudaStream_t stream) {
  detail::scoped_range range{"encode"};
  DELTASYNC_RETURN_IF_ERROR(check_items(items));
  State& s = *state_;
  s.result_tensors = 0;
  s.result_changed = 0;
  s.result_value_bytes = 0;
  s.transfer = {};
  // A stage() queued on another stream may still be copying the previous results out.
  if (s.stage_done != nullptr) DELTASYNC_RETURN_IF_ERROR(cudaEventSynchronize(s.stage_done));
  DELTASYNC_RETURN_IF_ERROR(s.prepare_tables(items, stream));
  DELTASYNC_RETURN_IF_ERROR(s.counts.reserve(1));
  DELTASYNC_RETURN_IF_ERROR(s.counts_readback.reserve(1));
  DELTASYNC_RETURN_IF_ERROR(s.ensure_capacity(std::max(s.capacity, kInitialCapacity)));
  s.note_workspace();

  // Normally one pass and one synchronization. A step with more changed elements than ever
  // before overflows the select's output (writes dropped, count exact, shadow untouched: the kernels
  // that write it do nothing after an overflow): grow to
  // the exact count plus headroom and run again.
  for (;;) {
    DELTASYNC_RETURN_IF_ERROR(s.run_pipeline(stream));
    DELTASYNC_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    ++s.transfer.host_syncs;
    const int64_t selected = s.counts_readback.data()->num_selected;
    if (selected <= s.capacity) break;
    DELTASYNC_RETURN_IF_ERROR(s.ensure_capacity(selected + selected / 8));
    s.note_workspace();
  }
  s.result_tensors = s.num_tensors;
  s.result_changed = static_cast<uint64_t>(s.counts_readback.data()->num_selected);
  s.result_value_bytes = s.counts_readback.data()->value_bytes;
  return cudaSuccess;
}

uint64_t Encoder::total_changed() const { return state_->result_changed; }
size_t Encoder::num_tensors() const { return state_->result_tensors; }
const uint64_t* Encoder::device_offsets() const { return state_->offsets.data(); }
const uint64_t* Encoder::device_value_offsets() const { return state_->value_offsets.data(); }
const int64_t* Encoder::device_indices() const { return state_->indices.data(); }
const uint8_t* Encoder::device_values() const { return state_->values.data(); }
const uint8_t* Encoder::device_base_values() const { return state_->base_values.data(); }
const uint64_t* Encoder::host_offsets() const { return state_->offsets_readback.data(); }
const uint64_t* Encoder::host_value_offsets() const {
  return state_->offsets_readback.data() + state_->result_tensors + 1;
}
const TransferCounters& Encoder::transfer() const { return state_->transfer; }

cudaError_t Encoder::stage(cudaStream_t stream) {
  detail::scoped_range range{"stage"};
  State& s = *state_;
  if (s.stage_done == nullptr)
    DELTASYNC_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s.stage_done, cudaEventDisableTiming));
  // The pinned buffers below may be rewritten or reallocated only once an earlier stage() has
  // finished copying into them.
  DELTASYNC_RETURN_IF_ERROR(cudaEventSynchronize(s.stage_done));
  // A reserve below that fails has released its old buffer: until this stage completes,
  // staged() must not describe the previous one.
  s.staged_any = false;
  const size_t table_entries = s.result_tensors + 1;
  DELTASYNC_RETURN_IF_ERROR(s.staged_offsets.reserve(table_entries));
  DELTASYNC_RETURN_IF_ERROR(s.staged_value_offsets.reserve(table_entries));
  DELTASYNC_RETURN_IF_ERROR(s.staged_indices.reserve(s.result_changed));
  DELTASYNC_RETURN_IF_ERROR(s.staged_values.reserve(s.result_value_bytes));
  DELTASYNC_RETURN_IF_ERROR(s.staged_base_values.reserve(s.result_value_bytes));
  if (s.result_tensors == 0) {
    // No tensors (or no successful encode, whose device tables may never have been written):
    // the result is one zero offset each.
    s.staged_offsets.data()[0] = 0;
    s.staged_value_offsets.data()[0] = 0;
  } else {
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.staged_offsets.data(), s.offsets.data(),
                                              table_entries * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.staged_value_offsets.data(), s.value_offsets.data(),
                                              table_entries * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
    s.transfer.device_to_host_bytes += 2 * table_entries * sizeof(uint64_t);
  }
  if (s.result_changed > 0) {
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.staged_indices.data(), s.indices.data(),
                                              s.result_changed * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.staged_values.data(), s.values.data(), s.result_value_bytes,
                                              cudaMemcpyDeviceToHost, stream));
    DELTASYNC_RETURN_IF_ERROR(cudaMemcpyAsync(s.staged_base_values.data(), s.base_values.data(),
                                              s.result_value_bytes, cudaMemcpyDeviceToHost, stream));
    s.transfer.device_to_host_bytes += s.result_changed * sizeof(int64_t) + 2 * s.result_value_bytes;
  }
  DELTASYNC_RETURN_IF_ERROR(cudaEventRecord(s.stage_done, stream));
  s.staged_tensors = s.result_tensors;
  s.staged_changed = s.result_changed;
  s.staged_value_bytes = s.result_value_bytes;
  s.staged_any = true;
  return cudaSuccess;
}

DeltaView Encoder::staged() const {
  const State& s = *state_;
  if (!s.staged_any) return DeltaView{};
  return DeltaView{{s.staged_offsets.data(), s.staged_tensors + 1},
                   {s.staged_value_offsets.data(), s.staged_tensors + 1},
                   {s.staged_indices.data(), s.staged_changed},
                   {s.staged_values.data(), s.staged_value_bytes},
                   {s.staged_base_values.data(), s.staged_value_bytes}};
}

size_t Encoder::workspace_bytes() const { return state_->workspace(); }
size_t Encoder::peak_workspace_bytes() const { return state_->peak_workspace; }

}  // namespace deltasync::cuda
