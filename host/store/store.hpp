// Object stores behind one interface, chosen by URL:
//   file:///abs/path      a folder (atomic rename; exclusive create for put_if_absent)
//   s3://bucket/prefix    any S3-compatible service (AWS, R2, MinIO)
//   hf://buckets/NAMESPACE/BUCKET/PREFIX   a Hugging Face bucket, through its S3 gateway
//   http(s)://host/path   plain PUT/GET/HEAD (WebDAV servers); no listing
// Keys are relative, '/'-separated ("manifests/v000000000012.json"). Objects are written
// whole: a reader sees either the old object, the new one, or none — never a torn write.
// Every failure is a deltasync::Error whose message names the object ("s3://b/p/key: ...")
// and never contains a secret.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace deltasync {

// Thrown by get/get_range when the object does not exist (a normal outcome a caller may
// handle, e.g. a version deleted by retention while a reader was planning).
class NotFoundError : public Error {
 public:
  explicit NotFoundError(const std::string& what) : Error(what, ErrorKind::kNotFound) {}
};

struct ObjectInfo {
  std::string key;   // relative to the store's root
  uint64_t size = 0;
  std::string etag;  // opaque change tag (S3 ETag, or mtime+size+inode for a folder)
};

// Outcome of a conditional read: `changed` is false (and `bytes` empty) when the object's tag
// still equals the tag the caller passed.
struct ConditionalGet {
  bool changed = true;
  std::vector<uint8_t> bytes;
  std::string etag;
};

// Retries for transient failures (5xx, 429, timeouts, dropped connections): attempt k waits
// a random time in [0, min(max_delay, base_delay * 2^k)] ("full jitter") before trying again.
struct RetryPolicy {
  int max_attempts = 5;
  double base_delay_s = 0.1;
  double max_delay_s = 5.0;
};

// Progress of one long transfer, reported from whichever thread moves the bytes.
using ProgressFn = std::function<void(uint64_t done_bytes, uint64_t total_bytes)>;

class Store {
 public:
  virtual ~Store() = default;

  // The store's URL as given, safe to print (never contains credentials).
  virtual std::string url() const = 0;
  // The printable name of one object ("s3://bucket/prefix/KEY").
  std::string describe(const std::string& key) const;

  // Creates or replaces the object.
  virtual void put(const std::string& key, std::span<const uint8_t> bytes) = 0;
  // Creates the object only if no object of that name exists; returns false (writing nothing)
  // if one does. Safe against a concurrent writer of the same key: exactly one wins.
  virtual bool put_if_absent(const std::string& key, std::span<const uint8_t> bytes) = 0;
  // Replaces the object only while its tag still equals `etag` (S3 If-Match); returns false,
  // writing nothing, when it moved. Only where supports_put_if_match() (else throws Error).
  virtual bool supports_put_if_match() const { return false; }
  virtual bool put_if_match(const std::string& key, std::span<const uint8_t> bytes, const std::string& etag);
  // Whole object. Throws NotFoundError when absent.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  // Bytes [offset, offset + length) (fewer at the end of the object).
  virtual std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t length) = 0;
  // The object unless its tag still equals `etag` (empty `etag`: always fetch). Throws
  // NotFoundError when absent. Stores implement this cheaply (If-None-Match; stat()).
  virtual ConditionalGet get_if_changed(const std::string& key, const std::string& etag);
  // Size and tag, or nullopt when absent.
  virtual std::optional<ObjectInfo> head(const std::string& key) = 0;
  // Every object whose key starts with `prefix`, sorted by key.
  virtual std::vector<ObjectInfo> list(const std::string& prefix) = 0;
  // Deletes the object; deleting an absent object is not an error.
  virtual void remove(const std::string& key) = 0;
  // Aborts the unfinished multipart uploads under `prefix` whose key `abandoned` says no writer
  // will finish (left by a writer killed mid-upload: no reader ever sees them, but the service
  // keeps, and bills, their parts until they are aborted). Returns how many were aborted. Stores
  // without multipart uploads (folders, HTTP) have none to abort.
  virtual uint64_t abort_unfinished_uploads(const std::string& prefix, const std::function<bool(const std::string& key)>& abandoned) {
    (void)prefix;
    (void)abandoned;
    return 0;
  }

  // Called during long transfers of this store (may be empty). Not thread-safe to change
  // while a transfer runs.
  void set_progress(ProgressFn fn) { progress_ = std::move(fn); }

  // Requests sent so far: HTTP exchanges for the network stores (retries and redirect follow-ups
  // included), file system operations for a folder. What a follower's polls cost.
  uint64_t requests() const { return requests_.load(std::memory_order_relaxed); }

 protected:
  ProgressFn progress_;
  std::atomic<uint64_t> requests_{0};
};

// Tunables shared by the network stores; defaults suit a datacenter link.
struct StoreOptions {
  RetryPolicy retry;
  // Objects at least this large are uploaded in parts / downloaded with ranged GETs (above the
  // publisher's 64 MiB anchor parts, which are already transferred in parallel)...
  uint64_t multipart_threshold = 128ull << 20;
  // ...of this size each (S3 requires >= 5 MiB for all but the last part)...
  uint64_t part_size = 16ull << 20;
  // ...with this many transfers in flight.
  unsigned parallelism = 8;
  long connect_timeout_s = 10;
  // A transfer slower than `low_speed_bytes_per_s` for `low_speed_time_s` is dropped and retried.
  long low_speed_bytes_per_s = 1024;
  long low_speed_time_s = 30;
  // Keys per S3 listing page (0: the server's default, 1000 on AWS).
  unsigned list_page_size = 0;
};

// Opens a store from its URL. Options come from the environment where a URL scheme needs
// them (AWS_* for s3://, DELTASYNC_HF_* or AWS_* for hf://; DELTASYNC_STORE_RETRIES, DELTASYNC_STORE_PARALLELISM,
// DELTASYNC_STORE_PART_SIZE, DELTASYNC_STORE_MULTIPART_THRESHOLD,
// DELTASYNC_STORE_RETRY_BASE_MS, DELTASYNC_STORE_LOW_SPEED_TIME, DELTASYNC_STORE_LIST_PAGE override the
// defaults). Throws Error for an unknown scheme or a
// malformed URL.
std::unique_ptr<Store> open_store(const std::string& url);
std::unique_ptr<Store> open_store(const std::string& url, const StoreOptions& options);

// The individual constructors, for tests and callers that configure stores themselves.
std::unique_ptr<Store> open_folder_store(const std::string& path);
std::unique_ptr<Store> open_s3_store(const std::string& url, const StoreOptions& options);
// hf://buckets/NAMESPACE/BUCKET[/PREFIX]: the gateway https://s3.hf.co/NAMESPACE (or
// DELTASYNC_HF_S3_ENDPOINT), region us-east-1, credentials from DELTASYNC_HF_ACCESS_KEY_ID /
// DELTASYNC_HF_SECRET_ACCESS_KEY, else AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
std::unique_ptr<Store> open_hf_bucket_store(const std::string& url, const StoreOptions& options);
std::unique_ptr<Store> open_http_store(const std::string& url, const StoreOptions& options);

}  // namespace deltasync
