// The S3 store: any S3-compatible service through libcurl's SigV4 signing.
//
// Addressing: with AWS_ENDPOINT_URL (MinIO, R2, Hugging Face buckets, moto) requests are
// path-style, ENDPOINT/BUCKET/KEY; without it, AWS virtual-hosted style,
// https://BUCKET.s3.REGION.amazonaws.com/KEY. Libcurl 7.88 signs the request but does not hash
// a streamed body, so every request carries x-amz-content-sha256 computed here. Query strings
// are written already in SigV4 canonical form (sorted keys, every value '='-terminated and
// percent-encoded) because this libcurl signs the query string as given.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

#include "store/sha256.hpp"
#include "store/store.hpp"
#include "store/http_transport.hpp"

namespace deltasync {
namespace {

constexpr const char* kEmptySha256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string xml_unescape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    auto semi = s.find(';', i);
    if (semi == std::string_view::npos) throw Error("malformed XML entity in S3 response");
    std::string_view ent = s.substr(i + 1, semi - i - 1);
    if (ent == "amp") out += '&';
    else if (ent == "lt") out += '<';
    else if (ent == "gt") out += '>';
    else if (ent == "quot") out += '"';
    else if (ent == "apos") out += '\'';
    else if (ent.size() > 1 && ent[0] == '#') {
      unsigned long code = ent[1] == 'x' ? std::stoul(std::string(ent.substr(2)), nullptr, 16) : std::stoul(std::string(ent.substr(1)));
      if (code < 0x80) out += static_cast<char>(code);
      else if (code < 0x800) { out += char(0xC0 | (code >> 6)); out += char(0x80 | (code & 0x3F)); }
      else if (code < 0x10000) { out += char(0xE0 | (code >> 12)); out += char(0x80 | ((code >> 6) & 0x3F)); out += char(0x80 | (code & 0x3F)); }
      else { out += char(0xF0 | (code >> 18)); out += char(0x80 | ((code >> 12) & 0x3F)); out += char(0x80 | ((code >> 6) & 0x3F)); out += char(0x80 | (code & 0x3F)); }
    } else {
      throw Error("unknown XML entity &" + std::string(ent) + "; in S3 response");
    }
    i = semi;
  }
  return out;
}

// The text of every <tag>...</tag> directly found in `xml` from `pos` on (no nesting of the same
// tag in the documents S3 returns for the calls used here).
std::vector<std::string_view> xml_all(std::string_view xml, std::string_view tag) {
  std::vector<std::string_view> out;
  // Appended piecewise: GCC 12 misreports `"<" + std::string&&` under -Wrestrict.
  std::string open("<"), close("</");
  open.append(tag).append(">");
  close.append(tag).append(">");
  size_t pos = 0;
  for (;;) {
    auto b = xml.find(open, pos);
    if (b == std::string_view::npos) break;
    b += open.size();
    auto e = xml.find(close, b);
    if (e == std::string_view::npos) throw Error("truncated XML in S3 response (no " + close + ")");
    out.push_back(xml.substr(b, e - b));
    pos = e + close.size();
  }
  return out;
}

std::optional<std::string> xml_one(std::string_view xml, std::string_view tag) {
  auto all = xml_all(xml, tag);
  if (all.empty()) return std::nullopt;
  return xml_unescape(all.front());
}

std::string_view as_text(const std::vector<uint8_t>& body) { return {reinterpret_cast<const char*>(body.data()), body.size()}; }

uint64_t parse_u64(const std::string& s, const std::string& what) {
  try {
    size_t used = 0;
    unsigned long long v = std::stoull(s, &used);
    if (used != s.size()) throw std::invalid_argument(s);
    return v;
  } catch (const std::exception&) {
    throw Error("S3 response: bad " + what + " '" + s + "'");
  }
}

// "bytes 0-99/12345" -> 12345
std::optional<uint64_t> total_from_content_range(const std::string& v) {
  auto slash = v.rfind('/');
  if (slash == std::string::npos || v.substr(slash + 1) == "*") return std::nullopt;
  return parse_u64(v.substr(slash + 1), "Content-Range");
}

