// Digest metadata, base/result checks and the transactional verified apply (host tensors).
#include "engine/integrity.hpp"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <vector>

#include "engine/cpu_engine.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"

namespace deltasync::integrity {

namespace {

using nlohmann::json;

// Changed elements per parallel task when saving old bits and hashing what was written.
constexpr uint64_t kChunkElements = uint64_t{1} << 18;

[[noreturn]] void fail(const std::string& label, const std::string& reason) { throw BadInputError(label + ": " + reason); }

std::string version_text(std::optional<uint64_t> v) { return v ? std::to_string(*v) : std::string("unknown"); }

std::string to_json(const DigestMap& digests) {
  json object = json::object();
  for (const auto& [name, digest] : digests) object[name] = digest_to_hex(digest);
  return object.dump();
}

DigestMap parse_digest_object(const st::Metadata& md, const char* key, const std::string& label) {
  json object;
  try {
    object = json::parse(md.at(key));
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e999
    fail(label, std::string("metadata ") + key + " is not valid JSON (" + e.what() + ")");
  }
  if (!object.is_object()) fail(label, std::string("metadata ") + key + " is not a JSON object");
  DigestMap out;
  for (const auto& [name, value] : object.items()) {
    const std::string where = label + ": metadata " + key + " entry \"" + name + "\"";
    if (!value.is_string()) throw Error(where + ": " + value.dump() + " is not a string");
    out.emplace(name, digest_from_hex(value.get<std::string>(), where));
  }
  return out;
}

void check_algorithm(const st::Metadata& md, const char* what, const std::string& label) {
  const auto alg = md.find(keys::kDigestAlgorithm);
  if (alg == md.end()) fail(label, std::string("metadata has ") + what + " but no " + keys::kDigestAlgorithm);
  if (alg->second != kDigestAlgorithm)
    fail(label, std::string("metadata ") + keys::kDigestAlgorithm + " is \"" + alg->second + "\"; this build knows \"" +
                    std::string(kDigestAlgorithm) + "\"");
}

// Per-tensor shifts Σ term(new) − Σ term(old) of an encode result, in parallel.
std::vector<uint64_t> encode_shifts(std::span<const TensorMeta> tensors, const DeltaView& delta) {
  if (delta.num_tensors() != tensors.size())
    throw Error("digest: delta has " + std::to_string(delta.num_tensors()) + " tensors, model has " +
                std::to_string(tensors.size()));
  if (delta.base_values.size() != delta.values.size())
    throw Error("digest: delta carries no base values; result digests need the bits it replaces");
  std::vector<PatchRef> patches(tensors.size());
  std::vector<const void*> old_bits(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    patches[t] = delta.patch(t, tensors[t].width());
    old_bits[t] = delta.base_values.data() + delta.value_offsets[t];
    if (delta.value_offsets[t + 1] - delta.value_offsets[t] != delta.count(t) * tensors[t].width())
      throw Error("digest: delta values of tensor " + tensors[t].name + " do not match its width");
  }
  return digest_shifts(patches, old_bits);
}

}  // namespace

// ---- computing -------------------------------------------------------------------------------

DigestMap digest_map(std::span<const ConstTensorRef> tensors) {
  const std::vector<uint64_t> digests = digest_tensors(tensors);
  DigestMap out;
  for (size_t t = 0; t < tensors.size(); ++t)
    if (!out.emplace(std::string(tensors[t].name), digests[t]).second)
      throw Error("digest: tensor " + std::string(tensors[t].name) + " appears twice");
  return out;
}

DeltaDigests delta_digests(std::span<const TensorMeta> tensors, const DeltaView& delta,
                           std::span<const uint64_t> base_digests, uint64_t model_version,
                           std::optional<uint64_t> base_version) {
  if (base_digests.size() != tensors.size())
    throw Error("digest: " + std::to_string(base_digests.size()) + " base digests for " + std::to_string(tensors.size()) +
                " tensors");
  const std::vector<uint64_t> shifts = encode_shifts(tensors, delta);
  DeltaDigests out{model_version, base_version, {}, {}};
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (delta.count(t) == 0) continue;
    out.base[tensors[t].name] = base_digests[t];
    out.result[tensors[t].name] = base_digests[t] + shifts[t];
  }
  return out;
}

