// deltasync apply BASE DELTA -o OUT: BASE patched by DELTA. The delta's base digests are
// checked before anything is patched and its result digests after; OUT is written (atomically)
// only when both hold. OUT keeps BASE's header byte for byte, except that a model_version and
// digests recorded in BASE's metadata are brought up to date, so a chain of applies verifies.
// A checkpoint folder is patched one shard at a time into a temporary folder (same shard files,
// the index kept byte for byte) that replaces OUT once every shard has been checked.
#include <chrono>
#include <cstdio>
#include <optional>

#include "args.hpp"
#include "backend.hpp"
#include "checkpoint.hpp"
#include "format/atomic_file.hpp"
#include "codec/delta_io.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"
#include "tensor_patch.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "apply BASE DELTA -o OUT [--cpu|--gpu]";

integrity::DigestMap by_name(const CheckpointImage& image, const FilePatch& delta, const std::vector<uint64_t>& d) {
  integrity::DigestMap out;
  for (size_t t = 0; t < image.meta.size(); ++t)
    if (delta.patches[t].count) out.emplace(image.meta[t].name, d[t]);
  return out;
}

void write_output(engine::SyncEngine& engine, const std::string& path, CheckpointImage& image, const FilePatch& delta,
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
  if (versioned) md["model_version"] = std::to_string(delta.model_version);
  if (old_digests) {
    integrity::DigestMap digests = *old_digests;
    const bool known = !new_digests.empty();
    const std::vector<uint64_t> fresh = known ? new_digests : changed_digests(engine, image.views(), delta, false);
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
  const std::unique_ptr<engine::SyncEngine> engine = make_engine(backend);
  const auto t0 = std::chrono::steady_clock::now();

  // The base mapped whole (the compact layout decodes values relative to its bits, reading only
  // the changed positions); patched below one file at a time.
  const Checkpoint base = Checkpoint::open(args.positional()[0]);
  const std::vector<TensorMeta> base_meta = base.tensors();
  const st::File delta_file = st::File::open(args.positional()[1]);
  ResolvedDelta delta;
  resolve_delta(delta_file, base_meta, checkpoint_views(base, base_meta), delta);
  const auto promises = integrity::read_delta_digests(delta.info, delta_file.label());
  if (promises) check_promises_name_changes(delta.patches, *promises, base_meta, delta_file.label());
  const std::optional<uint64_t> version = base.recorded_version();

  if (!base.is_folder()) {
    CheckpointImage image = CheckpointImage::load(base.path());
    const FilePatch patch = file_patch(delta.patches, delta.info.model_version, promises, base_meta, 0, base_meta.size());
    const std::vector<uint64_t> new_digests = patch_tensors(*engine, image.targets(), patch, version, delta_file.label());
    write_output(*engine, out_path, image, patch, new_digests);
  } else {
    FolderWriter folder(out_path);
    size_t first = 0;
    for (const auto& shard : base.shards()) {
      CheckpointImage image = CheckpointImage::load(shard.path);
      const FilePatch patch = file_patch(delta.patches, delta.info.model_version, promises, base_meta, first, image.meta.size());
      first += image.meta.size();
      // Also for a shard the delta leaves alone: the version check belongs to every shard.
      const std::vector<uint64_t> new_digests = patch_tensors(*engine, image.targets(), patch, version, delta_file.label());
      write_output(*engine, folder.path_of(shard.file), image, patch, new_digests);
    }
    const std::string& index = base.index_text();
    if (!index.empty()) folder.write_bytes(kIndexFileName, {reinterpret_cast<const uint8_t*>(index.data()), index.size()});
    folder.copy_files(base.path(), base.other_files());  // config.json, tokenizer files: OUT is a whole checkpoint
    folder.commit();
  }

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
