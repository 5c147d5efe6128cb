#include "sync/shard_resume.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "codec/compact_two_phase.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "format/model_version.hpp"
#include "format/safetensors.hpp"
#include "sync/publisher_resume.hpp"
#include "sync/shard_parts.hpp"

namespace deltasync {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string meta_text(const TensorMeta& m) { return std::string(dtype_name(m.dtype)) + shape_text(m.shape); }

// One tensor of an anchor part as its header describes it: a slice of the full tensor and where
// its bytes sit in the object.
struct TableEntry {
  TensorMeta full;
  Placement placement;
  uint64_t offset = 0;  // of its first byte in the object
};

// An anchor part's tensor table from two ranged reads: the header's length, then the header.
// Checked here as far as the ranged reads rely on it; a part read whole then goes through the
// strict reader.
std::vector<TableEntry> read_part_table(Store& store, const protocol::ObjectRef& part, ResumeCounters& counters) {
  const std::string label = store.describe(part.key);
  const std::vector<uint8_t> length = store.get_range(part.key, 0, 8);
  if (length.size() < 8 || part.size < 8) throw BadInputError(label + ": shorter than a safetensors header");
  uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | length[static_cast<size_t>(b)];
  if (n == 0 || n > part.size - 8 || n > st::kMaxHeaderBytes) throw BadInputError(label + ": bad safetensors header length");
  const std::vector<uint8_t> head = store.get_range(part.key, 8, n);
  counters.header_reads += 2;
  counters.bytes_read += length.size() + head.size();
  if (head.size() != n) throw BadInputError(label + ": its header is cut short");
  const json j = json::parse(head.begin(), head.end(), nullptr, false);
  if (!j.is_object()) throw BadInputError(label + ": header is not a JSON object");
  json placements;  // a part of slices names each tensor's full shape and placement (shard_parts.hpp)
  if (j.contains("__metadata__") && j["__metadata__"].is_object() && j["__metadata__"].contains(shard_keys::kPlacements) &&
      j["__metadata__"][shard_keys::kPlacements].is_string())
    placements = json::parse(j["__metadata__"][shard_keys::kPlacements].get<std::string>(), nullptr, false);
  std::vector<TableEntry> out;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    const bool ok = v.is_object() && v.contains("dtype") && v["dtype"].is_string() && v.contains("shape") && v["shape"].is_array() &&
                    v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2 &&
                    v["data_offsets"][0].is_number_unsigned() && v["data_offsets"][1].is_number_unsigned();
    if (!ok) throw BadInputError(label + ": tensor " + name + " has a malformed header entry");
    const auto dtype = dtype_from_name(v["dtype"].get<std::string>());
    if (!dtype || !is_weight_dtype(*dtype)) throw BadInputError(label + ": tensor " + name + " has no weight dtype");
    TableEntry e;
    e.full = TensorMeta{name, *dtype, {}};
    const json* shape = &v["shape"];
    if (placements.is_object()) {
      const auto p = placements.find(name);
      if (p == placements.end() || !p->is_object() || !p->contains("shape") || !(*p)["shape"].is_array() || !p->contains("placement"))
        throw BadInputError(label + ": tensor " + name + " has no placement entry");
      shape = &(*p)["shape"];
      const std::optional<Placement> pl = placement_from_json((*p)["placement"]);
      if (!pl) throw BadInputError(label + ": tensor " + name + " has a malformed placement");
      e.placement = *pl;
    }
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned()) throw BadInputError(label + ": tensor " + name + " has a malformed shape");
      e.full.shape.push_back(d.get<uint64_t>());
    }
    if (!placements.is_object()) e.placement = whole_placement(e.full.numel());
    const uint64_t begin = v["data_offsets"][0].get<uint64_t>(), end = v["data_offsets"][1].get<uint64_t>();
    const bool fits = !e.placement.empty() && e.placement.run_stride >= e.placement.run_length && e.placement.end() <= e.full.numel();
    if (!fits || end < begin || end - begin != e.placement.numel() * e.full.width() || end > part.size - 8 - n)
      throw BadInputError(label + ": tensor " + name + ": its header entry disagrees with its placement or the object's size");
    e.offset = 8 + n + begin;
    out.push_back(std::move(e));
  }
  return out;
}

