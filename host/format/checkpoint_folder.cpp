#include "format/checkpoint_folder.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "format/atomic_file.hpp"
#include "format/model_version.hpp"

namespace deltasync {
namespace fs = std::filesystem;

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) throw Error(path + ": read failed");
  return text.str();
}

// The weight_map of an index file, checked: an object of tensor name -> plain file name.
WeightMap parse_index(const std::string& index_path, const std::string& text, std::optional<uint64_t>& total_size) {
  const nlohmann::json index = nlohmann::json::parse(text, nullptr, false);
  if (index.is_discarded() || !index.is_object()) throw BadInputError(index_path + ": not a JSON object");
  const auto map = index.find("weight_map");
  if (map == index.end() || !map->is_object()) throw BadInputError(index_path + ": has no weight_map object");
  WeightMap out;
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string()) throw BadInputError(index_path + ": weight_map entry for " + name + " is not a file name");
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos || f == "." || f == "..")
      throw BadInputError(index_path + ": weight_map names '" + f + "' for " + name + ", not a file name inside the folder");
    out.emplace(name, f);
  }
  if (out.empty()) throw BadInputError(index_path + ": weight_map is empty");
  total_size.reset();
  if (const auto md = index.find("metadata"); md != index.end() && md->is_object()) {
    if (const auto ts = md->find("total_size"); ts != md->end()) {
      if (!ts->is_number_unsigned() && !(ts->is_number_integer() && ts->get<int64_t>() >= 0))
        throw BadInputError(index_path + ": metadata.total_size is not a non-negative integer");
      total_size = ts->get<uint64_t>();
    }
  }
  return out;
}

// Every tensor of a file, whatever its dtype (verify digests any; tensors() insists on weights).
std::vector<TensorMeta> tensor_list(const st::File& file) {
  std::vector<TensorMeta> out;
  for (const st::TensorInfo& t : file.tensors()) out.push_back(TensorMeta{t.name, t.dtype, t.shape});
  return out;
}

std::vector<std::string> safetensors_files_in(const std::string& folder) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (ends_with(name, ".safetensors") && name.find(".tmp.") == std::string::npos) out.push_back(name);
  }
  if (ec) throw Error(folder + ": cannot list: " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint c;
  c.path_ = path;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    // A single file: st::File::open says what is wrong with it (missing, not safetensors, ...).
    Shard shard{fs::path(path).filename().string(), path, st::File::open(path), {}};
    shard.tensors = tensor_list(shard.data);
    c.shards_.push_back(std::move(shard));
  } else {
    c.folder_ = true;
    const std::string index_path = (fs::path(path) / kIndexFileName).string();
    const std::vector<std::string> present = safetensors_files_in(path);
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      const std::string name = entry.path().filename().string();
      if (entry.is_regular_file() && name != kIndexFileName && !ends_with(name, ".safetensors") &&
          name.find(".tmp.") == std::string::npos)
        c.other_files_.push_back(name);
    }
    std::sort(c.other_files_.begin(), c.other_files_.end());
    std::optional<WeightMap> weight_map;
    std::optional<uint64_t> total_size;
    std::vector<std::string> files;
    if (fs::exists(index_path, ec)) {
      c.index_text_ = read_text(index_path);
      weight_map = parse_index(index_path, c.index_text_, total_size);
      std::set<std::string> named;
      for (const auto& [tensor, file] : *weight_map) named.insert(file);
      for (const std::string& f : named)
        if (!std::binary_search(present.begin(), present.end(), f))
          throw BadInputError(index_path + ": names shard " + f + ", which does not exist");
      for (const std::string& f : present)
        if (!named.count(f)) throw BadInputError((fs::path(path) / f).string() + ": shard not named in " + kIndexFileName);
      files.assign(named.begin(), named.end());
    } else {
      files = present;
      if (files.empty()) throw BadInputError(path + ": folder holds no " + kIndexFileName + " and no *.safetensors files");
    }
    for (const std::string& f : files) {
      const std::string shard_path = (fs::path(path) / f).string();
      Shard shard{f, shard_path, st::File::open(shard_path), {}};
      shard.tensors = tensor_list(shard.data);
      c.shards_.push_back(std::move(shard));
    }
    c.index_names();
    if (weight_map) {
      for (const Shard& s : c.shards_)
        for (const TensorMeta& t : s.tensors) {
          const auto it = weight_map->find(t.name);
          if (it == weight_map->end()) throw BadInputError(s.path + ": tensor " + t.name + " is not in the index's weight_map");
          if (it->second != s.file)
            throw BadInputError(s.path + ": tensor " + t.name + " is mapped to " + it->second + " by " + kIndexFileName);
        }
      for (const auto& [tensor, file] : *weight_map)
        if (!c.by_name_.count(tensor)) throw BadInputError(index_path + ": maps tensor " + tensor + " to " + file + ", which does not hold it");
      if (total_size && *total_size != c.tensor_bytes())
        throw BadInputError(index_path + ": metadata.total_size is " + std::to_string(*total_size) + " but the shards hold " +
                    std::to_string(c.tensor_bytes()) + " bytes of tensors");
    }
    return c;
  }
  c.index_names();
  return c;
}

