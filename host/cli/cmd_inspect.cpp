// deltasync inspect FILE|FOLDER: what a file is (delta, anchor or plain checkpoint) or what a
// checkpoint folder holds, its version, and how much, read from the headers alone (no tensor
// data is touched).
#include <cstdio>
#include <filesystem>

#include "args.hpp"
#include "checkpoint.hpp"
#include "core/error.hpp"
#include <nlohmann/json.hpp>

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "inspect FILE|FOLDER";

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

int inspect_folder(const std::string& path) {
  const Checkpoint c = Checkpoint::open(path);
  uint64_t elements = 0, bytes = 0;
  size_t tensors = 0, with_digests = 0;
  for (const auto& shard : c.shards()) {
    for (const auto& t : shard.tensors) elements += t.numel();
    tensors += shard.tensors.size();
    bytes += shard.data.size_bytes();
    with_digests += shard.data.metadata().count("digests");
  }
  const auto version = c.recorded_version();
  std::printf("file: %s\n", c.path().c_str());
  std::printf("kind: checkpoint folder\n");
  std::printf("shards: %zu (%s)\n", c.shards().size(), c.index_text().empty() ? "no index" : kIndexFileName);
  std::printf("version: %s\n", version ? std::to_string(*version).c_str() : "unknown");
  std::printf("tensors: %zu\n", tensors);
  std::printf("elements: %llu\n", static_cast<unsigned long long>(elements));
  std::printf("bytes: %llu (tensor data %llu)\n", static_cast<unsigned long long>(bytes),
              static_cast<unsigned long long>(c.tensor_bytes()));
  std::printf("digests: %s\n", with_digests == 0 ? "none" : with_digests == c.shards().size() ? "recorded" : "in some shards");
  return 0;
}

int run_inspect(const Args& raw) {
  ParsedArgs args(raw, {}, {});
  args.expect_positional(1, kUsage);
  if (std::filesystem::is_directory(args.positional()[0])) return inspect_folder(args.positional()[0]);
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
