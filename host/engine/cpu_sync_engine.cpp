#include "engine/cpu_sync_engine.hpp"

#include <cstring>

#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "engine/cpu_engine.hpp"

namespace deltasync::engine {

CpuSyncEngine::CpuSyncEngine(const EngineOptions& options) : kind_(options.shadow) {}

namespace {

class HostMemory final : public EngineMemory {
 public:
  explicit HostMemory(uint64_t bytes) : buffer_(bytes) {}
  void* data() const override { return const_cast<uint8_t*>(buffer_.data()); }

 private:
  HugeBuffer buffer_;
};

}  // namespace

std::unique_ptr<EngineMemory> CpuSyncEngine::allocate(uint64_t bytes) { return std::make_unique<HostMemory>(bytes); }

void CpuSyncEngine::reset_shadow(std::span<const ConstTensorRef> current) {
  if (kind_ == ShadowKind::kLowByte) check_low_byte_shadow(current);
  std::vector<HugeBuffer> shadow;
  shadow.reserve(current.size());
  numel_.clear();
  width_.clear();
  for (const auto& t : current) {
    const uint64_t bytes = kind_ == ShadowKind::kLowByte ? t.numel : t.numel * t.width;
    shadow.emplace_back(bytes);
    numel_.push_back(t.numel);
    width_.push_back(t.width);
  }
  parallel_for(current.size(), [&](size_t t) {
    const auto* src = static_cast<const uint8_t*>(current[t].data);
    uint8_t* dst = shadow[t].data();
    if (kind_ == ShadowKind::kFull) {
      std::memcpy(dst, src, shadow[t].size());
    } else {
      for (uint64_t i = 0; i < current[t].numel; ++i) dst[i] = src[2 * i];  // little-endian: byte 0 is the low byte
    }
  });
  shadow_ = std::move(shadow);
  has_shadow_ = true;
}

uint64_t CpuSyncEngine::shadow_bytes() const {
  uint64_t n = 0;
  for (const auto& b : shadow_) n += b.size();
  return n;
}

ConstTensorRef CpuSyncEngine::shadow_tensor(size_t t) const {
  if (!has_shadow_ || kind_ != ShadowKind::kFull || t >= shadow_.size()) throw Error("shadow_tensor: no full shadow of tensor " + std::to_string(t));
  return ConstTensorRef{"shadow", shadow_[t].data(), numel_[t], width_[t]};
}

void CpuSyncEngine::encode(std::span<const ConstTensorRef> current, const EncodeRequest&, StagedDelta& out) {
  if (!has_shadow_) throw Error("encode: no shadow (reset_shadow first)");
  check_matches_shadow(current, numel_, width_);
  out.clear();
  if (kind_ == ShadowKind::kLowByte) return encode_low_byte(current, out);
  std::vector<EncodeItem> items(current.size());
  for (size_t t = 0; t < current.size(); ++t)
    items[t] = EncodeItem{current[t].name, current[t].data, shadow_[t].data(), current[t].numel, current[t].width};
  cpu::encode(items, out.changes);
  out.has_base_values = true;
  out.counts.resize(current.size());
  for (size_t t = 0; t < current.size(); ++t) out.counts[t] = out.changes.offsets[t + 1] - out.changes.offsets[t];
}

// Compares the low byte of each 2-byte element with the shadow's; ships the whole element.
void CpuSyncEngine::encode_low_byte(std::span<const ConstTensorRef> current, StagedDelta& out) {
  const size_t T = current.size();
  std::vector<SparseDelta> per_tensor(T);
  parallel_for(T, [&](size_t t) {
    const auto* bits = static_cast<const uint16_t*>(current[t].data);
    uint8_t* low = shadow_[t].data();
    SparseDelta& d = per_tensor[t];
    for (uint64_t i = 0; i < current[t].numel; ++i) {
      const uint16_t v = bits[i];
      if (static_cast<uint8_t>(v) != low[i]) {
        low[i] = static_cast<uint8_t>(v);
        d.indices.push_back(static_cast<int64_t>(i));
        d.values.push_back(static_cast<uint8_t>(v));
        d.values.push_back(static_cast<uint8_t>(v >> 8));
      }
    }
  });
  SparseDelta& c = out.changes;
  c.offsets.assign(1, 0);
  c.value_offsets.assign(1, 0);
  out.counts.resize(T);
  for (size_t t = 0; t < T; ++t) {
    c.indices.insert(c.indices.end(), per_tensor[t].indices.begin(), per_tensor[t].indices.end());
    c.values.insert(c.values.end(), per_tensor[t].values.begin(), per_tensor[t].values.end());
    c.offsets.push_back(c.indices.size());
    c.value_offsets.push_back(c.values.size());
    out.counts[t] = per_tensor[t].indices.size();
  }
  out.has_base_values = false;
}

void CpuSyncEngine::read(const ConstTensorRef& source, uint64_t offset, std::span<uint8_t> out) {
  if (offset + out.size() > source.numel * source.width)
    throw Error("read: tensor " + std::string(source.name) + ": byte range past its end");
  std::memcpy(out.data(), static_cast<const uint8_t*>(source.data) + offset, out.size());
}

std::vector<uint64_t> CpuSyncEngine::digests(std::span<const ConstTensorRef> tensors) { return digest_tensors(tensors); }

void CpuSyncEngine::write(const TensorRef& target, uint64_t offset, std::span<const uint8_t> bytes) {
  if (offset + bytes.size() > target.numel * target.width)
    throw Error("write: tensor " + std::string(target.name) + ": byte range past its end");
  std::memcpy(static_cast<uint8_t*>(target.data) + offset, bytes.data(), bytes.size());
}

void CpuSyncEngine::gather(std::span<const ConstTensorRef> sources, std::span<const PatchRef> positions,
                           std::span<uint8_t> out, TransferCounters&) {
  cpu::gather(sources, positions, out);
}

void CpuSyncEngine::scatter(std::span<const TensorRef> targets, std::span<const PatchRef> patches, TransferCounters&) {
  cpu::apply(targets, patches);
}

integrity::ApplyReport CpuSyncEngine::apply(const DeltaToApply& delta, std::span<const TensorMeta> meta,
                                            std::span<const TensorRef> targets, std::span<uint64_t> digests,
                                            std::optional<uint64_t> current_version, TransferCounters&) {
  std::vector<ConstTensorRef> base(targets.size());
  for (size_t t = 0; t < targets.size(); ++t) base[t] = ConstTensorRef{targets[t].name, targets[t].data, targets[t].numel, targets[t].width};
  ResolvedDelta resolved;
  resolve_delta(*delta.file, meta, base, resolved);
  const integrity::DeltaDigests expected = delta_promises(delta, resolved.info);
  return integrity::apply_verified(targets, resolved.patches, expected, digests, current_version);
}

integrity::ApplyReport CpuSyncEngine::apply_patches(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                                    const integrity::DeltaDigests& expected, std::span<uint64_t> digests,
                                                    std::optional<uint64_t> current_version, TransferCounters&) {
  return integrity::apply_verified(targets, patches, expected, digests, current_version);
}

}  // namespace deltasync::engine
