#include "sync/subscriber.hpp"

#include <chrono>
#include <cstring>
#include <set>

#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "engine/integrity.hpp"
#include "store/http_transport.hpp"

namespace deltasync {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The digests a manifest records, compared with the model's; returns the first mismatch.
std::optional<std::string> digest_mismatch(const HostModel& model, const protocol::Manifest& manifest) {
  if (manifest.digests.empty()) return std::nullopt;  // a manifest without digests cannot audit
  if (manifest.digests.size() != model.tensors.size())
    return "the model has " + std::to_string(model.tensors.size()) + " tensors, version " + std::to_string(manifest.version) +
           " has " + std::to_string(manifest.digests.size());
  for (size_t t = 0; t < model.tensors.size(); ++t) {
    auto it = manifest.digests.find(model.tensors[t].name);
    if (it == manifest.digests.end()) return "tensor " + model.tensors[t].name + " is not part of version " + std::to_string(manifest.version);
    if (it->second != digest_to_hex(model.digests[t]))
      return "tensor " + model.tensors[t].name + " digest " + digest_to_hex(model.digests[t]) + " differs from version " +
             std::to_string(manifest.version) + "'s " + it->second;
  }
  return std::nullopt;
}

}  // namespace

HostModel load_anchor(const protocol::Manifest& manifest, std::vector<std::vector<uint8_t>> parts, const std::string& label) {
  HostModel model;
  std::set<std::string> seen;
  integrity::DigestMap recorded;
  for (size_t k = 0; k < parts.size(); ++k) {
    st::File file = st::File::from_bytes(std::move(parts[k]), label + " part " + std::to_string(k));
    HostModel piece = HostModel::from_file(file);
    if (piece.version != manifest.version)
      throw Error(file.label() + ": anchor part is for version " + (piece.version ? std::to_string(*piece.version) : "unknown") +
                  ", expected " + std::to_string(manifest.version));
    if (auto d = integrity::read_checkpoint_digests(file.metadata(), file.label())) recorded.insert(d->begin(), d->end());
    for (size_t t = 0; t < piece.tensors.size(); ++t) {
      if (!seen.insert(piece.tensors[t].name).second) throw Error(label + ": tensor " + piece.tensors[t].name + " appears in two anchor parts");
      model.tensors.push_back(std::move(piece.tensors[t]));
      model.data.push_back(std::move(piece.data[t]));
    }
  }
  model.version = manifest.version;
  model.compute_digests();  // the audit an anchor deserves: one read of the weights
  for (size_t t = 0; t < model.tensors.size(); ++t) {
    auto it = recorded.find(model.tensors[t].name);
    if (it != recorded.end() && it->second != model.digests[t])
      throw Error(label + ": tensor " + model.tensors[t].name + " does not match its recorded digest");
  }
  if (auto bad = digest_mismatch(model, manifest)) throw Error(label + ": anchor does not match its manifest: " + *bad);
  return model;
}

void apply_delta_object(HostModel& model, const protocol::Manifest& manifest, std::vector<uint8_t> bytes, const std::string& label) {
  st::File file = st::File::from_bytes(std::move(bytes), label);
  ResolvedDelta resolved;
  {
    auto base = model.const_refs();
    resolve_delta(file, model.tensors, base, resolved);
  }
  const DeltaInfo& info = resolved.info;
  const std::vector<PatchRef>& patches = resolved.patches;
  if (info.model_version != manifest.version || info.base_version != manifest.base_version)
    throw Error(label + ": delta's versions disagree with its manifest");
  auto expected = integrity::read_delta_digests(info, label);
  if (!expected) throw Error(label + ": delta carries no digests; refusing to apply it unverified");
  if (model.digests.size() != model.tensors.size()) model.compute_digests();
  auto targets = model.refs();
  integrity::apply_verified(targets, patches, *expected, model.digests, model.version);
  model.version = manifest.version;
}

Subscriber::Subscriber(Store& store, SubscriberOptions options)
    : store_(store), options_(std::move(options)), catalog_(store) {}

void Subscriber::note(const std::string& line) const {
  if (options_.log) options_.log(line);
}

std::optional<uint64_t> Subscriber::poll() {
  std::optional<uint64_t> latest;
  try {
    auto r = store_.get_if_changed(protocol::kLatestKey, latest_etag_);
    if (r.changed) {
      latest_etag_ = r.etag;
      latest_seen_ = protocol::parse_latest(std::string_view(reinterpret_cast<const char*>(r.bytes.data()), r.bytes.size()),
                                            store_.describe(protocol::kLatestKey));
    }
    latest = latest_seen_;
  } catch (const NotFoundError&) {
    latest_etag_.clear();
    latest_seen_.reset();
  }
  // LATEST is a hint written after the manifest; a manifest is the truth.
  if (latest && catalog_.find(*latest)) return latest;
  if (!can_list_) return std::nullopt;
  try {
    auto versions = catalog_.refresh();
    if (!versions.empty()) return versions.back();
  } catch (const Error& e) {
    if (std::string(e.what()).find("listing is not supported") == std::string::npos) throw;
    can_list_ = false;
  }
  return std::nullopt;
}

