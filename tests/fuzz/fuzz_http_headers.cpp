// Fuzzes HTTP response header handling and redirects (host/store/http_transport.cpp): header
// lines as libcurl hands them to us (add_header_line), then the redirect a Location header
// asks for (redirected_request: same origin, or a pre-signed GET elsewhere, as a Hugging Face
// or S3 gateway answers), and the URL helpers the decision rests on.
// Input: byte 0 picks the original request (bits 0-1 URL, 2-4 method, 5 pre-signed redirect
// policy, 6 signed), the rest is header lines separated by '\n'.
// Invariants: credentials never leave their origin (a request to another origin is an
// unsigned GET carrying only Range, and goes over HTTPS unless both ends are loopback), a
// same-origin redirect keeps the request as it was but for its URL, and an error message's
// URL (redact_url) never shows a query or user:password@.
#include <algorithm>

#include "core/error.hpp"
#include "fuzz_model.hpp"
#include "store/http_transport.hpp"

using namespace deltasync;

namespace {

const char* const kUrls[] = {
    "https://bucket.s3.us-east-1.amazonaws.com/prefix/deltas/00000000000000000006-0123456789ab.safetensors",
    "https://s3.huggingface.co/user-bucket/anchors/00000000000000000005-abcdef012345/part-00000.safetensors",
    "http://127.0.0.1:9000/bucket/LATEST",
    "http://user:secret@localhost:8080/bucket/manifests/00000000000000000006.json?versionId=3",
};
const char* const kMethods[] = {"GET", "HEAD", "PUT", "POST", "DELETE"};

bool has_credentials_in_clear(const std::string& redacted) {
  if (redacted.find('?') != std::string::npos && redacted.find("?...") != redacted.size() - 4) return true;
  const auto scheme_end = redacted.find("://");
  const auto authority = scheme_end == std::string::npos ? 0 : scheme_end + 3;
  const auto end = redacted.find('/', authority);
  return redacted.substr(authority, end == std::string::npos ? std::string::npos : end - authority).find('@') != std::string::npos;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const http::AwsSigning aws{"aws:amz:us-east-1:s3", "AKIDEXAMPLE", "wJalrXUtnFEMI"};
  http::Request request;
  request.url = kUrls[data[0] % 4];
  request.method = kMethods[((data[0] >> 2) & 7) % 5];
  request.redirects = (data[0] & 0x20) ? http::RedirectPolicy::PresignedGet : http::RedirectPolicy::SameOrigin;
  request.aws = (data[0] & 0x40) ? &aws : nullptr;
  request.headers = {"Range: bytes=0-99", "If-Match: \"etag\"", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
                     "Authorization: Bearer hf_token"};

  http::Response response;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    end = end == std::string_view::npos ? text.size() : end + 1;
    http::add_header_line(response.headers, text.substr(at, end - at));
    at = end;
  }
  for (const auto& [name, value] : response.headers) {
    if (std::any_of(name.begin(), name.end(), [](unsigned char c) { return c >= 'A' && c <= 'Z'; }))
      fuzz::fail("a header name kept upper case");
    if (!value.empty() && (value.front() == ' ' || value.back() == '\n' || value.back() == '\r'))
      fuzz::fail("a header value kept surrounding blanks");
  }
  const std::string location = response.header("location");
  if (location.empty()) return 0;
  http::Request next;
  try {
    next = http::redirected_request(request, location, "fuzz redirect");
  } catch (const Error&) {
    if (has_credentials_in_clear(http::redact_url(location))) fuzz::fail("a redacted URL shows a query or credentials");
    return 0;
  }
  if (has_credentials_in_clear(http::redact_url(next.url))) fuzz::fail("a redacted URL shows a query or credentials");
  if (http::origin_of(next.url) == http::origin_of(request.url)) {
    if (next.method != request.method || next.aws != request.aws || next.headers != request.headers)
      fuzz::fail("a same-origin redirect changed the request");
    return 0;
  }
  if (request.redirects != http::RedirectPolicy::PresignedGet || request.method != "GET")
    fuzz::fail("followed a redirect to another origin the policy does not allow");
  if (next.aws != nullptr || next.method != "GET") fuzz::fail("a cross-origin follow-up is signed or not a GET");
  for (const auto& h : next.headers)
    if (h.rfind("Range:", 0) != 0) fuzz::fail("a cross-origin follow-up carries a header other than Range");
  const bool https = http::origin_of(next.url).rfind("https://", 0) == 0;
  if (!https && !(http::is_loopback(next.url) && http::is_loopback(request.url)))
    fuzz::fail("a cross-origin follow-up goes over plain HTTP off loopback");
  return 0;
}
