// The S3 store: any S3-compatible service through libcurl's SigV4 signing, and Hugging Face
// buckets through their S3 gateway (hf://buckets/NAMESPACE/BUCKET/PREFIX).
//
// Addressing: with AWS_ENDPOINT_URL (MinIO, R2, moto) requests are path-style,
// ENDPOINT/BUCKET/KEY; without it, AWS virtual-hosted style, https://BUCKET.s3.REGION.amazonaws.com/KEY.
// Libcurl 7.88 signs the request but does not hash a streamed body, so every request carries
// x-amz-content-sha256 computed here. Query strings are written already in SigV4 canonical form
// (http::sigv4_query) because this libcurl signs the query string as given.
//
// The Hugging Face gateway (https://s3.hf.co/NAMESPACE, us-east-1, path-style) differs in
// three ways handled here: GetObject answers 302/307 to a CDN with a pre-signed URL (followed
// without credentials, see http::RedirectPolicy), listing is by folder (delimiter "/", so
// list() walks the folders), and keys obey its rules (gateway_key_error). It is reached as
// hf://buckets/NAMESPACE/BUCKET or as s3://BUCKET with AWS_ENDPOINT_URL=https://s3.hf.co/NAMESPACE.
//
// Any endpoint set by AWS_ENDPOINT_URL may redirect GETs to pre-signed URLs elsewhere (a gateway
// in front of a CDN): they are followed without credentials, and once a GET has come back from
// another origin, the store's ETags (LATEST's compare-and-swap, conditional polls) are taken from
// HEADs, which the gateway answers itself, never from the CDN's responses.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

#include "core/parse_number.hpp"
#include "store/s3_xml.hpp"
#include "format/sha256.hpp"
#include "store/store.hpp"
#include "store/http_transport.hpp"

namespace deltasync {
namespace {

constexpr const char* kEmptySha256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string_view as_text(const std::vector<uint8_t>& body) { return {reinterpret_cast<const char*>(body.data()), body.size()}; }

// A size in an S3 response (header or listing), by the one number rule; `what` names the object.
uint64_t response_u64(const std::string& text, const std::string& what) {
  return parse_decimal<uint64_t>(text, what, ErrorKind::kGeneral);
}

// "bytes 0-99/12345" -> 12345
std::optional<uint64_t> total_from_content_range(const std::string& v, const std::string& what) {
  auto slash = v.rfind('/');
  if (slash == std::string::npos || v.substr(slash + 1) == "*") return std::nullopt;
  return response_u64(v.substr(slash + 1), what);
}

// Where and how a store's requests go: filled from an s3:// or an hf:// URL.
struct S3Target {
  std::string url;     // printable store URL
  std::string bucket;
  std::string prefix;  // "" or ending in '/'
  std::string bucket_root;  // requests go to BUCKET_ROOT/KEY
  std::string list_url;     // bucket URL ending in '?', ready for a query string
  http::AwsSigning signing;
  std::string session_token;
  bool hf_gateway = false;  // Hugging Face bucket: folder listing, key rules, pre-signed redirects
  bool follow_presigned = false;  // an endpoint of the user's: GETs may be redirected to a CDN
};

// Why the gateway would refuse this key (empty when it is fine): no leading or trailing '/',
// no "//", no "." or ".." segment, no '\\' or NUL.
std::string gateway_key_error(std::string_view key) {
  if (key.empty()) return "empty key";
  if (key.front() == '/' || key.back() == '/') return "key starts or ends with '/'";
  if (key.find("//") != std::string_view::npos) return "key contains '//'";
  if (key.find('\\') != std::string_view::npos) return "key contains '\\'";
  if (key.find('\0') != std::string_view::npos) return "key contains a NUL byte";
  size_t begin = 0;
  while (begin <= key.size()) {
    size_t end = key.find('/', begin);
    if (end == std::string_view::npos) end = key.size();
    const std::string_view segment = key.substr(begin, end - begin);
    if (segment == "." || segment == "..") return "key has a '" + std::string(segment) + "' segment";
    begin = end + 1;
  }
  return {};
}

class S3Store final : public Store {
 public:
  S3Store(S3Target target, const StoreOptions& options)
      : url_(target.url), bucket_(target.bucket), prefix_(target.prefix), options_(options),
        bucket_root_(std::move(target.bucket_root)), list_url_(std::move(target.list_url)),
        signing_(std::move(target.signing)), session_token_(std::move(target.session_token)),
        hf_gateway_(target.hf_gateway), follow_presigned_(target.hf_gateway || target.follow_presigned),
        tags_by_head_(target.hf_gateway) {}

