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

}  // namespace deltasync::engine
