// deltasync verify FILE: recomputes the full digest of every tensor of a checkpoint or anchor
// (one read of the weights, on the GPU when present) and compares them with the `digests` its
// metadata records.
// Contract: exit 0 and "OK: N tensors, M elements verified" when every tensor matches and the
// recorded digests name exactly the file's tensors; exit 1 with the first problem on one line
// otherwise. A file that records no digests: its computed digests are printed ("NAME HEX" per
// line) with a note on stderr that there was nothing to compare, exit 0 — unless --require is
// given, then exit 1. A delta (it records base/result digests, not full ones) is an error.
#include <cstdio>
#include <string>
#include <vector>

#include "args.hpp"
#include "backend.hpp"
#include "codec/digest.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"
#include "format/safetensors.hpp"
#include "digest_backend.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "verify FILE.safetensors [--cpu|--gpu] [--require]";

int run_verify(const Args& raw) {
  std::set<std::string> switches = kBackendSwitches;
  switches.insert("--require");
  ParsedArgs args(raw, {}, switches);
  args.expect_positional(1, kUsage);
  const Backend backend = choose_backend(args);
  const st::File file = st::File::open(args.positional()[0]);
  const std::string& label = file.label();

  const auto recorded = integrity::read_checkpoint_digests(file.metadata(), label);
  if (!recorded && file.metadata().count(integrity::keys::kBaseDigests))
    throw Error(label + ": is a delta (it records base_digests/result_digests, not full digests); verify checks "
                        "checkpoints and anchors — apply the delta to its base to check it");

  std::vector<ConstTensorRef> tensors;
  uint64_t elements = 0;
  for (const auto& info : file.tensors()) {
    tensors.push_back({info.name, file.bytes(info).data(), info.numel(), dtype_width(info.dtype)});
    elements += info.numel();
  }
  std::vector<uint64_t> computed;
  try {
    computed = digests_on(backend, tensors);
  } catch (const Error& e) {
    throw Error(label + ": " + e.what());
  }

  if (!recorded) {
    for (size_t t = 0; t < tensors.size(); ++t)
      std::printf("%s %s\n", std::string(tensors[t].name).c_str(), digest_to_hex(computed[t]).c_str());
    std::fprintf(stderr, "%s: records no digests; nothing to compare (%zu tensors digested)\n", label.c_str(),
                 tensors.size());
    return args.has("--require") ? 1 : 0;
  }

  for (size_t t = 0; t < tensors.size(); ++t) {
    const std::string name(tensors[t].name);
    const auto it = recorded->find(name);
    if (it == recorded->end()) throw Error(label + ": tensor " + name + " has no recorded digest");
    if (it->second != computed[t])
      throw Error(label + ": tensor " + name + " digest mismatch: recorded " + digest_to_hex(it->second) + ", computed " +
                  digest_to_hex(computed[t]));
  }
  for (const auto& [name, digest] : *recorded)
    if (!file.find(name)) throw Error(label + ": digests name tensor " + name + ", which the file does not hold");

  std::printf("OK: %zu tensors, %llu elements verified\n", tensors.size(), static_cast<unsigned long long>(elements));
  return 0;
}

const bool registered = register_command({"verify", kUsage, &run_verify});

}  // namespace
}  // namespace deltasync::cli
