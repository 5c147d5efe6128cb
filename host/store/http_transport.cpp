#include "store/http_transport.hpp"

#include "store/s3_xml.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <random>
#include <system_error>
#include <thread>

namespace deltasync::http {
namespace {

void global_init_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// Easy handles are pooled rather than tied to threads: transfers run on short-lived worker
// threads (one set per large object), and a handle returned to the pool keeps its connection
// cache, so the next request to the same endpoint skips the TCP and TLS handshakes.
class HandlePool {
 public:
  CURL* acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        CURL* h = free_.back();
        free_.pop_back();
        return h;
      }
    }
    global_init_once();
    CURL* h = curl_easy_init();
    if (!h) throw TransportError("curl_easy_init failed");
    return h;
  }
  void release(CURL* h) {
    curl_easy_reset(h);  // drops options (credentials included), keeps live connections
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < 64) {
      free_.push_back(h);
      return;
    }
    curl_easy_cleanup(h);
  }
  ~HandlePool() {
    for (CURL* h : free_) curl_easy_cleanup(h);
  }

 private:
  std::mutex mutex_;
  std::vector<CURL*> free_;
};

HandlePool& handle_pool() {
  // Never destroyed: a transfer may still run on a background thread (a publisher's worker, a
  // Python interpreter shutting down) after static destructors began; the OS reclaims the
  // handles at exit.
  static HandlePool* pool = new HandlePool;
  return *pool;
}

// Borrows a handle for one exchange.
class PooledHandle {
 public:
  PooledHandle() : h_(handle_pool().acquire()) {}
  ~PooledHandle() { handle_pool().release(h_); }
  PooledHandle(const PooledHandle&) = delete;
  PooledHandle& operator=(const PooledHandle&) = delete;
  CURL* get() const { return h_; }

 private:
  CURL* h_;
};

struct UploadCursor {
  std::span<const uint8_t> body;
  size_t sent = 0;
};

size_t read_body(char* out, size_t size, size_t count, void* user) {
  auto* cursor = static_cast<UploadCursor*>(user);
  size_t n = std::min(size * count, cursor->body.size() - cursor->sent);
  std::memcpy(out, cursor->body.data() + cursor->sent, n);
  cursor->sent += n;
  return n;
}

size_t write_body(char* data, size_t size, size_t count, void* user) {
  auto* out = static_cast<std::vector<uint8_t>*>(user);
  out->insert(out->end(), reinterpret_cast<uint8_t*>(data), reinterpret_cast<uint8_t*>(data) + size * count);
  return size * count;
}

size_t write_header(char* data, size_t size, size_t count, void* user) {
  add_header_line(*static_cast<std::map<std::string, std::string>*>(user), std::string_view(data, size * count));
  return size * count;
}

struct HeaderList {
  curl_slist* list = nullptr;
  ~HeaderList() { curl_slist_free_all(list); }
  void add(const std::string& h) {
    curl_slist* next = curl_slist_append(list, h.c_str());
    if (!next) throw TransportError("out of memory building request headers");
    list = next;
  }
};

// <Code> and <Message> of an S3-style <Error> body; empty when the body is something else (a
// proxy's HTML page, nothing at all): describing a failure never fails itself.
std::pair<std::string, std::string> error_fields(const Response& response) {
  std::string_view body(reinterpret_cast<const char*>(response.body.data()), response.body.size());
  if (body.find("<Error") == std::string_view::npos) return {};
  try {
    const s3xml::Element root = s3xml::parse(body, "error body");
    if (root.name != "Error") return {};
    return {root.child_text("Code").value_or(""), root.child_text("Message").value_or("")};
  } catch (const Error&) {
    return {};
  }
}

bool transient_status(long status) { return status == 429 || (status >= 500 && status <= 599); }

bool is_redirect(long status) { return status == 301 || status == 302 || status == 303 || status == 307 || status == 308; }

