// Manifests, visibility, catch-up planning and retention (see protocol.hpp for the layout).
#include "sync/protocol.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "codec/delta_io.hpp"
#include "core/parse_number.hpp"
#include "format/sha256.hpp"
#include "sync/part_placements.hpp"
#include "sync/protocol_json.hpp"
#include "sync/shard_parts.hpp"

namespace deltasync::protocol {
namespace {

using json = nlohmann::json;

std::string padded(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%020llu", static_cast<unsigned long long>(v));
  return buf;
}

// The version an object key belongs to: deltas/V-..., anchors/V-.../..., manifests/V.json.
std::optional<uint64_t> version_of_object_key(const std::string& key) {
  for (const char* prefix : {"deltas/", "anchors/", "manifests/"}) {
    std::string p(prefix);
    if (key.rfind(p, 0) != 0) continue;
    std::string digits = key.substr(p.size(), 20);
    if (digits.size() != 20) return std::nullopt;
    return try_parse_decimal(digits);
  }
  return std::nullopt;
}

[[noreturn]] void bad(const std::string& label, const std::string& why) { throw BadInputError(label + ": " + why); }

const json& field(const json& j, const char* name, const std::string& label) {
  auto it = j.find(name);
  if (it == j.end()) bad(label, std::string("manifest has no \"") + name + "\"");
  return *it;
}

uint64_t get_u64(const json& j, const char* name, const std::string& label) {
  const json& v = field(j, name, label);
  if (!v.is_number_unsigned()) bad(label, std::string("manifest field \"") + name + "\" is not a non-negative integer");
  return v.get<uint64_t>();
}


// Manifest field "delta_parts": [{key, size, sha256}, ...] (shard-local publish; protocol.hpp
// DeltaPart) and, from format 2 on, "part_placements" beside it (sync/part_placements.hpp); in
// format 1 every part carries its own "placements": {tensor: [first, run_length, run_stride,
// run_count]}.
json delta_parts_json(const Manifest& m, PlacementForm form) {
  std::vector<std::map<std::string, Placement>> per_part;
  if (form == PlacementForm::kPerPart) per_part = m.part_placements.per_part();
  json out = json::array();
  for (size_t k = 0; k < m.delta_parts.size(); ++k) {
    json e = object_json(m.delta_parts[k].object);
    if (form == PlacementForm::kPerPart) {
      json placements = json::object();
      if (k < per_part.size())
        for (const auto& [name, pl] : per_part[k]) placements.emplace(name, placement_to_json(pl));
      e["placements"] = std::move(placements);
    }
    out.push_back(std::move(e));
  }
  return out;
}

// Format 1's per-part placements. The parts of each tensor must not overlap or leave a gap.
PartPlacements read_per_part_placements(const json& j, const std::vector<DeltaPart>& parts, const std::vector<std::string>& part_names,
                                        const std::string& label) {
  std::vector<std::map<std::string, Placement>> per_part(parts.size());
  std::map<std::string, std::vector<Placement>> by_tensor;
  for (size_t k = 0; k < parts.size(); ++k) {
    const json& placements = field(j[k], "placements", label);
    if (!placements.is_object()) bad(label, "manifest delta part " + parts[k].object.key + " has no placements object");
    for (auto it = placements.begin(); it != placements.end(); ++it) {
      const std::optional<Placement> pl = placement_from_json(it.value());
      if (!pl) bad(label, "manifest delta part " + parts[k].object.key + ": placement of tensor " + it.key() + " is not 4 non-negative integers");
      per_part[k][it.key()] = *pl;
      auto& held = by_tensor[it.key()];
      held.resize(parts.size());
      held[k] = *pl;
    }
  }
  for (const auto& [name, held] : by_tensor) check_parts_tile(held, part_names, name, label);
  return PartPlacements::from_per_part(per_part);
}

void read_delta_parts(const json& j, const json* part_placements, bool has_single_delta, uint64_t format, const std::string& label,
                      Manifest& m) {
  if (!j.is_array()) bad(label, "manifest delta_parts is not an array");
  if (has_single_delta) bad(label, "manifest names both a delta and delta_parts");
  if (j.size() < 2) bad(label, "manifest delta_parts lists fewer than two parts (one is written as \"delta\")");
  std::vector<std::string> part_names;
  for (const auto& e : j) {
    DeltaPart p;
    p.object = object_from_json(e, label);
    if (format >= 2 && e.contains("placements"))
      bad(label, "manifest delta part " + p.object.key + " has its own placements in a format " + std::to_string(format) +
                     " manifest (they belong in part_placements)");
    part_names.push_back("part " + p.object.key);
    m.delta_parts.push_back(std::move(p));
  }
  if (format == 1) {
    m.part_placements = read_per_part_placements(j, m.delta_parts, part_names, label);
  } else {
    if (!part_placements) bad(label, "manifest has delta_parts but no part_placements");
    m.part_placements = read_part_placements(*part_placements, part_names, label);
  }
}

json fence_json(const Fence& f) {
  return json{{"run", f.run_id}, {"epoch", f.epoch}, {"since", f.since ? json(*f.since) : json(nullptr)}};
}

Fence fence_from_json(const json& j, const std::string& label) {
  if (!j.is_object()) bad(label, "manifest fence is not a JSON object");
  Fence f;
  const json& run = field(j, "run", label);
  if (!run.is_string() || run.get<std::string>().empty()) bad(label, "manifest fence has no run identity");
  f.run_id = run.get<std::string>();
  f.epoch = get_u64(j, "epoch", label);
  if (!field(j, "since", label).is_null()) f.since = get_u64(j, "since", label);
  return f;
}

// A run identity is printed in errors and written as one LATEST line: printable, no blanks.
void check_run_id(const std::string& run_id, const std::string& label) {
  if (run_id.empty()) throw Error(label + ": a publisher needs a run identity", ErrorKind::kInvalidArgument);
  if (run_id.size() > 128 || std::any_of(run_id.begin(), run_id.end(), [](unsigned char c) { return c <= ' ' || c >= 0x7f; }))
    throw Error(label + ": run identity '" + run_id + "' must be 1 to 128 printable characters without blanks", ErrorKind::kInvalidArgument);
}

std::string describe_fence(const Fence& f) { return "run " + f.run_id + " (epoch " + std::to_string(f.epoch) + ")"; }

// LATEST and the tag to compare-and-swap it against. The tag comes from the store itself (a HEAD):
// through the Hugging Face gateway a GET is answered by a CDN whose tags are its own. Contents
// newer than the tag only make the conditional write fail and the caller look again.
struct TaggedPointer {
  std::optional<LatestPointer> pointer;  // nullopt: no LATEST
  std::string etag;
};

TaggedPointer read_tagged_pointer(Store& store) {
  TaggedPointer out;
  const std::optional<ObjectInfo> info = store.head(kLatestKey);
  if (!info) return out;
  out.etag = info->etag;
  out.pointer = read_latest_pointer(store);
  return out;
}

// Writes `next` over `seen` (by compare-and-swap where the store has one); false when LATEST moved
// meanwhile and the caller must look again.
bool swap_pointer(Store& store, const TaggedPointer& seen, const LatestPointer& next) {
  const std::string text = latest_text(next);
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  if (!seen.pointer) return store.put_if_absent(kLatestKey, bytes);
  if (!store.supports_put_if_match() || seen.etag.empty()) {  // nothing to compare against: a plain write
    store.put(kLatestKey, bytes);
    return true;
  }
  return store.put_if_match(kLatestKey, bytes, seen.etag);
}

// Refuses `mine` when LATEST names another fence: a newer epoch, or another run in the same one.
void check_fence_holds(Store& store, const std::optional<LatestPointer>& pointer, const Fence& mine) {
  if (!pointer || !pointer->fence || *pointer->fence == mine) return;
  const Fence& now = *pointer->fence;
  if (now.epoch < mine.epoch) return;  // ours is newer (a claim racing with this read)
  throw FencedError(store.describe(kLatestKey) + ": " + describe_fence(mine) + " was fenced off: the store is now " +
                    describe_fence(now) + "; nothing more of this publisher becomes visible");
}

}  // namespace

json object_json(const ObjectRef& o) {
  json j{{"key", o.key}, {"size", o.size}, {"sha256", o.sha256}};
  if (!o.header_sha256.empty()) j["header_sha256"] = o.header_sha256;  // absent: read whole, as before
  return j;
}

ObjectRef object_from_json(const json& j, const std::string& label) {
  if (!j.is_object()) bad(label, "manifest object entry is not a JSON object");
  ObjectRef o;
  const json& key = field(j, "key", label);
  const json& sha = field(j, "sha256", label);
  if (!key.is_string() || !sha.is_string()) bad(label, "manifest object entry has a non-string key or sha256");
  o.key = key.get<std::string>();
  o.sha256 = sha.get<std::string>();
  o.size = get_u64(j, "size", label);
  if (o.sha256.size() != 64 || o.sha256.find_first_not_of("0123456789abcdef") != std::string::npos)
    bad(label, "manifest object " + o.key + " has a malformed sha256");
  if (j.contains("header_sha256")) {
    const json& h = j["header_sha256"];
    if (!h.is_string() || h.get<std::string>().size() != 64 ||
        h.get<std::string>().find_first_not_of("0123456789abcdef") != std::string::npos)
      bad(label, "manifest object " + o.key + " has a malformed header_sha256");
    o.header_sha256 = h.get<std::string>();
  }
  if (o.key.empty() || o.key.find("..") != std::string::npos || o.key[0] == '/') bad(label, "manifest names an invalid object key");
  return o;
}

std::string manifest_key(uint64_t version) { return std::string(kManifestPrefix) + padded(version) + ".json"; }

std::optional<uint64_t> version_of_manifest_key(const std::string& key) {
  const std::string prefix(kManifestPrefix);
  if (key.size() != prefix.size() + 20 + 5 || key.rfind(prefix, 0) != 0 || key.substr(key.size() - 5) != ".json") return std::nullopt;
  return try_parse_decimal(std::string_view(key).substr(prefix.size(), 20));
}

std::string delta_key(uint64_t version, const std::string& nonce) { return "deltas/" + padded(version) + "-" + nonce + ".safetensors"; }

std::string anchor_part_key(uint64_t version, const std::string& nonce, size_t part) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "part-%05zu", part);
  return "anchors/" + padded(version) + "-" + nonce + "/" + buf + ".safetensors";
}

