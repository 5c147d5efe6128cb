// URL dispatch, environment overrides and the parts of Store shared by every backend.
#include "store/store.hpp"

#include <cstdlib>

#include "core/parse_number.hpp"
#include "store/http_transport.hpp"

namespace deltasync {

std::string Store::describe(const std::string& key) const {
  std::string base = url();
  if (!base.empty() && base.back() != '/') base += '/';
  return base + key;
}

ConditionalGet Store::get_if_changed(const std::string& key, const std::string& etag) {
  // Generic fallback: a HEAD, then a GET only when the tag moved.
  auto info = head(key);
  if (!info) throw NotFoundError(describe(key) + ": no such object");
  if (!etag.empty() && info->etag == etag) return ConditionalGet{false, {}, etag};
  return ConditionalGet{true, get(key), info->etag};
}

bool Store::put_if_match(const std::string& key, std::span<const uint8_t>, const std::string&) {
  throw Error(describe(key) + ": this store has no conditional replace (If-Match)");
}

namespace {

// An unset or empty variable keeps `fallback`; any other value must fit T.
template <class T>
T env_number(const char* name, T fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return parse_decimal<T>(v, name, ErrorKind::kInvalidArgument);
}

StoreOptions options_from_env() {
  StoreOptions o;
  o.retry.max_attempts = env_number("DELTASYNC_STORE_RETRIES", o.retry.max_attempts);
  if (o.retry.max_attempts < 1) o.retry.max_attempts = 1;
  o.parallelism = env_number("DELTASYNC_STORE_PARALLELISM", o.parallelism);
  if (o.parallelism < 1) o.parallelism = 1;
  o.part_size = env_number("DELTASYNC_STORE_PART_SIZE", o.part_size);
  if (o.part_size == 0) throw Error("DELTASYNC_STORE_PART_SIZE: expected a positive number of bytes, got 0");
  o.multipart_threshold = env_number("DELTASYNC_STORE_MULTIPART_THRESHOLD", o.multipart_threshold);
  // Test hook and slow-link knob: the delay unit of the backoff, in milliseconds.
  o.retry.base_delay_s = static_cast<double>(env_number<uint64_t>("DELTASYNC_STORE_RETRY_BASE_MS", 100)) / 1000.0;
  o.low_speed_time_s = env_number("DELTASYNC_STORE_LOW_SPEED_TIME", o.low_speed_time_s);
  o.list_page_size = env_number<unsigned>("DELTASYNC_STORE_LIST_PAGE", 0);
  return o;
}

}  // namespace

std::unique_ptr<Store> open_store(const std::string& url) { return open_store(url, options_from_env()); }

std::unique_ptr<Store> open_store(const std::string& url, const StoreOptions& options) {
  if (url.rfind("file://", 0) == 0) return open_folder_store(url.substr(7));
  if (url.rfind("s3://", 0) == 0) return open_s3_store(url, options);
  if (url.rfind("hf://", 0) == 0) return open_hf_bucket_store(url, options);
  if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0) return open_http_store(url, options);
  if (!url.empty() && url.find("://") == std::string::npos) return open_folder_store(url);  // a plain path
  throw Error(http::redact_url(url) +
                  ": unknown store URL (expected file:///path, s3://bucket/prefix, hf://buckets/NAMESPACE/BUCKET/PREFIX or http(s)://...)",
              ErrorKind::kInvalidArgument);
}

}  // namespace deltasync
