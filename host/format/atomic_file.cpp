#include "format/atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

#include "core/error.hpp"

namespace deltasync {

namespace {

std::string errno_text() { return std::strerror(errno); }

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

std::string temporary_name_for(const std::string& path) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char suffix[17];
  std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(rng()));
  return path + ".tmp." + suffix;
}

void sync_parent_folder(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0 || ::fsync(fd.get()) != 0) throw Error(path + ": cannot sync folder " + dir + ": " + errno_text());
}

void write_file_atomic(const std::string& path,
                       const std::function<void(const std::function<void(std::span<const uint8_t>)>&)>& produce) {
  const std::string temp = temporary_name_for(path);
  Fd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw Error(path + ": cannot create temporary file " + temp + ": " + errno_text());
  try {
    produce([&](std::span<const uint8_t> bytes) {
      while (!bytes.empty()) {
        const ssize_t n = ::write(fd.get(), bytes.data(), bytes.size());
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw Error(path + ": write failed: " + errno_text());
        bytes = bytes.subspan(static_cast<size_t>(n));
      }
    });
    if (::fsync(fd.get()) != 0) throw Error(path + ": fsync failed: " + errno_text());
    if (::close(fd.release()) != 0) throw Error(path + ": close failed: " + errno_text());
    if (std::rename(temp.c_str(), path.c_str()) != 0) throw Error(path + ": cannot rename into place: " + errno_text());
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  sync_parent_folder(path);
}

void write_file_atomic(const std::string& path, std::span<const std::span<const uint8_t>> pieces) {
  write_file_atomic(path, [&](const auto& write) {
    for (const auto& piece : pieces) write(piece);
  });
}

}  // namespace deltasync
