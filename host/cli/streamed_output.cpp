#include "streamed_output.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include "core/error.hpp"
#include "format/atomic_file.hpp"

namespace deltasync::cli {
namespace {

void write_all_at(int fd, const uint8_t* data, uint64_t size, uint64_t offset, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error(path + ": cannot write: " + std::strerror(errno));
    data += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

}  // namespace

StreamedOutput::StreamedOutput(const std::string& path, std::vector<TensorMeta> tensors, std::optional<uint64_t> version,
                               std::span<const uint64_t> digests, const FolderLayout* layout, uint64_t max_shard_bytes)
    : path_(path), tensors_(std::move(tensors)), layout_(layout) {
  const OutputPlan plan = plan_output(tensors_, version, digests, path, layout, max_shard_bytes);
  if (plan.folder) folder_ = std::make_unique<FolderWriter>(path);
  index_text_ = plan.index;
  slots_.resize(tensors_.size());
  for (size_t t = 0; t < tensors_.size(); ++t) index_.emplace(tensors_[t].name, t);
  for (const OutputFile& file : plan.files) {
    std::vector<TensorMeta> members;
    for (size_t t : file.members) members.push_back(tensors_[t]);
    const std::string header = st::header_of(members, file.metadata);
    const std::string temp = folder_ ? folder_->path_of(file.name) : temporary_name_for(path);
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) throw Error(temp + ": cannot create: " + std::strerror(errno));
    file_paths_.push_back(temp);
    fds_.push_back(fd);
    write_all_at(fd, reinterpret_cast<const uint8_t*>(header.data()), header.size(), 0, temp);
    uint64_t offset = header.size();
    for (size_t t : file.members) {
      slots_[t] = Slot{fds_.size() - 1, offset, false};
      offset += tensors_[t].numel() * tensors_[t].width();
    }
    if (::ftruncate(fd, static_cast<off_t>(offset)) != 0) throw Error(temp + ": cannot size: " + std::strerror(errno));
  }
}

StreamedOutput::~StreamedOutput() {
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
  // A folder's temporary folder goes with folder_; a single file's temporary is ours to remove.
  if (!committed_ && !folder_)
    for (const auto& p : file_paths_) std::remove(p.c_str());
}

void StreamedOutput::write(const TensorMeta& meta, std::span<const uint8_t> bytes) {
  const auto it = index_.find(meta.name);
  if (it == index_.end()) throw Error(path_ + ": tensor " + meta.name + " is not in the anchor's tensor table");
  const TensorMeta& want = tensors_[it->second];
  Slot& slot = slots_[it->second];
  if (meta.dtype != want.dtype || meta.shape != want.shape || bytes.size() != want.numel() * want.width())
    throw Error(path_ + ": tensor " + meta.name + " differs from the anchor's tensor table");
  if (slot.written) throw Error(path_ + ": tensor " + meta.name + " written twice");
  write_all_at(fds_[slot.file], bytes.data(), bytes.size(), slot.offset, file_paths_[slot.file]);
  slot.written = true;
}

const std::string& StreamedOutput::staged_path() const { return folder_ ? folder_->temporary_path() : file_paths_.front(); }

void StreamedOutput::finish() {
  if (finished_) return;
  for (size_t t = 0; t < tensors_.size(); ++t)
    if (!slots_[t].written) throw Error(path_ + ": tensor " + tensors_[t].name + " never arrived");
  for (size_t f = 0; f < fds_.size(); ++f) {
    if (::fsync(fds_[f]) != 0 || ::close(fds_[f]) != 0) {
      fds_[f] = -1;
      throw Error(file_paths_[f] + ": cannot write: " + std::strerror(errno));
    }
    fds_[f] = -1;
  }
  if (folder_) {
    if (index_text_)
      folder_->write_bytes(kIndexFileName, {reinterpret_cast<const uint8_t*>(index_text_->data()), index_text_->size()});
    if (layout_) folder_->copy_files(layout_->folder, layout_->other_files);
  }
  finished_ = true;
}

void StreamedOutput::commit() {
  finish();
  if (folder_) {
    folder_->commit();
  } else {
    if (std::rename(file_paths_.front().c_str(), path_.c_str()) != 0)
      throw Error(path_ + ": cannot rename into place: " + std::strerror(errno));
    sync_parent_folder(path_);
  }
  committed_ = true;
}

}  // namespace deltasync::cli
