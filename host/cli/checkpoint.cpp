#include "checkpoint.hpp"

#include <cstdio>
#include <cstring>

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

std::optional<uint64_t> recorded_version(const st::File& file) {
  auto it = file.metadata().find("model_version");
  if (it == file.metadata().end()) return std::nullopt;
  uint64_t v = 0;
  const std::string& s = it->second;
  if (s.empty() || s.size() > 19) throw Error(file.label() + ": model_version '" + s + "' is not a version number");
  for (char c : s) {
    if (c < '0' || c > '9') throw Error(file.label() + ": model_version '" + s + "' is not a version number");
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

std::vector<const uint8_t*> matching_tensors(const st::File& other, const std::vector<TensorMeta>& base) {
  std::vector<const uint8_t*> out;
  for (const auto& m : base) {
    const st::TensorInfo* t = other.find(m.name);
    if (!t) throw Error(other.label() + ": tensor " + m.name + " is missing (the base has it)");
    if (t->dtype != m.dtype)
      throw Error(other.label() + ": tensor " + m.name + " has dtype " + std::string(dtype_name(t->dtype)) +
                  " but " + std::string(dtype_name(m.dtype)) + " in the base");
    if (t->shape != m.shape) throw Error(other.label() + ": tensor " + m.name + " has another shape than in the base");
    out.push_back(other.bytes(*t).data());
  }
  if (other.tensors().size() != base.size()) {
    for (const auto& t : other.tensors()) {
      bool known = false;
      for (const auto& m : base) known = known || m.name == t.name;
      if (!known) throw Error(other.label() + ": tensor " + t.name + " is not in the base");
    }
  }
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
