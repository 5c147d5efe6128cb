// SHA-256 (FIPS 180-4). S3 signs the payload hash (x-amz-content-sha256) and manifests name
// every object by its hash, so one implementation serves both; no crypto library is linked.
// Uses the x86 SHA extensions when the CPU has them (about 10x the portable code), chosen at
// run time.
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
  void compress(const uint8_t* blocks, size_t count);  // count × 64 bytes
  uint32_t h_[8];
  uint8_t buf_[64];
  uint64_t total_ = 0;
  size_t used_ = 0;
};

std::array<uint8_t, 32> sha256(std::span<const uint8_t> bytes);
// Lowercase hex of the digest (64 characters).
std::string sha256_hex(std::span<const uint8_t> bytes);
std::string to_hex(std::span<const uint8_t> bytes);

namespace detail {
// The portable code path whatever the CPU (tests compare both paths).
std::string sha256_hex_portable(std::span<const uint8_t> bytes);
// True when sha256() uses the CPU's SHA extensions.
bool sha256_uses_cpu_extensions();
}  // namespace detail

}  // namespace deltasync