// This rank's tensors and what it has recovered of them so far.
class Shard {
 public:
  Shard(std::span<const ShardTensor> tensors, std::string label) : tensors_(tensors), label_(std::move(label)) {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      full_.push_back(tensors_[t].full);
      if (tensors_[t].placement.empty()) continue;
      held_.emplace(tensors_[t].full.name, t);
      bits_.emplace(t, std::vector<uint8_t>(tensors_[t].placement.numel() * tensors_[t].full.width()));
      covered_.emplace(t, 0);
    }
  }

  const std::vector<TensorMeta>& full() const { return full_; }
  bool empty() const { return held_.empty(); }

  // The model index of a tensor this rank holds, or nullopt; `where` names the object whose
  // tensor `meta` must agree with the model's.
  std::optional<size_t> holds(const TensorMeta& meta, const std::string& where) const {
    const auto it = held_.find(meta.name);
    if (it == held_.end()) return std::nullopt;
    const TensorMeta& mine = tensors_[it->second].full;
    if (mine.dtype != meta.dtype || mine.shape != meta.shape)
      throw BadInputError(where + ": tensor " + meta.name + " is " + meta_text(meta) + " in the store, " + meta_text(mine) + " in the model");
    return it->second;
  }
  const Placement& placement(size_t t) const { return tensors_[t].placement; }
  bool holds_any(size_t t) const { return !tensors_[t].placement.empty(); }
  // Elements of this rank's tensor t that a slice at `source` holds.
  uint64_t needs(size_t t, const Placement& source) const { return for_each_overlap(source, placement(t), nullptr); }

  // The anchor's elements of a slice at `source` whose local elements from `first` on are `bytes`.
  void take_anchor(size_t t, const Placement& source, uint64_t first, std::span<const uint8_t> bytes) {
    const uint32_t w = full_[t].width();
    std::vector<uint8_t>& dst = bits_.at(t);
    covered_.at(t) += for_each_overlap(source, placement(t), [&](uint64_t s, uint64_t d, uint64_t count) {
      std::memcpy(dst.data() + d * w, bytes.data() + (s - first) * w, count * w);
    });
  }

  // A resolved delta part's changes at this rank's positions (compact parts come unbased: their
  // values are rebased on the bits they replace, as every reader without host bits does).
  void apply(const ResolvedPart& part) {
    for (const auto& [t, p] : part.patches) {
      const auto held = bits_.find(t);
      if (held == bits_.end()) continue;
      std::vector<uint8_t>& dst = held->second;
      const Placement& mine = placement(t);
      const uint32_t w = full_[t].width();
      std::vector<uint64_t> at;
      std::vector<uint8_t> values, old;
      for (uint64_t k = 0; k < p.count; ++k) {
        const uint64_t position = patch_index(p, k);
        if (!mine.contains(position)) continue;
        at.push_back(mine.local_position(position));
        const auto* v = static_cast<const uint8_t*>(p.values) + k * w;
        values.insert(values.end(), v, v + w);
      }
      if (part.relative) {
        old.resize(values.size());
        for (size_t i = 0; i < at.size(); ++i) std::memcpy(old.data() + i * w, dst.data() + at[i] * w, w);
        compact::rebase_values(values, old, w, values);
      }
      for (size_t i = 0; i < at.size(); ++i) std::memcpy(dst.data() + at[i] * w, values.data() + i * w, w);
    }
  }

  // Every element of every held tensor came from the anchor exactly once.
  void check_covered(uint64_t anchor_version) const {
    for (const auto& [t, n] : covered_)
      if (n != placement(t).numel())
        throw BadInputError(label_ + ": the parts of anchor " + std::to_string(anchor_version) + " give " + std::to_string(n) +
                            " elements of the " + std::to_string(placement(t).numel()) + " of tensor " + full_[t].name +
                            " this rank holds");
  }

  void finish(ShardRecovery& out) {
    std::vector<ConstTensorRef> refs;
    std::vector<Placement> placements;
    for (auto& [t, bits] : bits_) {
      refs.push_back(ConstTensorRef{full_[t].name, bits.data(), placement(t).numel(), full_[t].width()});
      placements.push_back(placement(t));
    }
    const std::vector<uint64_t> partials = digest_placed_tensors(refs, placements);
    out.partials.assign(tensors_.size(), 0);
    size_t i = 0;
    for (auto& [t, bits] : bits_) {
      out.partials[t] = partials[i++];
      out.local.push_back(std::move(bits));
    }
  }

 private:
  std::span<const ShardTensor> tensors_;
  std::string label_;
  std::vector<TensorMeta> full_;
  std::map<std::string, size_t> held_;             // name -> model index
  std::map<size_t, std::vector<uint8_t>> bits_;    // model index -> bits (ordered: model order)
  std::map<size_t, uint64_t> covered_;             // model index -> elements the anchor gave
};