std::vector<std::vector<uint8_t>> Subscriber::fetch_all(const std::vector<protocol::ObjectRef>& objects, SyncReport& report) {
  std::vector<std::vector<uint8_t>> out(objects.size());
  http::run_parallel(objects.size(), options_.parallel_fetches, [&](size_t i) {
    const auto& o = objects[i];
    auto bytes = store_.get(o.key);
    protocol::verify_object(o, bytes, store_.describe(o.key));
    out[i] = std::move(bytes);
  });
  for (const auto& o : objects) report.bytes_fetched += o.size;
  return out;
}

void Subscriber::execute(const protocol::CatchUpPlan& plan, HostModel& model, SyncReport& report) {
  std::vector<protocol::ObjectRef> objects;
  std::vector<const protocol::Manifest*> chain;
  const protocol::Manifest* anchor = nullptr;
  if (plan.anchor_version) {
    anchor = catalog_.find(*plan.anchor_version);
    if (!anchor) throw NotFoundError(store_.describe(protocol::manifest_key(*plan.anchor_version)) + ": anchor version disappeared");
    objects = anchor->anchor_parts;
  }
  for (uint64_t v : plan.deltas) {
    const protocol::Manifest* m = catalog_.find(v);
    if (!m || !m->delta) throw NotFoundError(store_.describe(protocol::manifest_key(v)) + ": delta version disappeared");
    chain.push_back(m);
    objects.push_back(*m->delta);
  }
  auto t0 = Clock::now();
  auto fetched = fetch_all(objects, report);
  report.fetch_seconds += seconds_since(t0);
  auto t1 = Clock::now();
  size_t next = 0;
  if (anchor) {
    std::vector<std::vector<uint8_t>> parts(std::make_move_iterator(fetched.begin()),
                                            std::make_move_iterator(fetched.begin() + anchor->anchor_parts.size()));
    next = anchor->anchor_parts.size();
    HostModel fresh = load_anchor(*anchor, std::move(parts), store_.describe(protocol::manifest_key(anchor->version)));
    // Deltas go onto the fresh copy; the caller's weights change only once all succeeded.
    for (const auto* m : chain) apply_delta_object(fresh, *m, std::move(fetched[next++]), store_.describe(m->delta->key));
    model = std::move(fresh);
  } else {
    for (const auto* m : chain) apply_delta_object(model, *m, std::move(fetched[next++]), store_.describe(m->delta->key));
  }
  report.apply_seconds += seconds_since(t1);
}

SyncReport Subscriber::sync(HostModel& model, std::optional<uint64_t> target) {
  auto start = Clock::now();
  SyncReport report;
  if (!target) target = poll();
  if (!target) throw Error(store_.url() + ": the store has no published versions");
  const protocol::Manifest* found = catalog_.find(*target);
  if (!found) throw Error(store_.describe(protocol::manifest_key(*target)) + ": version " + std::to_string(*target) + " does not exist");
  report.to = *target;
  // A copy, not a pointer into the catalog: the recovery below refreshes the catalog, which
  // drops entries whose manifests vanished meanwhile.
  const protocol::Manifest goal = *found;

  // Audit the weights we start from: a delta is only as good as its base.
  std::optional<uint64_t> usable = model.empty() ? std::nullopt : model.version;
  if (usable) {
    if (model.digests.size() != model.tensors.size()) model.compute_digests();
    if (const protocol::Manifest* mine = catalog_.find(*usable)) {
      if (auto bad = digest_mismatch(model, *mine)) {
        report.recovered = true;
        report.recovery_reason = "local weights do not match version " + std::to_string(*usable) + ": " + *bad;
        note("recovering: " + report.recovery_reason);
        usable.reset();
      }
    }
  }
  report.from = usable;
  if (usable && *usable == *target) {
    report.total_seconds = seconds_since(start);
    return report;
  }

  auto plan = protocol::plan_catch_up(catalog_, usable, *target);
  if (!plan) throw Error(store_.url() + ": no way to reach version " + std::to_string(*target) + " (no anchor left on its chain)");
  note("plan: " + plan->describe());
  try {
    execute(*plan, model, report);
    report.plan = *plan;
  } catch (const Error& first) {
    // The plan failed (corrupt object, digest mismatch, a version deleted by retention
    // meanwhile): `model` is still consistent at model.version; rebuild from the newest anchor.
    report.recovered = true;
    report.recovery_reason = first.what();
    note(std::string("recovering from an anchor after: ") + first.what());
    if (can_list_) {
      try {
        catalog_.refresh();  // forget manifests that vanished
      } catch (const Error&) {
      }
    }
    auto again = protocol::plan_catch_up(catalog_, std::nullopt, *target, /*allow_current=*/false);
    if (!again) throw Error(std::string(first.what()) + "; and no anchor to recover from");
    try {
      execute(*again, model, report);
    } catch (const Error& second) {
      throw Error(std::string(first.what()) + "; recovery from anchor " + std::to_string(*again->anchor_version) +
                  " failed too: " + second.what());
    }
    report.plan = *again;
  }
  if (model.version != *target) throw Error(store_.url() + ": sync ended at the wrong version");
  if (auto bad = digest_mismatch(model, goal)) throw Error(store_.url() + ": weights after sync do not match version " + std::to_string(*target) + ": " + *bad);
  report.total_seconds = seconds_since(start);
  return report;
}

}  // namespace deltasync