std::string new_nonce() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[16];
  std::snprintf(buf, sizeof buf, "%012llx", static_cast<unsigned long long>(rng() & 0xffffffffffffull));
  return buf;
}

uint64_t Manifest::delta_bytes() const {
  uint64_t n = 0;
  for (const auto& o : delta_objects(*this)) n += o.size;
  return n;
}

std::vector<ObjectRef> delta_objects(const Manifest& m) {
  std::vector<ObjectRef> out;
  if (m.delta) out.push_back(*m.delta);
  for (const auto& p : m.delta_parts) out.push_back(p.object);
  return out;
}

uint64_t Manifest::anchor_bytes() const {
  uint64_t total = 0;
  for (const auto& p : anchor_parts) total += p.size;
  return total;
}

ObjectRef put_object(Store& store, const std::string& key, std::span<const uint8_t> bytes) {
  store.put(key, bytes);
  return ObjectRef{key, bytes.size(), sha256_hex(bytes), {}};
}

void verify_object(const ObjectRef& ref, std::span<const uint8_t> bytes, const std::string& label) {
  if (bytes.size() != ref.size)
    throw BadInputError(label + ": size " + std::to_string(bytes.size()) + " differs from the manifest's " + std::to_string(ref.size));
  if (sha256_hex(bytes) != ref.sha256) throw BadInputError(label + ": sha256 differs from the manifest's (corrupt object)");
}

