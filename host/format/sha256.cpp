#include "format/sha256.hpp"

#include <openssl/evp.h>

#include "core/error.hpp"

namespace deltasync {

struct Sha256::Context {
  EVP_MD_CTX* md = nullptr;
  ~Context() { EVP_MD_CTX_free(md); }
};

Sha256::Sha256() : ctx_(std::make_unique<Context>()) {
  ctx_->md = EVP_MD_CTX_new();
  // Only allocation failure can make these fail: SHA-256 is always in the default provider.
  if (!ctx_->md || EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr) != 1) throw Error("sha256: OpenSSL EVP initialisation failed");
}

Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(std::span<const uint8_t> bytes) {
  if (bytes.empty()) return;  // data() may be null
  if (EVP_DigestUpdate(ctx_->md, bytes.data(), bytes.size()) != 1) throw Error("sha256: OpenSSL EVP update failed");
}

std::array<uint8_t, 32> Sha256::finish() {
  std::array<uint8_t, 32> out{};
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(ctx_->md, out.data(), &length) != 1 || length != out.size())
    throw Error("sha256: OpenSSL EVP final failed");
  return out;
}

std::array<uint8_t, 32> sha256(std::span<const uint8_t> bytes) {
  Sha256 h;
  h.update(bytes);
  return h.finish();
}

std::string to_hex(std::span<const uint8_t> bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

std::string sha256_hex(std::span<const uint8_t> bytes) { return to_hex(sha256(bytes)); }

}  // namespace deltasync