std::string resolve_location(const std::string& base, const std::string& location) {
  if (location.find("://") != std::string::npos) return location;
  if (!location.empty() && location[0] == '/') return origin_of(base) + location;
  auto slash = base.rfind('/');
  return base.substr(0, slash + 1) + location;
}

}  // namespace

void add_header_line(std::map<std::string, std::string>& headers, std::string_view line) {
  if (line.rfind("HTTP/", 0) == 0) {
    headers.clear();  // a new response (after 100-continue): keep only the final one's headers
    return;
  }
  auto colon = line.find(':');
  if (colon == std::string_view::npos) return;
  std::string name(line.substr(0, colon));
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' ')) value.remove_suffix(1);
  headers[name] = std::string(value);
}

Request redirected_request(const Request& request, const std::string& location, const std::string& label) {
  const std::string target = resolve_location(request.url, location);
  if (origin_of(target) == origin_of(request.url)) {
    Request next = request;
    next.url = target;
    return next;
  }
  if (request.redirects != RedirectPolicy::PresignedGet || request.method != "GET")
    throw Error(label + ": " + request.method + " redirected to another host (" + origin_of(target) +
                "); refusing to follow with credentials");
  return presigned_follow_up(request, target, label);
}

std::string Response::header(const std::string& lower_name) const {
  auto it = headers.find(lower_name);
  return it == headers.end() ? std::string() : it->second;
}

std::string origin_of(const std::string& url) {
  auto scheme_end = url.find("://");
  if (scheme_end == std::string::npos) return {};
  auto host_end = url.find_first_of("/?#", scheme_end + 3);
  std::string origin = url.substr(0, host_end == std::string::npos ? url.size() : host_end);
  std::transform(origin.begin(), origin.end(), origin.begin(), [](unsigned char c) { return std::tolower(c); });
  // Make the default port explicit so "https://h" and "https://h:443" compare equal.
  std::string scheme = origin.substr(0, scheme_end);
  std::string hostport = origin.substr(scheme_end + 3);
  if (auto at = hostport.rfind('@'); at != std::string::npos) hostport = hostport.substr(at + 1);
  bool has_port = hostport.find(':', hostport.rfind(']') == std::string::npos ? 0 : hostport.rfind(']')) != std::string::npos;
  if (!has_port) hostport += scheme == "https" ? ":443" : ":80";
  return scheme + "://" + hostport;
}

std::string uri_encode(std::string_view text, bool keep_slash) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

std::string sigv4_query(std::vector<std::pair<std::string, std::string>> params) {
  for (auto& [name, value] : params) {
    name = uri_encode(name, false);
    value = uri_encode(value, false);
  }
  // Sorted after encoding: SigV4 orders the encoded names by byte value.
  std::sort(params.begin(), params.end());
  std::string out;
  for (const auto& [name, value] : params) {
    if (!out.empty()) out += '&';
    out += name + "=" + value;
  }
  return out;
}

std::string error_code(const Response& response) { return error_fields(response).first; }

std::string describe_failure(const Response& response) {
  std::string out = "HTTP " + std::to_string(response.status);
  std::string_view body(reinterpret_cast<const char*>(response.body.data()), response.body.size());
  const auto [code, message] = error_fields(response);
  if (!code.empty()) {
    out += " " + code;
    if (!message.empty()) out += ": " + message;
  } else if (!body.empty()) {
    std::string excerpt;
    for (char c : body.substr(0, 160)) excerpt += (c >= 32 && c < 127) ? c : ' ';
    out += ": " + excerpt;
  }
  return out;
}