void advance_digests(std::span<uint64_t> digests, std::span<const TensorMeta> tensors, const DeltaView& delta) {
  if (digests.size() != tensors.size())
    throw Error("digest: " + std::to_string(digests.size()) + " digests for " + std::to_string(tensors.size()) + " tensors");
  const std::vector<uint64_t> shifts = encode_shifts(tensors, delta);
  for (size_t t = 0; t < tensors.size(); ++t) digests[t] += shifts[t];
}

// ---- metadata --------------------------------------------------------------------------------

void put_delta_digests(st::Metadata& metadata, const DeltaDigests& digests) {
  metadata[keys::kDigestAlgorithm] = std::string(kDigestAlgorithm);
  metadata[keys::kBaseDigests] = to_json(digests.base);
  metadata[keys::kResultDigests] = to_json(digests.result);
}

void put_delta_digests(DeltaInfo& info, const DeltaDigests& digests) {
  info.model_version = digests.model_version;
  info.base_version = digests.base_version;
  put_delta_digests(info.extra, digests);
  // Typed as well, for the compact indexed layout's records (base and result name one set).
  auto& typed = info.digests.emplace();
  typed.reserve(digests.base.size());
  for (const auto& [name, base] : digests.base) {
    const auto result = digests.result.find(name);
    if (result == digests.result.end()) throw Error("delta digests: tensor " + name + " has a base digest but no result digest");
    typed.push_back(TensorDigests{name, base, result->second});
  }
  if (typed.size() != digests.result.size()) throw Error("delta digests: a result digest names a tensor without a base digest");
}

void put_checkpoint_digests(st::Metadata& metadata, const DigestMap& digests) { put_digest_map(metadata, keys::kDigests, digests); }

std::optional<DeltaDigests> read_delta_digests(const DeltaInfo& info, const std::string& label) {
  const st::Metadata& md = info.extra;
  if (info.digests) {  // typed (a compact indexed delta's records): names are unique, pairs complete
    check_algorithm(md, "digests", label);
    DeltaDigests out{info.model_version, info.base_version, {}, {}};
    for (const TensorDigests& d : *info.digests) {
      if (!out.base.emplace(d.name, d.base).second) fail(label, "records digests of tensor " + d.name + " twice");
      out.result.emplace(d.name, d.result);
    }
    return out;
  }
  const bool has_base = md.contains(keys::kBaseDigests), has_result = md.contains(keys::kResultDigests);
  if (!has_base && !has_result) return std::nullopt;
  if (!has_base) fail(label, "metadata has result_digests but no base_digests");
  if (!has_result) fail(label, "metadata has base_digests but no result_digests");
  check_algorithm(md, "base_digests", label);
  DeltaDigests out{info.model_version, info.base_version, parse_digest_object(md, keys::kBaseDigests, label),
                   parse_digest_object(md, keys::kResultDigests, label)};
  for (const auto& [name, digest] : out.base)
    if (!out.result.contains(name)) fail(label, "metadata result_digests has no digest for tensor " + name + " (base_digests has one)");
  for (const auto& [name, digest] : out.result)
    if (!out.base.contains(name)) fail(label, "metadata base_digests has no digest for tensor " + name + " (result_digests has one)");
  return out;
}

std::optional<DigestMap> read_checkpoint_digests(const st::Metadata& metadata, const std::string& label) {
  return read_digest_map(metadata, keys::kDigests, label);
}

void put_digest_map(st::Metadata& metadata, const char* key, const DigestMap& digests) {
  metadata[keys::kDigestAlgorithm] = std::string(kDigestAlgorithm);
  metadata[key] = to_json(digests);
}

