// deltasync apply BASE DELTA -o OUT: BASE patched by DELTA. The delta's base digests are
// checked before anything is patched and its result digests after; OUT is written (atomically)
// only when both hold. OUT keeps BASE's header byte for byte, except that a model_version and
// digests recorded in BASE's metadata are brought up to date, so a chain of applies verifies.
#include <chrono>
#include <cstdio>

#include "args.hpp"
#include "backend.hpp"
#include "checkpoint.hpp"
#include "deltasync/atomic_file.hpp"
#include "deltasync/delta_io.hpp"
#include "deltasync/digest.hpp"
#include "deltasync/error.hpp"
#include "deltasync/integrity.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "apply BASE DELTA -o OUT [--cpu|--gpu]";

// Digests of the tensors the delta changes, by name.
integrity::DigestMap changed_digests(const CheckpointImage& image, const ResolvedDelta& delta) {
  std::vector<ConstTensorRef> changed;
  const std::vector<ConstTensorRef> all = image.views();
  for (size_t t = 0; t < all.size(); ++t)
    if (delta.patches[t].count) changed.push_back(all[t]);
  const std::vector<uint64_t> d = digest_tensors(changed);
  integrity::DigestMap out;
  for (size_t k = 0; k < changed.size(); ++k) out.emplace(std::string(changed[k].name), d[k]);
  return out;
}

void write_output(const std::string& path, CheckpointImage& image, const ResolvedDelta& delta) {
  const st::Metadata& old_md = image.file.metadata();
  const bool versioned = old_md.count("model_version") > 0;
  const auto old_digests = integrity::read_checkpoint_digests(old_md, image.file.label());
  if (!versioned && !old_digests) {
    const std::span<const uint8_t> pieces[] = {image.bytes};
    write_file_atomic(path, pieces);
    return;
  }
  st::Metadata md = old_md;
  if (versioned) md["model_version"] = std::to_string(delta.info.model_version);
  if (old_digests) {
    integrity::DigestMap digests = *old_digests;
    for (const auto& [name, d] : changed_digests(image, delta)) digests[name] = d;
    integrity::put_checkpoint_digests(md, digests);
  }
  std::vector<st::WriteTensor> tensors;
  for (const auto& info : image.file.tensors())
    tensors.push_back({info.name, info.dtype, info.shape, {image.bytes.data() + image.data_start + info.begin, info.nbytes()}});
  st::write_file(path, tensors, md);
}

int run_apply(const Args& raw) {
  ParsedArgs args(raw, {"-o", "--output"}, kBackendSwitches);
  args.expect_positional(2, kUsage);
  const std::string out_path = args.get("-o").value_or(args.get("--output").value_or(""));
  if (out_path.empty()) throw Error("missing -o OUT: " + std::string(kUsage));
  const Backend backend = choose_backend(args);
  const auto t0 = std::chrono::steady_clock::now();

  CheckpointImage image = CheckpointImage::load(args.positional()[0]);
  const st::File delta_file = st::File::open(args.positional()[1]);
  ResolvedDelta delta;
  resolve_delta(delta_file, image.meta, image.views(), delta);

  const auto promises = integrity::read_delta_digests(delta.info, delta_file.label());
  if (promises) {
    try {
      integrity::check_base(*promises, recorded_version(image.file), changed_digests(image, delta));
    } catch (const Error& e) {
      throw Error(delta_file.label() + ": " + e.what());
    }
  }
  const std::vector<TensorRef> targets = image.targets();
  apply_on(backend, targets, delta.patches);
  if (promises) {
    try {
      integrity::check_result(*promises, changed_digests(image, delta));
    } catch (const Error& e) {
      throw Error(delta_file.label() + ": " + e.what());
    }
  }
  write_output(out_path, image, delta);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s: applied %llu changes to %zu tensors (%s delta, %s), %s backend, %.3f s\n", out_path.c_str(),
              static_cast<unsigned long long>(delta.total_changed()), delta.changed_names.size(),
              std::string(delta_format_name(delta.format)).c_str(),
              promises ? "digests verified" : "no digests to verify", backend_name(backend), seconds);
  return 0;
}

const bool registered = register_command({"apply", kUsage, &run_apply});

}  // namespace
}  // namespace deltasync::cli
