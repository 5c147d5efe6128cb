// SHA-256 (FIPS 180-4). S3 signs the payload hash (x-amz-content-sha256) and manifests name
// every object by its hash, so one implementation serves both; no crypto library is linked.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>

namespace deltasync {

class Sha256 {
 public:
  Sha256();
  void update(std::span<const uint8_t> bytes);
  std::array<uint8_t, 32> finish();  // the object must not be updated afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  uint64_t total_ = 0;
  size_t used_ = 0;
};

std::array<uint8_t, 32> sha256(std::span<const uint8_t> bytes);
// Lowercase hex of the digest (64 characters).
std::string sha256_hex(std::span<const uint8_t> bytes);
std::string to_hex(std::span<const uint8_t> bytes);

}  // namespace deltasync
