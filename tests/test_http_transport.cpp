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