std::string to_json(const Manifest& m, PlacementForm form) {
  if (!m.delta_parts.empty() && m.part_placements.parts() != m.delta_parts.size())
    throw Error("manifest of version " + std::to_string(m.version) + ": placements for " + std::to_string(m.part_placements.parts()) +
                " parts, " + std::to_string(m.delta_parts.size()) + " delta parts");
  json j;
  j["format"] = "deltasync-manifest";
  // Format 3 only where it differs (a sharded delta: compact placements, parts naming their
  // changed tensors only): every other manifest stays readable by readers that know format 1 only.
  const bool compact = !m.delta_parts.empty() && form == PlacementForm::kCompact;
  j["format_version"] = compact ? kManifestFormat : 1;
  j["version"] = m.version;
  j["kind"] = m.kind();
  j["base_version"] = m.base_version ? json(*m.base_version) : json(nullptr);
  j["delta"] = m.delta ? object_json(*m.delta) : json(nullptr);
  j["delta_format"] = m.delta_format;
  j["changed_elements"] = m.changed_elements;
  json parts = json::array();
  for (const auto& p : m.anchor_parts) parts.push_back(object_json(p));
  j["anchor_parts"] = parts;
  j["latest_anchor"] = m.latest_anchor ? json(*m.latest_anchor) : json(nullptr);
  j["total_elements"] = m.total_elements;
  j["model_bytes"] = m.model_bytes;
  j["digest_algorithm"] = m.digest_algorithm;
  j["digests"] = m.digests;
  j["created_unix_ms"] = m.created_unix_ms;
  if (!m.delta_parts.empty()) j["delta_parts"] = delta_parts_json(m, compact ? PlacementForm::kCompact : PlacementForm::kPerPart);
  if (compact) j["part_placements"] = part_placements_json(m.part_placements);
  if (m.fence) j["fence"] = fence_json(*m.fence);
  return j.dump(1);
}

