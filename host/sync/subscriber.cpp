#include "sync/subscriber.hpp"

#include <random>

#include <chrono>
#include <cstring>
#include <algorithm>
#include <set>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "engine/integrity.hpp"
#include "format/model_version.hpp"
#include "store/http_transport.hpp"
#include "sync/shard_parts.hpp"
#include "sync/slice_anchor_stream.hpp"

namespace deltasync {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The digests a manifest records, compared with the weights'; returns the first mismatch.
std::optional<std::string> digest_mismatch(const std::vector<TensorMeta>& tensors, const std::vector<uint64_t>& digests,
                                           const protocol::Manifest& manifest) {
  if (manifest.digests.empty()) return std::nullopt;  // a manifest without digests cannot audit
  if (manifest.digests.size() != tensors.size())
    return "the model has " + std::to_string(tensors.size()) + " tensors, version " + std::to_string(manifest.version) +
           " has " + std::to_string(manifest.digests.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    auto it = manifest.digests.find(tensors[t].name);
    if (it == manifest.digests.end()) return "tensor " + tensors[t].name + " is not part of version " + std::to_string(manifest.version);
    if (it->second != digest_to_hex(digests[t]))
      return "tensor " + tensors[t].name + " digest " + digest_to_hex(digests[t]) + " differs from version " +
             std::to_string(manifest.version) + "'s " + it->second;
  }
  return std::nullopt;
}

}  // namespace

VerifiedAnchor verify_anchor(const protocol::Manifest& manifest, std::vector<std::vector<uint8_t>> parts,
                             const std::string& label) {
  VerifiedAnchor a;
  std::set<std::string> seen;
  integrity::DigestMap recorded;
  a.files.reserve(parts.size());
  std::vector<const st::File*> slice_parts;  // parts of a shard-local publish, assembled below
  for (size_t k = 0; k < parts.size(); ++k) {
    a.files.push_back(st::File::from_bytes(std::move(parts[k]), label + " part " + std::to_string(k)));
    const st::File& file = a.files.back();
    const std::optional<uint64_t> version = read_model_version(file.metadata(), file.label());
    if (version != manifest.version)
      throw Error(file.label() + ": anchor part is for version " +
                  (version ? std::to_string(*version) : std::string("unknown")) + ", expected " +
                  std::to_string(manifest.version));
    if (holds_anchor_slices(file)) {
      slice_parts.push_back(&file);
      continue;
    }
    if (auto d = integrity::read_checkpoint_digests(file.metadata(), file.label())) recorded.insert(d->begin(), d->end());
    for (const TensorMeta& m : model_tensors(file)) {
      if (!seen.insert(m.name).second) throw Error(label + ": tensor " + m.name + " appears in two anchor parts");
      a.bytes.push_back(file.bytes(file.at(m.name)));
      a.tensors.push_back(m);
    }
  }
  if (!slice_parts.empty()) {
    AssembledTensors whole = assemble_anchor_slices(slice_parts, label);
    a.assembled = std::move(whole.storage);
    for (size_t t = 0; t < whole.tensors.size(); ++t) {
      if (!seen.insert(whole.tensors[t].name).second)
        throw Error(label + ": tensor " + whole.tensors[t].name + " appears in two anchor parts");
      a.bytes.push_back(a.assembled[t]);
      a.tensors.push_back(std::move(whole.tensors[t]));
    }
  }
  // The audit an anchor deserves: one read of its bytes, before any of them is written anywhere.
  std::vector<ConstTensorRef> refs;
  for (size_t t = 0; t < a.tensors.size(); ++t)
    refs.push_back(ConstTensorRef{a.tensors[t].name, a.bytes[t].data(), a.tensors[t].numel(), a.tensors[t].width()});
  a.digests = digest_tensors(refs);
  for (size_t t = 0; t < a.tensors.size(); ++t) {
    auto it = recorded.find(a.tensors[t].name);
    if (it != recorded.end() && it->second != a.digests[t])
      throw Error(label + ": tensor " + a.tensors[t].name + " does not match its recorded digest");
  }
  if (auto bad = digest_mismatch(a.tensors, a.digests, manifest)) throw Error(label + ": anchor does not match its manifest: " + *bad);
  return a;
}