std::optional<DigestMap> read_digest_map(const st::Metadata& metadata, const char* key, const std::string& label) {
  if (!metadata.contains(key)) return std::nullopt;
  check_algorithm(metadata, key, label);
  return parse_digest_object(metadata, key, label);
}

// ---- checks ----------------------------------------------------------------------------------

void check_base(const DeltaDigests& expected, std::optional<uint64_t> current_version,
                const std::function<std::optional<uint64_t>(std::string_view)>& current_digest) {
  const std::string delta = "delta " + std::to_string(expected.model_version);
  if (expected.base_version && current_version && *expected.base_version != *current_version)
    throw Error(delta + " expects base version " + std::to_string(*expected.base_version) + ", found version " +
                    std::to_string(*current_version),
                ErrorKind::kWrongBase);
  for (const auto& [name, want] : expected.base) {
    const std::optional<uint64_t> have = current_digest(name);
    if (have && *have == want) continue;
    throw Error(delta + " expects base version " + version_text(expected.base_version) + " digest " + digest_to_hex(want) +
                    " for tensor " + name + ", found " + (have ? digest_to_hex(*have) : std::string("no such tensor")),
                ErrorKind::kWrongBase);
  }
}

void check_base(const DeltaDigests& expected, std::optional<uint64_t> current_version, const DigestMap& current) {
  check_base(expected, current_version, [&](std::string_view name) -> std::optional<uint64_t> {
    const auto it = current.find(name);
    if (it == current.end()) return std::nullopt;
    return it->second;
  });
}

void check_result(const DeltaDigests& expected, const DigestMap& actual) {
  for (const auto& [name, want] : expected.result) {
    const auto it = actual.find(name);
    if (it != actual.end() && it->second == want) continue;
    throw Error("delta " + std::to_string(expected.model_version) + " result digest mismatch for tensor " + name +
                    ": expected " + digest_to_hex(want) + ", got " +
                    (it == actual.end() ? std::string("nothing (tensor not applied)") : digest_to_hex(it->second)),
                ErrorKind::kIntegrity);
  }
}

// ---- transactional apply ---------------------------------------------------------------------

namespace {

// Work split of the changed elements of all patches into chunks (the same for saving old bits
// and for hashing the result).
struct ChangedChunks {
  std::vector<uint64_t> task_begin;  // T + 1: tasks of patch t are task_begin[t] .. task_begin[t+1]
  std::vector<uint64_t> byte_begin;  // T + 1: patch t's old bits live at saved[byte_begin[t] ..)

  explicit ChangedChunks(std::span<const PatchRef> patches)
      : task_begin(patches.size() + 1, 0), byte_begin(patches.size() + 1, 0) {
    for (size_t t = 0; t < patches.size(); ++t) {
      task_begin[t + 1] = task_begin[t] + (patches[t].count + kChunkElements - 1) / kChunkElements;
      byte_begin[t + 1] = byte_begin[t] + patches[t].count * patches[t].value_width;
    }
  }
  size_t tasks() const { return task_begin.back(); }
  // (patch, first changed element of the chunk, elements in the chunk)
  std::tuple<size_t, uint64_t, uint64_t> locate(size_t task, std::span<const PatchRef> patches) const {
    const size_t t = std::upper_bound(task_begin.begin(), task_begin.end(), task) - task_begin.begin() - 1;
    const uint64_t first = (task - task_begin[t]) * kChunkElements;
    return {t, first, std::min(kChunkElements, patches[t].count - first)};
  }
};

uint64_t index_at(const PatchRef& p, uint64_t k) {
  if (p.index_width == 4) {
    int32_t v;
    std::memcpy(&v, static_cast<const uint8_t*>(p.indices) + 4 * k, 4);
    return static_cast<uint64_t>(v);
  }
  int64_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(p.indices) + 8 * k, 8);
  return static_cast<uint64_t>(v);
}

