// Helpers shared by the GoogleTest executables: a scratch folder that cleans up after itself,
// reproducible random bytes, whole-file I/O, a raw safetensors container builder for crafting
// malformed files, and a way to capture the message of an expected deltasync::Error.
// Everything is inline in the global namespace so that any test file can just include it.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"

// A fresh folder under the system temp directory, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "deltasync-test-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }

  const std::filesystem::path& path() const { return path_; }
  // Path of an entry inside the folder, as a string (the form the library's APIs take).
  std::string file(std::string_view name) const { return (path_ / name).string(); }
  // Names of the entries in the folder, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(path_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::filesystem::path path_;
};

// n pseudo-random bytes, the same for the same seed on every machine (splitmix64).
inline std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> bytes(n);
  uint64_t state = seed;
  for (size_t i = 0; i < n; i += 8) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(bytes.data() + i, &z, std::min<size_t>(8, n - i));
  }
  return bytes;
}

inline std::vector<uint8_t> read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_file_bytes(const std::string& path, std::span<const uint8_t> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

// A safetensors container exactly as given: 8-byte little-endian length of `header`, the header
// text unpadded, then `data`. For building malformed files byte by byte.
inline std::vector<uint8_t> safetensors_bytes(std::string_view header, std::span<const uint8_t> data = {}) {
  std::vector<uint8_t> bytes(8 + header.size() + data.size());
  const uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(length >> (8 * i));
  std::copy(header.begin(), header.end(), bytes.begin() + 8);
  std::copy(data.begin(), data.end(), bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header.size()));
  return bytes;
}

// Runs `action`, which must throw deltasync::Error, and returns the message (the test fails, and
// "" is returned, when nothing or something else is thrown).
template <typename Action>
std::string error_message(Action&& action) {
  try {
    action();
  } catch (const deltasync::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected deltasync::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected deltasync::Error, nothing was thrown";
  return "";
}
