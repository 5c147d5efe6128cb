// The CUDA sync engine: the SyncEngine interface over kernels/ (plain C++; the kernels' public
// API is all it calls, and their cudaError_t results become Error here, engine/cuda/cuda_calls.hpp).
// The verified apply is the one policy (integrity::apply_verified) on the device transaction. Every call queues its work on the stream set_stream() gave (the legacy
// default stream until then) and waits for the device only where a result must be read on the
// host; each wait and each host<->device byte is counted in the TransferCounters it reports.
//
// Host synchronizations, as counted (the kernels' own transfer() reports add up to these):
//   encode, full shadow, want_coded   3 = Encoder (1: the changed count sizes its output; the
//                                     per-tensor offsets come back in the same wait) +
//                                     CompactEncoder (2: block sizes size the download, then the
//                                     download). The digest shifts are queued before the compact
//                                     encode and arrive under its waits. 0 when nothing changed
//                                     but the Encoder's 1.
//   encode, full shadow, raw          2 = Encoder (1) + the wait for the staged copies (1)
//   encode, low-byte shadow           2 = LowByteEncoder (1) + the staged copies (1) (always raw:
//                                     the compact layout codes against base bits this shadow
//                                     does not keep)
//   apply, TRL layout                 1 (CudaPatchTransaction over cuda::SavingApplier: scatter +
//   and apply_patches                 shifts + status); a result mismatch adds 1 (the restore)
//   apply, compact layout             1: the decode is queued (DeviceCompactDecode::queue) and
//                                     judged right after the transaction's one wait, before the
//                                     patches are; a bad block's writes are then undone (+1, the
//                                     restore; +1 to fetch the bad block's details)
//   digests                           1;  read / write  1 per staging chunk (see kStagingBytes)
//   gather                            1 (positions up, bits down, one wait)
//   scatter                           1 (Applier: device validation + scatter, status read)
#include "engine/cuda/cuda_sync_engine.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "codec/compact_codec.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "deltasync/cuda/buffers.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "deltasync/cuda/gather.hpp"
#include "deltasync/cuda/low_byte.hpp"
#include "deltasync/cuda/saving_apply.hpp"
#include "engine/cpu_engine.hpp"
#include "engine/cuda/compact_decode.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "engine/cuda/cuda_patch_transaction.hpp"

namespace deltasync::engine {
namespace {

// Anchors stream through read()/write() in parts of up to this many bytes per pinned buffer;
// two buffers alternate so that one copy runs while the other is drained or filled.
constexpr uint64_t kStagingBytes = uint64_t{16} << 20;

// Makes `device` current for the duration of a call and restores the caller's device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cuda::check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda::check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = previous_ != device;
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// A dtype of the right width for the compact encoder, which reads only names and widths.
DType dtype_of_width(uint32_t width) {
  switch (width) {
    case 1: return DType::U8;
    case 2: return DType::U16;
    case 4: return DType::U32;
    default: throw Error("encode: " + std::to_string(width) + "-byte elements are not 1, 2 or 4 bytes");
  }
}

// The staged change set out of the encoders' pinned buffers into the caller's vectors.
void copy_staged(const DeltaView& v, SparseDelta& c) {
  c.offsets.assign(v.offsets.begin(), v.offsets.end());
  c.value_offsets.assign(v.value_offsets.begin(), v.value_offsets.end());
  c.indices.assign(v.indices.begin(), v.indices.end());
  c.values.assign(v.values.begin(), v.values.end());
  c.base_values.assign(v.base_values.begin(), v.base_values.end());
}

// Drains `stream` before an exception leaves a call, so that no queued copy still writes a
// staging buffer the next call reuses; the original error is what the caller sees.
template <typename Fn>
auto drained_on_error(cudaStream_t stream, Fn&& fn) {
  try {
    return fn();
  } catch (...) {
    cudaStreamSynchronize(stream);
    cudaGetLastError();
    throw;
  }
}

// Adds a call's counters to its report(s) when the call ends, by return or by exception.
class ReportOnExit {
 public:
  ReportOnExit(const TransferCounters& call, TransferCounters& a) : call_(call), a_(&a) {}
  ReportOnExit(const TransferCounters& call, TransferCounters& a, TransferCounters& b)
      : call_(call), a_(&a), b_(&b) {}
  ~ReportOnExit() {
    a_->add(call_);
    if (b_ != nullptr) b_->add(call_);
  }
  ReportOnExit(const ReportOnExit&) = delete;
  ReportOnExit& operator=(const ReportOnExit&) = delete;

