// The CPU twin of the sync engine: host tensors, the multithreaded CPU kernels (cpu_engine.hpp),
// the CPU codec and digests. Its results are the reference the CUDA engine is tested against.
#pragma once
#include <vector>

#include "core/huge_buffer.hpp"
#include "engine/engine.hpp"

namespace deltasync::engine {

class CpuSyncEngine final : public SyncEngine {
 public:
  explicit CpuSyncEngine(const EngineOptions& options = {});

  Device device() const override { return Device::kCpu; }
  void set_stream(void*) override {}
  std::unique_ptr<EngineMemory> allocate(uint64_t bytes) override;

  void reset_shadow(std::span<const ConstTensorRef> current) override;
  bool has_shadow() const override { return has_shadow_; }
  ShadowKind shadow_kind() const override { return kind_; }
  uint64_t shadow_bytes() const override;
  ConstTensorRef shadow_tensor(size_t t) const override;
  void encode(std::span<const ConstTensorRef> current, const EncodeRequest& request, StagedDelta& out) override;
  void read(const ConstTensorRef& source, uint64_t offset, std::span<uint8_t> out) override;

  std::vector<uint64_t> digests(std::span<const ConstTensorRef> tensors) override;

  void write(const TensorRef& target, uint64_t offset, std::span<const uint8_t> bytes) override;
  void gather(std::span<const ConstTensorRef> sources, std::span<const PatchRef> positions, std::span<uint8_t> out,
              TransferCounters& transfer) override;
  void scatter(std::span<const TensorRef> targets, std::span<const PatchRef> patches, TransferCounters& transfer) override;
  integrity::ApplyReport apply(const DeltaToApply& delta, std::span<const TensorMeta> meta,
                               std::span<const TensorRef> targets, std::span<uint64_t> digests,
                               std::optional<uint64_t> current_version, TransferCounters& transfer) override;
  integrity::ApplyReport apply_patches(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                       const integrity::DeltaDigests& expected, std::span<uint64_t> digests,
                                       std::optional<uint64_t> current_version, TransferCounters& transfer) override;

 private:
  void encode_low_byte(std::span<const ConstTensorRef> current, StagedDelta& out);

  ShadowKind kind_;
  bool has_shadow_ = false;
  std::vector<HugeBuffer> shadow_;  // per tensor: full bits, or the low bytes (kLowByte)
  std::vector<uint64_t> numel_;
  std::vector<uint32_t> width_;
};

}  // namespace deltasync::engine
