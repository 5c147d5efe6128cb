#include "engine/engine.hpp"

#include "core/error.hpp"

namespace deltasync::engine {

std::string_view device_name(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

uint64_t StagedDelta::total_changed() const {
  uint64_t n = 0;
  for (uint64_t c : counts) n += c;
  return n;
}

void StagedDelta::clear() {
  counts.clear();
  changes.offsets.clear();
  changes.value_offsets.clear();
  changes.indices.clear();
  changes.values.clear();
  changes.base_values.clear();
  has_base_values = false;
  coded_on_device = false;
  coded.clear();
  digest_shifts.clear();
  transfer = {};
}

void StagedDelta::fill_offsets(std::span<const TensorMeta> tensors) {
  if (changes.offsets.size() == tensors.size() + 1) return;
  changes.offsets.assign(1, 0);
  changes.value_offsets.assign(1, 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    changes.offsets.push_back(changes.offsets.back() + counts[t]);
    changes.value_offsets.push_back(changes.value_offsets.back() + counts[t] * tensors[t].width());
  }
}

void StagedDelta::advance_digests(std::span<uint64_t> digests, std::span<const TensorMeta> tensors) const {
  if (!digest_shifts.empty()) {
    for (size_t t = 0; t < digests.size() && t < digest_shifts.size(); ++t) digests[t] += digest_shifts[t];
    return;
  }
  integrity::advance_digests(digests, tensors, changes.view());
}

integrity::DeltaDigests delta_promises(const DeltaToApply& delta, const DeltaInfo& info) {
  const std::string& label = delta.file->label();
  if (info.model_version != delta.model_version || info.base_version != delta.base_version)
    throw Error(label + ": delta's versions (" + std::to_string(info.model_version) + " from " +
                (info.base_version ? std::to_string(*info.base_version) : "unknown") + ") disagree with its manifest (" +
                std::to_string(delta.model_version) + " from " +
                (delta.base_version ? std::to_string(*delta.base_version) : "none") + ")");
  auto expected = integrity::read_delta_digests(info, label);
  if (!expected) throw Error(label + ": delta carries no digests; refusing to apply it unverified");
  return std::move(*expected);
}

void check_low_byte_shadow(std::span<const ConstTensorRef> current) {
  for (const auto& t : current)
    if (t.width != 2)
      throw Error("low-memory shadow: tensor " + std::string(t.name) + " has " + std::to_string(t.width) +
                  "-byte elements; the low-byte shadow needs 2-byte dtypes (bfloat16, float16)");
}

void check_matches_shadow(std::span<const ConstTensorRef> current, std::span<const uint64_t> numel,
                          std::span<const uint32_t> width) {
  if (current.size() != numel.size())
    throw Error("encode: " + std::to_string(current.size()) + " tensors, the shadow has " + std::to_string(numel.size()));
  for (size_t t = 0; t < current.size(); ++t)
    if (current[t].numel != numel[t] || current[t].width != width[t])
      throw Error("encode: tensor " + std::string(current[t].name) + " changed size or dtype since the shadow was taken");
}

}  // namespace deltasync::engine
