#include "sync/shard_commit.hpp"

#include <chrono>
#include <nlohmann/json.hpp>

#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"

namespace deltasync {
namespace {

using json = nlohmann::json;

uint64_t unix_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

}  // namespace

std::string outcome_to_json(const CommitOutcome& o) {
  return json{{"version", o.version},           {"committed", o.committed},         {"error", o.error}, {"fenced", o.fenced},
              {"needs_tables", o.needs_tables}, {"anchor", o.anchor},               {"delta_bytes", o.delta_bytes},
              {"anchor_bytes", o.anchor_bytes}, {"changed_elements", o.changed_elements}}
      .dump();
}

CommitOutcome outcome_from_json(std::string_view text, const std::string& label) {
  try {
    const json j = json::parse(text);
    CommitOutcome o;
    o.version = j.at("version").get<uint64_t>();
    o.committed = j.at("committed").get<bool>();
    o.error = j.at("error").get<std::string>();
    o.fenced = j.at("fenced").get<bool>();
    o.needs_tables = j.at("needs_tables").get<bool>();
    o.anchor = j.at("anchor").get<bool>();
    o.delta_bytes = j.at("delta_bytes").get<uint64_t>();
    o.anchor_bytes = j.at("anchor_bytes").get<uint64_t>();
    o.changed_elements = j.at("changed_elements").get<uint64_t>();
    return o;
  } catch (const json::exception& e) {
    throw BadInputError(label + ": malformed commit outcome (" + e.what() + ")");
  }
}

protocol::Manifest manifest_from_receipts(const GatheredReceipts& g, std::optional<uint64_t> latest_anchor) {
  const auto& receipts = g.receipts;
  if (receipts.empty()) throw Error("commit: no receipts");
  const PartReceipt& first = receipts[0];
  const std::string label = "version " + std::to_string(first.version);
  for (const auto& r : receipts)
    if (!r.error.empty()) throw Error(label + ": rank " + std::to_string(r.rank) + " failed: " + r.error);
  for (const auto& r : receipts) {
    const std::string who = label + ": rank " + std::to_string(r.rank);
    if (r.version != first.version) throw BadInputError(who + " published version " + std::to_string(r.version));
    if (r.base_version != first.base_version || r.anchor != first.anchor || r.delta_format != first.delta_format)
      throw BadInputError(who + " disagrees with rank " + std::to_string(first.rank) + " about the base version, the anchor or the format");
  }
  const RankPlacements ranks = rank_placements(g, label);
  const size_t T = ranks.model.size();
  if (g.digests.size() != T)
    throw Error(label + ": " + std::to_string(g.digests.size()) + " summed partials for " + std::to_string(T) + " tensors");
  protocol::Manifest m;
  m.version = first.version;
  m.digest_algorithm = std::string(integrity::kDigestAlgorithm);
  for (size_t t = 0; t < T; ++t) {
    const TensorMeta& meta = ranks.model[t];
    m.digests.emplace(meta.name, digest_to_hex(g.digests[t]));
    m.total_elements += meta.numel();
    m.model_bytes += meta.numel() * meta.width();
  }
  if (first.base_version) {
    m.base_version = first.base_version;
    m.delta_format = first.delta_format;
    for (const auto& r : receipts) m.changed_elements += r.changed;
    // The ranks that hold anything have a part; the placements are renumbered over them.
    const protocol::PartPlacements& over_ranks = ranks.placements;
    std::vector<bool> holds(receipts.size(), false);
    for (const protocol::PlacementPattern& p : over_ranks.patterns())
      for (const protocol::PlacementSegment& s : p) std::fill_n(holds.begin() + static_cast<ptrdiff_t>(s.part), s.count, true);
    std::vector<uint64_t> part_of(receipts.size(), 0);
    std::vector<protocol::DeltaPart> parts;
    for (size_t r = 0; r < receipts.size(); ++r) {
      if (!holds[r]) continue;
      if (!receipts[r].delta)
        throw BadInputError(label + ": rank " + std::to_string(receipts[r].rank) + " holds tensors but sent no delta part");
      part_of[r] = parts.size();
      parts.push_back(protocol::DeltaPart{*receipts[r].delta});
    }
    if (parts.empty()) throw BadInputError(label + ": no rank sent a delta part");
    if (parts.size() == 1) {
      m.delta = parts[0].object;  // the single form: one publisher's manifest reads as before
    } else {
      m.part_placements = protocol::PartPlacements(parts.size());
      std::vector<size_t> renumbered;
      for (const protocol::PlacementPattern& p : over_ranks.patterns()) renumbered.push_back(m.part_placements.intern(protocol::renumber(p, part_of)));
      for (const auto& [name, index] : over_ranks.tensors()) m.part_placements.assign(name, renumbered[index]);
      m.delta_parts = std::move(parts);
    }
  }
  for (const auto& r : receipts) m.anchor_parts.insert(m.anchor_parts.end(), r.anchor_parts.begin(), r.anchor_parts.end());
  if (first.anchor && m.anchor_parts.empty()) throw BadInputError(label + ": an anchor version without anchor parts");
  m.latest_anchor = first.anchor ? std::optional<uint64_t>(first.version) : latest_anchor;
  m.created_unix_ms = unix_ms();
  return m;
}

CommitOutcome commit_parts(Store& store, const GatheredReceipts& g, std::optional<uint64_t> latest_anchor, const protocol::Fence& fence) {
  CommitOutcome out;
  if (!g.receipts.empty()) out.version = g.receipts[0].version;
  try {
    for (const auto& r : g.receipts)
      if (r.fenced) throw protocol::FencedError("version " + std::to_string(r.version) + ": rank " + std::to_string(r.rank) + ": " + r.error);
    if (g.tables.empty() && tables_needed(g.receipts, g.mine)) {
      out.needs_tables = true;
      return out;
    }
    protocol::Manifest m = manifest_from_receipts(g, latest_anchor);
    m.fence = fence;  // commit_version refuses a fenced-off group; LATEST keeps naming its owner
    for (const auto& r : g.receipts) {
      std::vector<protocol::ObjectRef> objects = r.anchor_parts;
      if (r.delta) objects.push_back(*r.delta);
      for (const auto& o : objects) {
        const auto info = store.head(o.key);
        if (!info) throw NotFoundError("version " + std::to_string(m.version) + ": part " + store.describe(o.key) + " of rank " +
                                       std::to_string(r.rank) + " is missing from the store");
      }
    }
    if (!protocol::commit_version(store, m))
      throw Error(store.describe(protocol::manifest_key(m.version)) + ": version " + std::to_string(m.version) + " already exists");
    out.committed = true;
    out.anchor = m.has_anchor();
    out.delta_bytes = m.delta_bytes();
    out.anchor_bytes = m.anchor_bytes();
    out.changed_elements = m.changed_elements;
  } catch (const protocol::FencedError& e) {
    out.committed = false;
    out.fenced = true;
    out.error = e.what();
  } catch (const std::exception& e) {
    out.committed = false;
    out.error = e.what();
  }
  return out;
}

}  // namespace deltasync
