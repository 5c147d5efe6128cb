// The folder store: one file per object under a root folder. Writes go to a temporary name in
// the target's folder, are fsynced, then renamed (put) or hard-linked (put_if_absent: link()
// fails with EEXIST instead of replacing, so of two concurrent creators exactly one wins), and
// the folder is fsynced so the new name survives a crash. A compare-and-swap (put_if_match)
// compares and renames while holding an exclusive flock() on the target's folder, so of two
// concurrent swaps from the same tag exactly one wins; the kernel drops the lock of a writer that
// dies, so none is ever left stale, and no lock file is left in the store.
#include <sys/file.h>
#include <time.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "store/store.hpp"

namespace deltasync {
namespace {

namespace fs = std::filesystem;

std::string errno_text(int err) { return std::strerror(err); }

// Temporary files carry this marker so list() never reports them.
constexpr const char* kTempMarker = ".deltasync-tmp.";

bool is_temp_name(const std::string& filename) { return filename.find(kTempMarker) != std::string::npos; }

void validate_key(const std::string& key, const std::string& label) {
  if (key.empty() || key.front() == '/' || key.back() == '/') throw Error(label + ": invalid object key");
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find('/', start);
    if (end == std::string::npos) end = key.size();
    std::string_view part(key.data() + start, end - start);
    if (part.empty() || part == "." || part == "..") throw Error(label + ": invalid object key");
    start = end + 1;
  }
  if (is_temp_name(key)) throw Error(label + ": object keys may not contain '" + kTempMarker + "'");
}

int flock_retrying(int fd) {
  int rc;
  do rc = ::flock(fd, LOCK_EX);
  while (rc != 0 && errno == EINTR);
  return rc;
}

std::string etag_of(const struct stat& st) {
  return std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) + "-" +
         std::to_string(st.st_size) + "-" + std::to_string(st.st_ino);
}

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some filesystems refuse to open folders
  ::fsync(fd);
  ::close(fd);
}

