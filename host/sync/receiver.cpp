#include "sync/receiver.hpp"

#include <cerrno>
#include <cstring>
#include <string_view>
#include <unordered_map>

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

void TensorReceiver::begin_anchor(std::span<const TensorMeta> table, uint64_t version) {
  // The refusals, and their order, of a whole anchor's (the subscriber's order_like, then
  // check_same_model): a tensor the model lacks, one the anchor lacks, another dtype or shape.
  const std::string label = "anchor of version " + std::to_string(version);
  std::unordered_map<std::string_view, size_t> mine;
  for (size_t t = 0; t < meta_.size(); ++t) mine.emplace(meta_[t].name, t);
  for (const TensorMeta& t : table)
    if (!mine.count(t.name)) throw BadInputError(label + ": tensor " + t.name + " is not in this model");
  if (table.size() != meta_.size()) {
    std::unordered_map<std::string_view, size_t> theirs;
    for (size_t k = 0; k < table.size(); ++k) theirs.emplace(table[k].name, k);
    for (const TensorMeta& m : meta_)
      if (!theirs.count(m.name)) throw BadInputError(label + ": has no tensor " + m.name + " of the model");
    throw BadInputError(label + ": holds " + std::to_string(table.size()) + " tensors, the model has " + std::to_string(meta_.size()));
  }
  anchor_target_.assign(table.size(), 0);
  for (size_t k = 0; k < table.size(); ++k) {
    const auto it = mine.find(table[k].name);
    const TensorMeta& m = meta_[it->second];
    if (table[k].dtype != m.dtype || table[k].shape != m.shape)
      throw BadInputError(label + ": tensor " + m.name + " is " + describe(table[k]) + ", the model's is " + describe(m));
    anchor_target_[k] = it->second;
  }
  anchor_index_.clear();
  for (size_t t = 0; t < meta_.size(); ++t) anchor_index_.emplace(meta_[t].name, t);
  version_before_ = version_;
  digests_before_ = digests_;
  close_undo();
  undo_ = std::tmpfile();
  if (!undo_) throw Error(label + ": cannot create the undo file for a streamed anchor: " + std::strerror(errno));
  anchor_written_.assign(meta_.size(), false);
  undo_order_.clear();
}

void TensorReceiver::write_anchor_part(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes) {
  if (!undo_) throw Error("receiver: an anchor part outside begin_anchor/finish_anchor (internal error)");
  std::vector<uint8_t> old;
  for (size_t k = 0; k < meta.size(); ++k) {
    const auto at = anchor_index_.find(meta[k].name);
    if (at == anchor_index_.end()) throw BadInputError("anchor: tensor " + meta[k].name + " is not in this model");
    const size_t t = at->second;
    if (anchor_written_[t]) throw BadInputError("anchor: tensor " + meta[k].name + " comes twice");
    const TensorRef& target = targets_[t];
    if (bytes[k].size() != target.numel * target.width)
      throw BadInputError("anchor: tensor " + meta[k].name + " has " + std::to_string(bytes[k].size()) + " bytes, the model's " +
                          std::to_string(target.numel * target.width));
    // Its old bits go to the undo file before the first new bit reaches it.
    old.resize(bytes[k].size());
    engine_.read(ConstTensorRef{target.name, target.data, target.numel, target.width}, 0, old);
    if (std::fwrite(old.data(), 1, old.size(), undo_) != old.size())
      throw Error("anchor: cannot save tensor " + meta[k].name + "'s old bits to the undo file: " + std::strerror(errno));
    undo_order_.push_back(t);
    anchor_written_[t] = true;
    // From the first write the weights hold a mix until finish_anchor or abort_anchor.
    version_.reset();
    digests_.clear();
    engine_.write(target, 0, bytes[k]);
  }
}

void TensorReceiver::finish_anchor(std::span<const uint64_t> digests, uint64_t version) {
  for (size_t t = 0; t < meta_.size(); ++t)
    if (!anchor_written_[t]) throw BadInputError("anchor of version " + std::to_string(version) + ": has no tensor " + meta_[t].name);
  digests_.assign(meta_.size(), 0);
  for (size_t k = 0; k < anchor_target_.size(); ++k) digests_[anchor_target_[k]] = digests[k];
  version_ = version;
  close_undo();
}

void TensorReceiver::abort_anchor() {
  if (!undo_) return;
  std::rewind(undo_);
  std::vector<uint8_t> old;
  for (size_t t : undo_order_) {
    const TensorRef& target = targets_[t];
    old.resize(target.numel * target.width);
    if (std::fread(old.data(), 1, old.size(), undo_) != old.size())
      throw Error("anchor: cannot read tensor " + meta_[t].name + "'s old bits back from the undo file");
    engine_.write(target, 0, old);
  }
  // Every written tensor holds its old bits again: so do the version and digests.
  version_ = version_before_;
  digests_ = digests_before_;
  close_undo();
}

void TensorReceiver::close_undo() {
  if (undo_) std::fclose(undo_);
  undo_ = nullptr;
  undo_order_.clear();
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