void Checkpoint::index_names() {
  for (size_t i = 0; i < shards_.size(); ++i) {
    for (const st::TensorInfo& t : shards_[i].data.tensors()) {
      const auto [it, fresh] = by_name_.emplace(t.name, Located{i, &t});
      if (!fresh)
        throw BadInputError(path_ + ": tensor " + t.name + " is in both " + shards_[it->second.shard].file + " and " + shards_[i].file);
    }
  }
}

std::vector<TensorMeta> Checkpoint::tensors() const {
  std::vector<TensorMeta> out;
  for (const Shard& s : shards_) {
    const std::vector<TensorMeta> weights = model_tensors(s.data);  // Error for a non-weight dtype
    out.insert(out.end(), weights.begin(), weights.end());
  }
  return out;
}

std::optional<Checkpoint::Located> Checkpoint::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

uint64_t Checkpoint::tensor_bytes() const {
  uint64_t total = 0;
  for (const Shard& s : shards_)
    for (const st::TensorInfo& t : s.data.tensors()) total += t.nbytes();
  return total;
}

std::optional<uint64_t> Checkpoint::recorded_version() const {
  std::optional<uint64_t> version;
  std::string first;
  for (const Shard& s : shards_) {
    const std::optional<uint64_t> recorded = read_model_version(s.data.metadata(), s.path);
    if (!recorded) continue;
    const uint64_t v = *recorded;
    if (version && *version != v)
      throw BadInputError(path_ + ": shards record different model versions (" + first + " and " + s.file + ")");
    version = v;
    first = s.file;
  }
  return version;
}

std::string index_json(const WeightMap& weight_map, uint64_t total_size) {
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total_size}};
  index["weight_map"] = nlohmann::ordered_json::object();
  for (const auto& [tensor, file] : weight_map) index["weight_map"][tensor] = file;
  return index.dump(2) + "\n";
}

WeightMap plan_shards(std::span<const TensorMeta> tensors, uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> shards;
  uint64_t filled = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint64_t bytes = tensors[t].numel() * tensors[t].width();
    if (shards.empty() || (filled > 0 && filled + bytes > max_shard_bytes)) {
      shards.emplace_back();
      filled = 0;
    }
    shards.back().push_back(t);
    filled += bytes;
  }
  WeightMap out;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    if (shards.size() == 1) std::snprintf(name, sizeof name, "model.safetensors");
    else std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    for (size_t t : shards[s]) out.emplace(tensors[t].name, name);
  }
  return out;
}

FolderWriter::FolderWriter(std::string target) : target_(std::move(target)) {
  while (target_.size() > 1 && target_.back() == '/') target_.pop_back();
  temp_ = temporary_name_for(target_);
  if (::mkdir(temp_.c_str(), 0755) != 0) throw Error(target_ + ": cannot create temporary folder " + temp_ + ": " + std::strerror(errno));
}

FolderWriter::~FolderWriter() {
  if (committed_) return;
  std::error_code ec;
  fs::remove_all(temp_, ec);  // best effort: nothing of it is visible under the target's name
}

std::string FolderWriter::path_of(const std::string& name) const { return (fs::path(temp_) / name).string(); }

void FolderWriter::write_shard(const std::string& name, std::span<const st::WriteTensor> tensors, const st::Metadata& metadata) {
  st::write_file(path_of(name), tensors, metadata);
}

void FolderWriter::write_bytes(const std::string& name, std::span<const uint8_t> bytes) {
  const std::span<const uint8_t> pieces[] = {bytes};
  write_file_atomic(path_of(name), pieces);
}

void FolderWriter::copy_files(const std::string& folder, std::span<const std::string> names) {
  for (const std::string& name : names) {
    std::error_code ec;
    fs::copy_file(fs::path(folder) / name, path_of(name), ec);
    if (ec) throw Error((fs::path(folder) / name).string() + ": cannot copy into the new folder: " + ec.message());
  }
}

void FolderWriter::commit() {
  std::error_code ec;
  const bool exists = fs::exists(fs::symlink_status(target_, ec));
  if (exists && !fs::is_directory(fs::symlink_status(target_, ec)))
    throw Error(target_ + ": exists and is not a folder; refusing to replace it by a checkpoint folder");
  if (!exists) {
    if (std::rename(temp_.c_str(), target_.c_str()) != 0) throw Error(target_ + ": cannot rename into place: " + std::strerror(errno));
  } else {
    // One atomic step: the old folder takes the temporary name and is removed afterwards.
    if (::renameat2(AT_FDCWD, temp_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) != 0)
      throw Error(target_ + ": cannot swap the new folder into place: " + std::strerror(errno));
  }
  committed_ = true;
  sync_parent_folder(target_);
  if (exists) fs::remove_all(temp_, ec);
}

}  // namespace deltasync
