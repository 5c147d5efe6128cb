// deltasync verify CHECKPOINT: recomputes the full digest of every tensor of a checkpoint (file or
// folder, shard by shard) or anchor (one read of the weights, on the GPU when present) and
// compares them with the `digests` its metadata records (each shard records its own tensors').
// Contract: exit 0 and "OK: N tensors, M elements verified" when every tensor matches and the
// recorded digests name exactly the tensors of their file; exit 1 with the first problem on one
// line otherwise. A checkpoint that records no digests: its computed digests are printed ("NAME
// HEX" per line) with a note on stderr that there was nothing to compare, exit 0 — unless
// --require is given, then exit 1. A folder where some shards record digests and others do not
// is an error. A delta (it records base/result digests, not full ones) is an error.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "args.hpp"
#include "backend.hpp"
#include "codec/digest.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"
#include "format/checkpoint_folder.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "verify CHECKPOINT [--cpu|--gpu] [--require]";

struct FileDigests {
  std::vector<std::string> names;
  std::vector<uint64_t> computed;
  uint64_t elements = 0;
};

FileDigests digest_file(engine::SyncEngine& engine, const st::File& file) {
  FileDigests out;
  std::vector<ConstTensorRef> tensors;
  for (const auto& info : file.tensors()) {
    out.names.push_back(info.name);
    out.elements += info.numel();
  }
  for (size_t t = 0; t < file.tensors().size(); ++t) {
    const auto& info = file.tensors()[t];
    tensors.push_back({out.names[t], file.bytes(info).data(), info.numel(), dtype_width(info.dtype)});
  }
  try {
    out.computed = engine_digests(engine, tensors);
  } catch (const Error& e) {
    throw Error(file.label() + ": " + e.what());
  }
  return out;
}

void compare(const st::File& file, const FileDigests& d, const integrity::DigestMap& recorded) {
  const std::string& label = file.label();
  for (size_t t = 0; t < d.names.size(); ++t) {
    const auto it = recorded.find(d.names[t]);
    if (it == recorded.end()) throw Error(label + ": tensor " + d.names[t] + " has no recorded digest");
    if (it->second != d.computed[t])
      throw Error(label + ": tensor " + d.names[t] + " digest mismatch: recorded " + digest_to_hex(it->second) +
                  ", computed " + digest_to_hex(d.computed[t]));
  }
  for (const auto& [name, digest] : recorded)
    if (!file.find(name)) throw Error(label + ": digests name tensor " + name + ", which the file does not hold");
}

int run_verify(const Args& raw) {
  std::set<std::string> switches = kBackendSwitches;
  switches.insert("--require");
  ParsedArgs args(raw, {}, switches);
  args.expect_positional(1, kUsage);
  const Backend backend = choose_backend(args);
  const std::string& path = args.positional()[0];
  if (!std::filesystem::is_directory(path)) {
    // A real delta holds index/payload tensors a checkpoint cannot: say what it is first.
    const st::File file = st::File::open(path);
    if (file.metadata().count(integrity::keys::kBaseDigests) && !file.metadata().count(integrity::keys::kDigests))
      throw Error(file.label() + ": is a delta (it records base_digests/result_digests, not full digests); verify checks "
                                 "checkpoints and anchors — apply the delta to its base to check it");
  }
  const Checkpoint checkpoint = Checkpoint::open(path);

  // What each file records, checked before any tensor is read.
  std::vector<std::optional<integrity::DigestMap>> recorded;
  for (const auto& shard : checkpoint.shards()) {
    const st::File& file = shard.data;
    recorded.push_back(integrity::read_checkpoint_digests(file.metadata(), file.label()));
    if (!recorded.back() && file.metadata().count(integrity::keys::kBaseDigests))
      throw Error(file.label() + ": is a delta (it records base_digests/result_digests, not full digests); verify checks "
                                 "checkpoints and anchors — apply the delta to its base to check it");
    if (recorded.back().has_value() != recorded.front().has_value())
      throw Error((recorded.back() ? checkpoint.shards().front().path : file.label()) +
                  ": records no digests while other shards of " + checkpoint.path() + " do");
  }

  const std::unique_ptr<engine::SyncEngine> engine = make_engine(backend);
  size_t tensors = 0;
  uint64_t elements = 0;
  for (size_t s = 0; s < checkpoint.shards().size(); ++s) {
    const st::File& file = checkpoint.shards()[s].data;
    const FileDigests d = digest_file(*engine, file);  // one shard's tensors at a time
    tensors += d.names.size();
    elements += d.elements;
    if (recorded[s]) {
      compare(file, d, *recorded[s]);
      continue;
    }
    for (size_t t = 0; t < d.names.size(); ++t) std::printf("%s %s\n", d.names[t].c_str(), digest_to_hex(d.computed[t]).c_str());
  }
  if (!recorded.front()) {
    std::fprintf(stderr, "%s: records no digests; nothing to compare (%zu tensors digested)\n", checkpoint.path().c_str(), tensors);
    return args.has("--require") ? 1 : 0;
  }
  std::printf("OK: %zu tensors, %llu elements verified\n", tensors, static_cast<unsigned long long>(elements));
  return 0;
}

const bool registered = register_command({"verify", kUsage, &run_verify});

}  // namespace
}  // namespace deltasync::cli
