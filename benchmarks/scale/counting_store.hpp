// An in-memory store for the scale model that counts every request per actor (a publisher rank,
// rank 0's commit, a receiver rank). Objects under `drop_prefix` (the anchors) keep only their
// size: the model's anchor is ~2 GB at this scale and nothing in the run reads it back. An object
// put with put_head keeps its first bytes only and reads as zeros after them (the full-width index
// parts, whose payloads are zeros: index_parts.hpp).
#pragma once
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "store/store.hpp"

namespace deltasync::scale_model {

struct RequestCount {
  uint64_t get = 0, put = 0, head = 0, list = 0;
  uint64_t bytes_down = 0, bytes_up = 0;
  uint64_t total() const { return get + put + head + list; }
};

class CountingStore final : public Store {
 public:
  explicit CountingStore(std::string drop_prefix) : drop_prefix_(std::move(drop_prefix)) {}

  // Requests from now on count against `actor`.
  void act_as(const std::string& actor) { actor_ = &counts_[actor]; }
  const RequestCount& count(const std::string& actor) { return counts_[actor]; }

  std::string url() const override { return "memory://scale-model"; }
  void put(const std::string& key, std::span<const uint8_t> bytes) override {
    ++actor_->put;
    actor_->bytes_up += bytes.size();
    Object& o = objects_[key];
    o.size = bytes.size();
    o.bytes = key.rfind(drop_prefix_, 0) == 0 ? std::vector<uint8_t>{} : std::vector<uint8_t>(bytes.begin(), bytes.end());
    o.etag = std::to_string(++tag_);
  }
  void put_head(const std::string& key, std::vector<uint8_t> head, uint64_t size) {
    ++actor_->put;
    actor_->bytes_up += size;
    Object& o = objects_[key];
    o.size = size;
    o.bytes = std::move(head);
    o.etag = std::to_string(++tag_);
  }
  bool put_if_absent(const std::string& key, std::span<const uint8_t> bytes) override {
    if (objects_.count(key)) {
      ++actor_->put;
      return false;
    }
    put(key, bytes);
    return true;
  }
  bool supports_put_if_match() const override { return true; }
  bool put_if_match(const std::string& key, std::span<const uint8_t> bytes, const std::string& etag) override {
    auto it = objects_.find(key);
    if (it == objects_.end() || it->second.etag != etag) {
      ++actor_->put;
      return false;
    }
    put(key, bytes);
    return true;
  }
  std::vector<uint8_t> get(const std::string& key) override {
    ++actor_->get;
    const Object& o = find(key);
    actor_->bytes_down += o.size;
    return o.bytes;
  }
  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t length) override {
    ++actor_->get;
    const Object& o = find(key);
    if (offset >= o.size) return {};
    const uint64_t n = std::min<uint64_t>(length, o.size - offset);
    actor_->bytes_down += n;
    std::vector<uint8_t> out(n, 0);  // zeros past what is kept
    if (offset < o.bytes.size())
      std::copy(o.bytes.begin() + offset, o.bytes.begin() + offset + std::min<uint64_t>(n, o.bytes.size() - offset), out.begin());
    return out;
  }
  ConditionalGet get_if_changed(const std::string& key, const std::string& etag) override {
    ++actor_->get;
    const Object& o = find(key);
    if (!etag.empty() && etag == o.etag) return ConditionalGet{false, {}, o.etag};
    actor_->bytes_down += o.size;
    return ConditionalGet{true, o.bytes, o.etag};
  }
  std::optional<ObjectInfo> head(const std::string& key) override {
    ++actor_->head;
    auto it = objects_.find(key);
    if (it == objects_.end()) return std::nullopt;
    return ObjectInfo{key, it->second.size, it->second.etag};
  }
  std::vector<ObjectInfo> list(const std::string& prefix) override {
    ++actor_->list;
    std::vector<ObjectInfo> out;
    for (auto it = objects_.lower_bound(prefix); it != objects_.end() && it->first.rfind(prefix, 0) == 0; ++it)
      out.push_back(ObjectInfo{it->first, it->second.size, it->second.etag});
    return out;
  }
  void remove(const std::string& key) override { objects_.erase(key); }

  uint64_t size_of(const std::string& key) const { return objects_.at(key).size; }
  // An object's bytes without a request (what the model's own measures look at).
  std::span<const uint8_t> bytes_of(const std::string& key) const { return find(key).bytes; }

 private:
  struct Object {
    uint64_t size = 0;
    std::vector<uint8_t> bytes;
    std::string etag;
  };
  const Object& find(const std::string& key) const {
    auto it = objects_.find(key);
    if (it == objects_.end()) throw NotFoundError(describe(key) + ": not found");
    return it->second;
  }
  std::string drop_prefix_;
  std::map<std::string, Object> objects_;
  std::map<std::string, RequestCount> counts_;
  RequestCount* actor_ = &counts_["other"];
  uint64_t tag_ = 0;
};

}  // namespace deltasync::scale_model
