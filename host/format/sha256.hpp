// SHA-256 through OpenSSL's EVP interface (libcrypto, which libcurl already brings). S3 signs the
// payload hash (x-amz-content-sha256), manifests name every object by its hash and the compact
// indexed layout hashes its records, block indexes and blocks, so all use this one streaming API
// (format layer: the codec below the stores needs it). EVP picks the CPU's SHA extensions.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace deltasync {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  void update(std::span<const uint8_t> bytes);
  std::array<uint8_t, 32> finish();  // the object must not be updated afterwards

 private:
  struct Context;
  std::unique_ptr<Context> ctx_;
};

std::array<uint8_t, 32> sha256(std::span<const uint8_t> bytes);
// Lowercase hex of the digest (64 characters).
std::string sha256_hex(std::span<const uint8_t> bytes);
std::string to_hex(std::span<const uint8_t> bytes);

}  // namespace deltasync