  std::string url() const override { return url_; }

  void put(const std::string& key, std::span<const uint8_t> bytes) override {
    if (options_.part_size > 0 && bytes.size() >= options_.multipart_threshold && bytes.size() > options_.part_size) {
      put_multipart(key, bytes);
      return;
    }
    auto r = send("PUT", object_url(key), key, bytes, {});
    if (r.status != 200) fail("PUT", key, r);
    if (progress_) progress_(bytes.size(), bytes.size());
  }

  bool put_if_absent(const std::string& key, std::span<const uint8_t> bytes) override {
    // 409 ConditionalRequestConflict: another conditional write of this key is in flight;
    // retrying settles who won (412 for the loser).
    auto r = send("PUT", object_url(key), key, bytes, {"If-None-Match: *"}, [](const http::Response& x) { return x.status == 409; });
    if (r.status == 412) return false;
    if (r.status != 200) fail("PUT", key, r);
    return true;
  }

  bool supports_put_if_match() const override { return true; }

  bool put_if_match(const std::string& key, std::span<const uint8_t> bytes, const std::string& etag) override {
    auto r = send("PUT", object_url(key), key, bytes, {"If-Match: " + etag}, [](const http::Response& x) { return x.status == 409; });
    if (r.status == 412) return false;
    if (r.status != 200) fail("PUT", key, r);
    return true;
  }

  std::vector<uint8_t> get(const std::string& key) override {
    // The first request asks for up to the multipart threshold: one round trip for every object
    // below it, and the Content-Range tells the total size of larger ones (no HEAD needed), whose
    // rest then comes as parallel ranged GETs.
    const uint64_t first = std::max<uint64_t>({options_.multipart_threshold, options_.part_size, 1});
    auto r = send("GET", object_url(key), key, {}, {"Range: bytes=0-" + std::to_string(first - 1)});
    if (r.status == 416) {  // zero-length object
      r = send("GET", object_url(key), key, {}, {});
    }
    if (r.status == 404) throw NotFoundError(describe(key) + ": no such object");
    if (r.status == 200) return std::move(r.body);
    if (r.status != 206) fail("GET", key, r);
    auto total = total_from_content_range(r.header("content-range"), describe(key) + ": GET Content-Range total");
    if (!total) fail("GET", key, r);
    if (*total == r.body.size()) return std::move(r.body);
    // Pin the remaining parts to the version we started reading (a CDN's tag means nothing to
    // the store: unpinned then; deltasync's objects are immutable but for LATEST, read whole).
    std::string etag = r.from_other_origin ? std::string() : r.header("etag");
    return http::fetch_in_parallel(*total, std::move(r.body), options_,
                                   [&](uint64_t offset, uint64_t length) { return range_get(key, offset, length, etag); },
                                   progress_);
  }

  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t length) override {
    if (length == 0) return {};
    return range_get(key, offset, length, {});
  }