 private:
  const TransferCounters& call_;
  TransferCounters* a_;
  TransferCounters* b_ = nullptr;
};

}  // namespace

struct CudaSyncEngine::State {
  EngineOptions options;
  cudaStream_t stream = nullptr;

  // The shadow: one device block, each tensor's part 256-byte aligned.
  bool has_shadow = false;
  void* shadow_block = nullptr;
  std::vector<uint8_t*> shadow;
  std::vector<uint64_t> numel;
  std::vector<uint32_t> width;

  // Kernel dispatchers, made on first use (a subscriber never builds the encoders).
  std::unique_ptr<cuda::Encoder> encoder;
  std::unique_ptr<cuda::LowByteEncoder> low_byte;
  std::unique_ptr<cuda::CompactEncoder> compact_encoder;
  std::unique_ptr<DeviceCompactDecode> compact_decoder;
  std::unique_ptr<cuda::Digester> digester;
  std::unique_ptr<cuda::SavingApplier> applier;
  std::unique_ptr<cuda::Applier> scatterer;  // unverified scatter of a mapped receiver
  std::unique_ptr<cuda::Gatherer> gatherer;

  cuda::PinnedArray<uint64_t> small_results;  // digests / digest shifts, one per tensor
  cuda::PinnedArray<uint8_t> staging[2];      // read() / write() parts
  cudaEvent_t staging_done[2] = {nullptr, nullptr};
  cuda::PinnedArray<uint8_t> patch_upload;    // a TRL delta's indices and values
  cuda::DeviceArray<uint8_t> patch_device;
  cuda::DeviceArray<uint8_t> gather_device;   // gathered bits, each tensor's part 16-byte aligned
  cuda::PinnedArray<uint8_t> gather_download;
  uint64_t shadow_total = 0;                  // bytes of shadow_block
  TransferCounters cumulative;                // every call since construction

  ~State() {
    for (cudaEvent_t e : staging_done)
      if (e != nullptr) cudaEventDestroy(e);
    if (shadow_block != nullptr) cudaFree(shadow_block);
  }

  template <typename T>
  T& get(std::unique_ptr<T>& p) {
    if (!p) p = std::make_unique<T>();
    return *p;
  }

  void sync(TransferCounters& transfer, const char* what) {
    cuda::check(cudaStreamSynchronize(stream), what);
    ++transfer.host_syncs;
  }

  uint64_t* results(size_t n) {
    cuda::check(small_results.reserve(std::max<size_t>(n, 1)), "cudaHostAlloc");
    return small_results.data();
  }

  std::vector<EncodeItem> encode_items(std::span<const ConstTensorRef> current) const {
    std::vector<EncodeItem> items(current.size());
    for (size_t t = 0; t < current.size(); ++t)
      items[t] = EncodeItem{current[t].name, current[t].data, shadow[t], current[t].numel, current[t].width};
    return items;
  }

  // The two staging buffers and their events, for parts of a copy of `n` bytes; returns the
  // part size.
  uint64_t prepare_staging(uint64_t n) {
    const uint64_t part = std::min<uint64_t>(kStagingBytes, std::max<uint64_t>(n, 1));
    for (int b = 0; b < 2; ++b) {
      cuda::check(staging[b].reserve(part), "cudaHostAlloc of the staging buffers");
      if (staging_done[b] == nullptr)
        cuda::check(cudaEventCreateWithFlags(&staging_done[b], cudaEventDisableTiming), "cudaEventCreate");
    }
    return part;
  }

