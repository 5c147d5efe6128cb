// deltasync inspect FILE: what a file is (delta, anchor or plain checkpoint), its version, and
// how much it holds, read from the header alone (no tensor data is touched).
#include <cstdio>

#include "args.hpp"
#include "checkpoint.hpp"
#include "core/error.hpp"
#include <nlohmann/json.hpp>

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "inspect FILE";

// Number of entries of a JSON list/object stored as a metadata string (0 when absent).
size_t json_size(const st::Metadata& md, const char* key, const std::string& label) {
  auto it = md.find(key);
  if (it == md.end()) return 0;
  const auto parsed = nlohmann::json::parse(it->second, nullptr, false);
  if (parsed.is_discarded() || !(parsed.is_array() || parsed.is_object()))
    throw Error(label + ": metadata " + key + " is not a JSON list or object");
  return parsed.size();
}

std::string meta_or(const st::Metadata& md, const char* key, const char* fallback) {
  auto it = md.find(key);
  return it == md.end() ? fallback : it->second;
}

int run_inspect(const Args& raw) {
  ParsedArgs args(raw, {}, {});
  args.expect_positional(1, kUsage);
  const st::File file = st::File::open(args.positional()[0]);
  const st::Metadata& md = file.metadata();
  const std::string sparse = meta_or(md, "sparse", "");
  const std::string kind = sparse == "True" ? "delta" : sparse == "False" ? "anchor" : "checkpoint";
  uint64_t data_bytes = 0;
  for (const auto& t : file.tensors()) data_bytes += t.nbytes();

  std::printf("file: %s\n", file.label().c_str());
  std::printf("kind: %s\n", kind.c_str());
  if (kind == "delta") std::printf("format: %s\n", meta_or(md, "format", "trl").c_str());
  std::printf("version: %s\n", meta_or(md, "model_version", "unknown").c_str());
  if (kind == "delta") std::printf("base version: %s\n", meta_or(md, "base_version", "unknown").c_str());
  if (kind == "delta") {
    std::printf("tensors: %zu changed of %zu in the model\n", json_size(md, "changed_params", file.label()),
                json_size(md, "tensor_shapes", file.label()));
    std::printf("changed elements: %s of %s\n", meta_or(md, "total_changed_elements", "?").c_str(),
                meta_or(md, "total_elements", "?").c_str());
    std::printf("sparsity: %s\n", meta_or(md, "sparsity", "?").c_str());
  } else {
    uint64_t elements = 0;
    for (const auto& t : file.tensors()) elements += t.numel();
    std::printf("tensors: %zu\n", file.tensors().size());
    std::printf("elements: %llu\n", static_cast<unsigned long long>(elements));
  }
  std::printf("bytes: %llu (tensor data %llu)\n", static_cast<unsigned long long>(file.size_bytes()),
              static_cast<unsigned long long>(data_bytes));
  std::printf("digests: %s\n", md.count("digests") || md.count("result_digests") ? "recorded" : "none");
  return 0;
}

const bool registered = register_command({"inspect", kUsage, &run_inspect});

}  // namespace
}  // namespace deltasync::cli
