// The reader side of the store protocol: find the newest version cheaply, plan the cheapest
// catch-up by bytes, fetch in parallel, verify every object (SHA-256 against the manifest) and
// every apply (integrity digests), and on any failure keep consistent weights and recover from
// the newest anchor.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "engine/host_model.hpp"
#include "sync/protocol.hpp"
#include "store/store.hpp"

namespace deltasync {

struct SubscriberOptions {
  unsigned parallel_fetches = 4;  // objects downloaded at once
  // Called with a one-line note (plan chosen, recovery started); may be empty.
  std::function<void(const std::string&)> log;
};

struct SyncReport {
  std::optional<uint64_t> from;  // version before (nullopt: nothing usable)
  uint64_t to = 0;
  protocol::CatchUpPlan plan;    // the plan that succeeded
  bool recovered = false;        // the first plan failed (or the weights did not match their
  std::string recovery_reason;   // version) and the model was rebuilt from an anchor
  uint64_t bytes_fetched = 0;
  double fetch_seconds = 0, apply_seconds = 0, total_seconds = 0;
};

class Subscriber {
 public:
  explicit Subscriber(Store& store, SubscriberOptions options = {});

  // The newest visible version. Reads LATEST with a conditional GET (no body moves while it is
  // unchanged) and confirms the manifest exists; falls back to listing manifests when LATEST is
  // absent or names a version without a manifest. nullopt: the store has no versions.
  std::optional<uint64_t> poll();

  // Brings `model` to `target` (default: the newest version). A model with a version is first
  // audited: its digests (computed if missing) must equal those its version's manifest
  // records; otherwise it is treated as having nothing and rebuilt from an anchor. On success
  // model.version == target and model.digests match the target's manifest. On failure throws
  // Error; the model then holds consistent weights at model.version (possibly advanced part way).
  SyncReport sync(HostModel& model, std::optional<uint64_t> target = std::nullopt);

  protocol::Catalog& catalog() { return catalog_; }

 private:
  void execute(const protocol::CatchUpPlan& plan, HostModel& model, SyncReport& report);
  std::vector<std::vector<uint8_t>> fetch_all(const std::vector<protocol::ObjectRef>& objects, SyncReport& report);
  void note(const std::string& line) const;

  Store& store_;
  SubscriberOptions options_;
  protocol::Catalog catalog_;
  std::string latest_etag_;
  std::optional<uint64_t> latest_seen_;
  bool can_list_ = true;
};

// Builds a model from an anchor's parts (already fetched and hash-checked): parts in order,
// every tensor once, digests recomputed and compared with the digests the parts carry.
HostModel load_anchor(const protocol::Manifest& manifest, std::vector<std::vector<uint8_t>> parts, const std::string& label);

// Applies one fetched delta object to `model` (transactional: on a failed check nothing is
// changed). The delta's versions must match the manifest's.
void apply_delta_object(HostModel& model, const protocol::Manifest& manifest, std::vector<uint8_t> bytes,
                        const std::string& label);

}  // namespace deltasync
