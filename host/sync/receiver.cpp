#include "sync/receiver.hpp"

#include <cstring>

#include "codec/compact_two_phase.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "core/huge_buffer.hpp"
#include "core/parallel.hpp"

namespace deltasync {
namespace {

std::string describe(const TensorMeta& m) { return std::string(dtype_name(m.dtype)) + st::shape_text(m.shape); }

// An anchor must hold exactly the receiver's tensors: an anchor that left out unchanged tensors
// (or describes another model) is refused before anything is written.
void check_same_model(std::span<const TensorMeta> mine, std::span<const TensorMeta> anchor, uint64_t version) {
  const std::string label = "anchor of version " + std::to_string(version);
  if (anchor.size() != mine.size())
    throw BadInputError(label + ": holds " + std::to_string(anchor.size()) + " tensors, the model has " + std::to_string(mine.size()));
  for (size_t t = 0; t < mine.size(); ++t) {
    if (anchor[t].name != mine[t].name) throw BadInputError(label + ": tensor " + anchor[t].name + " where the model has " + mine[t].name);
    if (anchor[t].dtype != mine[t].dtype || anchor[t].shape != mine[t].shape)
      throw BadInputError(label + ": tensor " + mine[t].name + " is " + describe(anchor[t]) + ", the model's is " + describe(mine[t]));
  }
}

}  // namespace

TensorReceiver::TensorReceiver(std::vector<TensorMeta> meta, std::vector<TensorRef> targets, engine::SyncEngine& engine)
    : meta_(std::move(meta)), targets_(std::move(targets)), engine_(engine) {
  if (meta_.size() != targets_.size()) throw Error("receiver: " + std::to_string(meta_.size()) + " tensors described, " + std::to_string(targets_.size()) + " given");
  for (size_t t = 0; t < meta_.size(); ++t)
    if (targets_[t].numel != meta_[t].numel() || targets_[t].width != meta_[t].width())
      throw Error("receiver: tensor " + meta_[t].name + " does not match its description " + describe(meta_[t]));
}

void TensorReceiver::recompute_digests() {
  std::vector<ConstTensorRef> refs;
  for (const auto& t : targets_) refs.push_back(ConstTensorRef{t.name, t.data, t.numel, t.width});
  digests_ = engine_.digests(refs);
}

void TensorReceiver::load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                 std::span<const uint64_t> digests, uint64_t version) {
  check_same_model(meta_, meta, version);
  // From here the old weights are being replaced: until the last write the receiver is at no
  // version (a failure leaves it unusable, and the subscriber says so and recovers).
  version_.reset();
  digests_.clear();
  for (size_t t = 0; t < targets_.size(); ++t) engine_.write(targets_[t], 0, bytes[t]);
  digests_.assign(digests.begin(), digests.end());
  version_ = version;
}

uint64_t TensorReceiver::apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) {
  if (digests_.size() != targets_.size()) recompute_digests();
  auto report = engine_.apply(delta, meta_, targets_, digests_, version_, transfer);
  version_ = delta.model_version;
  return report.elements_changed;
}

uint64_t TensorReceiver::apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                                       engine::TransferCounters& transfer) {
  if (digests_.size() != targets_.size()) recompute_digests();
  std::vector<std::vector<uint8_t>> rebased;
  std::vector<PatchRef> absolute(patches.begin(), patches.end());
  if (relative) {
    // The base bits at the changed positions, from where the weights live (O(changed)).
    std::vector<ConstTensorRef> sources;
    uint64_t bytes = 0;
    for (size_t t = 0; t < targets_.size(); ++t) {
      sources.push_back(ConstTensorRef{targets_[t].name, targets_[t].data, targets_[t].numel, targets_[t].width});
      bytes += patches[t].count * targets_[t].width;
    }
    std::vector<uint8_t> base(bytes);
    engine_.gather(sources, patches, base, transfer);
    rebased.resize(targets_.size());
    uint64_t at = 0;
    for (size_t t = 0; t < targets_.size(); ++t) {
      const uint64_t n = patches[t].count * targets_[t].width;
      rebased[t].resize(n);
      compact::rebase_values(std::span(static_cast<const uint8_t*>(patches[t].values), n), std::span(base).subspan(at, n),
                             targets_[t].width, rebased[t]);
      absolute[t].values = rebased[t].data();
      at += n;
    }
  }
  auto report = engine_.apply_patches(targets_, absolute, expected, digests_, version_, transfer);
  version_ = expected.model_version;
  return report.elements_changed;
}

std::vector<ConstTensorRef> TensorReceiver::host_bits() const {
  std::vector<ConstTensorRef> out;
  if (engine_.device() != engine::Device::kCpu) return out;
  for (const auto& t : targets_) out.push_back(ConstTensorRef{t.name, t.data, t.numel, t.width});
  return out;
}

std::vector<uint64_t> HostModelReceiver::digests() const {
  return model_.digests.size() == model_.tensors.size() ? model_.digests : std::vector<uint64_t>{};
}

void HostModelReceiver::load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                    std::span<const uint64_t> digests, uint64_t version) {
  // New storage, swapped in whole: the old model stays intact until the copy is complete.
  HostModel fresh;
  fresh.tensors.assign(meta.begin(), meta.end());
  fresh.data.resize(meta.size());
  for (size_t t = 0; t < meta.size(); ++t) fresh.data[t] = huge_page_vector(bytes[t].size());
  parallel_for(meta.size(), [&](size_t t) { std::memcpy(fresh.data[t].data(), bytes[t].data(), bytes[t].size()); });
  fresh.digests.assign(digests.begin(), digests.end());
  fresh.version = version;
  model_ = std::move(fresh);
}

uint64_t HostModelReceiver::apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) {
  if (model_.digests.size() != model_.tensors.size()) model_.compute_digests();
  auto targets = model_.refs();
  auto report = engine_.apply(delta, model_.tensors, targets, model_.digests, model_.version, transfer);
  model_.version = delta.model_version;
  return report.elements_changed;
}

uint64_t HostModelReceiver::apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                                          engine::TransferCounters& transfer) {
  if (relative) throw Error("receiver: unbased values for a host model (its bits are in host memory: internal error)");
  if (model_.digests.size() != model_.tensors.size()) model_.compute_digests();
  auto targets = model_.refs();
  auto report = engine_.apply_patches(targets, patches, expected, model_.digests, model_.version, transfer);
  model_.version = expected.model_version;
  return report.elements_changed;
}

std::vector<ConstTensorRef> HostModelReceiver::host_bits() const { return model_.const_refs(); }

}  // namespace deltasync
