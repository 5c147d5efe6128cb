#include "sync/shard_receipts.hpp"

#include <algorithm>
#include <map>
#include <tuple>

#include "core/error.hpp"
#include "core/little_endian.hpp"
#include "format/sha256.hpp"

namespace deltasync {
namespace {

constexpr char kReceiptMagic[4] = {'D', 'S', 'R', '1'};
constexpr char kTableMagic[4] = {'D', 'S', 'T', '1'};

class Writer {
 public:
  void magic(const char (&m)[4]) { out_.insert(out_.end(), m, m + 4); }
  void u8(uint8_t v) { out_.push_back(v); }
  void u64(uint64_t v) {
    const size_t at = out_.size();
    out_.resize(at + 8);
    detail::store_le<uint64_t>(out_.data() + at, v);
  }
  void bytes(std::span<const uint8_t> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  void str(std::string_view s) {
    u64(s.size());
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void placement(const Placement& p) {
    for (uint64_t v : {p.first, p.run_length, p.run_stride, p.run_count}) u64(v);
  }
  void object(const protocol::ObjectRef& o) {
    str(o.key);
    u64(o.size);
    str(o.sha256);
    str(o.header_sha256);
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  Reader(std::span<const uint8_t> in, std::string label, const char* what) : in_(in), label_(std::move(label)), what_(what) {}
  void magic(const char (&m)[4]) {
    need(4);
    if (!std::equal(m, m + 4, in_.begin() + at_)) fail("is not a " + std::string(what_) + " of this version (bad magic)");
    at_ += 4;
  }
  uint8_t u8() {
    need(1);
    return in_[at_++];
  }
  bool flag() {
    const uint8_t v = u8();
    if (v > 1) fail("has a flag of " + std::to_string(v));
    return v == 1;
  }
  uint64_t u64() {
    need(8);
    const uint64_t v = detail::load_le<uint64_t>(in_.data() + at_);
    at_ += 8;
    return v;
  }
  // A count of items of at least `item_bytes` each: bounded by what is left.
  uint64_t count(uint64_t item_bytes) {
    const uint64_t n = u64();
    if (n > (in_.size() - at_) / std::max<uint64_t>(item_bytes, 1)) fail("is cut short");
    return n;
  }
  std::string str() {
    const uint64_t n = count(1);
    std::string s(reinterpret_cast<const char*>(in_.data() + at_), n);
    at_ += n;
    return s;
  }
  void bytes(std::span<uint8_t> out) {
    need(out.size());
    std::copy_n(in_.begin() + at_, out.size(), out.begin());
    at_ += out.size();
  }
  Placement placement() {
    Placement p;
    p.first = u64();
    p.run_length = u64();
    p.run_stride = u64();
    p.run_count = u64();
    return p;
  }
  protocol::ObjectRef object() {
    protocol::ObjectRef o;
    o.key = str();
    o.size = u64();
    o.sha256 = str();
    o.header_sha256 = str();
    if (o.key.empty()) fail("names an object without a key");
    return o;
  }
  void end() {
    if (at_ != in_.size()) fail("has " + std::to_string(in_.size() - at_) + " bytes after its end");
  }
  [[noreturn]] void fail(const std::string& why) const { throw BadInputError(label_ + ": the " + what_ + " " + why); }

 private:
  void need(size_t n) {
    if (in_.size() - at_ < n) fail("is cut short");
  }
  std::span<const uint8_t> in_;
  size_t at_ = 0;
  std::string label_;
  const char* what_;
};

void hash_u64(Sha256& h, uint64_t v) {
  uint8_t b[8];
  detail::store_le<uint64_t>(b, v);
  h.update(b);
}

void hash_str(Sha256& h, std::string_view s) {
  hash_u64(h, s.size());
  h.update(std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

TableHash table_hash(std::span<const ShardTensor> tensors) {
  Sha256 h;
  hash_u64(h, tensors.size());
  for (const ShardTensor& t : tensors) {
    hash_str(h, t.full.name);
    hash_str(h, dtype_name(t.full.dtype));
    hash_u64(h, t.full.shape.size());
    for (uint64_t d : t.full.shape) hash_u64(h, d);
  }
  return h.finish();
}

// The rules without the coordinates, which differ from rank to rank.
TableHash rules_hash(std::span<const ShardTensor> tensors) {
  Sha256 h;
  for (const ShardTensor& t : tensors) {
    hash_u64(h, static_cast<uint64_t>(t.rule.kind));
    hash_u64(h, t.rule.kind == PlacementRule::Kind::kShard ? t.rule.dim : 0);
    hash_u64(h, t.rule.kind == PlacementRule::Kind::kShard ? t.rule.mesh_size : 0);
  }
  return h.finish();
}

std::string meta_text(const TensorMeta& m) { return std::string(dtype_name(m.dtype)) + shape_text(m.shape); }

// The placement rank 0 derives for a tensor of `mine` at a rank's coordinate (before the rank's own
// explicit placements).
Placement derived(const ShardTensor& mine, uint64_t coordinate) {
  return mine.rule.kind == PlacementRule::Kind::kExplicit ? Placement{} : rule_placement(mine.rule, mine.full.shape, coordinate);
}

std::vector<TensorMeta> metas(std::span<const ShardTensor> tensors) {
  std::vector<TensorMeta> out;
  out.reserve(tensors.size());
  for (const ShardTensor& t : tensors) out.push_back(t.full);
  return out;
}

// The second round: every rank's table against the first rank's, then its placements as they are.
RankPlacements from_tables(const GatheredReceipts& g, const std::vector<std::string>& names, const std::string& label) {
  const auto& receipts = g.receipts;
  if (g.tables.size() != receipts.size())
    throw Error(label + ": " + std::to_string(g.tables.size()) + " tables for " + std::to_string(receipts.size()) + " receipts");
  const std::vector<ShardTensor>& first = g.tables[0];
  const std::string first_rank = std::to_string(receipts[0].rank);
  for (size_t r = 0; r < receipts.size(); ++r) {
    const std::vector<ShardTensor>& table = g.tables[r];
    const std::string who = label + ": rank " + std::to_string(receipts[r].rank);
    if (table.size() != first.size())
      throw BadInputError(who + " reports " + std::to_string(table.size()) + " tensors, rank " + first_rank + " " + std::to_string(first.size()));
    for (size_t t = 0; t < table.size(); ++t) {
      const TensorMeta& a = table[t].full;
      const TensorMeta& b = first[t].full;
      if (a.name != b.name) throw BadInputError(who + " reports tensor " + a.name + " where rank " + first_rank + " has " + b.name);
      if (a.dtype != b.dtype || a.shape != b.shape)
        throw BadInputError(who + " reports tensor " + a.name + " as " + meta_text(a) + ", rank " + first_rank + " as " + meta_text(b));
    }
  }
  RankPlacements out{metas(first), protocol::PartPlacements(receipts.size())};
  std::vector<Placement> per_rank(receipts.size());
  for (size_t t = 0; t < first.size(); ++t) {
    for (size_t r = 0; r < receipts.size(); ++r) per_rank[r] = g.tables[r][t].placement;
    out.placements.set(first[t].full.name, protocol::pattern_of(per_rank));
  }
  protocol::TilingChecker tiling(out.placements, names, label);
  for (const TensorMeta& m : out.model) tiling.check(m.name, m.numel());
  return out;
}

}  // namespace

void describe_table(std::span<const ShardTensor> tensors, PartReceipt& receipt) {
  receipt.tensors = tensors.size();
  receipt.table_hash = table_hash(tensors);
  receipt.rules_hash = rules_hash(tensors);
  receipt.coordinate = 0;
  for (const ShardTensor& t : tensors)
    if (t.rule.kind != PlacementRule::Kind::kExplicit) {
      receipt.coordinate = t.rule.coordinate;
      break;
    }
  receipt.placements.clear();
  for (size_t t = 0; t < tensors.size(); ++t)
    if (derived(tensors[t], receipt.coordinate) != tensors[t].placement) receipt.placements.emplace_back(t, tensors[t].placement);
}

std::vector<uint8_t> receipt_to_bytes(const PartReceipt& r) {
  Writer w;
  w.magic(kReceiptMagic);
  w.u64(r.rank);
  w.u64(r.version);
  w.u8(r.base_version.has_value());
  w.u64(r.base_version.value_or(0));
  w.u8(r.anchor);
  w.str(r.error);
  w.u8(r.fenced);
  w.u8(r.delta.has_value());
  if (r.delta) w.object(*r.delta);
  w.str(r.delta_format);
  w.u64(r.anchor_parts.size());
  for (const auto& p : r.anchor_parts) w.object(p);
  w.u64(r.changed);
  w.u64(r.tensors);
  w.bytes(r.table_hash);
  w.bytes(r.rules_hash);
  w.u64(r.coordinate);
  w.u64(r.placements.size());
  for (const auto& [t, p] : r.placements) {
    w.u64(t);
    w.placement(p);
  }
  return w.take();
}

PartReceipt receipt_from_bytes(std::span<const uint8_t> bytes, const std::string& label) {
  Reader in(bytes, label, "receipt");
  in.magic(kReceiptMagic);
  PartReceipt r;
  r.rank = in.u64();
  r.version = in.u64();
  const bool has_base = in.flag();
  const uint64_t base = in.u64();
  if (has_base) r.base_version = base;
  r.anchor = in.flag();
  r.error = in.str();
  r.fenced = in.flag();
  if (in.flag()) r.delta = in.object();
  r.delta_format = in.str();
  const uint64_t parts = in.count(24);
  for (uint64_t i = 0; i < parts; ++i) r.anchor_parts.push_back(in.object());
  r.changed = in.u64();
  r.tensors = in.u64();
  in.bytes(r.table_hash);
  in.bytes(r.rules_hash);
  r.coordinate = in.u64();
  const uint64_t n = in.count(40);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t t = in.u64();
    const Placement p = in.placement();
    if (t >= r.tensors || (!r.placements.empty() && t <= r.placements.back().first))
      in.fail("lists tensor " + std::to_string(t) + " out of order or past its " + std::to_string(r.tensors) + " tensors");
    if (!p.empty() && p.run_stride < p.run_length) in.fail("gives tensor " + std::to_string(t) + " overlapping runs");
    r.placements.emplace_back(t, p);
  }
  in.end();
  return r;
}

PartReceipt failed_receipt(uint64_t rank, uint64_t version, const std::string& error, bool fenced, size_t tensors) {
  PartReceipt r;
  r.rank = rank;
  r.version = version;
  r.error = error.empty() ? std::string("unknown failure") : error;
  r.fenced = fenced;
  r.partials.assign(tensors, 0);
  return r;
}

std::vector<uint8_t> table_to_bytes(std::span<const ShardTensor> tensors) {
  Writer w;
  w.magic(kTableMagic);
  w.u64(tensors.size());
  for (const ShardTensor& t : tensors) {
    w.str(t.full.name);
    w.str(dtype_name(t.full.dtype));
    w.u64(t.full.shape.size());
    for (uint64_t d : t.full.shape) w.u64(d);
    w.placement(t.placement);
    w.u8(static_cast<uint8_t>(t.rule.kind));
    w.u64(t.rule.dim);
    w.u64(t.rule.mesh_size);
    w.u64(t.rule.coordinate);
  }
  return w.take();
}

std::vector<ShardTensor> table_from_bytes(std::span<const uint8_t> bytes, const std::string& label) {
  Reader in(bytes, label, "tensor table");
  in.magic(kTableMagic);
  const uint64_t n = in.count(8 + 8 + 8 + 32 + 1 + 24);
  std::vector<ShardTensor> out;
  out.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    ShardTensor t;
    t.full.name = in.str();
    const std::string dtype = in.str();
    const auto parsed = dtype_from_name(dtype);
    if (!parsed) in.fail("gives tensor " + t.full.name + " the unknown dtype " + dtype);
    t.full.dtype = *parsed;
    const uint64_t dims = in.count(8);
    for (uint64_t d = 0; d < dims; ++d) t.full.shape.push_back(in.u64());
    t.placement = in.placement();
    const uint8_t kind = in.u8();
    if (kind > static_cast<uint8_t>(PlacementRule::Kind::kReplicate)) in.fail("gives tensor " + t.full.name + " an unknown rule");
    t.rule.kind = static_cast<PlacementRule::Kind>(kind);
    t.rule.dim = static_cast<uint32_t>(in.u64());
    t.rule.mesh_size = in.u64();
    t.rule.coordinate = in.u64();
    if (!t.placement.empty() && t.placement.run_stride < t.placement.run_length)
      in.fail("gives tensor " + t.full.name + " overlapping runs");
    out.push_back(std::move(t));
  }
  in.end();
  return out;
}

std::vector<int64_t> split_partials(std::span<const uint64_t> partials) {
  const size_t T = partials.size();
  std::vector<int64_t> out(2 * T);
  for (size_t t = 0; t < T; ++t) {
    out[t] = static_cast<int64_t>(partials[t] & 0xffffffffu);
    out[T + t] = static_cast<int64_t>(partials[t] >> 32);
  }
  return out;
}

std::vector<uint64_t> join_partials(std::span<const int64_t> summed, size_t tensors, const std::string& label) {
  if (summed.size() != 2 * tensors)
    throw BadInputError(label + ": " + std::to_string(summed.size()) + " summed partial halves for " + std::to_string(tensors) + " tensors");
  std::vector<uint64_t> out(tensors);
  for (size_t t = 0; t < tensors; ++t) {
    if (summed[t] < 0 || summed[tensors + t] < 0) throw BadInputError(label + ": a summed partial half is negative (overflowed)");
    out[t] = static_cast<uint64_t>(summed[t]) + (static_cast<uint64_t>(summed[tensors + t]) << 32);  // mod 2^64
  }
  return out;
}

bool tables_needed(std::span<const PartReceipt> receipts, std::span<const ShardTensor> mine) {
  for (const PartReceipt& r : receipts)
    if (!r.error.empty()) return false;
  const TableHash table = table_hash(mine), rules = rules_hash(mine);
  return std::any_of(receipts.begin(), receipts.end(), [&](const PartReceipt& r) {
    return r.tensors != mine.size() || r.table_hash != table || r.rules_hash != rules;
  });
}

RankPlacements rank_placements(const GatheredReceipts& g, const std::string& label) {
  const auto& receipts = g.receipts;
  const size_t R = receipts.size();
  if (R == 0) throw Error(label + ": no receipts");
  std::vector<std::string> names;
  for (const PartReceipt& r : receipts) names.push_back("rank " + std::to_string(r.rank));
  if (!g.tables.empty()) return from_tables(g, names, label);
  if (tables_needed(receipts, g.mine)) throw Error(label + ": the ranks' tensor tables differ from this rank's; they must be gathered");

  const std::span<const ShardTensor> mine = g.mine;
  RankPlacements out{metas(mine), protocol::PartPlacements(R)};
  // The ranks' explicit placements by tensor; every other placement is its rule's at the rank's
  // coordinate, one pattern per rule and shape (computed once over the ranks).
  struct Explicit {
    uint64_t tensor;
    size_t rank;
    Placement placement;
  };
  std::vector<Explicit> explicit_placements;
  for (size_t r = 0; r < R; ++r)
    for (const auto& [t, p] : receipts[r].placements) explicit_placements.push_back(Explicit{t, r, p});
  std::stable_sort(explicit_placements.begin(), explicit_placements.end(),
                   [](const Explicit& a, const Explicit& b) { return a.tensor < b.tensor; });
  using RuleKey = std::tuple<PlacementRule::Kind, uint32_t, uint64_t, std::vector<uint64_t>>;
  std::map<RuleKey, std::optional<size_t>> by_rule;  // nullopt: no rank holds any of it
  std::vector<Placement> per_rank(R);
  auto derive_all = [&](const ShardTensor& x) {  // per_rank: the rule's placements (none without a rule)
    for (size_t r = 0; r < R; ++r) {
      try {
        per_rank[r] = derived(x, receipts[r].coordinate);
      } catch (const Error& e) {
        throw BadInputError(label + ": " + names[r] + ": tensor " + x.full.name + ": " + e.what());
      }
    }
  };
  protocol::TilingChecker tiling(out.placements, names, label);
  size_t next = 0;
  for (size_t t = 0; t < mine.size(); ++t) {
    const ShardTensor& x = mine[t];
    const bool has_explicit = next < explicit_placements.size() && explicit_placements[next].tensor == t;
    if (!has_explicit && x.rule.kind != PlacementRule::Kind::kExplicit) {
      const RuleKey key{x.rule.kind, x.rule.kind == PlacementRule::Kind::kShard ? x.rule.dim : 0,
                        x.rule.kind == PlacementRule::Kind::kShard ? x.rule.mesh_size : 0, x.full.shape};
      auto [it, fresh] = by_rule.emplace(key, std::nullopt);
      if (fresh) {
        derive_all(x);
        protocol::PlacementPattern pattern = protocol::pattern_of(per_rank);
        if (!pattern.empty()) it->second = out.placements.intern(std::move(pattern));
      }
      if (it->second) out.placements.assign(x.full.name, *it->second);
    } else if (has_explicit) {
      derive_all(x);
      for (; next < explicit_placements.size() && explicit_placements[next].tensor == t; ++next)
        per_rank[explicit_placements[next].rank] = explicit_placements[next].placement;
      out.placements.set(x.full.name, protocol::pattern_of(per_rank));
    }
    tiling.check(x.full.name, x.full.numel());
  }
  return out;
}

}  // namespace deltasync
