// deltasync diff BASE NEW -o DELTA: the changes from BASE to NEW as a delta file, with the
// digests that let a receiver check its base before and its weights after applying.
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

  CheckpointImage base = CheckpointImage::load(args.positional()[0]);
  const st::File next = st::File::open(args.positional()[1]);
  const std::vector<const uint8_t*> next_bits = matching_tensors(next, base.meta);

  DeltaInfo info;
  info.model_version = args.get_u64("--model-version").value_or(recorded_version(next).value_or(1));
  info.base_version = args.get_u64("--base-version");
  if (!info.base_version) info.base_version = recorded_version(base.file);

  // Base digests first: the encode turns the base copy into NEW (it is the shadow).
  const std::vector<uint64_t> base_digests = digest_tensors(base.views());
  std::vector<EncodeItem> items;
  for (size_t t = 0; t < base.meta.size(); ++t)
    items.push_back({base.meta[t].name, next_bits[t], base.tensor_data(t), base.meta[t].numel(), base.meta[t].width()});
  // The compact layout is coded where the change set is (on the GPU with the CUDA backend).
  EncodedDelta encoded;
  encode_delta_on(backend, items, base.meta, format, encoded);
  const SparseDelta& delta = encoded.changes;

  integrity::put_delta_digests(
      info, integrity::delta_digests(base.meta, delta.view(), base_digests, info.model_version, info.base_version));
  write_encoded_delta(out_path, base.meta, encoded, info);

  uint64_t total = 0, full_bytes = 0;
  for (const auto& m : base.meta) {
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
