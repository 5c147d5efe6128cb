// The CUDA sync engine: device tensors, work queued on one stream, adapting kernels/ (Encoder,
// CompactEncoder/Decoder, Digester, SavingApplier, Applier, Gatherer) to the SyncEngine interface.
#pragma once
#include "engine/engine.hpp"

namespace deltasync::engine {

// One engine serves one thread at a time (the publisher's or the subscriber's calling thread):
// its staging buffers and kernel workspaces are reused across calls without locks.
class CudaSyncEngine final : public SyncEngine {
 public:
  explicit CudaSyncEngine(const EngineOptions& options = {});
  ~CudaSyncEngine() override;

  Device device() const override { return Device::kCuda; }
  void set_stream(void* stream) override;
  std::unique_ptr<EngineMemory> allocate(uint64_t bytes) override;

  // Host<->device bytes and host waits of every call since construction, read(), write() and
  // digests() included (the interface reports only encode's and apply's).
  const TransferCounters& cumulative_transfer() const;

  void reset_shadow(std::span<const ConstTensorRef> current) override;
  bool has_shadow() const override;
  ShadowKind shadow_kind() const override;
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
  struct State;
  State* state_;
};

}  // namespace deltasync::engine