bool is_loopback(const std::string& url) {
  const std::string origin = origin_of(url);
  const auto scheme_end = origin.find("://");
  if (scheme_end == std::string::npos) return false;
  std::string host = origin.substr(scheme_end + 3);
  host = host.substr(0, host.rfind(':'));  // origin_of always ends in :PORT
  return host == "localhost" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

Request presigned_follow_up(const Request& original, const std::string& target, const std::string& label) {
  const std::string origin = origin_of(target);
  const bool https = origin.rfind("https://", 0) == 0;
  const bool test_loopback = origin.rfind("http://", 0) == 0 && origin_of(original.url).rfind("http://", 0) == 0 &&
                             is_loopback(original.url) && is_loopback(target);
  if (!https && !test_loopback)
    throw Error(label + ": " + original.method + " redirected to " + redact_url(target) +
                ", which is not HTTPS; refusing to follow");
  Request next;
  next.method = "GET";
  next.url = target;
  next.redirects = original.redirects;
  next.sent = original.sent;
  for (const std::string& h : original.headers) {
    std::string name = h.substr(0, h.find(':'));
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    if (name == "range") next.headers.push_back(h);
  }
  return next;  // aws == nullptr: libcurl neither signs nor sends Authorization
}

std::string range_header(uint64_t offset, uint64_t length) {
  std::string header = "Range: bytes=" + std::to_string(offset) + "-";
  if (length > 0 && length - 1 <= std::numeric_limits<uint64_t>::max() - offset) header += std::to_string(offset + (length - 1));
  return header;
}

std::vector<uint8_t> cut_range(const std::vector<uint8_t>& whole, uint64_t offset, uint64_t length) {
  if (offset >= whole.size()) return {};
  const uint64_t n = std::min<uint64_t>(length, whole.size() - offset);
  return std::vector<uint8_t>(whole.begin() + static_cast<ptrdiff_t>(offset), whole.begin() + static_cast<ptrdiff_t>(offset + n));
}

std::string redact_url(const std::string& url) {
  const auto cut = url.find_first_of("?#");
  std::string out = url.substr(0, cut);
  const auto scheme_end = out.find("://");
  const size_t authority = scheme_end == std::string::npos ? 0 : scheme_end + 3;
  const auto authority_end = out.find('/', authority);
  const auto at = out.rfind('@', authority_end);  // npos: search the whole string
  if (at != std::string::npos && at >= authority) out.erase(authority, at + 1 - authority);
  if (cut != std::string::npos && url[cut] == '?') out += "?...";
  return out;
}

Response perform(const Request& request, const StoreOptions& options) {
  PooledHandle handle;
  CURL* curl = handle.get();
  Response response;
  HeaderList headers;
  for (const auto& h : request.headers) headers.add(h);
  // No "Expect: 100-continue" round trip for unsigned requests. (Libcurl's SigV4 would sign
  // the empty removal header, which is never sent, so signed requests keep curl's default.)
  if (!request.aws) headers.add("Expect:");
  UploadCursor cursor{request.body, 0};

  curl_easy_setopt(curl, CURLOPT_URL, request.url.c_str());
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 0L);  // redirects are vetted by the caller
  curl_easy_setopt(curl, CURLOPT_SSL_VERIFYPEER, 1L);
  curl_easy_setopt(curl, CURLOPT_SSL_VERIFYHOST, 2L);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT, options.connect_timeout_s);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, options.low_speed_bytes_per_s);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, options.low_speed_time_s);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &write_header);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &response.headers);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &write_body);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response.body);

  if (request.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, &read_body);
    curl_easy_setopt(curl, CURLOPT_READDATA, &cursor);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
  } else if (request.method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, request.body.empty() ? "" : reinterpret_cast<const char*>(request.body.data()));
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
  } else if (request.method != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }
  if (request.aws) {
    curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, request.aws->sigv4.c_str());
    curl_easy_setopt(curl, CURLOPT_USERNAME, request.aws->access_key.c_str());
    curl_easy_setopt(curl, CURLOPT_PASSWORD, request.aws->secret_key.c_str());
  }
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers.list);

  char error_buffer[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error_buffer);
  CURLcode rc = curl_easy_perform(curl);
  if (rc != CURLE_OK) {
    // curl's messages name hosts and reasons, never the credentials we passed as options.
    throw TransportError(std::string(error_buffer[0] ? error_buffer : curl_easy_strerror(rc)));
  }
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  return response;
}

