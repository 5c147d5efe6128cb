#include "checkpoint_receiver.hpp"

#include <filesystem>
#include <sys/mman.h>
#include <unistd.h>

#include "codec/compact_two_phase.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "tensor_patch.hpp"

namespace deltasync::cli {
namespace {

// The pages of a mapped tensor the pass has finished with: read once, they would otherwise stay
// in this process's resident set until the mapping closes, a model's worth by the end of a pass.
// The page cache keeps them; a later read maps them again.
void release(std::span<const uint8_t> bytes) {
  if (bytes.empty()) return;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);  // advice: a failure only costs memory
}

}  // namespace

CheckpointReceiver::CheckpointReceiver(std::string out_path, uint64_t max_shard_bytes, protocol::Catalog& catalog, std::string* unreadable)
    : out_path_(std::move(out_path)), max_shard_bytes_(max_shard_bytes), catalog_(catalog) {
  if (!std::filesystem::exists(out_path_)) return;
  try {
    Checkpoint existing = Checkpoint::open(out_path_);
    std::vector<TensorMeta> meta = existing.tensors();
    const std::optional<uint64_t> version = existing.recorded_version();
    if (existing.is_folder()) layout_ = layout_of(existing);
    meta_ = std::move(meta);
    version_ = version;
    current_.emplace(std::move(existing));
  } catch (const Error& e) {
    // An unreadable OUT is rebuilt from the store rather than refused: it is ours to replace.
    if (unreadable) *unreadable = e.what();
    layout_.reset();
  }
}

std::span<const uint8_t> CheckpointReceiver::bits(size_t t) const {
  const auto at = current_->find(meta_[t].name);
  if (!at) throw Error(out_path_ + ": tensor " + meta_[t].name + " vanished from the weights");
  return current_->bytes(*at);
}

void CheckpointReceiver::recompute_digests() {
  digests_.clear();
  for (size_t t = 0; t < meta_.size(); ++t) {
    const std::span<const uint8_t> b = bits(t);
    const ConstTensorRef ref{meta_[t].name, b.data(), meta_[t].numel(), meta_[t].width()};
    digests_.push_back(digest_tensors({&ref, 1}).front());
    release(b);
  }
}

std::unique_ptr<StreamedOutput> CheckpointReceiver::new_output(std::span<const TensorMeta> tensors, uint64_t version,
                                                               std::vector<uint64_t>* digests) {
  digests->clear();
  if (const protocol::Manifest* m = catalog_.find(version)) {
    for (const TensorMeta& t : tensors) {
      const auto it = m->digests.find(t.name);
      if (it == m->digests.end()) {
        digests->clear();  // a manifest without digests: the shards record none
        break;
      }
      digests->push_back(digest_from_hex(it->second, "manifest of version " + std::to_string(version)));
    }
  }
  return std::make_unique<StreamedOutput>(out_path_, std::vector<TensorMeta>(tensors.begin(), tensors.end()), version, *digests,
                                          layout_ ? &*layout_ : nullptr, max_shard_bytes_);
}

void CheckpointReceiver::take(std::unique_ptr<StreamedOutput> output) {
  output->finish();
  current_.emplace(Checkpoint::open(output->staged_path()));
  staged_ = std::move(output);  // the staged output before it goes (the current weights no longer read it)
}

void CheckpointReceiver::load_anchor(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                     std::span<const uint64_t> digests, uint64_t version) {
  try {
    begin_anchor(meta, version);
    write_anchor_part(meta, bytes);
    finish_anchor(digests, version);
  } catch (...) {
    abort_anchor();
    throw;
  }
}

void CheckpointReceiver::begin_anchor(std::span<const TensorMeta> table, uint64_t version) {
  std::vector<uint64_t> digests;
  pending_ = new_output(table, version, &digests);
  pending_meta_.assign(table.begin(), table.end());
}

void CheckpointReceiver::write_anchor_part(std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes) {
  for (size_t t = 0; t < meta.size(); ++t) pending_->write(meta[t], bytes[t]);
}