namespace {

// Anchor parts list tensors in their files' order; a receiver with a fixed model takes them in
// its own order. Matched by name: a tensor the model lacks, or one the anchor lacks, refuses the
// anchor before anything is written (dtypes and shapes are the receiver's to check).
void order_like(VerifiedAnchor& a, std::span<const TensorMeta> model, uint64_t version) {
  if (model.empty()) return;
  const std::string label = "anchor of version " + std::to_string(version);
  std::unordered_map<std::string_view, size_t> at;
  for (size_t t = 0; t < a.tensors.size(); ++t) at.emplace(a.tensors[t].name, t);
  std::unordered_map<std::string_view, size_t> mine;
  for (size_t t = 0; t < model.size(); ++t) mine.emplace(model[t].name, t);
  for (const auto& t : a.tensors)
    if (!mine.count(t.name)) throw BadInputError(label + ": tensor " + t.name + " is not in this model");
  std::vector<TensorMeta> tensors;
  std::vector<std::span<const uint8_t>> bytes;
  std::vector<uint64_t> digests;
  for (const auto& m : model) {
    auto it = at.find(m.name);
    if (it == at.end()) throw BadInputError(label + ": has no tensor " + m.name + " of the model");
    tensors.push_back(a.tensors[it->second]);
    bytes.push_back(a.bytes[it->second]);
    digests.push_back(a.digests[it->second]);
  }
  a.tensors = std::move(tensors);
  a.bytes = std::move(bytes);
  a.digests = std::move(digests);
}

}  // namespace

Subscriber::Subscriber(Store& store, SubscriberOptions options)
    : store_(store), options_(std::move(options)), catalog_(store), requests_reported_(store.requests()) {}

uint64_t Subscriber::take_requests() {
  const uint64_t now = store_.requests();
  const uint64_t since = now - requests_reported_;
  requests_reported_ = now;
  return since;
}

double Subscriber::next_poll_delay(double interval_s) {
  // Full jitter around the interval (uniform in [interval/2, 3*interval/2], mean the interval), so
  // replicas started together drift apart instead of polling in step; never below the floor.
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  const double base = std::max(interval_s, kMinPollSeconds);
  return std::uniform_real_distribution<double>(base * 0.5, base * 1.5)(rng);
}

void Subscriber::note(const std::string& line) const {
  if (options_.log) options_.log(line);
}

