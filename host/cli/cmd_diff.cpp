// deltasync diff BASE NEW -o DELTA: the changes from BASE to NEW as a delta file, with the
// digests that let a receiver check its base before and its weights after applying. BASE and NEW
// are files or checkpoint folders (split alike or not: tensors are matched by name), both mapped;
// the engine (CPU twin or CUDA) takes one base shard at a time as its shadow and encodes NEW's
// tensors of that shard against it.
#include <chrono>
#include <cstdio>

#include "args.hpp"
#include "backend.hpp"
#include "checkpoint.hpp"
#include "codec/delta_io.hpp"
#include "codec/compact_codec.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"

namespace deltasync::cli {
namespace {

// Appends the engine's encode of the next tensors (the next shard) to `into`: counts, the raw
// change set (offsets alone when it was coded on the device), coded tensors, digest shifts.
void append_staged(engine::StagedDelta& into, engine::StagedDelta& part, std::span<const TensorMeta> part_meta) {
  part.fill_offsets(part_meta);
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
  into.counts.insert(into.counts.end(), part.counts.begin(), part.counts.end());
  into.coded_on_device = part.coded_on_device;
  into.has_base_values = part.has_base_values;
  for (auto& t : part.coded) into.coded.push_back(std::move(t));
  if (part.digest_shifts.empty()) {
    // Shifts from the base and new values, as the publisher takes them.
    std::vector<uint64_t> shifts(part_meta.size(), 0);
    part.advance_digests(shifts, part_meta);
    into.digest_shifts.insert(into.digest_shifts.end(), shifts.begin(), shifts.end());
  } else {
    into.digest_shifts.insert(into.digest_shifts.end(), part.digest_shifts.begin(), part.digest_shifts.end());
  }
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

  // One base shard at a time on the engine: its digests, the shadow taken from it, then NEW
  // encoded against it (the compact layout coded where the change set is: on the GPU with the
  // CUDA engine).
  const std::unique_ptr<engine::SyncEngine> engine = make_engine(backend);
  engine::EncodeRequest request;
  request.want_coded = format == DeltaFormat::Compact;
  engine::StagedDelta staged;
  staged.changes.offsets = {0};
  staged.changes.value_offsets = {0};
  std::vector<uint64_t> base_digests;
  size_t first = 0;  // index in `meta` of the shard's first tensor
  for (const auto& shard : base.shards()) {
    std::vector<ConstTensorRef> base_views, next_views;
    std::vector<TensorMeta> shard_meta;
    for (const auto& info : shard.data.tensors()) {
      const TensorMeta& m = meta[first + shard_meta.size()];
      base_views.push_back({m.name, shard.data.bytes(info).data(), m.numel(), m.width()});
      next_views.push_back({m.name, next_bits[first + shard_meta.size()], m.numel(), m.width()});
      shard_meta.push_back(m);
    }
    engine::StagedDelta part;
    {
      const PlacedTensors placed_base(*engine, base_views);
      const std::vector<uint64_t> digests = engine->digests(placed_base.views());
      base_digests.insert(base_digests.end(), digests.begin(), digests.end());
      engine->reset_shadow(placed_base.views());
    }
    const PlacedTensors placed_next(*engine, next_views);
    request.tensors = shard_meta;  // their shapes decide the compact layout's tiles
    engine->encode(placed_next.views(), request, part);
    append_staged(staged, part, shard_meta);
    first += shard_meta.size();
  }
  const SparseDelta& delta = staged.changes;

  integrity::DeltaDigests promises{info.model_version, info.base_version, {}, {}};
  for (size_t t = 0; t < meta.size(); ++t) {
    if (staged.counts[t] == 0) continue;
    promises.base.emplace(meta[t].name, base_digests[t]);
    promises.result.emplace(meta[t].name, base_digests[t] + staged.digest_shifts[t]);
  }
  integrity::put_delta_digests(info, promises);
  if (staged.coded_on_device)
    compact::write_compact_delta(out_path, meta, delta.view(), info, std::move(staged.coded));
  else
    write_delta(out_path, format, meta, delta.view(), info);

  uint64_t total = 0, full_bytes = 0;
  for (const auto& m : meta) {
    total += m.numel();
    full_bytes += m.numel() * m.width();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t delta_bytes = st::File::open(out_path).size_bytes();
  std::printf("%s: %llu of %llu elements changed (%.4f%%), %s (full weights %s, %.1fx smaller), %s, %s backend, %.3f s\n",
              out_path.c_str(), static_cast<unsigned long long>(staged.total_changed()),
              static_cast<unsigned long long>(total), total ? 100.0 * staged.total_changed() / total : 0.0,
              human_bytes(delta_bytes).c_str(), human_bytes(full_bytes).c_str(),
              delta_bytes ? double(full_bytes) / delta_bytes : 0.0, std::string(delta_format_name(format)).c_str(),
              backend_name(backend), seconds);
  return 0;
}

const bool registered = register_command({"diff", kUsage, &run_diff});

}  // namespace
}  // namespace deltasync::cli