class S3Store final : public Store {
 public:
  S3Store(std::string url, std::string bucket, std::string prefix, const StoreOptions& options)
      : url_(std::move(url)), bucket_(std::move(bucket)), prefix_(std::move(prefix)), options_(options) {
    std::string region = env("AWS_REGION");
    if (region.empty()) region = env("AWS_DEFAULT_REGION");
    if (region.empty()) region = "us-east-1";
    std::string endpoint = env("AWS_ENDPOINT_URL_S3");
    if (endpoint.empty()) endpoint = env("AWS_ENDPOINT_URL");
    while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
    if (endpoint.empty()) {
      bucket_root_ = "https://" + bucket_ + ".s3." + region + ".amazonaws.com";
      list_url_ = bucket_root_ + "/?";
    } else {
      if (endpoint.find("://") == std::string::npos) throw Error(url_ + ": AWS_ENDPOINT_URL must start with http:// or https://");
      bucket_root_ = endpoint + "/" + http::uri_encode(bucket_, false);
      list_url_ = bucket_root_ + "?";
    }
    signing_.sigv4 = "aws:amz:" + region + ":s3";
    signing_.access_key = env("AWS_ACCESS_KEY_ID");
    signing_.secret_key = env("AWS_SECRET_ACCESS_KEY");
    if (signing_.access_key.empty() || signing_.secret_key.empty())
      throw Error(url_ + ": AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set");
    session_token_ = env("AWS_SESSION_TOKEN");
  }

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
    auto total = total_from_content_range(r.header("content-range"));
    if (!total) fail("GET", key, r);
    if (*total == r.body.size()) return std::move(r.body);
    // Pin the remaining parts to the version we started reading.
    std::string etag = r.header("etag");
    return http::fetch_in_parallel(*total, std::move(r.body), options_,
                                   [&](uint64_t offset, uint64_t length) { return range_get(key, offset, length, etag); },
                                   progress_);
  }

  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t length) override {
    if (length == 0) return {};
    return range_get(key, offset, length, {});
  }

  ConditionalGet get_if_changed(const std::string& key, const std::string& etag) override {
    std::vector<std::string> headers;
    if (!etag.empty()) headers.push_back("If-None-Match: " + etag);
    auto r = send("GET", object_url(key), key, {}, headers);
    if (r.status == 304) return ConditionalGet{false, {}, etag};
    if (r.status == 404) throw NotFoundError(describe(key) + ": no such object");
    if (r.status != 200) fail("GET", key, r);
    return ConditionalGet{true, std::move(r.body), r.header("etag")};
  }

  std::optional<ObjectInfo> head(const std::string& key) override {
    auto r = send("HEAD", object_url(key), key, {}, {});
    if (r.status == 404) return std::nullopt;
    if (r.status != 200) fail("HEAD", key, r);
    return ObjectInfo{key, parse_u64(r.header("content-length"), "Content-Length"), r.header("etag")};
  }

  std::vector<ObjectInfo> list(const std::string& prefix) override {
    std::vector<ObjectInfo> out;
    std::string token;
    const std::string full_prefix = prefix_ + prefix;
    for (int page = 0;; ++page) {
      // Canonical order: continuation-token < list-type < max-keys < prefix.
      std::string query;
      if (!token.empty()) query += "continuation-token=" + http::uri_encode(token, false) + "&";
      query += "list-type=2&";
      if (options_.list_page_size) query += "max-keys=" + std::to_string(options_.list_page_size) + "&";
      query += "prefix=" + http::uri_encode(full_prefix, false);
      auto r = send("GET", list_url_ + query, prefix + "*", {}, {});
      if (r.status != 200) fail("LIST", prefix + "*", r);
      std::string_view xml = as_text(r.body);
      for (std::string_view item : xml_all(xml, "Contents")) {
        auto key = xml_one(item, "Key");
        auto size = xml_one(item, "Size");
        if (!key || !size) throw Error(describe(prefix) + ": LIST response without Key/Size");
        if (key->rfind(prefix_, 0) != 0) continue;
        out.push_back(ObjectInfo{key->substr(prefix_.size()), parse_u64(*size, "Size"), xml_one(item, "ETag").value_or("")});
      }
      auto truncated = xml_one(xml, "IsTruncated");
      if (!truncated || *truncated != "true") break;
      auto next = xml_one(xml, "NextContinuationToken");
      if (!next || next->empty()) throw Error(describe(prefix) + ": LIST truncated without a continuation token");
      token = *next;
    }
    std::sort(out.begin(), out.end(), [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  void remove(const std::string& key) override {
    auto r = send("DELETE", object_url(key), key, {}, {});
    if (r.status != 204 && r.status != 200 && r.status != 404) fail("DELETE", key, r);
  }

 private:
  std::string object_url(const std::string& key) const {
    if (key.empty()) throw Error(url_ + ": empty object key");
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
    if (r.status == 403) hint = " (check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and AWS_REGION)";
    if (r.status == 301) hint = " (the bucket lives in another region: set AWS_REGION, or AWS_ENDPOINT_URL)";
    throw Error(describe(key) + ": " + verb + " failed: " + http::describe_failure(r) + hint);
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
    auto init = send("POST", url + "?uploads=", key, {}, {});
    if (init.status != 200) fail("POST (start multipart upload)", key, init);
    auto upload_id = xml_one(as_text(init.body), "UploadId");
    if (!upload_id || upload_id->empty()) throw Error(describe(key) + ": multipart upload start returned no UploadId");
    const std::string id_query = "uploadId=" + http::uri_encode(*upload_id, false);
    try {
      const uint64_t part = options_.part_size;
      const size_t parts = static_cast<size_t>((bytes.size() + part - 1) / part);
      std::vector<std::string> etags(parts);
      std::atomic<uint64_t> done{0};
      http::run_parallel(parts, options_.parallelism, [&](size_t i) {
        uint64_t offset = i * part, length = std::min<uint64_t>(part, bytes.size() - offset);
        // Canonical order: partNumber < uploadId.
        std::string part_url = url + "?partNumber=" + std::to_string(i + 1) + "&" + id_query;
        auto r = send("PUT", part_url, key, bytes.subspan(offset, length), {});
        if (r.status != 200) fail("PUT (part " + std::to_string(i + 1) + ")", key, r);
        etags[i] = r.header("etag");
        if (etags[i].empty()) throw Error(describe(key) + ": part " + std::to_string(i + 1) + " upload returned no ETag");
        uint64_t now = done.fetch_add(length) + length;
        if (progress_) progress_(now, bytes.size());
      });
      std::string xml = "<CompleteMultipartUpload>";
      for (size_t i = 0; i < parts; ++i)
        xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etags[i] + "</ETag></Part>";
      xml += "</CompleteMultipartUpload>";
      std::span<const uint8_t> body(reinterpret_cast<const uint8_t*>(xml.data()), xml.size());
      auto done_r = send("POST", url + "?" + id_query, key, body, {"Content-Type: application/xml"});
      // S3 may answer 200 with an <Error> body when completion fails late.
      if (done_r.status != 200 || as_text(done_r.body).find("<Error>") != std::string_view::npos)
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
};

}  // namespace

std::unique_ptr<Store> open_s3_store(const std::string& url, const StoreOptions& options) {
  // Errors name the URL without anything before an '@' (someone may have put a key pair there).
  if (url.rfind("s3://", 0) != 0) throw Error(http::redact_url(url) + ": not an s3:// URL");
  std::string rest = url.substr(5);
  auto slash = rest.find('/');
  std::string bucket = rest.substr(0, slash);
  std::string prefix = slash == std::string::npos ? std::string() : rest.substr(slash + 1);
  if (bucket.empty()) throw Error(http::redact_url(url) + ": missing bucket name");
  if (bucket.find_first_of("@:?#") != std::string::npos)
    throw Error(http::redact_url(url) + ": invalid bucket name (credentials go in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, never in the URL)");
  while (!prefix.empty() && prefix.front() == '/') prefix.erase(0, 1);
  if (!prefix.empty() && prefix.back() != '/') prefix += '/';
  std::string clean = "s3://" + bucket + (prefix.empty() ? "" : "/" + prefix.substr(0, prefix.size() - 1));
  return std::make_unique<S3Store>(clean, bucket, prefix, options);
}

}  // namespace deltasync
