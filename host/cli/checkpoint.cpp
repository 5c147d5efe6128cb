#include "checkpoint.hpp"

#include <cstdio>
#include <cstring>
#include <set>

#include "core/error.hpp"

namespace deltasync::cli {

CheckpointImage CheckpointImage::load(const std::string& path) {
  CheckpointImage image{st::File::open(path), {}, {}, 0};
  image.meta = model_tensors(image.file);
  const uint64_t size = image.file.size_bytes();
  image.bytes = HugeBuffer(size);
  uint64_t header_len = 0;
  // File::open validated the layout; the writable copy is what apply patches and writes out.
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw Error(path + ": cannot open: " + std::strerror(errno));
  const size_t got = std::fread(image.bytes.data(), 1, size, f);
  std::fclose(f);
  if (got != size) throw Error(path + ": changed while being read");
  std::memcpy(&header_len, image.bytes.data(), 8);
  image.data_start = 8 + header_len;
  return image;
}

uint8_t* CheckpointImage::tensor_data(size_t t) {
  return bytes.data() + data_start + file.at(meta[t].name).begin;
}

std::vector<TensorRef> CheckpointImage::targets() {
  std::vector<TensorRef> out;
  for (size_t t = 0; t < meta.size(); ++t) out.push_back({meta[t].name, tensor_data(t), meta[t].numel(), meta[t].width()});
  return out;
}

std::vector<ConstTensorRef> CheckpointImage::views() const {
  std::vector<ConstTensorRef> out;
  for (const auto& m : meta)
    out.push_back({m.name, bytes.data() + data_start + file.at(m.name).begin, m.numel(), m.width()});
  return out;
}

std::vector<const uint8_t*> matching_tensors(const Checkpoint& other, const std::vector<TensorMeta>& base) {
  std::vector<const uint8_t*> out;
  for (const auto& m : base) {
    const auto at = other.find(m.name);
    if (!at) throw Error(other.path() + ": tensor " + m.name + " is missing (the base has it)");
    const std::string& label = other.shards()[at->shard].path;
    const st::TensorInfo& t = *at->info;
    if (t.dtype != m.dtype)
      throw Error(label + ": tensor " + m.name + " has dtype " + std::string(dtype_name(t.dtype)) + " but " +
                  std::string(dtype_name(m.dtype)) + " in the base");
    if (t.shape != m.shape) throw Error(label + ": tensor " + m.name + " has another shape than in the base");
    out.push_back(other.bytes(*at).data());
  }
  const std::vector<TensorMeta> all = other.tensors();
  if (all.size() != base.size()) {
    std::set<std::string_view> known;
    for (const auto& m : base) known.insert(m.name);
    for (const auto& t : all)
      if (!known.count(t.name)) throw Error(other.path() + ": tensor " + t.name + " is not in the base");
  }
  return out;
}

std::vector<ConstTensorRef> checkpoint_views(const Checkpoint& checkpoint, const std::vector<TensorMeta>& tensors) {
  std::vector<ConstTensorRef> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back({t.name, checkpoint.bytes(*checkpoint.find(t.name)).data(), t.numel(), t.width()});
  return out;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000 && u < 4) {
    bytes /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

}  // namespace deltasync::cli