Response perform_with_retries(Request request, const StoreOptions& options, const std::string& label,
                              const std::function<bool(const Response&)>& retry_also) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const int attempts = std::max(1, options.retry.max_attempts);
  std::string last_reason;
  int redirects = 0;
  const std::string first_origin = origin_of(request.url);
  for (int attempt = 1; attempt <= attempts; ++attempt) {
    if (attempt > 1) {
      double cap = std::min(options.retry.max_delay_s, options.retry.base_delay_s * double(1ull << std::min(attempt - 2, 20)));
      std::uniform_real_distribution<double> jitter(0.0, cap);
      std::this_thread::sleep_for(std::chrono::duration<double>(jitter(rng)));
    }
    Response response;
    if (request.sent) request.sent->fetch_add(1, std::memory_order_relaxed);
    try {
      response = perform(request, options);
    } catch (const TransportError& e) {
      last_reason = e.what();
      continue;
    }
    if (is_redirect(response.status)) {
      std::string location = response.header("location");
      if (location.empty()) return response;  // e.g. S3's PermanentRedirect: the caller explains
      if (++redirects > 5) throw Error(label + ": " + request.method + " failed: too many redirects");
      request = redirected_request(request, location, label);
      --attempt;  // a redirect is not a failed attempt
      continue;
    }
    if (transient_status(response.status) || (retry_also && retry_also(response))) {
      last_reason = describe_failure(response);
      continue;
    }
    response.from_other_origin = origin_of(request.url) != first_origin;
    return response;
  }
  throw Error(label + ": " + request.method + " failed after " + std::to_string(attempts) +
                  (attempts == 1 ? " attempt: " : " attempts: ") + last_reason,
              ErrorKind::kStoreUnavailable);
}

ErrorKind failure_kind(long status) {
  if (status == 401 || status == 403) return ErrorKind::kCredentials;
  if (status >= 500) return ErrorKind::kStoreUnavailable;
  return ErrorKind::kGeneral;
}

void run_parallel(size_t n, unsigned parallelism, const std::function<void(size_t)>& job) {
  if (n == 0) return;
  unsigned threads = static_cast<unsigned>(std::min<size_t>(std::max(1u, parallelism), n));
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (;;) {
      if (failed.load()) return;
      size_t i = next.fetch_add(1);
      if (i >= n) return;
      try {
        job(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the ones running (and this one) share the jobs
    }
  }
  worker();
  for (auto& t : pool) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

std::vector<uint8_t> fetch_in_parallel(uint64_t total, std::vector<uint8_t> head, const StoreOptions& options,
                                       const std::function<std::vector<uint8_t>(uint64_t, uint64_t)>& fetch_range,
                                       const ProgressFn& progress) {
  if (head.size() > total) throw Error("the first GET returned " + std::to_string(head.size()) + " bytes of an object of " + std::to_string(total));
  std::vector<uint8_t> out = std::move(head);
  const uint64_t start = out.size();
  out.resize(total);
  const uint64_t part = std::max<uint64_t>(options.part_size, 1);
  const uint64_t parts = (total - start + part - 1) / part;
  std::atomic<uint64_t> done{start};
  run_parallel(parts, options.parallelism, [&](size_t i) {
    uint64_t offset = start + i * part;
    uint64_t length = std::min(part, total - offset);
    std::vector<uint8_t> bytes = fetch_range(offset, length);
    if (bytes.size() != length) throw Error("ranged GET returned " + std::to_string(bytes.size()) + " bytes, expected " + std::to_string(length));
    std::memcpy(out.data() + offset, bytes.data(), length);
    uint64_t now = done.fetch_add(length) + length;
    if (progress) progress(now, total);
  });
  return out;
}

}  // namespace deltasync::http