  void encode_full(std::span<const ConstTensorRef> current, const EncodeRequest& request, StagedDelta& out);
  void encode_low_byte(std::span<const ConstTensorRef> current, StagedDelta& out);
  std::vector<PatchRef> upload_patches(std::span<const PatchRef> patches, TransferCounters& transfer);
};

CudaSyncEngine::CudaSyncEngine(const EngineOptions& options) : state_(new State) { state_->options = options; }
CudaSyncEngine::~CudaSyncEngine() { delete state_; }

void CudaSyncEngine::set_stream(void* stream) { state_->stream = static_cast<cudaStream_t>(stream); }
bool CudaSyncEngine::has_shadow() const { return state_->has_shadow; }
const TransferCounters& CudaSyncEngine::cumulative_transfer() const { return state_->cumulative; }
ShadowKind CudaSyncEngine::shadow_kind() const { return state_->options.shadow; }
uint64_t CudaSyncEngine::shadow_bytes() const { return state_->shadow_total; }
ConstTensorRef CudaSyncEngine::shadow_tensor(size_t t) const {
  const State& s = *state_;
  if (!s.has_shadow || s.options.shadow != ShadowKind::kFull || t >= s.shadow.size())
    throw Error("shadow_tensor: no full shadow of tensor " + std::to_string(t));
  return ConstTensorRef{"shadow", s.shadow[t], s.numel[t], s.width[t]};
}

// ---- publish side ----------------------------------------------------------------------------

void CudaSyncEngine::reset_shadow(std::span<const ConstTensorRef> current) {
  State& s = *state_;
  DeviceScope scope(s.options.cuda_device);
  const bool low_byte = s.options.shadow == ShadowKind::kLowByte;
  if (low_byte) check_low_byte_shadow(current);
  // The new shadow is allocated and filled before the old one is let go: a failure leaves the
  // engine as it was.
  std::vector<uint64_t> at(current.size());
  uint64_t total = 0;
  for (size_t t = 0; t < current.size(); ++t) {
    at[t] = total;
    const uint64_t bytes = low_byte ? current[t].numel : current[t].numel * current[t].width;
    total += (bytes + 255) / 256 * 256;
  }
  void* block = nullptr;
  if (total > 0) cuda::check(cudaMalloc(&block, total), "reset_shadow: cudaMalloc of the device shadow");
  std::vector<uint8_t*> shadow(current.size());
  for (size_t t = 0; t < current.size(); ++t) shadow[t] = static_cast<uint8_t*>(block) + at[t];
  try {
    if (low_byte) {
      std::vector<EncodeItem> items(current.size());
      for (size_t t = 0; t < current.size(); ++t)
        items[t] = EncodeItem{current[t].name, current[t].data, shadow[t], current[t].numel, current[t].width};
      cuda::check(s.get(s.low_byte).take_shadow(items, s.stream), "reset_shadow");
    } else {
      for (size_t t = 0; t < current.size(); ++t)
        if (current[t].numel > 0)
          cuda::check(cudaMemcpyAsync(shadow[t], current[t].data, current[t].numel * current[t].width,
                                      cudaMemcpyDeviceToDevice, s.stream),
                      "reset_shadow: copy");
    }
  } catch (...) {
    cudaStreamSynchronize(s.stream);
    cudaFree(block);
    throw;
  }
  // The old block may still be read by work queued earlier on the stream (a new chain starts
  // rarely, so one wait here costs nothing per version).
  if (s.shadow_block != nullptr) {
    cuda::check(cudaStreamSynchronize(s.stream), "reset_shadow");
    cudaFree(s.shadow_block);
  }
  s.shadow_block = block;
  s.shadow_total = total;
  s.shadow = std::move(shadow);
  s.numel.resize(current.size());
  s.width.resize(current.size());
  for (size_t t = 0; t < current.size(); ++t) {
    s.numel[t] = current[t].numel;
    s.width[t] = current[t].width;
  }
  s.has_shadow = true;
}

void CudaSyncEngine::encode(std::span<const ConstTensorRef> current, const EncodeRequest& request, StagedDelta& out) {
  State& s = *state_;
  if (!s.has_shadow) throw Error("encode: no shadow (reset_shadow first)");
  check_matches_shadow(current, s.numel, s.width);
  DeviceScope scope(s.options.cuda_device);
  out.clear();
  const ReportOnExit report(out.transfer, s.cumulative);
  drained_on_error(s.stream, [&] {
    if (s.options.shadow == ShadowKind::kLowByte) s.encode_low_byte(current, out);
    else s.encode_full(current, request, out);
  });
}

void CudaSyncEngine::State::encode_full(std::span<const ConstTensorRef> current, const EncodeRequest& request,
                                        StagedDelta& out) {
  cuda::Encoder& enc = get(encoder);
  const std::vector<EncodeItem> items = encode_items(current);
  cuda::check(enc.encode(items, stream), "encode");  // wait 1: the changed count
  const size_t T = current.size();
  const std::span<const uint64_t> offsets(enc.host_offsets(), T + 1);
  const std::span<const uint64_t> value_offsets(enc.host_value_offsets(), T + 1);
  out.counts.resize(T);
  for (size_t t = 0; t < T; ++t) out.counts[t] = offsets[t + 1] - offsets[t];
  out.has_base_values = true;

  if (!request.want_coded) {
    // The raw change set, as the CPU engine stages it.
    cuda::check(enc.stage(stream), "encode: stage");
    sync(out.transfer, "encode: stage");  // wait 2
    out.transfer.add(enc.transfer());       // the encode and the staged copies
    copy_staged(enc.staged(), out.changes);
    return;
  }

  // Coded on the device: only the coded bytes, the counts and the digest shifts come back.
  out.transfer.add(enc.transfer());
  out.coded_on_device = true;
  uint64_t* shifts = results(T);
  const uint64_t total = offsets[T];
  if (total == 0) {
    std::fill(shifts, shifts + T, uint64_t{0});
  } else {
    // digest(after) - digest(before) from the positions, the new bits (the live tensors) and the
    // base bits; queued now, it lands under the compact encoder's waits.
    std::vector<PatchRef> patches(T);
    std::vector<const void*> old_bits(T);
    for (size_t t = 0; t < T; ++t) {
      patches[t] = PatchRef{out.counts[t], enc.device_indices() + offsets[t], 8, enc.device_values() + value_offsets[t],
                            current[t].width};
      old_bits[t] = enc.device_base_values() + value_offsets[t];
    }
    cuda::Digester& dig = get(digester);
    cuda::check(dig.shifts(current, patches, old_bits, shifts, stream), "encode: digest shifts");
    out.transfer.add(dig.transfer());
  }
  std::vector<TensorMeta> metas(T);
  for (size_t t = 0; t < T; ++t)
    metas[t] = TensorMeta{std::string(current[t].name), dtype_of_width(current[t].width), {current[t].numel}};
  if (!request.tensors.empty()) {
    if (request.tensors.size() != T)
      throw Error("encode: " + std::to_string(request.tensors.size()) + " tensor descriptions for " + std::to_string(T) + " tensors",
                  ErrorKind::kInvalidArgument);
    for (size_t t = 0; t < T; ++t) {
      if (request.tensors[t].numel() != current[t].numel)
        throw Error("encode: tensor " + request.tensors[t].name + " is described with " + std::to_string(request.tensors[t].numel()) +
                    " elements, holds " + std::to_string(current[t].numel), ErrorKind::kInvalidArgument);
      metas[t].shape = request.tensors[t].shape;
    }
  }
  const cuda::DeviceDeltaView view{T, enc.device_offsets(), enc.device_value_offsets(), enc.device_indices(),
                                   enc.device_values(), enc.device_base_values()};
  cuda::CompactEncoder& coder = get(compact_encoder);
  out.coded = cuda::encode_compact(coder, metas, view, offsets, value_offsets, stream, request.compact);  // waits 2 and 3
  out.transfer.add(coder.transfer());
  out.digest_shifts.assign(shifts, shifts + T);
}

void CudaSyncEngine::State::encode_low_byte(std::span<const ConstTensorRef> current, StagedDelta& out) {
  cuda::LowByteEncoder& enc = get(low_byte);
  const std::vector<EncodeItem> items = encode_items(current);
  cuda::check(enc.encode(items, stream), "encode");  // wait 1: the changed count
  cuda::check(enc.stage(stream), "encode: stage");
  sync(out.transfer, "encode: stage");  // wait 2
  out.transfer.add(enc.transfer());
  const DeltaView v = enc.staged();
  copy_staged(v, out.changes);
  out.counts.resize(current.size());
  for (size_t t = 0; t < current.size(); ++t) out.counts[t] = v.count(t);
  out.has_base_values = false;
}

void CudaSyncEngine::read(const ConstTensorRef& source, uint64_t offset, std::span<uint8_t> out) {
  if (offset + out.size() > source.numel * source.width)
    throw Error("read: tensor " + std::string(source.name) + ": byte range past its end");
  State& s = *state_;
  DeviceScope scope(s.options.cuda_device);
  TransferCounters transfer;
  const ReportOnExit report(transfer, s.cumulative);
  const auto* src = static_cast<const uint8_t*>(source.data) + offset;
  const uint64_t n = out.size();
  const uint64_t part = s.prepare_staging(n);
  drained_on_error(s.stream, [&] {
    // Part k goes to buffer k % 2; part k + 1 is queued before part k is drained on the host.
    auto queue = [&](uint64_t k) {
      const uint64_t at = k * part, len = std::min(part, n - at);
      cuda::check(cudaMemcpyAsync(s.staging[k % 2].data(), src + at, len, cudaMemcpyDeviceToHost, s.stream), "read");
      cuda::check(cudaEventRecord(s.staging_done[k % 2], s.stream), "read");
    };
    const uint64_t parts = (n + part - 1) / part;
    if (parts > 0) queue(0);
    for (uint64_t k = 0; k < parts; ++k) {
      if (k + 1 < parts) queue(k + 1);
      cuda::check(cudaEventSynchronize(s.staging_done[k % 2]), "read");
      const uint64_t at = k * part, len = std::min(part, n - at);
      std::memcpy(out.data() + at, s.staging[k % 2].data(), len);
      transfer.device_to_host_bytes += len;
      ++transfer.host_syncs;
    }
  });
}

// ---- both sides ------------------------------------------------------------------------------

std::vector<uint64_t> CudaSyncEngine::digests(std::span<const ConstTensorRef> tensors) {
  for (const ConstTensorRef& t : tensors) check_digest_width(t.width, t.name);
  State& s = *state_;
  DeviceScope scope(s.options.cuda_device);
  uint64_t* out = s.results(tensors.size());
  TransferCounters transfer;
  const ReportOnExit report(transfer, s.cumulative);
  drained_on_error(s.stream, [&] {
    cuda::Digester& digester = s.get(s.digester);
    cuda::check(digester.digest(tensors, out, s.stream), "digest");
    transfer.add(digester.transfer());
    s.sync(transfer, "digest");
  });
  return std::vector<uint64_t>(out, out + tensors.size());
}

// ---- subscribe side --------------------------------------------------------------------------

void CudaSyncEngine::write(const TensorRef& target, uint64_t offset, std::span<const uint8_t> bytes) {
  if (offset + bytes.size() > target.numel * target.width)
    throw Error("write: tensor " + std::string(target.name) + ": byte range past its end");
  State& s = *state_;
  DeviceScope scope(s.options.cuda_device);
  auto* dst = static_cast<uint8_t*>(target.data) + offset;
  TransferCounters transfer;
  const ReportOnExit report(transfer, s.cumulative);
  const uint64_t n = bytes.size();
  const uint64_t part = s.prepare_staging(n);
  drained_on_error(s.stream, [&] {
    // Buffer k % 2 is refilled only once its previous upload (part k - 2) has left it.
    const uint64_t parts = (n + part - 1) / part;
    for (uint64_t k = 0; k < parts; ++k) {
      const uint64_t at = k * part, len = std::min(part, n - at);
      cuda::check(cudaEventSynchronize(s.staging_done[k % 2]), "write");
      if (k >= 2) ++transfer.host_syncs;
      std::memcpy(s.staging[k % 2].data(), bytes.data() + at, len);
      cuda::check(cudaMemcpyAsync(dst + at, s.staging[k % 2].data(), len, cudaMemcpyHostToDevice, s.stream), "write");
      cuda::check(cudaEventRecord(s.staging_done[k % 2], s.stream), "write");
      transfer.host_to_device_bytes += len;
    }
    s.sync(transfer, "write");
  });
}

// A TRL delta's patches point into the file (host memory): all indices and values go up in one
// pinned copy, each array 16-byte aligned.
std::vector<PatchRef> CudaSyncEngine::State::upload_patches(std::span<const PatchRef> patches,
                                                           TransferCounters& transfer) {
  auto aligned = [](uint64_t bytes) { return (bytes + 15) / 16 * 16; };
  uint64_t total = 0;
  for (const PatchRef& p : patches) total += aligned(p.count * p.index_width) + aligned(p.count * p.value_width);
  cuda::check(patch_upload.reserve(std::max<uint64_t>(total, 1)), "apply: cudaHostAlloc");
  cuda::check(patch_device.reserve(std::max<uint64_t>(total, 1)), "apply: cudaMalloc");
  std::vector<PatchRef> device(patches.begin(), patches.end());
  uint64_t at = 0;
  for (size_t t = 0; t < patches.size(); ++t) {
    const PatchRef& p = patches[t];
    const uint64_t index_bytes = p.count * p.index_width, value_bytes = p.count * p.value_width;
    if (index_bytes) std::memcpy(patch_upload.data() + at, p.indices, index_bytes);
    device[t].indices = patch_device.data() + at;
    at += aligned(index_bytes);
    if (value_bytes) std::memcpy(patch_upload.data() + at, p.values, value_bytes);
    device[t].values = patch_device.data() + at;
    at += aligned(value_bytes);
  }
  if (total > 0)
    cuda::check(cudaMemcpyAsync(patch_device.data(), patch_upload.data(), total, cudaMemcpyHostToDevice, stream),
                "apply: upload");
  transfer.host_to_device_bytes += total;
  return device;
}

// Positions are checked on the host first (they are host memory already), with the CPU twin's
// message; the device then reads every position in one launch.
void CudaSyncEngine::gather(std::span<const ConstTensorRef> sources, std::span<const PatchRef> positions,
                            std::span<uint8_t> out, TransferCounters& reported) {
  // The CPU twin's checks and messages first (widths, output size), then every position.
  const std::vector<uint64_t> host_at = cpu::gather_layout(sources, positions, out.size());
  State& s = *state_;
  TransferCounters transfer;
  const ReportOnExit report(transfer, reported, s.cumulative);
  const size_t T = sources.size();
  std::vector<uint64_t> device_at(T);
  uint64_t device_total = 0;
  const uint64_t host_total = host_at[T];
  std::vector<PatchRef> indices_only(positions.begin(), positions.end());
  for (size_t t = 0; t < T; ++t) {
    const PatchRef& p = positions[t];
    const uint32_t w = sources[t].width;
    for (uint64_t k = 0; k < p.count; ++k) {
      const int64_t i = p.index_width == 4 ? static_cast<const int32_t*>(p.indices)[k] : static_cast<const int64_t*>(p.indices)[k];
      if (i < 0 || static_cast<uint64_t>(i) >= sources[t].numel)
        throw Error("gather: tensor " + std::string(sources[t].name) + ": position " + std::to_string(i) + " out of range");
    }
    indices_only[t].values = nullptr;
    indices_only[t].value_width = 0;
    device_at[t] = device_total;
    device_total += (p.count * w + 15) / 16 * 16;
  }
  if (host_total == 0) return;
  DeviceScope scope(s.options.cuda_device);
  drained_on_error(s.stream, [&] {
    const std::vector<PatchRef> device_positions = s.upload_patches(indices_only, transfer);
    cuda::check(s.gather_device.reserve(device_total), "gather: cudaMalloc");
    cuda::check(s.gather_download.reserve(device_total), "gather: cudaHostAlloc");
    std::vector<uint8_t*> parts(T);
    for (size_t t = 0; t < T; ++t) parts[t] = s.gather_device.data() + device_at[t];
    cuda::check(s.get(s.gatherer).gather(sources, device_positions, parts, s.stream), "gather");
    cuda::check(cudaMemcpyAsync(s.gather_download.data(), s.gather_device.data(), device_total, cudaMemcpyDeviceToHost,
                                s.stream),
                "gather: download");
    transfer.device_to_host_bytes += device_total;
    s.sync(transfer, "gather");
    for (size_t t = 0; t < T; ++t)
      std::memcpy(out.data() + host_at[t], s.gather_download.data() + device_at[t], positions[t].count * sources[t].width);
  });
}

// Validation runs on the device (the Applier's), so a bad patch writes nothing and reports the
// CPU twin's message.
void CudaSyncEngine::scatter(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                             TransferCounters& reported) {
  State& s = *state_;
  TransferCounters transfer;
  const ReportOnExit report(transfer, reported, s.cumulative);
  DeviceScope scope(s.options.cuda_device);
  drained_on_error(s.stream, [&] {
    const std::vector<PatchRef> device_patches = s.upload_patches(patches, transfer);
    cuda::apply_checked(s.get(s.scatterer), targets, device_patches, s.stream, &transfer);  // one wait
  });
}

integrity::ApplyReport CudaSyncEngine::apply(const DeltaToApply& delta, std::span<const TensorMeta> meta,
                                             std::span<const TensorRef> targets, std::span<uint64_t> digests,
                                             std::optional<uint64_t> current_version, TransferCounters& reported) {
  State& s = *state_;
  TransferCounters transfer;  // this call's, added to `reported` however it ends
  const ReportOnExit report(transfer, reported, s.cumulative);
  DeviceScope scope(s.options.cuda_device);
  const st::File& file = *delta.file;
  std::vector<ConstTensorRef> base(targets.size());
  for (size_t t = 0; t < targets.size(); ++t)
    base[t] = ConstTensorRef{targets[t].name, targets[t].data, targets[t].numel, targets[t].width};

  return drained_on_error(s.stream, [&] {
    // Resolve on the host what needs no tensor data; the promises are checked before any upload.
    std::vector<PatchRef> patches;
    integrity::DeltaDigests expected;
    const auto run = [&](const std::function<void()>& check_inputs) {
      CudaPatchTransaction transaction(s.get(s.applier), s.stream, check_inputs);
      const ReportOnExit transaction_report(transaction.transfer(), transfer);
      return integrity::apply_verified(targets, patches, expected, digests, current_version, transaction);
    };
    if (!compact::is_compact_delta(file)) {
      ResolvedDelta resolved;
      resolve_trl_delta(file, meta, resolved);
      expected = delta_promises(delta, resolved.info);
      patches = s.upload_patches(resolved.patches, transfer);
      return run({});
    }
    compact::CompactFile contents = compact::read_compact_file(file, meta);
    expected = delta_promises(delta, contents.info);
    // Decoded against the targets' current bits (never written by the decoder) and applied
    // under one wait: the decode's verdict is read right after it, before the patches are
    // judged, and a bad block's scattered writes are undone -- the CPU's message, nothing changed.
    DeviceCompactDecode& decoder = s.get(s.compact_decoder);
    const ReportOnExit decode_report(decoder.transfer(), transfer);
    const cuda::DeviceDecodedDelta& decoded = decoder.queue(contents.tensors, meta, base, file.label(), s.stream);
    const uint64_t decoded_total = decoded.offsets.back();
    patches = decoded.patches(meta);
    bool judged = false;
    const auto judge_decode = [&] {
      judged = true;
      decoder.finish(s.stream);
      compact::check_total_changed(file, decoded_total);
    };
    try {
      return run(judge_decode);
    } catch (...) {
      // Refused before the wait (e.g. a wrong base, found on the host): the CPU engine decodes
      // first, so a bad block, if there is one, is what it reports.
      if (!judged) {
        cuda::check(cudaStreamSynchronize(s.stream), "apply: synchronize");
        ++transfer.host_syncs;
        judge_decode();
      }
      throw;
    }
  });
}

integrity::ApplyReport CudaSyncEngine::apply_patches(std::span<const TensorRef> targets,
                                                     std::span<const PatchRef> patches,
                                                     const integrity::DeltaDigests& expected,
                                                     std::span<uint64_t> digests,
                                                     std::optional<uint64_t> current_version,
                                                     TransferCounters& reported) {
  State& s = *state_;
  TransferCounters transfer;
  const ReportOnExit report(transfer, reported, s.cumulative);
  DeviceScope scope(s.options.cuda_device);
  return drained_on_error(s.stream, [&] {
    // The promises first: nothing goes up for a delta made for another base.
    integrity::check_before_apply(targets, patches, expected, digests, current_version);
    const std::vector<PatchRef> device_patches = s.upload_patches(patches, transfer);
    CudaPatchTransaction transaction(s.get(s.applier), s.stream);
    const ReportOnExit transaction_report(transaction.transfer(), transfer);
    return integrity::apply_verified(targets, device_patches, expected, digests, current_version, transaction);
  });
}

namespace {

class DeviceMemoryBlock final : public EngineMemory {
 public:
  DeviceMemoryBlock(uint64_t bytes, int device) : device_(device) {
    if (bytes > 0) cuda::check(cudaMalloc(&data_, bytes), "allocate: cudaMalloc");
  }
  // Work queued on the block (a copy into the shadow, say) may still be running: the device is
  // drained before the block is let go, since CUDA does not document cudaFree as waiting.
  ~DeviceMemoryBlock() override {
    if (data_ == nullptr) return;
    int previous = 0;  // no DeviceScope: a destructor must not throw
    const bool switched =
        cudaGetDevice(&previous) == cudaSuccess && previous != device_ && cudaSetDevice(device_) == cudaSuccess;
    cudaDeviceSynchronize();
    cudaFree(data_);
    if (switched) cudaSetDevice(previous);
  }
  DeviceMemoryBlock(const DeviceMemoryBlock&) = delete;
  DeviceMemoryBlock& operator=(const DeviceMemoryBlock&) = delete;
  void* data() const override { return data_; }

 private:
  void* data_ = nullptr;
  int device_ = 0;
};

}  // namespace

// For callers with tensors in files (the CLI): one block per set of tensors, not per step.
std::unique_ptr<EngineMemory> CudaSyncEngine::allocate(uint64_t bytes) {
  DeviceScope scope(state_->options.cuda_device);
  return std::make_unique<DeviceMemoryBlock>(bytes, state_->options.cuda_device);
}

}  // namespace deltasync::engine