void recover_anchor(Store& store, const protocol::Manifest& anchor, Shard& shard, ResumeCounters& counters) {
  for (const protocol::ObjectRef& part : anchor.anchor_parts) {
    const std::string where = store.describe(part.key);
    const std::vector<TableEntry> table = read_part_table(store, part, counters);
    uint64_t needed = 0, data = 0;
    for (const TableEntry& e : table) {
      data += e.placement.numel() * e.full.width();
      if (const auto t = shard.holds(e.full, where)) needed += shard.needs(*t, e.placement) * e.full.width();
    }
    if (needed == 0) continue;
    if (2 * needed >= data) {  // most of it (the publishing group's sharding: all): whole, SHA-256 checked
      std::vector<uint8_t> bytes = store.get(part.key);
      protocol::verify_object(part, bytes, where);
      counters.bytes_read += bytes.size();
      ++counters.whole_objects;
      const st::File file = st::File::from_bytes(std::move(bytes), where);
      const std::optional<uint64_t> version = read_model_version(file.metadata(), where);
      if (version != anchor.version)
        throw BadInputError(where + ": anchor part is for version " + (version ? std::to_string(*version) : std::string("unknown")) +
                            ", expected " + std::to_string(anchor.version));
      for (const AnchorSlice& s : anchor_part_slices(file))
        if (const auto t = shard.holds(s.full, where)) shard.take_anchor(*t, s.placement, 0, s.bytes);
      continue;
    }
    // A small share of it (another world size than the publishing group's): the byte ranges of
    // this rank's elements, verified by the digests the ranks sum in check_recovery.
    for (const TableEntry& e : table) {
      const auto t = shard.holds(e.full, where);
      if (!t) continue;
      uint64_t lo = UINT64_MAX, hi = 0;
      for_each_overlap(e.placement, shard.placement(*t), [&](uint64_t s, uint64_t, uint64_t count) {
        lo = std::min(lo, s);
        hi = std::max(hi, s + count);
      });
      if (hi == 0) continue;
      const uint32_t w = e.full.width();
      const std::vector<uint8_t> bytes = store.get_range(part.key, e.offset + lo * w, (hi - lo) * w);
      ++counters.ranged_reads;
      counters.bytes_read += bytes.size();
      if (bytes.size() != (hi - lo) * w) throw BadInputError(where + ": tensor " + e.full.name + " is cut short");
      shard.take_anchor(*t, e.placement, lo, bytes);
    }
  }
}