// For k < count, at position i = indices[first + k]: old[k] = data[i], then data[i] = values[k].
// W is a compile-time width so that each access is a single load or store, not a memcpy call.
template <uint32_t W>
void exchange(const PatchRef& p, uint64_t first, uint64_t count, uint8_t* data, const uint8_t* values, uint8_t* old) {
  for (uint64_t k = 0; k < count; ++k) {
    uint8_t* at = data + index_at(p, first + k) * W;
    std::memcpy(old + k * W, at, W);
    std::memcpy(at, values + k * W, W);
  }
}

// The host mechanics of a verified apply (PatchTransaction over host tensors).
class HostPatchTransaction final : public PatchTransaction {
 public:
  void write(std::span<const TensorRef> targets, std::span<const PatchRef> patches, std::span<uint64_t> shifts) override;
  void undo(std::span<const TensorRef> targets) override { cpu::apply(targets, restore_); }

 private:
  std::vector<uint8_t> saved_;
  std::vector<PatchRef> restore_;
};

// Validates (throws, nothing written), then scatters while saving the bits each write replaces:
// one pass over the changed positions (the random accesses are the whole cost of an apply, so
// saving must not add a second pass), O(changed) memory. Then the shifts in O(changed), from the
// bits written (the patch values) and the bits saved: both are contiguous, so this runs at the
// speed of the vectorized digest loop. (Reading the written bits back out of the targets would
// be a second random pass as slow as the scatter itself, and would only re-check the two-line
// exchange loop.)
void HostPatchTransaction::write(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                                 std::span<uint64_t> shifts) {
  cpu::validate(targets, patches);
  const ChangedChunks chunks(patches);
  saved_.assign(chunks.byte_begin.back(), 0);
  restore_.assign(patches.begin(), patches.end());
  for (size_t t = 0; t < restore_.size(); ++t) restore_[t].values = saved_.data() + chunks.byte_begin[t];
  std::vector<uint64_t> partial(chunks.tasks(), 0);  // allocated before anything is written
  parallel_for(chunks.tasks(), [&](size_t task) {
    const auto [t, first, count] = chunks.locate(task, patches);
    const PatchRef& p = patches[t];
    auto* data = static_cast<uint8_t*>(targets[t].data);
    const auto* values = static_cast<const uint8_t*>(p.values) + first * p.value_width;
    uint8_t* old = saved_.data() + chunks.byte_begin[t] + first * p.value_width;
    switch (p.value_width) {
      case 1: exchange<1>(p, first, count, data, values, old); break;
      case 2: exchange<2>(p, first, count, data, values, old); break;
      default: exchange<4>(p, first, count, data, values, old); break;
    }
  });
  parallel_for(chunks.tasks(), [&](size_t task) {
    const auto [t, first, count] = chunks.locate(task, patches);
    const PatchRef& p = patches[t];
    const uint32_t w = p.value_width;
    const auto* idx = static_cast<const uint8_t*>(p.indices) + first * p.index_width;
    partial[task] = digest_scattered(w, count, idx, p.index_width, static_cast<const uint8_t*>(p.values) + first * w) -
                    digest_scattered(w, count, idx, p.index_width, saved_.data() + chunks.byte_begin[t] + first * w);
  });
  for (size_t t = 0; t < targets.size(); ++t) {
    shifts[t] = 0;
    for (uint64_t task = chunks.task_begin[t]; task < chunks.task_begin[t + 1]; ++task) shifts[t] += partial[task];
  }
}

}  // namespace

