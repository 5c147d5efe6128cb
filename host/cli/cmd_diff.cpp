// deltasync diff BASE NEW -o DELTA: the changes from BASE to NEW as a delta file, with the
// digests that let a receiver check its base before and its weights after applying. BASE and NEW
// are files or checkpoint folders (split alike or not: tensors are matched by name); BASE is
// read one shard at a time, NEW is mapped.
#include <chrono>
#include <cstdio>

#include "args.hpp"
#include "backend.hpp"
#include "checkpoint.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"

namespace deltasync::cli {
namespace {

// Appends the encode of the next tensors (the next shard) to `into`.
void append_encoded(EncodedDelta& into, EncodedDelta part) {
  SparseDelta& a = into.changes;
  const SparseDelta& b = part.changes;
  const uint64_t changes = a.offsets.back(), value_bytes = a.value_offsets.back();
  for (size_t t = 1; t < b.offsets.size(); ++t) {
    a.offsets.push_back(changes + b.offsets[t]);
    a.value_offsets.push_back(value_bytes + b.value_offsets[t]);
  }
  a.indices.insert(a.indices.end(), b.indices.begin(), b.indices.end());
  a.values.insert(a.values.end(), b.values.begin(), b.values.end());
  a.base_values.insert(a.base_values.end(), b.base_values.begin(), b.base_values.end());
  for (auto& t : part.compact) into.compact.push_back(std::move(t));
}

constexpr const char* kUsage =
    "diff BASE NEW -o DELTA [--model-version N] [--base-version N] [--format compact|trl|trl-idx|trl-idx-raw] [--cpu|--gpu]";

int run_diff(const Args& raw) {
  auto switches = kBackendSwitches;
  ParsedArgs args(raw, {"-o", "--output", "--model-version", "--base-version", "--format"}, switches);
  args.expect_positional(2, kUsage);
  const std::string out_path = args.get("-o").value_or(args.get("--output").value_or(""));
  if (out_path.empty()) throw Error("missing -o DELTA: " + std::string(kUsage));
  const DeltaFormat format = parse_delta_format(args.get("--format").value_or("compact"));
  const Backend backend = choose_backend(args);
  const auto t0 = std::chrono::steady_clock::now();

  const Checkpoint base = Checkpoint::open(args.positional()[0]);
  const Checkpoint next = Checkpoint::open(args.positional()[1]);
  const std::vector<TensorMeta> meta = base.tensors();
  const std::vector<const uint8_t*> next_bits = matching_tensors(next, meta);

  DeltaInfo info;
  info.model_version = args.get_u64("--model-version").value_or(next.recorded_version().value_or(1));
  info.base_version = args.get_u64("--base-version");
  if (!info.base_version) info.base_version = base.recorded_version();

  // One base shard in memory at a time: a writable copy, because the encode turns the base copy
  // into NEW (it is the shadow); its digests are taken first.
  EncodedDelta encoded;
  encoded.format = format;
  encoded.changes.offsets = {0};
  encoded.changes.value_offsets = {0};
  std::vector<uint64_t> base_digests;
  size_t first = 0;  // index in `meta` of the shard's first tensor
  for (const auto& shard : base.shards()) {
    CheckpointImage image = CheckpointImage::load(shard.path);
    const std::vector<uint64_t> digests = digest_tensors(image.views());
    base_digests.insert(base_digests.end(), digests.begin(), digests.end());
    std::vector<EncodeItem> items;
    for (size_t t = 0; t < image.meta.size(); ++t)
      items.push_back({image.meta[t].name, next_bits[first + t], image.tensor_data(t), image.meta[t].numel(), image.meta[t].width()});
    // The compact layout is coded where the change set is (on the GPU with the CUDA backend).
    EncodedDelta part;
    encode_delta_on(backend, items, image.meta, format, part);
    append_encoded(encoded, std::move(part));
    first += image.meta.size();
  }
  const SparseDelta& delta = encoded.changes;

  integrity::put_delta_digests(
      info, integrity::delta_digests(meta, delta.view(), base_digests, info.model_version, info.base_version));
  write_encoded_delta(out_path, meta, encoded, info);

  uint64_t total = 0, full_bytes = 0;
  for (const auto& m : meta) {
    total += m.numel();
    full_bytes += m.numel() * m.width();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t delta_bytes = st::File::open(out_path).size_bytes();
  std::printf("%s: %llu of %llu elements changed (%.4f%%), %s (full weights %s, %.1fx smaller), %s, %s backend, %.3f s\n",
              out_path.c_str(), static_cast<unsigned long long>(delta.indices.size()),
              static_cast<unsigned long long>(total), total ? 100.0 * delta.indices.size() / total : 0.0,
              human_bytes(delta_bytes).c_str(), human_bytes(full_bytes).c_str(),
              delta_bytes ? double(full_bytes) / delta_bytes : 0.0, std::string(delta_format_name(format)).c_str(),
              backend_name(backend), seconds);
  return 0;
}

const bool registered = register_command({"diff", kUsage, &run_diff});

}  // namespace
}  // namespace deltasync::cli
