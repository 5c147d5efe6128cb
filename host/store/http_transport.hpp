// One HTTP exchange over libcurl, and the retry loop around it shared by the S3 and plain HTTP
// stores. Internal to the host library.
//
// Secrets travel only in curl options (CURLOPT_USERNAME/PASSWORD for SigV4) and in headers the
// caller marks as secret; neither ever appears in an error message: errors name the object
// label the caller gives ("s3://bucket/key"), the verb, the status and the server's error code.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "store/store.hpp"

namespace deltasync::http {

// SigV4 signing by libcurl: provider string "aws:amz:REGION:s3" plus the key pair.
struct AwsSigning {
  std::string sigv4;  // CURLOPT_AWS_SIGV4 parameter
  std::string access_key;
  std::string secret_key;
};

// Where perform_with_retries may follow a redirect.
enum class RedirectPolicy {
  SameOrigin,    // only to the same scheme, host and port (credentials stay where they belong)
  PresignedGet,  // also a GET to another host whose URL is pre-signed (an S3 gateway's 302/307 to
                 // a CDN): followed without signing, Authorization or any x-amz-* header, only
                 // to HTTPS (or to loopback when the original request was plain HTTP on loopback)
};

struct Request {
  std::string method = "GET";  // GET HEAD PUT POST DELETE
  std::string url;
  std::vector<std::string> headers;  // "Name: value"
  std::span<const uint8_t> body;     // sent for PUT and POST
  const AwsSigning* aws = nullptr;
  RedirectPolicy redirects = RedirectPolicy::SameOrigin;
  std::atomic<uint64_t>* sent = nullptr;  // counts every exchange perform_with_retries makes (may be null)
};

struct Response {
  long status = 0;
  std::map<std::string, std::string> headers;  // lowercase names, of the final response
  std::vector<uint8_t> body;
  // True when perform_with_retries followed a redirect to another origin (a gateway's pre-signed
  // redirect to a CDN): status, headers and body are the CDN's, so its ETag is not the store's
  // and the conditional headers of the request never reached the store.
  bool from_other_origin = false;
  std::string header(const std::string& lower_name) const;
};

// A failure below HTTP (connect, timeout, connection dropped mid-body, TLS).
class TransportError : public Error {
 public:
  explicit TransportError(const std::string& what) : Error(what, ErrorKind::kStoreUnavailable) {}
};

// What a final non-success HTTP status means to a caller: refused credentials (401, 403), a
// store that is down (5xx), or anything else.
ErrorKind failure_kind(long status);

// One exchange; redirects are NOT followed here. Throws TransportError.
Response perform(const Request& request, const StoreOptions& options);

// perform() with retries on transport errors, 5xx and 429 (exponential backoff, full jitter),
// and redirects followed as request.redirects allows (credentials never leave the origin they
// were meant for; a redirect target's query, where a pre-signed URL keeps its signature, is
// never printed). Any other response is returned to the caller to interpret.
// After the last attempt throws Error("LABEL: VERB failed after N attempts: REASON").
// `retry_also` lets a caller mark further responses as transient (e.g. S3's 400 RequestTimeout,
// or its 409 on a racing conditional write).
Response perform_with_retries(Request request, const StoreOptions& options, const std::string& label,
                              const std::function<bool(const Response&)>& retry_also = {});

// One header line as libcurl hands it over ("Name: value\r\n"), added to `headers`: a status
// line ("HTTP/...") starts a new response (after 100-continue) and drops the headers so far;
// a header is kept under its lowercase name, its value without surrounding blanks.
void add_header_line(std::map<std::string, std::string>& headers, std::string_view line);

// The request to send after a redirect to `location` (absolute, or relative to request.url):
// the same request at the new URL within its origin; to another origin only as
// request.redirects allows (presigned_follow_up). Throws Error("LABEL: ...") otherwise.
Request redirected_request(const Request& request, const std::string& location, const std::string& label);

// The <Code> of an S3-style XML error body ("" when there is none).
std::string error_code(const Response& response);

// "HTTP 403 SignatureDoesNotMatch: message" built from a response (S3-style XML error bodies
// are recognized; other bodies are cut to a short printable excerpt).
std::string describe_failure(const Response& response);

// The scheme://host[:port] part of a URL (lowercased scheme and host).
std::string origin_of(const std::string& url);

// True for http(s)://localhost, 127.0.0.0/8 and [::1] (any port).
bool is_loopback(const std::string& url);

// The request to send to a pre-signed redirect target: GET of `target`, unsigned, with only the
// Range header of `original` (no Authorization, no x-amz-*, no conditional headers, which a CDN
// would judge against its own tags). Throws Error("LABEL: ...") when the target is not HTTPS
// (allowed over plain HTTP only from loopback to loopback, for tests).
Request presigned_follow_up(const Request& original, const std::string& target, const std::string& label);

// Percent-encodes everything except RFC 3986 unreserved characters (and '/' when keep_slash).
std::string uri_encode(std::string_view text, bool keep_slash);

// A query string in SigV4 canonical form, which is also what is sent (this libcurl signs the
// query as given): names and values percent-encoded as uri_encode does ('/', '+', '=', ' ' and
// everything else outside A-Z a-z 0-9 - _ . ~ become %XX), sorted by name then value, each
// "name=value" (a valueless parameter as "name="), joined by '&'.
std::string sigv4_query(std::vector<std::pair<std::string, std::string>> params);

// "Range: bytes=FIRST-LAST" for [offset, offset + length), length > 0. When offset + length
// would pass 2^64 (a caller asking for "everything from offset on") the range is left open,
// "bytes=FIRST-", instead of wrapping around to a LAST before FIRST.
std::string range_header(uint64_t offset, uint64_t length);

// The bytes [offset, offset + length) of a whole object (fewer at its end, none past it): for a
// server that ignored a Range header and answered 200 with everything.
std::vector<uint8_t> cut_range(const std::vector<uint8_t>& whole, uint64_t offset, uint64_t length);

// A URL fit for an error message: without user:password@ and without its query string (where a
// presigned URL keeps its signature and a shared-access URL its token).
std::string redact_url(const std::string& url);

// Completes the download of an object of `total` bytes whose first bytes (`head`, from offset
// 0) are already here, with ranged GETs of options.part_size bytes, options.parallelism in
// flight. fetch_range(offset, length) must return exactly those bytes.
std::vector<uint8_t> fetch_in_parallel(uint64_t total, std::vector<uint8_t> head, const StoreOptions& options,
                                       const std::function<std::vector<uint8_t>(uint64_t, uint64_t)>& fetch_range,
                                       const ProgressFn& progress);

// Runs job(i) for i in [0, n) on up to `parallelism` threads; rethrows the first failure after
// all started jobs finished, and stops handing out new jobs once one failed.
void run_parallel(size_t n, unsigned parallelism, const std::function<void(size_t)>& job);

}  // namespace deltasync::http
