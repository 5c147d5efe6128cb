// Fuzzes a checkpoint folder's index (model.safetensors.index.json) through Checkpoint::open,
// which parses it and checks it against the shards it names. The folder holds two fixed valid
// shards of the fuzz model; each input is written as the index and the folder opened.
// An accepted folder must name every tensor exactly once, each found in the shard that holds
// it, and report the bytes the shards hold.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.hpp"
#include "format/checkpoint_folder.hpp"
#include "fuzz_model.hpp"

using namespace deltasync;
namespace fs = std::filesystem;

namespace {

struct Folder {
  std::string path;
  uint64_t tensor_bytes = 0;
  Folder() {
    const fs::path root = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    path = (root / ("deltasync-fuzz-checkpoint-" + std::to_string(::getpid()))).string();
    fs::remove_all(path);
    fs::create_directories(path);
    const HostModel m = fuzz::base_model();
    for (int shard = 0; shard < 2; ++shard) {
      std::vector<st::WriteTensor> tensors;
      for (size_t t = 2 * size_t(shard); t < 2 * size_t(shard) + 2; ++t) {
        tensors.push_back({m.tensors[t].name, m.tensors[t].dtype, m.tensors[t].shape, m.data[t]});
        tensor_bytes += m.data[t].size();
      }
      st::write_file(path + "/model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors", tensors, {});
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Folder* folder = new Folder;
  {
    std::ofstream out(folder->path + "/" + kIndexFileName, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  std::optional<Checkpoint> c;
  try {
    c.emplace(Checkpoint::open(folder->path));
  } catch (const Error&) {
    return 0;
  }
  const std::vector<TensorMeta> tensors = c->tensors();
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (!names.insert(t.name).second) fuzz::fail("a tensor listed twice");
    const auto at = c->find(t.name);
    if (!at || at->shard >= c->shards().size() || at->info->name != t.name) fuzz::fail("a listed tensor is not found");
    if (c->bytes(*at).size() != t.numel() * t.width()) fuzz::fail("a tensor's bytes are not its size");
  }
  if (tensors.size() != fuzz::model_meta().size()) fuzz::fail("an accepted index lost or added tensors");
  if (c->tensor_bytes() != folder->tensor_bytes) fuzz::fail("an accepted index reports other tensor bytes");
  try {
    (void)c->recorded_version();
  } catch (const Error&) {
  }
  return 0;
}