class FdGuard {
 public:
  explicit FdGuard(int fd) : fd_(fd) {}
  ~FdGuard() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdGuard(FdGuard&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  int get() const { return fd_; }
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  FdGuard& operator=(FdGuard&&) = delete;

 private:
  int fd_;
};

void read_exact(int fd, uint8_t* out, uint64_t n, uint64_t offset, const std::string& label) {
  while (n > 0) {
    ssize_t got = ::pread(fd, out, std::min<uint64_t>(n, 1ull << 30), static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(label + ": read failed: " + errno_text(errno));
    }
    if (got == 0) throw Error(label + ": object shrank while being read");
    out += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

class FolderStore final : public Store {
 public:
  explicit FolderStore(fs::path root) : root_(std::move(root)) {}

  std::string url() const override { return "file://" + root_.string(); }

  void put(const std::string& key, std::span<const uint8_t> bytes) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    const std::string label = describe(key);
    validate_key(key, label);
    fs::path target = root_ / key;
    std::string tmp = write_temp(target, bytes, label);
    if (::rename(tmp.c_str(), target.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      throw Error(label + ": rename failed: " + errno_text(err));
    }
    fsync_dir(target.parent_path());
  }

  bool put_if_absent(const std::string& key, std::span<const uint8_t> bytes) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    const std::string label = describe(key);
    validate_key(key, label);
    fs::path target = root_ / key;
    if (::access(target.c_str(), F_OK) == 0) return false;
    std::string tmp = write_temp(target, bytes, label);
    int rc = ::link(tmp.c_str(), target.c_str());
    int err = errno;
    ::unlink(tmp.c_str());
    if (rc != 0) {
      if (err == EEXIST) return false;
      throw Error(label + ": exclusive create failed: " + errno_text(err));
    }
    fsync_dir(target.parent_path());
    return true;
  }

  bool supports_put_if_match() const override { return true; }

  bool put_if_match(const std::string& key, std::span<const uint8_t> bytes, const std::string& etag) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    const std::string label = describe(key);
    validate_key(key, label);
    fs::path target = root_ / key;
    std::string tmp = write_temp(target, bytes, label);
    FdGuard lock(::open(target.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (lock.get() < 0 || flock_retrying(lock.get()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      throw Error(label + ": cannot lock for a conditional replace: " + errno_text(err));
    }
    struct stat st {};
    if (::stat(target.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || etag_of(st) != etag) {
      ::unlink(tmp.c_str());
      return false;  // absent, or replaced since the caller read its tag
    }
    // The tag is mtime, size and inode; file times tick coarsely and a freed inode number comes
    // back, so two swaps within one tick could bring back an old tag. Each swap's mtime is made
    // strictly newer than the one it replaces, so no tag ever returns.
    struct timespec now {};
    ::clock_gettime(CLOCK_REALTIME, &now);
    if (now.tv_sec < st.st_mtim.tv_sec || (now.tv_sec == st.st_mtim.tv_sec && now.tv_nsec <= st.st_mtim.tv_nsec)) {
      now = st.st_mtim;
      if (++now.tv_nsec == 1000000000) now = {now.tv_sec + 1, 0};
    }
    const struct timespec times[2] = {{0, UTIME_OMIT}, now};
    if (::utimensat(AT_FDCWD, tmp.c_str(), times, 0) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      throw Error(label + ": cannot set the modification time: " + errno_text(err));
    }
    if (::rename(tmp.c_str(), target.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      throw Error(label + ": rename failed: " + errno_text(err));
    }
    fsync_dir(target.parent_path());
    return true;  // the lock goes with the descriptor
  }

  std::vector<uint8_t> get(const std::string& key) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    struct stat st {};
    FdGuard fd = open_existing(key, st);
    std::vector<uint8_t> out(static_cast<size_t>(st.st_size));
    read_exact(fd.get(), out.data(), out.size(), 0, describe(key));
    report(out.size(), out.size());
    return out;
  }

  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t length) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    struct stat st {};
    FdGuard fd = open_existing(key, st);
    uint64_t size = static_cast<uint64_t>(st.st_size);
    if (offset > size) throw Error(describe(key) + ": range starts at " + std::to_string(offset) + " past the end (" + std::to_string(size) + " bytes)");
    std::vector<uint8_t> out(static_cast<size_t>(std::min(length, size - offset)));
    read_exact(fd.get(), out.data(), out.size(), offset, describe(key));
    return out;
  }

  ConditionalGet get_if_changed(const std::string& key, const std::string& etag) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    struct stat st {};
    FdGuard fd = open_existing(key, st);
    std::string now = etag_of(st);
    if (!etag.empty() && now == etag) return ConditionalGet{false, {}, now};
    std::vector<uint8_t> out(static_cast<size_t>(st.st_size));
    read_exact(fd.get(), out.data(), out.size(), 0, describe(key));
    return ConditionalGet{true, std::move(out), now};
  }

  std::optional<ObjectInfo> head(const std::string& key) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    validate_key(key, describe(key));
    struct stat st {};
    if (::stat((root_ / key).c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
      throw Error(describe(key) + ": stat failed: " + errno_text(errno));
    }
    if (!S_ISREG(st.st_mode)) return std::nullopt;
    return ObjectInfo{key, static_cast<uint64_t>(st.st_size), etag_of(st)};
  }

  std::vector<ObjectInfo> list(const std::string& prefix) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    // Walk only the folder the prefix points into, then filter by the full prefix.
    std::string dir_part = prefix.substr(0, prefix.rfind('/') == std::string::npos ? 0 : prefix.rfind('/'));
    fs::path start = dir_part.empty() ? root_ : root_ / dir_part;
    std::vector<ObjectInfo> out;
    std::error_code ec;
    if (!fs::is_directory(start, ec)) return out;
    for (auto it = fs::recursive_directory_iterator(start, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (!it->is_regular_file(ec)) continue;
      // Hidden files are never objects: temporary files of writers in progress (ours, or the
      // Python package's ".NAME.tmp.HEX"), editor and OS droppings.
      std::string filename = it->path().filename().string();
      if (filename.empty() || filename[0] == '.' || is_temp_name(filename)) continue;
      std::string key = fs::relative(it->path(), root_).generic_string();
      if (key.rfind(prefix, 0) != 0) continue;
      struct stat st {};
      if (::stat(it->path().c_str(), &st) != 0) continue;  // removed while listing
      out.push_back(ObjectInfo{key, static_cast<uint64_t>(st.st_size), etag_of(st)});
    }
    if (ec && ec != std::errc::no_such_file_or_directory) throw Error(url() + "/" + prefix + ": list failed: " + ec.message());
    std::sort(out.begin(), out.end(), [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  void remove(const std::string& key) override {
    requests_.fetch_add(1, std::memory_order_relaxed);
    validate_key(key, describe(key));
    fs::path target = root_ / key;
    if (::unlink(target.c_str()) != 0 && errno != ENOENT) throw Error(describe(key) + ": delete failed: " + errno_text(errno));
    // Drop folders left empty (anchors/vN/), never the root; rmdir fails harmlessly otherwise.
    for (fs::path dir = target.parent_path(); dir != root_ && dir.string().size() > root_.string().size(); dir = dir.parent_path()) {
      if (::rmdir(dir.c_str()) != 0) break;
    }
  }

 private:
  FdGuard open_existing(const std::string& key, struct stat& st) {
    const std::string label = describe(key);
    validate_key(key, label);
    int fd = ::open((root_ / key).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT || errno == ENOTDIR) throw NotFoundError(label + ": no such object");
      throw Error(label + ": open failed: " + errno_text(errno));
    }
    FdGuard guard(fd);
    if (::fstat(fd, &st) != 0) throw Error(label + ": stat failed: " + errno_text(errno));
    if (!S_ISREG(st.st_mode)) throw NotFoundError(label + ": not a regular file");
    return guard;
  }

  std::string write_temp(const fs::path& target, std::span<const uint8_t> bytes, const std::string& label) {
    std::error_code ec;
    fs::create_directories(target.parent_path(), ec);
    if (ec) throw Error(label + ": cannot create folder: " + ec.message());
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    char suffix[17];
    std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(rng()));
    // Built by appending: GCC 12 misreports `"." + std::string&&` under -Wrestrict.
    std::string name(".");
    name.append(target.filename().string()).append(kTempMarker).append(suffix);
    std::string tmp = (target.parent_path() / name).string();
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) throw Error(label + ": cannot create temporary file: " + errno_text(errno));
    FdGuard guard(fd);
    const uint8_t* p = bytes.data();
    uint64_t left = bytes.size(), done = 0;
    while (left > 0) {
      ssize_t n = ::write(fd, p, std::min<uint64_t>(left, 1ull << 30));
      if (n < 0) {
        if (errno == EINTR) continue;
        int err = errno;
        ::unlink(tmp.c_str());
        throw Error(label + ": write failed: " + errno_text(err));
      }
      p += n;
      left -= static_cast<uint64_t>(n);
      done += static_cast<uint64_t>(n);
      report(done, bytes.size());
    }
    if (::fsync(fd) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      throw Error(label + ": fsync failed: " + errno_text(err));
    }
    return tmp;
  }

  void report(uint64_t done, uint64_t total) {
    if (progress_) progress_(done, total);
  }

  fs::path root_;
};

}  // namespace

std::unique_ptr<Store> open_folder_store(const std::string& path) {
  if (path.empty()) throw Error("file://: empty folder path");
  std::error_code ec;
  fs::path root = fs::absolute(fs::path(path), ec).lexically_normal();
  if (ec) throw Error("file://" + path + ": " + ec.message());
  std::string s = root.string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  // The folder is created by the first write, so a reader never leaves an empty store behind.
  if (fs::exists(s, ec) && !fs::is_directory(s, ec)) throw Error("file://" + s + ": not a folder");
  return std::make_unique<FolderStore>(fs::path(s));
}

}  // namespace deltasync
