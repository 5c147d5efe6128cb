// Pieces of the HTTP transport shared by the S3 and plain HTTP stores that need no server:
// Range headers at the edges of 64-bit offsets, cutting a range out of a whole body when a
// server ignores Range, and URLs made fit for error messages.
#include <gtest/gtest.h>

#include <limits>

#include "store/http_transport.hpp"

namespace {

using namespace deltasync::http;

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

TEST(RangeHeader, ClosedRange) {
  EXPECT_EQ(range_header(0, 1), "Range: bytes=0-0");
  EXPECT_EQ(range_header(10, 5), "Range: bytes=10-14");
}

TEST(RangeHeader, EverythingFromAnOffsetStaysOpenInsteadOfWrapping) {
  // offset + length - 1 wrapped to 8 here: "bytes=10-8", which servers ignore (200, whole body).
  EXPECT_EQ(range_header(10, kMax), "Range: bytes=10-");
  EXPECT_EQ(range_header(11, kMax - 9), "Range: bytes=11-");  // one past 2^64 - 1
  // The last byte 2^64 - 1 is still representable: the range stays closed.
  EXPECT_EQ(range_header(1, kMax), "Range: bytes=1-" + std::to_string(kMax));
  EXPECT_EQ(range_header(0, kMax), "Range: bytes=0-" + std::to_string(kMax - 1));
  EXPECT_EQ(range_header(kMax, 1), "Range: bytes=" + std::to_string(kMax) + "-" + std::to_string(kMax));
}

TEST(CutRange, WithinAtTheEndAndPastIt) {
  const std::vector<uint8_t> whole{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  EXPECT_EQ(cut_range(whole, 2, 3), (std::vector<uint8_t>{2, 3, 4}));
  EXPECT_EQ(cut_range(whole, 8, 100), (std::vector<uint8_t>{8, 9}));
  EXPECT_EQ(cut_range(whole, 8, kMax), (std::vector<uint8_t>{8, 9}));  // no offset + length overflow
  EXPECT_TRUE(cut_range(whole, 10, 1).empty());
  EXPECT_TRUE(cut_range(whole, kMax, kMax).empty());
}

TEST(RedactUrl, DropsCredentialsAndQuery) {
  EXPECT_EQ(redact_url("https://host:8443/base/dir"), "https://host:8443/base/dir");
  EXPECT_EQ(redact_url("https://user:pa55@host/base"), "https://host/base");
  EXPECT_EQ(redact_url("s3://AKIAEXAMPLE:s3cr3t@bucket/prefix"), "s3://bucket/prefix");
  EXPECT_EQ(redact_url("https://host/obj?X-Amz-Signature=abc&X-Amz-Credential=k"), "https://host/obj?...");
  EXPECT_EQ(redact_url("https://u:p@host/a@b?sig=1#frag"), "https://host/a@b?...");
  EXPECT_EQ(redact_url("https://host/a@b"), "https://host/a@b");  // an '@' in the path is not userinfo
  EXPECT_EQ(redact_url("ftp://u:secret@host"), "ftp://host");
}

}  // namespace

namespace sigv4 {

TEST(Sigv4Query, SortsByEncodedNameAndEncodesEveryReservedCharacter) {
  // An AWS continuation token (base64: '+', '/', '='), a prefix with '/', ' ' and '~', a delimiter.
  EXPECT_EQ(sigv4_query({{"prefix", "run 1/manifests/~x"}, {"list-type", "2"}, {"continuation-token", "1+/ab=="},
                         {"delimiter", "/"}, {"max-keys", "7"}}),
            "continuation-token=1%2B%2Fab%3D%3D&delimiter=%2F&list-type=2&max-keys=7&prefix=run%201%2Fmanifests%2F~x");
  EXPECT_EQ(sigv4_query({{"uploads", ""}}), "uploads=");
  EXPECT_EQ(sigv4_query({{"uploadId", "a&b"}, {"partNumber", "10"}}), "partNumber=10&uploadId=a%26b");
  // Uppercase sorts before lowercase (byte order), as SigV4 requires.
  EXPECT_EQ(sigv4_query({{"b", "1"}, {"B", "2"}, {"a", "3"}}), "B=2&a=3&b=1");
}

}  // namespace sigv4

TEST(Loopback, OnlyLoopbackHosts) {
  EXPECT_TRUE(is_loopback("http://127.0.0.1:9000/x"));
  EXPECT_TRUE(is_loopback("http://127.0.0.2/x"));
  EXPECT_TRUE(is_loopback("http://localhost:1/"));
  EXPECT_TRUE(is_loopback("http://[::1]:80/"));
  EXPECT_FALSE(is_loopback("http://127example.com/"));
  EXPECT_FALSE(is_loopback("https://s3.hf.co/ns"));
}

TEST(PresignedFollowUp, DropsCredentialsAndConditionsKeepsTheRange) {
  AwsSigning signing{"aws:amz:us-east-1:s3", "HFAKEXAMPLE", "secret"};
  Request original;
  original.url = "https://s3.hf.co/ns/bucket/key";
  original.aws = &signing;
  original.redirects = RedirectPolicy::PresignedGet;
  original.headers = {"Range: bytes=0-99", "x-amz-content-sha256: e3b0", "X-Amz-Security-Token: tok",
                      "Authorization: AWS4-HMAC-SHA256 ...", "If-Match: \"abc\"", "If-None-Match: \"abc\""};
  const Request next = presigned_follow_up(original, "https://cdn.example/blob?X-Amz-Signature=s3cr3t", "hf://b/key");
  EXPECT_EQ(next.method, "GET");
  EXPECT_EQ(next.aws, nullptr);
  EXPECT_EQ(next.url, "https://cdn.example/blob?X-Amz-Signature=s3cr3t");
  EXPECT_EQ(next.headers, std::vector<std::string>{"Range: bytes=0-99"});
}

TEST(PresignedFollowUp, RefusesPlainHttpUnlessLoopbackToLoopback) {
  Request original;
  original.url = "https://s3.hf.co/ns/bucket/key";
  auto refused = [&](const std::string& target) {
    try {
      presigned_follow_up(original, target, "hf://b/key");
      return std::string();
    } catch (const deltasync::Error& e) {
      return std::string(e.what());
    }
  };
  const std::string why = refused("http://cdn.example/blob?X-Amz-Signature=s3cr3t");
  EXPECT_NE(why.find("hf://b/key: GET redirected to http://cdn.example/blob?..., which is not HTTPS"), std::string::npos) << why;
  EXPECT_EQ(why.find("s3cr3t"), std::string::npos);
  // From HTTPS, even a loopback plain-HTTP target is refused; from plain HTTP on loopback it is allowed.
  EXPECT_FALSE(refused("http://127.0.0.2:1/blob").empty());
  original.url = "http://127.0.0.1:9000/bucket/key";
  EXPECT_TRUE(refused("http://127.0.0.2:1/blob?sig=1").empty());
  EXPECT_FALSE(refused("http://cdn.example/blob").empty());
}