std::optional<uint64_t> Subscriber::poll() {
  std::optional<uint64_t> latest;
  try {
    auto r = store_.get_if_changed(protocol::kLatestKey, latest_etag_);
    if (r.changed) {
      latest_etag_ = r.etag;
      const protocol::LatestPointer pointer = protocol::parse_latest_pointer(
          std::string_view(reinterpret_cast<const char*>(r.bytes.data()), r.bytes.size()), store_.describe(protocol::kLatestKey));
      latest_seen_ = pointer.version;
      catalog_.note_fence(pointer.fence);  // manifests of the epochs it supersedes are ignored from now on
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
    if (e.kind() != ErrorKind::kUnsupported) throw;
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

void Subscriber::execute(const protocol::CatchUpPlan& plan, Receiver& weights, SyncReport& report) {
  std::vector<protocol::ObjectRef> objects;
  std::vector<const protocol::Manifest*> chain;
  const protocol::Manifest* anchor = nullptr;
  if (plan.anchor_version) {
    anchor = catalog_.find(*plan.anchor_version);
    if (!anchor) throw NotFoundError(store_.describe(protocol::manifest_key(*plan.anchor_version)) + ": anchor version disappeared");
    // Part by part where the receiver can: host memory one part, not the model.
    if (weights.streams_anchors() && stream_anchor_into(*anchor, weights, report))
      anchor = nullptr;
    else
      objects = anchor->anchor_parts;
  }
  for (uint64_t v : plan.deltas) {
    const protocol::Manifest* m = catalog_.find(v);
    if (!m || !m->has_delta()) throw NotFoundError(store_.describe(protocol::manifest_key(v)) + ": delta version disappeared");
    chain.push_back(m);
    for (const auto& o : protocol::delta_objects(*m)) objects.push_back(o);
  }
  // A failure of this rank's own (fetch, verification, parse) before a step reaches the weights
  // is the receiver's to hear of too: its other ranks may be waiting to agree on that step.
  auto before_weights = [&weights](auto&& step) {
    try {
      return step();
    } catch (...) {
      weights.abandon();
      throw;
    }
  };
  auto t0 = Clock::now();
  auto fetched = before_weights(
      [&] { return fetch_planned(objects, anchor ? anchor->anchor_parts.size() : 0, chain, weights, report); });
  report.fetch_seconds += seconds_since(t0);
  auto t1 = Clock::now();
  size_t next = 0;
  if (anchor) {
    std::vector<std::vector<uint8_t>> parts(std::make_move_iterator(fetched.begin()),
                                            std::make_move_iterator(fetched.begin() + anchor->anchor_parts.size()));
    next = anchor->anchor_parts.size();
    // Every part is parsed and hashed before the first byte reaches the weights.
    VerifiedAnchor verified = before_weights([&] {
      VerifiedAnchor v = verify_anchor(*anchor, std::move(parts), store_.describe(protocol::manifest_key(anchor->version)));
      order_like(v, weights.tensors(), anchor->version);
      return v;
    });
    const auto w0 = Clock::now();
    weights.load_anchor(verified.tensors, verified.bytes, verified.digests, anchor->version);
    report.pause_seconds += seconds_since(w0);
    report.anchor = anchor->version;
    for (const auto& t : verified.tensors) report.applied_elements += t.numel();
  }
  for (const auto* m : chain) {
    if (!m->delta_parts.empty()) {
      // A shard-local publish: the parts combine into one delta's patches and promises.
      std::vector<st::File> files;
      CombinedDelta combined = before_weights([&] {
        for (const auto& part : m->delta_parts)
          files.push_back(st::File::from_bytes(std::move(fetched[next++]), store_.describe(part.object.key)));
        return combine_delta_parts(*m, files, weights.tensors(), weights.host_bits());
      });
      const auto w0 = Clock::now();
      report.applied_elements += weights.apply_patches(combined.patches, combined.digests, combined.relative, report.transfer);
      report.pause_seconds += seconds_since(w0);
      report.changed_elements += m->changed_elements;
      report.deltas.push_back(m->version);
      continue;
    }
    const st::File file =
        before_weights([&] { return st::File::from_bytes(std::move(fetched[next++]), store_.describe(m->delta->key)); });
    const engine::DeltaToApply delta{&file, m->version, m->base_version};
    const auto w0 = Clock::now();
    report.applied_elements += weights.apply(delta, report.transfer);
    report.pause_seconds += seconds_since(w0);
    report.changed_elements += m->changed_elements;
    report.deltas.push_back(m->version);
  }
  report.apply_seconds += seconds_since(t1);
}

bool Subscriber::stream_anchor_into(const protocol::Manifest& anchor, Receiver& weights, SyncReport& report) {
  std::vector<TensorMeta> table;
  try {
    table = anchor_table(anchor);
    weights.begin_anchor(table, anchor.version);
  } catch (...) {
    weights.abandon();
    throw;
  }
  std::unordered_map<std::string_view, size_t> at;
  for (size_t k = 0; k < table.size(); ++k) at.emplace(table[k].name, k);
  std::vector<uint64_t> digests(table.size(), 0);
  SyncReport streamed;
  try {
    streamed = stream_anchor(anchor.version, [&](std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                                 std::span<const uint64_t> part_digests) {
      for (size_t t = 0; t < meta.size(); ++t) {
        const auto it = at.find(meta[t].name);
        if (it == at.end()) throw BadInputError("anchor of version " + std::to_string(anchor.version) + ": tensor " + meta[t].name + " is not in its parts' headers");
        digests[it->second] = part_digests[t];
      }
      const auto w0 = Clock::now();
      weights.write_anchor_part(meta, bytes);
      report.pause_seconds += seconds_since(w0);
    });
    weights.finish_anchor(digests, anchor.version);
  } catch (const Error& e) {
    weights.abort_anchor();
    if (e.kind() == ErrorKind::kUnsupported) return false;
    throw;
  } catch (...) {
    weights.abort_anchor();
    throw;
  }
  report.anchor = anchor.version;
  report.bytes_fetched += streamed.bytes_fetched;
  report.fetch_seconds += streamed.fetch_seconds;
  report.apply_seconds += streamed.apply_seconds;
  report.applied_elements += streamed.applied_elements;
  return true;
}

std::vector<TensorMeta> Subscriber::published_tensors(std::optional<uint64_t> target) {
  if (!target) target = poll();
  if (!target) throw Error(store_.url() + ": the store has no published versions", ErrorKind::kNotFound);
  auto plan = protocol::plan_catch_up(catalog_, std::nullopt, *target, /*allow_current=*/false);
  if (!plan || !plan->anchor_version) throw Error(store_.url() + ": no anchor on the chain of version " + std::to_string(*target), ErrorKind::kNotFound);
  const protocol::Manifest* anchor = catalog_.find(*plan->anchor_version);
  if (!anchor) throw NotFoundError(store_.describe(protocol::manifest_key(*plan->anchor_version)) + ": anchor version disappeared");
  return anchor_table(*anchor);
}

std::vector<TensorMeta> Subscriber::anchor_table(const protocol::Manifest& anchor) {
  std::vector<TensorMeta> out;
  for (const auto& part : anchor.anchor_parts) {
    const std::string label = store_.describe(part.key);
    const std::vector<uint8_t> head = store_.get_range(part.key, 0, 8);
    uint64_t n = 0;
    for (int b = 7; b >= 0; --b) n = (n << 8) | head.at(static_cast<size_t>(b));
    if (n == 0 || n > part.size - 8 || n > (uint64_t{100} << 20)) throw BadInputError(label + ": bad safetensors header length");
    const std::vector<uint8_t> header = store_.get_range(part.key, 8, n);
    const auto j = nlohmann::json::parse(header.begin(), header.end(), nullptr, false);
    if (!j.is_object()) throw BadInputError(label + ": header is not a JSON object");
    // Tensors in file order (by data offset), as the anchor holds them. A part of slices
    // (sync/shard_parts.hpp) names each tensor's full shape in its placements; a tensor sliced
    // over several parts is listed once.
    nlohmann::json placements;
    if (j.contains("__metadata__") && j["__metadata__"].is_object() && j["__metadata__"].contains(shard_keys::kPlacements) &&
        j["__metadata__"][shard_keys::kPlacements].is_string())
      placements = nlohmann::json::parse(j["__metadata__"][shard_keys::kPlacements].get<std::string>(), nullptr, false);
    std::vector<std::pair<uint64_t, TensorMeta>> entries;
    for (const auto& [name, v] : j.items()) {
      if (name == "__metadata__") continue;
      if (placements.is_object() && std::any_of(out.begin(), out.end(), [&key = name](const TensorMeta& m) { return m.name == key; })) continue;
      const bool ok = v.is_object() && v.contains("dtype") && v["dtype"].is_string() && v.contains("shape") &&
                      v["shape"].is_array() && v.contains("data_offsets") && v["data_offsets"].is_array() &&
                      v["data_offsets"].size() == 2 && v["data_offsets"][0].is_number_unsigned();
      if (!ok) throw BadInputError(label + ": tensor " + name + " has a malformed header entry");
      const auto dtype = dtype_from_name(v["dtype"].get<std::string>());
      if (!dtype || !is_weight_dtype(*dtype)) throw BadInputError(label + ": tensor " + name + " has no weight dtype");
      TensorMeta m{name, *dtype, {}};
      for (const auto& d : v["shape"]) {
        if (!d.is_number_unsigned()) throw BadInputError(label + ": tensor " + name + " has a malformed shape");
        m.shape.push_back(d.get<uint64_t>());
      }
      if (placements.is_object()) {
        const auto e = placements.find(name);
        if (e == placements.end() || !e->is_object() || !e->contains("shape") || !(*e)["shape"].is_array())
          throw BadInputError(label + ": tensor " + name + " has no placement entry");
        m.shape.clear();
        for (const auto& d : (*e)["shape"]) {
          if (!d.is_number_unsigned()) throw BadInputError(label + ": tensor " + name + " has a malformed full shape");
          m.shape.push_back(d.get<uint64_t>());
        }
      }
      entries.emplace_back(v["data_offsets"][0].get<uint64_t>(), std::move(m));
    }
    std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& e : entries) out.push_back(std::move(e.second));
  }
  return out;
}

SyncReport Subscriber::stream_anchor(uint64_t version, const AnchorPartWriter& write) {
  const auto start = Clock::now();
  const protocol::Manifest* found = catalog_.find(version);
  if (!found || found->anchor_parts.empty())
    throw NotFoundError(store_.describe(protocol::manifest_key(version)) + ": no anchor at version " + std::to_string(version));
  const protocol::Manifest manifest = *found;
  const std::string label = "anchor of version " + std::to_string(version);
  SyncReport report;
  report.to = version;
  report.anchor = version;
  std::set<std::string> seen;
  bool slices = false;
  for (size_t k = 0; k < manifest.anchor_parts.size(); ++k) {
    const protocol::ObjectRef& o = manifest.anchor_parts[k];
    const auto f0 = Clock::now();
    auto bytes = store_.get(o.key);
    protocol::verify_object(o, bytes, store_.describe(o.key));
    report.bytes_fetched += o.size;
    report.fetch_seconds += seconds_since(f0);
    const auto a0 = Clock::now();
    const st::File file = st::File::from_bytes(std::move(bytes), store_.describe(o.key));
    const std::optional<uint64_t> part_version = read_model_version(file.metadata(), file.label());
    if (part_version != version)
      throw Error(file.label() + ": anchor part is for version " +
                  (part_version ? std::to_string(*part_version) : std::string("unknown")) + ", expected " + std::to_string(version));
    if (holds_anchor_slices(file)) {
      if (k > 0)
        throw Error(file.label() + ": a part of slices after a part of whole tensors is loaded whole, not streamed", ErrorKind::kUnsupported);
      slices = true;
      break;  // the part's bytes go with `file`
    }
    const std::vector<TensorMeta> tensors = model_tensors(file);
    std::vector<std::span<const uint8_t>> data;
    std::vector<ConstTensorRef> refs;
    for (const TensorMeta& m : tensors) {
      if (!seen.insert(m.name).second) throw Error(label + ": tensor " + m.name + " appears in two anchor parts");
      data.push_back(file.bytes(file.at(m.name)));
      refs.push_back(ConstTensorRef{m.name, data.back().data(), m.numel(), m.width()});
    }
    const std::vector<uint64_t> digests = digest_tensors(refs);
    const auto recorded = integrity::read_checkpoint_digests(file.metadata(), file.label());
    for (size_t t = 0; t < tensors.size(); ++t) {
      if (recorded) {
        auto it = recorded->find(tensors[t].name);
        if (it != recorded->end() && it->second != digests[t])
          throw Error(label + ": tensor " + tensors[t].name + " does not match its recorded digest");
      }
      if (manifest.digests.empty()) continue;
      auto it = manifest.digests.find(tensors[t].name);
      if (it == manifest.digests.end()) throw Error(label + ": tensor " + tensors[t].name + " is not part of version " + std::to_string(version));
      if (it->second != digest_to_hex(digests[t]))
        throw Error(label + ": anchor does not match its manifest: tensor " + tensors[t].name + " digest " +
                    digest_to_hex(digests[t]) + " differs from version " + std::to_string(version) + "'s " + it->second);
    }
    write(tensors, data, digests);
    for (const TensorMeta& m : tensors) report.applied_elements += m.numel();
    report.apply_seconds += seconds_since(a0);
  }
  if (slices) {
    // A shard-local publish: tensors are assembled from every part's slices, a group at a time
    // of half the largest part (sync/slice_anchor_stream.hpp). Learning it from the first part
    // costs that part's download once more; an anchor of whole tensors pays nothing.
    uint64_t largest = 1;
    for (const auto& part : manifest.anchor_parts) largest = std::max(largest, part.size);
    const auto a0 = Clock::now();
    const SliceStreamStats stats = stream_slice_anchor(store_, manifest, std::max<uint64_t>(1, largest / 2), write);
    report.bytes_fetched += stats.bytes_fetched;
    report.fetch_seconds += stats.fetch_seconds;
    report.applied_elements = stats.elements;
    report.apply_seconds += seconds_since(a0) - stats.fetch_seconds;
    report.plan.anchor_version = version;
    report.total_seconds = seconds_since(start);
    return report;
  }
  if (!manifest.digests.empty() && seen.size() != manifest.digests.size())
    throw Error(label + ": holds " + std::to_string(seen.size()) + " tensors, its manifest " + std::to_string(manifest.digests.size()));
  report.plan.anchor_version = version;
  report.total_seconds = seconds_since(start);
  return report;
}

SyncReport Subscriber::sync(HostModel& model, std::optional<uint64_t> target) {
  HostModelReceiver weights(model);
  return sync(weights, target);
}

SyncReport Subscriber::sync(Receiver& weights, std::optional<uint64_t> target) {
  auto start = Clock::now();
  SyncReport report;
  if (!target) target = poll();
  if (!target) throw Error(store_.url() + ": the store has no published versions", ErrorKind::kNotFound);
  const protocol::Manifest* found = catalog_.find(*target);
  if (!found)
    throw Error(store_.describe(protocol::manifest_key(*target)) + ": version " + std::to_string(*target) + " does not exist",
                ErrorKind::kNotFound);
  report.to = *target;
  // A copy, not a pointer into the catalog: the recovery below refreshes the catalog, which
  // drops entries whose manifests vanished meanwhile.
  const protocol::Manifest goal = *found;

  // Audit the weights we start from: a delta is only as good as its base.
  std::optional<uint64_t> usable = weights.version();
  if (usable) {
    if (weights.digests().empty()) weights.recompute_digests();
    if (const protocol::Manifest* mine = catalog_.find(*usable)) {
      if (auto bad = digest_mismatch(weights.tensors(), weights.digests(), *mine)) {
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
    report.store_requests = take_requests();
    return report;
  }

  auto plan = protocol::plan_catch_up(catalog_, usable, *target);
  if (!plan)
    throw Error(store_.url() + ": no way to reach version " + std::to_string(*target) + " (no anchor left on its chain)",
                ErrorKind::kNotFound);
  note("plan: " + plan->describe());
  try {
    execute(*plan, weights, report);
    report.plan = *plan;
  } catch (const Error& first) {
    // The plan failed (corrupt object, digest mismatch, a version deleted by retention
    // meanwhile): the weights are still consistent at weights.version(); rebuild from the
    // newest anchor.
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
    if (!again) throw Error(std::string(first.what()) + "; and no anchor to recover from", first.kind());
    try {
      execute(*again, weights, report);
    } catch (const Error& second) {
      // The kind of the failure that ended the sync: what the caller can act on.
      throw Error(std::string(first.what()) + "; recovery from anchor " + std::to_string(*again->anchor_version) +
                      " failed too: " + second.what(),
                  second.kind());
    }
    report.plan = *again;
  }
  if (weights.version() != *target) throw Error(store_.url() + ": sync ended at the wrong version");
  if (auto bad = digest_mismatch(weights.tensors(), weights.digests(), goal))
    throw Error(store_.url() + ": weights after sync do not match version " + std::to_string(*target) + ": " + *bad);
  report.total_seconds = seconds_since(start);
  report.store_requests = take_requests();
  return report;
}

}  // namespace deltasync