  ConditionalGet get_if_changed(const std::string& key, const std::string& etag) override {
    // A gateway's GET goes on to a CDN whose tags are its own, and the If-None-Match never
    // reaches the store: compare the gateway's tags (HEAD, then GET when it moved).
    if (tags_by_head_.load(std::memory_order_relaxed)) return Store::get_if_changed(key, etag);
    std::vector<std::string> headers;
    if (!etag.empty()) headers.push_back("If-None-Match: " + etag);
    auto r = send("GET", object_url(key), key, {}, headers);
    if (r.from_other_origin) {  // found out now: this endpoint redirects; ask it the HEAD way
      tags_by_head_.store(true, std::memory_order_relaxed);
      return Store::get_if_changed(key, etag);
    }
    if (r.status == 304) return ConditionalGet{false, {}, etag};
    if (r.status == 404) throw NotFoundError(describe(key) + ": no such object");
    if (r.status != 200) fail("GET", key, r);
    return ConditionalGet{true, std::move(r.body), r.header("etag")};
  }

  std::optional<ObjectInfo> head(const std::string& key) override {
    auto r = send("HEAD", object_url(key), key, {}, {});
    if (r.status == 404) return std::nullopt;
    if (r.status != 200) fail("HEAD", key, r);
    return ObjectInfo{key, response_u64(r.header("content-length"), describe(key) + ": HEAD Content-Length"), r.header("etag")};
  }

