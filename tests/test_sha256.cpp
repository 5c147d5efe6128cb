// SHA-256 (OpenSSL EVP behind the streaming API) against the FIPS 180-4 example vectors, and
// streaming in odd pieces.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "format/sha256.hpp"

namespace {

std::span<const uint8_t> bytes_of(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(deltasync::sha256_hex(bytes_of("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(deltasync::sha256_hex(bytes_of("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(deltasync::sha256_hex(bytes_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(deltasync::sha256_hex(bytes_of(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, StreamingEqualsOneShot) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>((i * 131) & 0xff);
  for (size_t step : {1u, 3u, 55u, 56u, 63u, 64u, 65u, 200u}) {
    deltasync::Sha256 h;
    for (size_t at = 0; at < text.size(); at += step) h.update(bytes_of(text.substr(at, step)));
    auto d = h.finish();
    EXPECT_EQ(deltasync::to_hex(d), deltasync::sha256_hex(bytes_of(text))) << "step " << step;
  }
}

TEST(Sha256, EmptyUpdatesChangeNothing) {
  // Empty spans (data() may be null) between and around chunks, with a partial block pending.
  std::string text(100, 'q');
  deltasync::Sha256 h;
  h.update({});
  h.update(bytes_of(text.substr(0, 30)));
  h.update({});
  h.update(std::span<const uint8_t>(static_cast<const uint8_t*>(nullptr), 0));
  h.update(bytes_of(text.substr(30)));
  h.update({});
  EXPECT_EQ(deltasync::to_hex(h.finish()), deltasync::sha256_hex(bytes_of(text)));
  EXPECT_EQ(deltasync::sha256_hex({}), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, TwoBlockVectorAndMovedHasher) {
  // FIPS 180-4's 896-bit message (the padding spills into a second block), hashed by a hasher
  // that was moved mid-stream: the EVP context travels with it.
  const std::string text =
      "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
  deltasync::Sha256 first;
  first.update(bytes_of(text.substr(0, 50)));
  deltasync::Sha256 moved(std::move(first));
  moved.update(bytes_of(text.substr(50)));
  EXPECT_EQ(deltasync::to_hex(moved.finish()), "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
}

}  // namespace