Manifest manifest_from_json(std::string_view text, const std::string& label) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    bad(label, std::string("manifest is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) bad(label, "manifest is not a JSON object");
  const json& fmt = field(j, "format", label);
  if (fmt != "deltasync-manifest") bad(label, "not a deltasync manifest");
  const uint64_t format = get_u64(j, "format_version", label);
  if (format < 1 || format > kManifestFormat)
    bad(label, "manifest format_version " + field(j, "format_version", label).dump() + " is not supported");
  if (format == 1 && j.contains("part_placements")) bad(label, "manifest format_version 1 with part_placements (a field of formats 2 and 3)");
  Manifest m;
  m.version = get_u64(j, "version", label);
  const json& base = field(j, "base_version", label);
  if (!base.is_null()) m.base_version = get_u64(j, "base_version", label);
  const json& delta = field(j, "delta", label);
  if (!delta.is_null()) m.delta = object_from_json(delta, label);
  if (j.contains("delta_parts")) {
    const auto pp = j.find("part_placements");
    read_delta_parts(j["delta_parts"], pp == j.end() ? nullptr : &*pp, m.delta.has_value(), format, label, m);
  } else if (j.contains("part_placements")) {
    bad(label, "manifest has part_placements but no delta_parts");
  }
  if (m.has_delta() != m.base_version.has_value()) bad(label, "manifest has a delta without base_version or the reverse");
  if (m.base_version && *m.base_version >= m.version) bad(label, "manifest base_version is not older than its version");
  const json& df = field(j, "delta_format", label);
  if (!df.is_string()) bad(label, "manifest delta_format is not a string");
  m.delta_format = df.get<std::string>();
  if (m.has_delta()) {
    try {
      parse_delta_format(m.delta_format);
    } catch (const Error&) {
      bad(label, "manifest delta_format '" + m.delta_format + "' is unknown");
    }
  }
  m.changed_elements = get_u64(j, "changed_elements", label);
  const json& parts = field(j, "anchor_parts", label);
  if (!parts.is_array()) bad(label, "manifest anchor_parts is not an array");
  for (const auto& p : parts) m.anchor_parts.push_back(object_from_json(p, label));
  if (!m.has_delta() && m.anchor_parts.empty()) bad(label, "manifest names neither a delta nor an anchor");
  const json& la = field(j, "latest_anchor", label);
  if (!la.is_null()) m.latest_anchor = get_u64(j, "latest_anchor", label);
  if (m.has_anchor() && m.latest_anchor != m.version) bad(label, "manifest with an anchor must name itself as latest_anchor");
  m.total_elements = get_u64(j, "total_elements", label);
  m.model_bytes = get_u64(j, "model_bytes", label);
  const json& alg = field(j, "digest_algorithm", label);
  if (!alg.is_string()) bad(label, "manifest digest_algorithm is not a string");
  m.digest_algorithm = alg.get<std::string>();
  const json& digests = field(j, "digests", label);
  if (!digests.is_object()) bad(label, "manifest digests is not an object");
  for (auto it = digests.begin(); it != digests.end(); ++it) {
    if (!it.value().is_string()) bad(label, "manifest digest of " + it.key() + " is not a string");
    m.digests[it.key()] = it.value().get<std::string>();
  }
  m.created_unix_ms = get_u64(j, "created_unix_ms", label);
  if (auto it = j.find("fence"); it != j.end()) m.fence = fence_from_json(*it, label);  // absent before fencing
  return m;
}

LatestPointer parse_latest_pointer(std::string_view text, const std::string& label) {
  // "V\n" (before fencing; "V\r\n" and a bare "V" are the same pointer written by hand), or the
  // version and the three fence lines latest_text writes. Anything else is read by the first rule,
  // whose message quotes it.
  std::vector<std::string_view> lines;
  for (std::string_view rest = text; !rest.empty();) {
    const size_t end = rest.find('\n');
    std::string_view line = rest.substr(0, end);
    if (line.ends_with('\r')) line.remove_suffix(1);
    lines.push_back(line);
    rest.remove_prefix(end == std::string_view::npos ? rest.size() : end + 1);
  }
  LatestPointer p;
  if (lines.size() != 4) {
    if (text.ends_with('\n')) text.remove_suffix(text.ends_with("\r\n") ? 2 : 1);
    p.version = parse_decimal<uint64_t>(text, label + ": LATEST pointer");
    return p;
  }
  auto value = [&](size_t i, std::string_view name) {
    if (!lines[i].starts_with(name) || lines[i].size() <= name.size() || lines[i][name.size()] != ' ')
      throw BadInputError(label + ": LATEST pointer line " + std::to_string(i + 1) + " is not '" + std::string(name) + " ...'");
    return lines[i].substr(name.size() + 1);
  };
  if (lines[0] != "none") p.version = parse_decimal<uint64_t>(lines[0], label + ": LATEST pointer");
  Fence f;
  f.run_id = std::string(value(1, "run"));
  check_run_id(f.run_id, label);
  f.epoch = parse_decimal<uint64_t>(value(2, "epoch"), label + ": LATEST epoch");
  const std::string_view since = value(3, "since");
  if (since != "none") f.since = parse_decimal<uint64_t>(since, label + ": LATEST since");
  p.fence = std::move(f);
  return p;
}

std::string latest_text(const LatestPointer& p) {
  std::string out = (p.version ? std::to_string(*p.version) : std::string("none")) + "\n";
  if (!p.fence) return out;
  return out + "run " + p.fence->run_id + "\nepoch " + std::to_string(p.fence->epoch) + "\nsince " +
         (p.fence->since ? std::to_string(*p.fence->since) : std::string("none")) + "\n";
}

std::optional<uint64_t> parse_latest(std::string_view text, const std::string& label) {
  return parse_latest_pointer(text, label).version;
}

std::optional<LatestPointer> read_latest_pointer(Store& store) {
  try {
    auto bytes = store.get(kLatestKey);
    return parse_latest_pointer(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), store.describe(kLatestKey));
  } catch (const NotFoundError&) {
    return std::nullopt;
  }
}

