// The plain HTTP store: objects are BASE/KEY on any server that takes PUT and serves GET/HEAD
// (WebDAV, an nginx with dav_methods, a presigned-URL prefix). put_if_absent sends
// `If-None-Match: *`, which WebDAV servers honour; listing has no portable HTTP form, so a
// subscriber on this store reads LATEST and manifests by name instead.
#include <cstdlib>

#include "core/parse_number.hpp"
#include "store/store.hpp"
#include "store/http_transport.hpp"

namespace deltasync {
namespace {

class HttpStore final : public Store {
 public:
  HttpStore(std::string base, std::string query, const StoreOptions& options)
      : base_(std::move(base)), query_(std::move(query)), options_(options) {
    // An optional bearer token for servers behind simple auth; never printed.
    if (const char* token = std::getenv("DELTASYNC_HTTP_BEARER_TOKEN"); token && *token) {
      auth_header_ = std::string("Authorization: Bearer ") + token;
      secrets_.emplace_back(token);
    }
    // Every value of the query string (a presigned URL's signature, a SAS token) counts as secret.
    for (size_t start = query_.empty() ? std::string::npos : 1; start < query_.size();) {
      size_t end = query_.find('&', start);
      if (end == std::string::npos) end = query_.size();
      const size_t eq = query_.find('=', start);
      if (eq != std::string::npos && eq < end && end - eq - 1 >= 4) secrets_.push_back(query_.substr(eq + 1, end - eq - 1));
      start = end + 1;
    }
  }

  std::string url() const override { return base_; }

  void put(const std::string& key, std::span<const uint8_t> bytes) override {
    auto r = send("PUT", key, bytes, {});
    if (r.status != 200 && r.status != 201 && r.status != 204) fail("PUT", key, r);
    if (progress_) progress_(bytes.size(), bytes.size());
  }

  bool put_if_absent(const std::string& key, std::span<const uint8_t> bytes) override {
    auto r = send("PUT", key, bytes, {"If-None-Match: *"});
    if (r.status == 412) return false;
    if (r.status != 200 && r.status != 201 && r.status != 204) fail("PUT", key, r);
    return true;
  }

  std::vector<uint8_t> get(const std::string& key) override {
    auto r = send("GET", key, {}, {});
    if (r.status == 404) throw NotFoundError(describe(key) + ": no such object");
    if (r.status != 200) fail("GET", key, r);
    if (progress_) progress_(r.body.size(), r.body.size());
    return std::move(r.body);
  }

  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t length) override {
    if (length == 0) return {};
    auto r = send("GET", key, {}, {http::range_header(offset, length)});
    if (r.status == 404) throw NotFoundError(describe(key) + ": no such object");
    if (r.status == 416) return {};
    if (r.status == 206) return std::move(r.body);
    if (r.status != 200) fail("GET", key, r);
    return http::cut_range(r.body, offset, length);  // the server ignored the range
  }

  ConditionalGet get_if_changed(const std::string& key, const std::string& etag) override {
    std::vector<std::string> headers;
    if (!etag.empty()) headers.push_back("If-None-Match: " + etag);
    auto r = send("GET", key, {}, headers);
    if (r.status == 304) return ConditionalGet{false, {}, etag};
    if (r.status == 404) throw NotFoundError(describe(key) + ": no such object");
    if (r.status != 200) fail("GET", key, r);
    return ConditionalGet{true, std::move(r.body), r.header("etag")};
  }

  std::optional<ObjectInfo> head(const std::string& key) override {
    auto r = send("HEAD", key, {}, {});
    if (r.status == 404) return std::nullopt;
    if (r.status != 200) fail("HEAD", key, r);
    std::string length = r.header("content-length");
    const uint64_t size = length.empty() ? 0 : parse_decimal<uint64_t>(length, describe(key) + ": HEAD Content-Length", ErrorKind::kGeneral);
    return ObjectInfo{key, size, r.header("etag")};
  }

  std::vector<ObjectInfo> list(const std::string& prefix) override {
    throw Error(describe(prefix) + ": listing is not supported by the http(s) store (use file:// or s3://)", ErrorKind::kUnsupported);
  }

  void remove(const std::string& key) override {
    auto r = send("DELETE", key, {}, {});
    if (r.status != 200 && r.status != 202 && r.status != 204 && r.status != 404) fail("DELETE", key, r);
  }

 private:
  http::Response send(const std::string& method, const std::string& key, std::span<const uint8_t> body,
                      std::vector<std::string> headers) {
    if (key.empty()) throw Error(base_ + ": empty object key");
    http::Request req;
    req.method = method;
    req.url = base_ + "/" + http::uri_encode(key, true) + query_;
    req.body = body;
    req.headers = std::move(headers);
    req.sent = &requests_;
    if (!auth_header_.empty()) req.headers.push_back(auth_header_);
    try {
      return http::perform_with_retries(std::move(req), options_, describe(key));
    } catch (const Error& e) {  // the last transient answer's body is part of the message
      throw Error(scrub(e.what()), e.kind());  // same kind (e.g. store unavailable)
    }
  }

  [[noreturn]] void fail(const std::string& verb, const std::string& key, const http::Response& r) const {
    throw Error(describe(key) + ": " + verb + " failed: " + scrub(http::describe_failure(r)), http::failure_kind(r.status));
  }

  // Error pages may echo the request ("Cannot PUT /obj?sig=..."): the secrets are cut out of
  // any text built from a response.
  std::string scrub(std::string text) const {
    for (const std::string& secret : secrets_)
      for (size_t at = text.find(secret); at != std::string::npos; at = text.find(secret, at + 3)) text.replace(at, secret.size(), "...");
    return text;
  }

  std::string base_;   // without trailing slash and without query
  std::string query_;  // "?..." appended to every object URL (e.g. a shared access signature), or ""
  StoreOptions options_;
  std::string auth_header_;
  std::vector<std::string> secrets_;  // never to appear in an error message
};

}  // namespace

std::unique_ptr<Store> open_http_store(const std::string& url, const StoreOptions& options) {
  std::string base = url, query;
  if (auto q = base.find('?'); q != std::string::npos) {
    query = base.substr(q);
    base = base.substr(0, q);
  }
  if (base.find('@') != std::string::npos && base.find('@') < base.find('/', base.find("://") + 3))
    throw Error("http store: credentials in the URL are not accepted (use DELTASYNC_HTTP_BEARER_TOKEN)");
  while (!base.empty() && base.back() == '/') base.pop_back();
  if (http::origin_of(base).empty()) throw Error(http::redact_url(url) + ": malformed URL");  // the query may hold a signature
  return std::make_unique<HttpStore>(base, query, options);
}

}  // namespace deltasync
