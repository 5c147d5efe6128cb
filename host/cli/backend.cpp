#include "backend.hpp"

#include <algorithm>

#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/select.hpp"

namespace deltasync::cli {

Backend choose_backend(const ParsedArgs& args) {
  if (args.has("--cpu") && args.has("--gpu")) throw Error("--cpu and --gpu are exclusive");
  if (args.has("--cpu")) return Backend::Cpu;
  // What this build and machine offer is engine/select's to say (one place for the whole tree).
  if (engine::cuda_available()) return Backend::Cuda;
#ifdef DELTASYNC_WITH_CUDA
  if (args.has("--gpu")) throw Error("--gpu: no CUDA device is available");
#else
  if (args.has("--gpu")) throw Error("--gpu: this build of deltasync has no CUDA backend");
#endif
  return Backend::Cpu;
}

const char* backend_name(Backend b) { return b == Backend::Cuda ? "cuda" : "cpu"; }

std::unique_ptr<engine::SyncEngine> make_engine(Backend backend) {
  return engine::make_engine(backend == Backend::Cuda ? engine::Device::kCuda : engine::Device::kCpu);
}

namespace {

uint64_t padded(uint64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

PlacedTensors::PlacedTensors(engine::SyncEngine& engine, std::span<const ConstTensorRef> host) : engine_(engine) {
  place(host);
}

PlacedTensors::PlacedTensors(engine::SyncEngine& engine, std::span<const TensorRef> host)
    : engine_(engine), writable_(true) {
  std::vector<ConstTensorRef> views;
  for (const TensorRef& t : host) views.push_back({t.name, t.data, t.numel, t.width});
  place(views);
}

void PlacedTensors::place(std::span<const ConstTensorRef> host) {
  for (const ConstTensorRef& t : host) host_.push_back({t.name, const_cast<void*>(t.data), t.numel, t.width});
  if (engine_.device() == engine::Device::kCpu) {
    placed_ = host_;
    return;
  }
  uint64_t total = 0;
  for (const TensorRef& t : host_) total += padded(t.numel * t.width);
  memory_ = engine_.allocate(total);
  uint64_t at = 0;
  for (const TensorRef& t : host_) {
    placed_.push_back({t.name, static_cast<uint8_t*>(memory_->data()) + at, t.numel, t.width});
    at += padded(t.numel * t.width);
  }
  for (size_t t = 0; t < host_.size(); ++t) upload(t, host_[t].data);
}

std::vector<ConstTensorRef> PlacedTensors::views() const {
  std::vector<ConstTensorRef> out;
  for (const TensorRef& t : placed_) out.push_back({t.name, t.data, t.numel, t.width});
  return out;
}

std::vector<TensorRef> PlacedTensors::refs() const {
  if (!writable_) throw Error("internal: writable tensors asked of read-only ones");
  return placed_;
}

void PlacedTensors::upload(size_t t, const void* bytes) {
  const TensorRef& where = placed_[t];
  if (where.data == bytes) return;  // the CPU engine works on the host memory itself
  engine_.write(where, 0, {static_cast<const uint8_t*>(bytes), where.numel * where.width});
}

void PlacedTensors::download() {
  if (!writable_) return;
  for (size_t t = 0; t < placed_.size(); ++t) {
    if (placed_[t].data == host_[t].data) continue;
    const ConstTensorRef source{placed_[t].name, placed_[t].data, placed_[t].numel, placed_[t].width};
    engine_.read(source, 0, {static_cast<uint8_t*>(host_[t].data), host_[t].numel * host_[t].width});
  }
}

std::vector<uint64_t> engine_digests(engine::SyncEngine& engine, std::span<const ConstTensorRef> tensors) {
  for (const ConstTensorRef& t : tensors) check_digest_width(t.width, t.name);  // before any copy
  if (engine.device() == engine::Device::kCpu) return engine.digests(tensors);
  // Device memory used per batch: big enough to keep the copy engine busy, small enough to fit
  // next to a running inference server.
  constexpr uint64_t kBatchBytes = uint64_t{1} << 30;
  std::vector<uint64_t> out;
  out.reserve(tensors.size());
  for (size_t first = 0; first < tensors.size();) {
    size_t last = first;
    uint64_t used = 0;
    while (last < tensors.size() &&
           (last == first || used + padded(tensors[last].numel * tensors[last].width) <= kBatchBytes))
      used += padded(tensors[last].numel * tensors[last].width), ++last;
    const PlacedTensors batch(engine, tensors.subspan(first, last - first));
    const std::vector<uint64_t> digests = engine.digests(batch.views());
    out.insert(out.end(), digests.begin(), digests.end());
    first = last;
  }
  return out;
}

}  // namespace deltasync::cli