std::optional<uint64_t> read_latest(Store& store) {
  const auto p = read_latest_pointer(store);
  return p ? p->version : std::nullopt;
}

bool write_manifest(Store& store, const Manifest& manifest) {
  std::string text = to_json(manifest);
  std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  if (!store.put_if_absent(manifest_key(manifest.version), bytes)) {
    // A retried create whose first attempt did succeed (the answer was lost on the way back)
    // finds its own manifest: the object names carry a per-upload nonce, so equal bytes mean
    // it is ours.
    std::vector<uint8_t> existing;
    try {
      existing = store.get(manifest_key(manifest.version));
    } catch (const NotFoundError&) {
      return false;
    }
    if (existing.size() != bytes.size() || !std::equal(existing.begin(), existing.end(), bytes.begin())) return false;
  }
  return true;
}

void advance_latest(Store& store, uint64_t version, const std::optional<Fence>& fence) {
  // LATEST only moves forward, and only for the fence that holds the store. Where the store can
  // compare-and-swap (S3 and the Hugging Face gateway's If-Match, the folder store's link and
  // rename) neither a racing writer nor a fenced-off one can move it; a store without (plain
  // HTTP) falls back to read-compare-write.
  for (int attempt = 0; attempt < 20; ++attempt) {
    const TaggedPointer seen = read_tagged_pointer(store);
    if (fence) check_fence_holds(store, seen.pointer, *fence);
    if (seen.pointer && seen.pointer->version && *seen.pointer->version >= version) return;
    LatestPointer next{version, fence};
    if (!fence && seen.pointer) next.fence = seen.pointer->fence;  // a writer without a fence keeps the one there
    if (swap_pointer(store, seen, next)) return;
  }
  throw Error(store.describe(kLatestKey) + ": kept changing while version " + std::to_string(version) + " was being made the latest");
}