void CheckpointReceiver::finish_anchor(std::span<const uint64_t> digests, uint64_t version) {
  take(std::move(pending_));
  meta_ = std::move(pending_meta_);
  version_ = version;
  digests_.assign(digests.begin(), digests.end());
}

uint64_t CheckpointReceiver::apply(const engine::DeltaToApply& delta, engine::TransferCounters& transfer) {
  ResolvedDelta resolved;
  const bool relative = resolve_delta_unbased(*delta.file, meta_, resolved);
  return apply_patches(resolved.patches, engine::delta_promises(delta, resolved.info), relative, transfer);
}

uint64_t CheckpointReceiver::apply_patches(std::span<const PatchRef> patches, const integrity::DeltaDigests& expected, bool relative,
                                           engine::TransferCounters& transfer) {
  const std::string label = "delta " + std::to_string(expected.model_version);
  if (!current_) throw Error(out_path_ + ": " + label + " has no weights to apply to");
  if (patches.size() != meta_.size())
    throw Error(label + ": patches for " + std::to_string(patches.size()) + " tensors, the weights have " + std::to_string(meta_.size()));
  if (digests_.size() != meta_.size()) recompute_digests();
  // Versions and every promised base digest, before the pass; each changed tensor's base is
  // checked again from its bits by the verified apply.
  integrity::DigestMap now;
  for (size_t t = 0; t < meta_.size(); ++t) now.emplace(meta_[t].name, digests_[t]);
  integrity::check_base(expected, version_, now);

  std::vector<uint64_t> recorded;  // what the new version's manifest records, written in its header
  std::unique_ptr<StreamedOutput> next = new_output(meta_, expected.model_version, &recorded);
  const std::optional<integrity::DeltaDigests> promises = expected;
  std::vector<uint64_t> after = digests_;
  uint64_t written = 0;
  std::vector<uint8_t> tensor, unbased_base, rebased;
  for (size_t t = 0; t < meta_.size(); ++t) {
    const TensorMeta& m = meta_[t];
    const std::span<const uint8_t> b = bits(t);
    if (patches[t].count == 0) {
      next->write(m, b);
      release(b);
    } else {
      tensor.assign(b.begin(), b.end());
      release(b);
      const TensorRef target{m.name, tensor.data(), m.numel(), m.width()};
      PatchRef patch = patches[t];
      if (relative) {
        // Compact values coded against the base: the base bits at the changed positions.
        const uint64_t n = patch.count * m.width();
        const ConstTensorRef source{m.name, tensor.data(), m.numel(), m.width()};
        unbased_base.resize(n);
        engine_.gather({&source, 1}, {&patch, 1}, unbased_base, transfer);
        rebased.resize(n);
        compact::rebase_values({static_cast<const uint8_t*>(patch.values), n}, unbased_base, m.width(), rebased);
        patch.values = rebased.data();
      }
      const FilePatch piece = file_patch({&patch, 1}, expected.model_version, promises, {&m, 1}, 0, 1);
      after[t] = patch_tensors(engine_, {&target, 1}, piece, version_, label).front();
      written += patch.count;
      next->write(m, tensor);
    }
    if (!recorded.empty() && after[t] != recorded[t])
      throw BadInputError(label + ": tensor " + m.name + " has digest " + digest_to_hex(after[t]) + " after the delta, version " +
                          std::to_string(expected.model_version) + "'s manifest records " + digest_to_hex(recorded[t]));
  }
  integrity::DigestMap result;
  for (size_t t = 0; t < meta_.size(); ++t) result.emplace(meta_[t].name, after[t]);
  integrity::check_result(expected, result);
  take(std::move(next));
  version_ = expected.model_version;
  digests_ = std::move(after);
  return written;
}

void CheckpointReceiver::commit() {
  if (!staged_) return;
  staged_->commit();
  current_.emplace(Checkpoint::open(out_path_));
  staged_.reset();
  if (current_->is_folder()) layout_ = layout_of(*current_);
}

}  // namespace deltasync::cli