void recover_delta(Store& store, const protocol::Manifest& m, Shard& shard, ResumeCounters& counters) {
  const size_t T = shard.full().size();
  const std::vector<protocol::ObjectRef> objects = protocol::delta_objects(m);
  for (size_t k = 0; k < objects.size(); ++k) {
    // One part (`delta`) covers the whole model; a part of several, what its manifest places in it.
    auto held = [&](size_t t) {
      const TensorMeta& meta = shard.full()[t];
      return m.delta ? whole_placement(meta.numel()) : m.part_placements.placement(meta.name, k);
    };
    bool needed = false;
    for (size_t t = 0; t < T && !needed; ++t) needed = shard.holds_any(t) && shard.needs(t, held(t)) > 0;
    if (!needed) continue;
    const std::string where = store.describe(objects[k].key);
    std::vector<uint8_t> bytes = store.get(objects[k].key);
    protocol::verify_object(objects[k], bytes, where);
    counters.bytes_read += bytes.size();
    ++counters.whole_objects;
    const st::File file = st::File::from_bytes(std::move(bytes), where);
    ResolvedPart resolved;
    resolve_delta_part(m, file, shard.full(), {}, held, resolved);
    shard.apply(resolved);
  }
}

}  // namespace

ShardRecovery recover_shard(Store& store, std::span<const ShardTensor> tensors, const protocol::Fence& fence) {
  const auto start = Clock::now();
  if (!fence.since) throw Error("resume: the store had no version when the group claimed it; there is nothing to resume");
  const uint64_t since = *fence.since;
  const std::string label = "resume from version " + std::to_string(since);
  protocol::Catalog catalog(store);
  catalog.note_fence(fence);
  const protocol::Manifest* target = catalog.find(since);
  if (!target) throw NotFoundError(store.describe(protocol::manifest_key(since)) + ": " + label + ": its manifest is missing");
  const auto plan = protocol::plan_catch_up(catalog, std::nullopt, since, /*allow_current=*/false);
  if (!plan || !plan->anchor_version) throw NotFoundError(label + ": no anchor is left on its chain");

  ShardRecovery out;
  out.version = since;
  out.state = resumed_state(catalog, store, since);
  // The model is the store's: the same tensors (dtypes and shapes are checked where read).
  std::map<std::string, size_t> names;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const std::string& name = tensors[t].full.name;
    names.emplace(name, t);
    const auto d = target->digests.find(name);
    if (d == target->digests.end()) throw BadInputError(label + ": the store has no tensor " + name);
    out.expected.push_back(digest_from_hex(d->second, label));
  }
  for (const auto& [name, digest] : target->digests)
    if (!names.contains(name)) throw BadInputError(label + ": the store's tensor " + name + " is not in the model");

  Shard shard(tensors, label);
  if (!shard.empty()) {
    const protocol::Manifest* anchor = catalog.find(*plan->anchor_version);
    if (!anchor) throw NotFoundError(store.describe(protocol::manifest_key(*plan->anchor_version)) + ": anchor version disappeared");
    recover_anchor(store, *anchor, shard, out.counters);
    shard.check_covered(anchor->version);
    for (uint64_t v : plan->deltas) {
      const protocol::Manifest* m = catalog.find(v);
      if (!m) throw NotFoundError(store.describe(protocol::manifest_key(v)) + ": version disappeared while resuming");
      recover_delta(store, *m, shard, out.counters);
    }
  }
  shard.finish(out);
  out.counters.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return out;
}

void check_recovery(const GatheredReceipts& g, uint64_t version, std::span<const uint64_t> expected) {
  const std::string label = "resume from version " + std::to_string(version);
  for (const PartReceipt& r : g.receipts)
    if (!r.error.empty()) throw Error(label + ": rank " + std::to_string(r.rank) + " failed: " + r.error);
  const RankPlacements ranks = rank_placements(g, label);  // every tensor tiled by the ranks' shards
  if (ranks.model.size() != expected.size() || g.digests.size() != expected.size())
    throw Error(label + ": " + std::to_string(ranks.model.size()) + " tensors, " + std::to_string(g.digests.size()) + " summed partials, the store " +
                std::to_string(expected.size()));
  for (size_t t = 0; t < expected.size(); ++t)
    if (g.digests[t] != expected[t])
      throw BadInputError(label + ": tensor " + ranks.model[t].name + ": the ranks' recovered shards sum to digest " +
                          digest_to_hex(g.digests[t]) + ", its manifest records " + digest_to_hex(expected[t]));
}

}  // namespace deltasync