void check_fence(Store& store, const Fence& mine) { check_fence_holds(store, read_latest_pointer(store), mine); }

bool commit_version(Store& store, const Manifest& manifest) {
  // Refused before anything is written when the fence no longer holds; a takeover between this
  // check and advance_latest leaves a manifest that readers ignore (superseded: its version is
  // newer than the new epoch's `since`).
  if (manifest.fence) check_fence(store, *manifest.fence);
  if (!write_manifest(store, manifest)) return false;
  advance_latest(store, manifest.version, manifest.fence);
  return true;
}

Fence claim_store(Store& store, const std::string& run_id, bool take_over) {
  check_run_id(run_id, store.url());
  for (int attempt = 0; attempt < 20; ++attempt) {
    const TaggedPointer seen = read_tagged_pointer(store);
    const std::optional<Fence> held = seen.pointer ? seen.pointer->fence : std::nullopt;
    if (held && held->run_id != run_id && !take_over)
      throw FencedError(store.url() + ": the store is published by " + describe_fence(*held) + "; refusing to publish run " + run_id +
                        " into it (taking it over is explicit: --take-over, or take_over=True)");
    // The newest visible version, judged with the fence that holds the store now.
    Catalog catalog(store);
    if (held) catalog.note_fence(held);
    Fence mine{run_id, 0, seen.pointer ? seen.pointer->version : std::nullopt};
    try {
      const std::vector<uint64_t> listed = catalog.refresh();
      if (!listed.empty() && (!mine.since || listed.back() > *mine.since)) mine.since = listed.back();
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kUnsupported) throw;  // no listing: LATEST is all there is
    }
    // Epochs never repeat, even where LATEST was rewritten without its fence (by hand, or by a
    // publisher from before fencing): the manifests remember theirs.
    mine.epoch = catalog.newest_epoch() + 1;
    if (swap_pointer(store, seen, LatestPointer{mine.since, mine})) return mine;
  }
  throw Error(store.describe(kLatestKey) + ": kept changing while run " + run_id + " was claiming the store");
}

void Catalog::note_fence(const std::optional<Fence>& fence) {
  if (fence) epoch_since_.emplace(fence->epoch, fence->since);
}

bool Catalog::superseded(const Manifest& m) const {
  const uint64_t epoch = m.fence ? m.fence->epoch : 0;
  for (auto it = epoch_since_.upper_bound(epoch); it != epoch_since_.end(); ++it)
    if (!it->second || *it->second < m.version) return true;
  return false;
}

const Manifest* Catalog::find(uint64_t version) {
  if (auto it = cache_.find(version); it != cache_.end()) return superseded(it->second) ? nullptr : &it->second;
  std::vector<uint8_t> bytes;
  try {
    bytes = store_.get(manifest_key(version));
  } catch (const NotFoundError&) {
    return nullptr;
  }
  Manifest m = manifest_from_json(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                                  store_.describe(manifest_key(version)));
  if (m.version != version) throw BadInputError(store_.describe(manifest_key(version)) + ": manifest names version " + std::to_string(m.version));
  note_fence(m.fence);
  const Manifest* cached = &cache_.emplace(version, std::move(m)).first->second;
  return superseded(*cached) ? nullptr : cached;
}

std::vector<uint64_t> Catalog::refresh() {
  std::set<uint64_t> present;
  for (const auto& info : store_.list(kManifestPrefix)) {
    if (auto v = version_of_manifest_key(info.key)) present.insert(*v);
  }
  for (auto it = cache_.begin(); it != cache_.end();) it = present.count(it->first) ? std::next(it) : cache_.erase(it);
  for (uint64_t v : present) find(v);  // every fence the manifests name is known before any is judged
  std::vector<uint64_t> versions;
  for (uint64_t v : present)
    if (find(v)) versions.push_back(v);
  return versions;
}