void check_before_apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                        const DeltaDigests& expected, std::span<const uint64_t> current_digests,
                        std::optional<uint64_t> current_version) {
  const std::string delta = "delta " + std::to_string(expected.model_version);
  if (patches.size() != targets.size() || current_digests.size() != targets.size())
    throw Error(delta + ": apply needs one patch and one current digest per target (" + std::to_string(targets.size()) +
                " targets, " + std::to_string(patches.size()) + " patches, " + std::to_string(current_digests.size()) +
                " digests)");
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t t = 0; t < targets.size(); ++t)
    if (!by_name.emplace(targets[t].name, t).second)
      throw Error(delta + ": target tensor " + std::string(targets[t].name) + " appears twice");
  for (size_t t = 0; t < targets.size(); ++t)
    if (patches[t].count > 0 && (!expected.base.contains(targets[t].name) || !expected.result.contains(targets[t].name)))
      throw BadInputError(delta + " changes tensor " + std::string(targets[t].name) + " but records no base/result digest for it");
  for (const auto& [name, digest] : expected.result)
    if (!expected.base.contains(name)) throw Error(delta + " records a result digest but no base digest for tensor " + name);
  check_base(expected, current_version, [&](std::string_view name) -> std::optional<uint64_t> {
    const auto it = by_name.find(name);
    if (it == by_name.end()) return std::nullopt;
    return current_digests[it->second];
  });
}

ApplyReport apply_verified(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                           const DeltaDigests& expected, std::span<uint64_t> current_digests,
                           std::optional<uint64_t> current_version, PatchTransaction& transaction) {
  // 1. The delta's digests name exactly the tensors it changes, and the base is ours: nothing
  //    is written for a delta made for another base.
  // 2. Validate + scatter + shifts (throws with nothing written for an invalid patch).
  //    A failure in either is this rank's refusal in the agreement below, not an early exit:
  //    the other ranks are waiting in it.
  std::vector<uint64_t> shifts(targets.size(), 0);
  std::exception_ptr failure;
  bool written = false;
  try {
    check_before_apply(targets, patches, expected, current_digests, current_version);
    transaction.write(targets, patches, shifts);
    written = true;
  } catch (...) {
    failure = std::current_exception();
    std::fill(shifts.begin(), shifts.end(), 0);
  }
  // 3. Every rank's verdict and shifts; from here on every failure puts the saved bits back
  //    before it propagates.
  uint64_t refusals = 0;
  try {
    refusals = transaction.agree(shifts, failure != nullptr);
  } catch (...) {
    if (written) transaction.undo(targets);
    throw;
  }
  if (failure) std::rethrow_exception(failure);  // nothing was written
  // 4. Result digests in O(changed), compared with the promises.
  try {
    if (refusals != 0)
      throw Error("delta " + std::to_string(expected.model_version) + ": refused by " + std::to_string(refusals) +
                      " other rank(s)",
                  ErrorKind::kIntegrity);
    std::vector<uint64_t> result(current_digests.begin(), current_digests.end());
    ApplyReport report;
    DigestMap actual;
    for (size_t t = 0; t < targets.size(); ++t) {
      const auto promise = expected.result.find(targets[t].name);
      if (transaction.holds(t))
        result[t] += shifts[t];
      else if (promise != expected.result.end())
        result[t] = promise->second;
      report.tensors_changed += patches[t].count > 0;
      report.elements_changed += patches[t].count;
      if (promise != expected.result.end()) actual.emplace(std::string(targets[t].name), result[t]);
    }
    check_result(expected, actual);
    std::copy(result.begin(), result.end(), current_digests.begin());
    return report;
  } catch (const Error& e) {
    transaction.undo(targets);
    throw Error(std::string(e.what()) + "; weights restored to their state before the delta", e.kind());
  } catch (...) {
    transaction.undo(targets);
    throw;
  }
}

void refuse_apply(size_t targets, std::exception_ptr failure, PatchTransaction& transaction) {
  std::vector<uint64_t> shifts(targets, 0);
  transaction.agree(shifts, true);
  std::rethrow_exception(failure);
}

ApplyReport apply_verified(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                           const DeltaDigests& expected, std::span<uint64_t> current_digests,
                           std::optional<uint64_t> current_version) {
  HostPatchTransaction transaction;
  return apply_verified(targets, patches, expected, current_digests, current_version, transaction);
}

}  // namespace deltasync::integrity