  std::vector<ObjectInfo> list(const std::string& prefix) override {
    std::vector<ObjectInfo> out;
    // The gateway lists one folder at a time (delimiter "/" only): walk the folders.
    std::vector<std::string> folders{prefix_ + prefix};
    while (!folders.empty()) {
      const std::string folder = folders.back();
      folders.pop_back();
      list_pages(prefix, folder, hf_gateway_ ? "/" : "", out, folders);
    }
    std::sort(out.begin(), out.end(), [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  void remove(const std::string& key) override {
    auto r = send("DELETE", object_url(key), key, {}, {});
    if (r.status != 204 && r.status != 200 && r.status != 404) fail("DELETE", key, r);
  }

  // ListMultipartUploads (every page), then AbortMultipartUpload for each abandoned key. The
  // Hugging Face gateway lists objects only (ListObjectsV2), so there is nothing to ask it; a
  // service that does not implement the listing (501) is treated the same way.
  uint64_t abort_unfinished_uploads(const std::string& prefix, const std::function<bool(const std::string& key)>& abandoned) override {
    if (hf_gateway_) return 0;
    const std::string label = describe(prefix) + "* (LIST multipart uploads)";
    std::vector<std::pair<std::string, std::string>> uploads;  // key relative to the store, upload id
    std::string key_marker, id_marker;
    for (;;) {
      std::vector<std::pair<std::string, std::string>> params{{"uploads", ""}, {"prefix", prefix_ + prefix}};
      if (!key_marker.empty()) params.emplace_back("key-marker", key_marker);
      if (!id_marker.empty()) params.emplace_back("upload-id-marker", id_marker);
      auto r = send("GET", list_url_ + http::sigv4_query(params), prefix + "*", {}, {});
      if (r.status == 501) return 0;
      if (r.status != 200) fail("LIST multipart uploads", prefix + "*", r);
      const s3xml::Element doc = s3xml::parse(as_text(r.body), label);
      if (doc.name != "ListMultipartUploadsResult")
        throw Error(label + ": answered <" + doc.name + ">, not <ListMultipartUploadsResult>");
      for (const s3xml::Element* upload : doc.all("Upload")) {
        auto key = upload->child_text("Key");
        auto id = upload->child_text("UploadId");
        if (!key || !id || id->empty()) throw Error(label + ": an upload entry without Key or UploadId");
        if (key->rfind(prefix_, 0) == 0) uploads.emplace_back(key->substr(prefix_.size()), *id);
      }
      const std::string truncated = doc.child_text("IsTruncated").value_or("false");
      if (truncated != "true") {
        if (truncated != "false") throw Error(label + ": IsTruncated '" + truncated + "'");
        break;
      }
      std::string next_key = doc.child_text("NextKeyMarker").value_or("");
      std::string next_id = doc.child_text("NextUploadIdMarker").value_or("");
      if (next_key.empty() || (next_key == key_marker && next_id == id_marker))
        throw Error(label + ": truncated without a new key marker");
      key_marker = std::move(next_key);
      id_marker = std::move(next_id);
    }
    uint64_t aborted = 0;
    for (const auto& [key, id] : uploads) {
      if (!abandoned(key)) continue;
      auto r = send("DELETE", object_url(key) + "?" + http::sigv4_query({{"uploadId", id}}), key, {}, {});
      if (r.status == 404) continue;  // finished or aborted meanwhile (NoSuchUpload)
      if (r.status != 204 && r.status != 200) fail("DELETE (abort multipart upload)", key, r);
      ++aborted;
    }
    return aborted;
  }

 private:
  std::string object_url(const std::string& key) const {
    if (key.empty()) throw Error(url_ + ": empty object key", ErrorKind::kInvalidArgument);
    if (hf_gateway_) {
      const std::string why = gateway_key_error(prefix_ + key);
      if (!why.empty()) throw Error(describe(key) + ": not a valid Hugging Face bucket key (" + why + ")", ErrorKind::kInvalidArgument);
    }
    return bucket_root_ + "/" + http::uri_encode(prefix_ + key, true);
  }

  http::Response send(const std::string& method, const std::string& url, const std::string& key,
                      std::span<const uint8_t> body, std::vector<std::string> headers,
                      const std::function<bool(const http::Response&)>& retry_also = {}) {
    http::Request req;
    req.method = method;
    req.url = url;
    req.body = body;
    req.aws = &signing_;
    req.redirects = follow_presigned_ ? http::RedirectPolicy::PresignedGet : http::RedirectPolicy::SameOrigin;
    req.sent = &requests_;
    req.headers = std::move(headers);
    req.headers.push_back("x-amz-content-sha256: " + (body.empty() ? std::string(kEmptySha256) : sha256_hex(body)));
    if (!session_token_.empty()) req.headers.push_back("x-amz-security-token: " + session_token_);
    // S3 reports a client that sent too slowly as 400 RequestTimeout: transient like a 5xx.
    auto transient = [&](const http::Response& r) {
      return (r.status == 400 && http::error_code(r) == "RequestTimeout") || (retry_also && retry_also(r));
    };
    return http::perform_with_retries(std::move(req), options_, describe(key), transient);
  }

  [[noreturn]] void fail(const std::string& verb, const std::string& key, const http::Response& r) const {
    std::string hint;
    if (r.status == 403)
      hint = hf_gateway_ ? " (check DELTASYNC_HF_ACCESS_KEY_ID and DELTASYNC_HF_SECRET_ACCESS_KEY, or AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY: S3 credentials generated from a Hugging Face token with access to the bucket)"
                         : " (check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and AWS_REGION)";
    if (r.status == 301) hint = " (the bucket lives in another region: set AWS_REGION, or AWS_ENDPOINT_URL)";
    throw Error(describe(key) + ": " + verb + " failed: " + http::describe_failure(r) + hint, http::failure_kind(r.status));
  }

  // Every page of one ListObjectsV2 of `full_prefix`: objects into `out` (keys relative to the
  // store), sub-folders (CommonPrefixes, with a delimiter) into `folders`.
  void list_pages(const std::string& prefix, const std::string& full_prefix, const std::string& delimiter,
                  std::vector<ObjectInfo>& out, std::vector<std::string>& folders) {
    const std::string label = describe(prefix) + "*";
    std::string token;
    for (;;) {
      std::vector<std::pair<std::string, std::string>> params{{"list-type", "2"}, {"prefix", full_prefix}};
      if (!token.empty()) params.emplace_back("continuation-token", token);
      if (!delimiter.empty()) params.emplace_back("delimiter", delimiter);
      if (options_.list_page_size) params.emplace_back("max-keys", std::to_string(options_.list_page_size));
      auto r = send("GET", list_url_ + http::sigv4_query(params), prefix + "*", {}, {});
      if (r.status != 200) fail("LIST", prefix + "*", r);
      const s3xml::Element doc = s3xml::parse(as_text(r.body), label + " (LIST)");
      if (doc.name != "ListBucketResult") throw Error(label + ": LIST answered <" + doc.name + ">, not <ListBucketResult>");
      for (const s3xml::Element* item : doc.all("Contents")) {
        auto key = item->child_text("Key");
        auto size = item->child_text("Size");
        if (!key || !size) throw Error(label + ": LIST response has an entry without Key or Size");
        if (key->rfind(prefix_, 0) != 0) continue;
        out.push_back(ObjectInfo{key->substr(prefix_.size()), response_u64(*size, label + ": LIST Size of " + *key), item->child_text("ETag").value_or("")});
      }
      for (const s3xml::Element* common : doc.all("CommonPrefixes")) {
        auto sub = common->child_text("Prefix");
        if (!sub || sub->size() <= full_prefix.size() || sub->rfind(full_prefix, 0) != 0)
          throw Error(label + ": LIST response has a CommonPrefixes entry outside the listed prefix");
        folders.push_back(*sub);
      }
      const std::string truncated = doc.child_text("IsTruncated").value_or("false");
      if (truncated != "true") {
        if (truncated != "false") throw Error(label + ": LIST response has IsTruncated '" + truncated + "'");
        return;
      }
      token = doc.child_text("NextContinuationToken").value_or("");
      if (token.empty()) throw Error(label + ": LIST truncated without a continuation token");
    }
  }

  std::vector<uint8_t> range_get(const std::string& key, uint64_t offset, uint64_t length, const std::string& etag) {
    std::vector<std::string> headers{http::range_header(offset, length)};
    if (!etag.empty()) headers.push_back("If-Match: " + etag);
    auto r = send("GET", object_url(key), key, {}, headers);
    if (r.status == 404) throw NotFoundError(describe(key) + ": no such object");
    if (r.status == 412) throw Error(describe(key) + ": object changed while it was being downloaded");
    if (r.status == 206) return std::move(r.body);
    if (r.status == 200) return http::cut_range(r.body, offset, length);  // the server ignored the range
    if (r.status == 416) return {};
    fail("GET", key, r);
  }

  void put_multipart(const std::string& key, std::span<const uint8_t> bytes) {
    const std::string url = object_url(key);
    auto init = send("POST", url + "?" + http::sigv4_query({{"uploads", ""}}), key, {}, {});
    if (init.status != 200) fail("POST (start multipart upload)", key, init);
    const s3xml::Element started = s3xml::parse(as_text(init.body), describe(key) + " (start multipart upload)");
    auto upload_id = started.child_text("UploadId");
    if (started.name != "InitiateMultipartUploadResult" || !upload_id || upload_id->empty())
      throw Error(describe(key) + ": multipart upload start returned no UploadId");
    const std::string id_query = http::sigv4_query({{"uploadId", *upload_id}});
    try {
      const uint64_t part = options_.part_size;
      const size_t parts = static_cast<size_t>((bytes.size() + part - 1) / part);
      std::vector<std::string> etags(parts);
      std::atomic<uint64_t> done{0};
      http::run_parallel(parts, options_.parallelism, [&](size_t i) {
        uint64_t offset = i * part, length = std::min<uint64_t>(part, bytes.size() - offset);
        std::string part_url = url + "?" + http::sigv4_query({{"partNumber", std::to_string(i + 1)}, {"uploadId", *upload_id}});
        auto r = send("PUT", part_url, key, bytes.subspan(offset, length), {});
        if (r.status != 200) fail("PUT (part " + std::to_string(i + 1) + ")", key, r);
        etags[i] = r.header("etag");
        if (etags[i].empty()) throw Error(describe(key) + ": part " + std::to_string(i + 1) + " upload returned no ETag");
        uint64_t now = done.fetch_add(length) + length;
        if (progress_) progress_(now, bytes.size());
      });
      std::string xml = "<CompleteMultipartUpload>";
      for (size_t i = 0; i < parts; ++i)
        xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + s3xml::escape(etags[i]) + "</ETag></Part>";
      xml += "</CompleteMultipartUpload>";
      std::span<const uint8_t> body(reinterpret_cast<const uint8_t*>(xml.data()), xml.size());
      auto done_r = send("POST", url + "?" + id_query, key, body, {"Content-Type: application/xml"});
      if (done_r.status != 200) fail("POST (complete multipart upload)", key, done_r);
      // S3 may answer 200 with an <Error> body when completion fails late.
      if (s3xml::parse(as_text(done_r.body), describe(key) + " (complete multipart upload)").name != "CompleteMultipartUploadResult")
        fail("POST (complete multipart upload)", key, done_r);
    } catch (...) {
      try {
        send("DELETE", url + "?" + id_query, key, {}, {});  // abort: free the stored parts
      } catch (...) {
      }
      throw;
    }
  }

  std::string url_, bucket_, prefix_;
  StoreOptions options_;
  std::string bucket_root_;
  std::string list_url_;  // bucket URL ending in '?', ready for a query string
  http::AwsSigning signing_;
  std::string session_token_;
  bool hf_gateway_ = false;
  bool follow_presigned_ = false;
  std::atomic<bool> tags_by_head_{false};  // ETags come from HEADs (see the top of this file)
};

std::string env_first(const char* a, const char* b) {
  std::string v = env(a);
  return v.empty() ? env(b) : v;
}

// The key pair: `own_id`/`own_secret` (a deltasync-specific pair) when set, else AWS_*.
void read_credentials(S3Target& t, const char* own_id, const char* own_secret) {
  if (own_id && !env(own_id).empty()) {
    t.signing.access_key = env(own_id);
    t.signing.secret_key = env(own_secret);
    if (t.signing.secret_key.empty()) throw Error(t.url + ": " + own_id + " is set but " + own_secret + " is not", ErrorKind::kCredentials);
    return;  // a session token belongs to the AWS_* pair only
  }
  t.signing.access_key = env("AWS_ACCESS_KEY_ID");
  t.signing.secret_key = env("AWS_SECRET_ACCESS_KEY");
  if (t.signing.access_key.empty() || t.signing.secret_key.empty())
    throw Error(t.url + ": " + (own_id ? std::string(own_id) + " and " + own_secret + " (or " : std::string()) +
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" + (own_id ? ")" : "") + " must be set", ErrorKind::kCredentials);
  t.session_token = env("AWS_SESSION_TOKEN");
}

void set_path_style_endpoint(S3Target& t, std::string endpoint, const char* variable) {
  while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
  if (endpoint.rfind("http://", 0) != 0 && endpoint.rfind("https://", 0) != 0)
    throw Error(t.url + ": " + variable + " must start with http:// or https://", ErrorKind::kInvalidArgument);
  t.bucket_root = endpoint + "/" + http::uri_encode(t.bucket, false);
  t.list_url = t.bucket_root + "?";
}

std::string normalized_prefix(std::string prefix) {
  while (!prefix.empty() && prefix.front() == '/') prefix.erase(0, 1);
  if (!prefix.empty() && prefix.back() != '/') prefix += '/';
  return prefix;
}

std::string printable(const std::string& scheme_and_root, const std::string& prefix) {
  return scheme_and_root + (prefix.empty() ? "" : "/" + prefix.substr(0, prefix.size() - 1));
}

}  // namespace

std::unique_ptr<Store> open_s3_store(const std::string& url, const StoreOptions& options) {
  // Errors name the URL without anything before an '@' (someone may have put a key pair there).
  if (url.rfind("s3://", 0) != 0) throw Error(http::redact_url(url) + ": not an s3:// URL", ErrorKind::kInvalidArgument);
  std::string rest = url.substr(5);
  auto slash = rest.find('/');
  S3Target t;
  t.bucket = rest.substr(0, slash);
  t.prefix = normalized_prefix(slash == std::string::npos ? std::string() : rest.substr(slash + 1));
  if (t.bucket.empty()) throw Error(http::redact_url(url) + ": missing bucket name", ErrorKind::kInvalidArgument);
  if (t.bucket.find_first_of("@:?#") != std::string::npos)
    throw Error(http::redact_url(url) + ": invalid bucket name (credentials go in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, never in the URL)", ErrorKind::kInvalidArgument);
  t.url = printable("s3://" + t.bucket, t.prefix);
  std::string region = env_first("AWS_REGION", "AWS_DEFAULT_REGION");
  if (region.empty()) region = "us-east-1";
  const std::string endpoint = env_first("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL");
  if (endpoint.empty()) {
    t.bucket_root = "https://" + t.bucket + ".s3." + region + ".amazonaws.com";
    t.list_url = t.bucket_root + "/?";
  } else {
    set_path_style_endpoint(t, endpoint, "AWS_ENDPOINT_URL");
    t.follow_presigned = true;
    // The Hugging Face gateway addressed as plain S3: its key and listing rules apply too.
    t.hf_gateway = http::origin_of(endpoint) == "https://s3.hf.co:443";
  }
  t.signing.sigv4 = "aws:amz:" + region + ":s3";
  read_credentials(t, nullptr, nullptr);
  return std::make_unique<S3Store>(std::move(t), options);
}

std::unique_ptr<Store> open_hf_bucket_store(const std::string& url, const StoreOptions& options) {
  constexpr std::string_view kScheme = "hf://buckets/";
  if (url.rfind(kScheme, 0) != 0)
    throw Error(http::redact_url(url) + ": not a Hugging Face bucket URL (expected hf://buckets/NAMESPACE/BUCKET[/PREFIX])", ErrorKind::kInvalidArgument);
  const std::string rest = url.substr(kScheme.size());
  const auto ns_end = rest.find('/');
  S3Target t;
  const std::string ns = rest.substr(0, ns_end);
  const auto bucket_end = ns_end == std::string::npos ? std::string::npos : rest.find('/', ns_end + 1);
  t.bucket = ns_end == std::string::npos ? std::string() : rest.substr(ns_end + 1, bucket_end == std::string::npos ? std::string::npos : bucket_end - ns_end - 1);
  if (ns.empty() || t.bucket.empty())
    throw Error(http::redact_url(url) + ": expected hf://buckets/NAMESPACE/BUCKET[/PREFIX]", ErrorKind::kInvalidArgument);
  if ((ns + t.bucket).find_first_of("@:?#%\\") != std::string::npos)
    throw Error(http::redact_url(url) + ": invalid namespace or bucket name (credentials go in DELTASYNC_HF_ACCESS_KEY_ID and "
                                        "DELTASYNC_HF_SECRET_ACCESS_KEY, never in the URL)", ErrorKind::kInvalidArgument);
  t.prefix = bucket_end == std::string::npos ? std::string() : rest.substr(bucket_end + 1);
  while (!t.prefix.empty() && t.prefix.back() == '/') t.prefix.pop_back();
  t.url = "hf://buckets/" + ns + "/" + t.bucket + (t.prefix.empty() ? "" : "/" + t.prefix);
  if (!t.prefix.empty()) {
    const std::string why = gateway_key_error(t.prefix);
    if (!why.empty()) throw Error(t.url + ": not a valid Hugging Face bucket prefix (" + why + ")", ErrorKind::kInvalidArgument);
    t.prefix += '/';
  }
  // The gateway: one endpoint per namespace, path-style, always signed for us-east-1.
  std::string endpoint = env("DELTASYNC_HF_S3_ENDPOINT");
  if (endpoint.empty()) endpoint = "https://s3.hf.co/" + http::uri_encode(ns, false);
  set_path_style_endpoint(t, endpoint, "DELTASYNC_HF_S3_ENDPOINT");
  t.signing.sigv4 = "aws:amz:us-east-1:s3";
  read_credentials(t, "DELTASYNC_HF_ACCESS_KEY_ID", "DELTASYNC_HF_SECRET_ACCESS_KEY");
  t.hf_gateway = true;
  return std::make_unique<S3Store>(std::move(t), options);
}

}  // namespace deltasync