std::optional<uint64_t> Catalog::newest(bool can_list) {
  const std::optional<LatestPointer> pointer = read_latest_pointer(store_);
  if (pointer) note_fence(pointer->fence);
  std::optional<uint64_t> best = pointer ? pointer->version : std::nullopt;
  if (can_list) {
    auto versions = refresh();
    if (!versions.empty() && (!best || versions.back() > *best)) best = versions.back();
  }
  return best;
}

std::string CatchUpPlan::describe() const {
  std::string out;
  if (anchor_version) out = "anchor " + std::to_string(*anchor_version);
  if (!deltas.empty()) {
    if (!out.empty()) out += " + ";
    out += std::to_string(deltas.size()) + (deltas.size() == 1 ? " delta" : " deltas");
  }
  if (out.empty()) out = "nothing";
  return out + " (" + std::to_string(bytes) + " bytes)";
}

std::optional<CatchUpPlan> plan_catch_up(Catalog& catalog, std::optional<uint64_t> current, uint64_t target,
                                         bool allow_current) {
  if (allow_current && current && *current == target) return CatchUpPlan{};
  // Walk target's chain of base versions backwards, summing delta bytes. Every anchor met is a
  // candidate start; reaching `current` is the delta-only candidate.
  std::optional<CatchUpPlan> best;
  std::vector<uint64_t> chain;  // versions whose deltas are applied, newest first
  uint64_t chain_bytes = 0;
  uint64_t v = target;
  for (;;) {
    const Manifest* m = catalog.find(v);
    if (!m) break;  // deleted by retention or never published: the chain ends here
    if (m->has_anchor()) {
      uint64_t cost = m->anchor_bytes() + chain_bytes;
      if (!best || cost < best->bytes) {
        best = CatchUpPlan{v, std::vector<uint64_t>(chain.rbegin(), chain.rend()), cost};
      }
    }
    if (!m->has_delta() || !m->base_version) break;
    chain.push_back(v);
    chain_bytes += m->delta_bytes();
    if (best && chain_bytes >= best->bytes) break;  // longer walks only cost more
    v = *m->base_version;
    if (allow_current && current && v == *current) {
      if (!best || chain_bytes < best->bytes) best = CatchUpPlan{std::nullopt, std::vector<uint64_t>(chain.rbegin(), chain.rend()), chain_bytes};
      break;
    }
  }
  return best;
}

RetentionReport apply_retention(Store& store, size_t keep_anchors) {
  RetentionReport report;
  if (keep_anchors == 0) return report;
  Catalog catalog(store);
  std::vector<uint64_t> versions = catalog.refresh();
  std::vector<uint64_t> anchors;
  for (uint64_t v : versions)
    if (const auto* m = catalog.find(v); m && m->has_anchor()) anchors.push_back(v);  // a manifest may vanish meanwhile
  if (anchors.size() <= keep_anchors) return report;
  const uint64_t oldest_kept = anchors[anchors.size() - keep_anchors];
  // Every manifest older than that, superseded ones (invisible, left by a fenced-off epoch) too.
  for (const auto& info : store.list(kManifestPrefix)) {
    const auto v = version_of_manifest_key(info.key);
    if (!v || *v >= oldest_kept) continue;
    store.remove(info.key);  // invisible first
    report.deleted_versions.push_back(*v);
  }
  // Then every object of an older version: those of the deleted manifests and orphans of
  // uploads that never committed.
  for (const char* prefix : {"deltas/", "anchors/"}) {
    for (const auto& info : store.list(prefix)) {
      auto v = version_of_object_key(info.key);
      if (!v || *v >= oldest_kept) continue;
      store.remove(info.key);
      ++report.deleted_objects;
      report.deleted_bytes += info.size;
    }
    // Uploads of those versions that a killed writer never finished: no writer goes back to a
    // version older than the oldest kept anchor, so none of them will ever complete.
    report.aborted_uploads += store.abort_unfinished_uploads(prefix, [&](const std::string& key) {
      auto v = version_of_object_key(key);
      return v && *v < oldest_kept;
    });
  }
  return report;
}

}  // namespace deltasync::protocol
