// deltasync apply BASE DELTA -o OUT: BASE patched by DELTA. The delta's base digests are
// checked before anything is patched and its result digests after; OUT is written (atomically)
// only when both hold. OUT keeps BASE's header byte for byte, except that a model_version and
// digests recorded in BASE's metadata are brought up to date, so a chain of applies verifies.
#include <chrono>
#include <cstdio>

#include "args.hpp"
#include "backend.hpp"
#include "checkpoint.hpp"
#include "format/atomic_file.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "apply BASE DELTA -o OUT [--cpu|--gpu]";

// Full digests of the tensors the delta changes (0 for the others), in base tensor order.
std::vector<uint64_t> changed_digests(const CheckpointImage& image, const ResolvedDelta& delta) {
  const std::vector<ConstTensorRef> all = image.views();
  std::vector<ConstTensorRef> changed;
  for (size_t t = 0; t < all.size(); ++t)
    if (delta.patches[t].count) changed.push_back(all[t]);
  const std::vector<uint64_t> d = digest_tensors(changed);
  std::vector<uint64_t> out(all.size(), 0);
  for (size_t t = 0, k = 0; t < all.size(); ++t)
    if (delta.patches[t].count) out[t] = d[k++];
  return out;
}

integrity::DigestMap by_name(const CheckpointImage& image, const ResolvedDelta& delta, const std::vector<uint64_t>& d) {
  integrity::DigestMap out;
  for (size_t t = 0; t < image.meta.size(); ++t)
    if (delta.patches[t].count) out.emplace(image.meta[t].name, d[t]);
  return out;
}

// Applies with the delta's promises checked. On the CPU the result check costs O(changed
// elements) (digests updated from the old bits, rolled back on a mismatch); the GPU path checks
// the result by rehashing the changed tensors once they are back on the host. Returns the
// digests after the apply (0 for unchanged tensors).
std::vector<uint64_t> apply_checked(Backend backend, CheckpointImage& image, const ResolvedDelta& delta,
                                    const integrity::DeltaDigests& promises) {
  std::vector<uint64_t> digests = changed_digests(image, delta);
  const std::vector<TensorRef> targets = image.targets();
  const auto version = recorded_version(image.file);
  if (backend == Backend::Cpu) {
    integrity::apply_verified(targets, delta.patches, promises, digests, version);
    return digests;
  }
  integrity::check_base(promises, version, by_name(image, delta, digests));
  apply_on(backend, targets, delta.patches);
  digests = changed_digests(image, delta);
  integrity::check_result(promises, by_name(image, delta, digests));
  return digests;
}

void write_output(const std::string& path, CheckpointImage& image, const ResolvedDelta& delta,
                  const std::vector<uint64_t>& new_digests) {
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
    const bool known = !new_digests.empty();
    const std::vector<uint64_t> fresh = known ? new_digests : changed_digests(image, delta);
    for (const auto& [name, d] : by_name(image, delta, fresh)) digests[name] = d;
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
  std::vector<uint64_t> new_digests;
  if (promises) {
    try {
      new_digests = apply_checked(backend, image, delta, *promises);
    } catch (const Error& e) {
      throw Error(delta_file.label() + ": " + e.what());
    }
  } else {
    apply_on(backend, image.targets(), delta.patches);
  }
  write_output(out_path, image, delta, new_digests);

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
