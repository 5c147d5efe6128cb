// deltasync-scale-model: the real sharded publisher, receipts, commit, manifest, catch-up planning
// and ranged read planning on the tensor table of a 1T-parameter MoE
// (benchmarks/scale/model_table.hpp), with the trailing dimensions scaled down so it runs on one
// small machine.
//
// What is real: every trainer rank is a ShardPublisher (CPU engine) over its FSDP2 Shard(0)
// placements (rule Shard(0) over the ranks' mesh), encoding and uploading its own delta part;
// receipts go through receipt_to_bytes / receipt_from_bytes and the partials through the reduce's
// int64 halves (split_partials / join_partials); rank 0 commits with commit_parts (placements
// derived from the rules, tiling checks, commit_version); the manifest is written and parsed by the
// protocol's code; a subscriber plans with Catalog + plan_catch_up; each receiver rank plans its
// ranged reads with the subscriber's own ranged reader (ranged::read_needed) on every part, through
// the counting store: its bytes and requests, at one or more request costs (--gap-bytes).
// What is simulated: the ranks run one after another in this process (each rank's publisher lives
// for its two versions, then goes: 256 publishers at once would hold 256 copies of the table);
// the gather is files on disk and the reduce a sum in this process; rank r concludes version 1
// with the outcome rank 0 computes only after every rank ran (checked to match); the store is in
// memory and keeps only the sizes of the anchor objects. --manifest-only publishes nothing: every
// rank's receipt is made from its table (describe_table) with placeholder objects, so rank 0's
// commit, the manifest and the placement side of planning run at the full table. --index-parts
// (with --manifest-only, best with --divisor 1) also writes every rank's delta part of the indexed
// layout up to its payloads (index_parts.hpp: real headers, records and block index entries at the
// table's width, the payloads zeros the store does not keep), so that the receivers' reads of a
// full-width version are measured.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "codec/compact_indexed.hpp"
#include "codec/compact_table.hpp"
#include "core/parse_number.hpp"
#include "format/sha256.hpp"
#include "scale/counting_store.hpp"
#include "scale/index_parts.hpp"
#include "scale/model_table.hpp"
#include "format/safetensors.hpp"
#include "sync/protocol.hpp"
#include "sync/range_hashes.hpp"
#include "sync/ranged_fetch.hpp"
#include "sync/ranged_plan.hpp"
#include "sync/shard_publish.hpp"

namespace sm = deltasync::scale_model;
using namespace deltasync;

namespace {

struct Options {
  sm::ModelShape shape;
  uint64_t ranks = 256;
  uint64_t receiver_tp = 8;
  uint64_t replicas = 64;
  double changed = 0.01;
  bool per_part_form = true;  // also write and parse the manifest in format 1 (costs memory)
  // No publishing: every rank's receipt from its table with placeholder objects (part sizes of
  // realistic-cpu's 1.236 B per change), committed and measured like a published version.
  bool manifest_only = false;
  bool index_parts = false;  // with manifest_only: the parts' heads at the table's width (index_parts.hpp)
  uint32_t compact_layout = compact::kPublisherDefaultLayout;
  std::vector<uint64_t> gaps{ranged::kDefaultGapBytes};  // the receivers' request costs, in bytes
  std::string work = "/tmp/deltasync-scale-model";
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double peak_rss_gb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1048576.0;
}

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// bf16 weights around +-2^-7 at version 1; version 2 moves ~`changed` of them by one ulp (what
// an Adam step does to most of the elements it changes in bf16).
uint16_t bits_at(uint64_t tensor, uint64_t position, uint64_t version, uint64_t threshold) {
  const uint64_t h = mix(tensor * 0x100000001b3ull ^ position);
  uint16_t b = static_cast<uint16_t>(((h >> 8) & 0x8000u) | (0x78u << 7) | (h & 0x7fu));
  if (version >= 2 && mix(h ^ 0x5eed) < threshold) {
    const uint16_t mant = b & 0x7fu;
    b = static_cast<uint16_t>(mant == 0x7f || (mant != 0 && (h >> 40) & 1) ? b - 1 : b + 1);
  }
  return b;
}
bool changed_at(uint64_t tensor, uint64_t position, uint64_t threshold) {
  return mix(mix(tensor * 0x100000001b3ull ^ position) ^ 0x5eed) < threshold;
}

std::vector<uint8_t> read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::filesystem::path& p, std::span<const uint8_t> bytes) {
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Rank r's table: every tensor under FSDP2's Shard(0) over the ranks, as a DTensor says it.
std::vector<ShardTensor> rank_tensors(const std::vector<sm::ModelTensor>& table, uint64_t r, uint64_t ranks) {
  std::vector<ShardTensor> out;
  out.reserve(table.size());
  for (const auto& t : table) {
    const PlacementRule rule{PlacementRule::Kind::kShard, 0, ranks, r};
    out.push_back(ShardTensor{t.meta, rule_placement(rule, t.meta.shape, r), rule});
  }
  return out;
}

// The flat elements of a placement as sorted spans (what a receiver rank needs of a tensor).
ranged::NeededTensor needed_of(const Placement& p, const std::vector<uint64_t>& shape) {
  ranged::NeededTensor n{shape, {}};
  for (uint64_t r = 0; r < p.run_count; ++r) n.spans.push_back({p.first + r * p.run_stride, p.first + r * p.run_stride + p.run_length});
  n.spans = ranged::merge_spans(std::move(n.spans));
  return n;
}

std::string kib(uint64_t bytes) { return bytes % 1024 ? std::to_string(bytes) + " B" : std::to_string(bytes / 1024) + " KiB"; }

std::string gb(double bytes) {
  char buf[64];
  if (bytes >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6) std::snprintf(buf, sizeof buf, "%.2f MB", bytes / 1e6);
  else if (bytes >= 1e3) std::snprintf(buf, sizeof buf, "%.1f KB", bytes / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  return buf;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(a + " needs a value", ErrorKind::kInvalidArgument);
      return argv[++i];
    };
    if (a == "--layers") o.shape.layers = std::stoull(next());
    else if (a == "--dense-layers") o.shape.dense_layers = std::stoull(next());
    else if (a == "--experts") o.shape.experts = std::stoull(next());
    else if (a == "--divisor") o.shape.divisor = std::stoull(next());
    else if (a == "--ranks") o.ranks = std::stoull(next());
    else if (a == "--receiver-tp") o.receiver_tp = std::stoull(next());
    else if (a == "--replicas") o.replicas = std::stoull(next());
    else if (a == "--changed") o.changed = std::stod(next());
    else if (a == "--no-per-part-form") o.per_part_form = false;
    else if (a == "--work") o.work = next();
    else if (a == "--manifest-only") o.manifest_only = true;
    else if (a == "--index-parts") o.manifest_only = o.index_parts = true;
    else if (a == "--compact-layout") o.compact_layout = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--gap-bytes") {
      o.gaps.clear();
      const std::string list = next();
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        o.gaps.push_back(parse_decimal<uint64_t>(list.substr(at, comma - at), "--gap-bytes", ErrorKind::kInvalidArgument));
        at = comma + 1;
      }
    }
    else throw Error("unknown option " + a + " (see benchmarks/README.md: deltasync-scale-model)", ErrorKind::kInvalidArgument);
  }
  return o;
}

// What the gather and the reduce carry for one version: every rank's receipt (written where rank 0
// reads it) and the sums of the partials' int64 halves.
struct Round {
  uint64_t version = 0;
  std::vector<int64_t> sums;
  std::vector<uint64_t> receipt_bytes;  // per rank
};

// Two manifests' placements say the same per tensor (pattern indices may be numbered otherwise).
bool same_placements(const protocol::PartPlacements& a, const protocol::PartPlacements& b) {
  if (a.parts() != b.parts() || a.tensors().size() != b.tensors().size()) return false;
  for (const auto& [name, index] : a.tensors()) {
    const protocol::PlacementPattern* other = b.find(name);
    if (!other || *other != a.patterns()[index]) return false;
  }
  return true;
}

int run(const Options& o) {
  const std::vector<sm::ModelTensor> table = sm::model_table(o.shape);
  const size_t T = table.size();
  uint64_t numel = 0, full_numel = 0;
  for (const auto& t : table) {
    numel += t.meta.numel();
    full_numel += t.full_numel;
  }
  const uint64_t threshold = static_cast<uint64_t>(o.changed * 18446744073709551615.0);
  std::filesystem::remove_all(o.work);
  std::filesystem::create_directories(o.work);
  std::printf("# scale model: %zu tensors, %llu params here (%.3g of %llu at full width: scale 1/%.0f), %llu publisher ranks, "
              "%llu replicas x %llu receiver ranks, %.2f%% changed\n\n",
              T, (unsigned long long)numel, double(numel) / full_numel, (unsigned long long)full_numel, double(full_numel) / numel,
              (unsigned long long)o.ranks, (unsigned long long)o.replicas, (unsigned long long)o.receiver_tp, o.changed * 100);

  auto store = std::make_shared<sm::CountingStore>("anchors/");
  PublisherOptions popts;
  popts.run_id = "scale-model";
  popts.keep_anchors = 0;
  popts.compact_layout = o.compact_layout;
  std::vector<TensorMeta> metas;
  for (const auto& t : table) metas.push_back(t.meta);
  const compact::TensorTable tensor_table(metas);  // the receivers' model, and the index parts' table
  store->act_as("claim");
  const ClaimOutcome claim = claim_for_group(*store, popts);
  if (!claim.fence) throw Error("claim refused: " + claim.error);
  const std::string claim_json = claim_to_json(claim);

  Round rounds[2] = {{1, std::vector<int64_t>(2 * T, 0), {}}, {2, std::vector<int64_t>(2 * T, 0), {}}};
  auto gather = [&](Round& round, uint64_t rank, const PartReceipt& receipt) {
    const std::vector<uint8_t> bytes = receipt_to_bytes(receipt);
    round.receipt_bytes.push_back(bytes.size());
    write_bytes(o.work + "/v" + std::to_string(round.version) + "-" + std::to_string(rank) + ".bin", bytes);
    const std::vector<int64_t> halves = split_partials(receipt.partials);
    for (size_t i = 0; i < halves.size(); ++i) round.sums[i] += halves[i];
  };
  std::vector<double> publish_s(o.ranks);
  double publish_total_s = 0;
  const double t_publish = now_s();
  if (o.manifest_only) {
    // 1'. Every rank's receipts from its table, with placeholder objects of the sizes its part
    // would have (1.236 B per change, realistic-cpu.md) and synthetic partials.
    const std::string sha(64, '0');
    const std::vector<uint8_t> placeholder{'x'};
    for (uint64_t r = 0; r < o.ranks; ++r) {
      const std::vector<ShardTensor> tensors = rank_tensors(table, r, o.ranks);
      PartReceipt base;
      base.rank = r;
      base.delta_format = "compact";
      describe_table(tensors, base);
      base.partials.assign(T, 0);
      uint64_t held = 0;
      for (size_t t = 0; t < T; ++t)
        if (!tensors[t].placement.empty()) {
          held += tensors[t].placement.numel();
          base.partials[t] = mix(t * 0x10001 + r);
        }
      store->act_as("rank " + std::to_string(r) + " v1");
      PartReceipt v1 = base;
      v1.version = 1;
      v1.anchor = true;
      const std::string anchor_key = protocol::anchor_part_key(1, protocol::new_nonce(), r);
      store->put(anchor_key, placeholder);
      v1.anchor_parts.push_back(protocol::ObjectRef{anchor_key, 2 * held, sha});
      gather(rounds[0], r, v1);
      store->act_as("rank " + std::to_string(r) + " v2");
      PartReceipt v2 = base;
      v2.version = 2;
      v2.base_version = 1;
      v2.changed = static_cast<uint64_t>(held * o.changed);
      if (held && o.index_parts) {
        // The part up to its payloads, as the publisher's indexed layout writes it.
        const std::string key = protocol::delta_key(2, protocol::new_nonce());
        sm::IndexPart part = sm::index_part(tensor_table, tensors, r, o.changed, 1.236, compact_options(popts));
        const uint64_t prefix = ranged::header_prefix_bytes(part.head, part.size, key);
        v2.changed = part.changes;
        v2.delta = protocol::ObjectRef{key, part.size, sha, sha256_hex(std::span<const uint8_t>(part.head).first(prefix))};
        store->put_head(key, std::move(part.head), part.size);
      } else if (held) {
        const std::string key = protocol::delta_key(2, protocol::new_nonce());
        store->put(key, placeholder);
        v2.delta = protocol::ObjectRef{key, static_cast<uint64_t>(v2.changed * 1.236), sha};
      }
      gather(rounds[1], r, v2);
    }
  } else {
    // 1. Every trainer rank: version 1 (anchor), then version 2 (delta), its receipts to "rank 0".
    CommitOutcome predicted_v1;
    predicted_v1.version = 1;
    predicted_v1.committed = true;
    predicted_v1.anchor = true;
    for (uint64_t r = 0; r < o.ranks; ++r) {
      const std::vector<ShardTensor> tensors = rank_tensors(table, r, o.ranks);
      std::vector<std::vector<uint16_t>> local(T);
      std::vector<ConstTensorRef> refs(T);
      auto fill = [&](uint64_t version) {
        for (size_t t = 0; t < T; ++t) {
          const Placement& pl = tensors[t].placement;
          local[t].resize(pl.numel());
          for (uint64_t i = 0; i < pl.numel(); ++i) local[t][i] = bits_at(t, pl.full_position(i), version, threshold);
          refs[t] = ConstTensorRef{table[t].meta.name, local[t].data(), pl.numel(), 2};
        }
      };
      store->act_as("rank " + std::to_string(r) + " v1");
      ShardPublisher pub(store, tensors, r, claim_from_json(claim_json, "claim"), std::make_unique<engine::CpuSyncEngine>(), popts);
      fill(1);
      gather(rounds[0], r, pub.publish_part(1, refs, pub.anchor_due(1)));
      pub.conclude(predicted_v1);
      fill(2);
      store->act_as("rank " + std::to_string(r) + " v2");
      const double t0 = now_s();
      const PartReceipt r2 = pub.publish_part(2, refs, pub.anchor_due(2));
      publish_s[r] = now_s() - t0;
      if (r2.anchor) throw Error("rank " + std::to_string(r) + ": version 2 came out as an anchor");
      gather(rounds[1], r, r2);
      if ((r + 1) % 32 == 0) std::fprintf(stderr, "rank %llu published (%.0f s)\n", (unsigned long long)r, now_s() - t_publish);
    }
  }
  publish_total_s = now_s() - t_publish;

  // 2. Rank 0 commits version 1, then version 2, from the receipts as they arrive over the wire
  // and the reduced partials; its own table is the model's.
  const std::vector<ShardTensor> mine = rank_tensors(table, 0, o.ranks);
  double p1 = 0, c1 = 0, p2 = 0, c2 = 0;
  auto commit = [&](Round& round, std::optional<uint64_t> latest_anchor, double& parse_s, double& commit_s) {
    std::vector<PartReceipt> receipts;
    receipts.reserve(o.ranks);
    const double t0 = now_s();
    for (uint64_t r = 0; r < o.ranks; ++r) {
      const std::string path = o.work + "/v" + std::to_string(round.version) + "-" + std::to_string(r) + ".bin";
      receipts.push_back(receipt_from_bytes(read_bytes(path), path));
    }
    const std::vector<uint64_t> digests = join_partials(round.sums, T, "reduced partials");
    const double t1 = now_s();
    store->act_as("commit v" + std::to_string(round.version));
    CommitOutcome out = commit_parts(*store, GatheredReceipts{receipts, digests, mine}, latest_anchor, *claim.fence);
    parse_s = t1 - t0;
    commit_s = now_s() - t1;
    if (out.needs_tables) throw Error("commit of version " + std::to_string(round.version) + ": rank 0 needed every rank's table");
    if (!out.committed) throw Error("commit of version " + std::to_string(round.version) + " failed: " + out.error);
    return out;
  };
  const CommitOutcome v1 = commit(rounds[0], std::nullopt, p1, c1);
  if (!v1.anchor || v1.delta_bytes != 0) throw Error("version 1's outcome differs from the one the ranks concluded with");
  const CommitOutcome v2 = commit(rounds[1], 1, p2, c2);
  const double rss_after_commit = peak_rss_gb();
  const uint64_t outcome_bytes = outcome_to_json(v2).size();
  const uint64_t manifest_bytes = store->size_of(protocol::manifest_key(2));

  // 3. The manifest: parse (compact form, as written), and the format 1 form for comparison.
  store->act_as("measure");
  const std::vector<uint8_t> raw = store->get(protocol::manifest_key(2));
  const std::string text(raw.begin(), raw.end());
  double t0 = now_s();
  std::optional<protocol::Manifest> m = protocol::manifest_from_json(text, "manifest 2");
  const double parse_compact_s = now_s() - t0;
  t0 = now_s();
  const std::string rewritten = protocol::to_json(*m);
  const double write_compact_s = now_s() - t0;
  if (rewritten.size() != text.size()) throw Error("the parsed manifest writes back to other bytes");
  uint64_t entries = 0;  // (part, tensor) placements the patterns stand for
  for (const auto& [name, index] : m->part_placements.tensors())
    for (const auto& seg : m->part_placements.patterns()[index]) entries += seg.count;
  const size_t patterns = m->part_placements.patterns().size();
  uint64_t per_part_bytes = 0;
  double write_per_part_s = 0, parse_per_part_s = 0;
  if (o.per_part_form) {
    t0 = now_s();
    std::string old_text = protocol::to_json(*m, protocol::PlacementForm::kPerPart);
    write_per_part_s = now_s() - t0;
    per_part_bytes = old_text.size();
    const protocol::PartPlacements committed = m->part_placements;
    m.reset();  // one parsed manifest at a time
    t0 = now_s();
    m = protocol::manifest_from_json(old_text, "manifest 2 (format 1)");
    parse_per_part_s = now_s() - t0;
    if (!same_placements(m->part_placements, committed)) throw Error("format 1 read back other placements");
  }
  const double rss_after_manifest = peak_rss_gb();

  // 4. A subscriber's catch-up planning (a follower at version 1, and a new one from nothing).
  store->act_as("subscriber");
  protocol::Catalog catalog(*store);
  t0 = now_s();
  const auto plan_follow = protocol::plan_catch_up(catalog, 1, 2);
  const double plan_follow_s = now_s() - t0;  // includes fetching and parsing manifest 2
  t0 = now_s();
  const auto plan_fresh = protocol::plan_catch_up(catalog, std::nullopt, 2);
  const double plan_fresh_s = now_s() - t0;
  if (!plan_follow || plan_follow->deltas != std::vector<uint64_t>{2}) throw Error("a follower at 1 should plan delta 2 only");
  const protocol::Manifest& m2 = *catalog.find(2);
  const std::vector<protocol::ObjectRef> objects = protocol::delta_objects(m2);

  // 5. The parts' headers (what every ranged reader reads of every part) and, in the indexed
  // layout, their index sections (bitmap, page hashes, records, block index entries).
  const bool have_parts = !o.manifest_only || o.index_parts;
  uint64_t header_sum = 0, header_max = 0, changed_tensors_sum = 0, index_sum = 0, records_sum = 0;
  if (have_parts)
    for (const auto& ref : objects) {
      const std::span<const uint8_t> bytes = store->bytes_of(ref.key);
      const uint64_t prefix = ranged::header_prefix_bytes(bytes.first(8), ref.size, ref.key);
      header_sum += prefix;
      header_max = std::max(header_max, prefix);
      const ranged::SealedHeader h = ranged::read_sealed_header(bytes.first(prefix), ref, ref.key);
      if (const st::TensorInfo* records = h.find(compact::indexed::kRecords)) {
        changed_tensors_sum += records->nbytes() / compact::indexed::kRecordBytes;
        records_sum += records->nbytes();
        index_sum += h.find(compact::indexed::kIndex)->end - h.find(compact::indexed::kPresent)->begin;
      } else {
        changed_tensors_sum += h.tensors.size() / 2;  // NAME.cindex + NAME.cdata
      }
    }

  // 6. Each receiver rank (TP = EP = receiver_tp): the parts' placements it meets (the manifest side
  // of planning: one lookup per part and tensor it needs), then -- with parts in the store -- the
  // subscriber's ranged reader on every part (ranged::read_needed through the counting store, at
  // each request cost of --gap-bytes): its bytes and requests. And the changes inside its positions
  // (what any fetch must carry at least).
  const double bytes_per_change = double(m2.delta_bytes()) / double(std::max<uint64_t>(m2.changed_elements, 1));
  struct Reads {
    uint64_t head_bytes = 0, index_bytes = 0, block_bytes = 0, requests = 0;
    double seconds = 0;
    uint64_t bytes() const { return head_bytes + index_bytes + block_bytes; }
  };
  struct ReceiverRank {
    uint64_t pairs = 0, changes = 0;
    double lookup_s = 0;
    std::vector<Reads> reads;  // per gap
  };
  std::vector<ReceiverRank> rx(o.receiver_tp);
  for (uint64_t q = 0; q < o.receiver_tp; ++q) {
    ranged::NeededRanges needed;
    for (size_t t = 0; t < T; ++t) {
      const Placement p = sm::receiver_placement(table[t], o.shape, q, o.receiver_tp);
      if (!p.empty()) needed.emplace(table[t].meta.name, needed_of(p, table[t].meta.shape));
    }
    t0 = now_s();
    for (size_t k = 0; k < m2.delta_parts.size(); ++k)
      for (const auto& [name, want] : needed) rx[q].pairs += ranged::placement_overlaps(m2.part_placements.placement(name, k), want.spans);
    rx[q].lookup_s = now_s() - t0;
    for (const uint64_t gap : have_parts ? o.gaps : std::vector<uint64_t>{}) {
      store->act_as("receiver " + std::to_string(q) + " gap " + std::to_string(gap));
      Reads r;
      t0 = now_s();
      for (size_t k = 0; k < objects.size(); ++k) {
        const ranged::RangeGet get = [&](uint64_t offset, uint64_t length) { return store->get_range(objects[k].key, offset, length); };
        const ranged::RangedDelta d = ranged::read_needed(get, objects[k], needed, ranged::PartScope{&m2.part_placements, k},
                                                          ranged::ReadOptions{&tensor_table, gap}, objects[k].key);
        r.head_bytes += d.head_bytes;
        r.index_bytes += d.index_bytes;
        r.block_bytes += d.block_bytes;
        r.requests += d.requests;
      }
      r.seconds = now_s() - t0;
      rx[q].reads.push_back(r);
    }
    for (size_t t = 0; t < T; ++t) {
      const Placement p = sm::receiver_placement(table[t], o.shape, q, o.receiver_tp);
      if (o.manifest_only) {  // no data: its share of the changes
        rx[q].changes += static_cast<uint64_t>(static_cast<double>(p.numel()) * o.changed);
        continue;
      }
      for (uint64_t i = 0; i < p.numel(); ++i) rx[q].changes += changed_at(t, p.full_position(i), threshold);
    }
  }

  // 7. The table.
  const double delta_bytes = double(v2.delta_bytes);
  std::vector<double> sorted_publish = publish_s;
  std::sort(sorted_publish.begin(), sorted_publish.end());
  auto rank_count = [&](uint64_t r) { return store->count("rank " + std::to_string(r) + " v2"); };
  uint64_t max_req = 0;
  for (uint64_t r = 0; r < o.ranks; ++r) max_req = std::max(max_req, rank_count(r).total());
  const sm::RequestCount commit_req = store->count("commit v2");
  const std::vector<uint64_t>& rb = rounds[1].receipt_bytes;
  const uint64_t receipts_total = std::accumulate(rb.begin(), rb.end(), uint64_t{0});
  const uint64_t receipt_max = *std::max_element(rb.begin(), rb.end());
  const uint64_t reduce_bytes = 2 * 8 * T;  // int64 halves of one 64-bit partial per tensor

  std::printf("| measure | value |\n|---|---|\n");
  if (o.index_parts)
    std::printf("| mode | index parts: receipts of %llu FSDP2 Shard(0) ranks from their tables, each rank's indexed delta part written up to its "
                "payloads (headers, records, block index entries at the table's width; payloads 1.236 B x changes of zeros, not kept) |\n",
                (unsigned long long)o.ranks);
  else if (o.manifest_only)
    std::printf("| mode | manifest only: receipts of %llu FSDP2 Shard(0) ranks from their tables, placeholder parts of 1.236 B x changes (no publish) |\n",
                (unsigned long long)o.ranks);
  std::printf("| compact layout of the parts | %u (%s) |\n", o.compact_layout, o.compact_layout == compact::kLayout2 ? "indexed" : "NAME.cindex / NAME.cdata");
  std::printf("| tensors / params here / params at full width | %zu / %llu / %llu |\n", T, (unsigned long long)numel,
              (unsigned long long)full_numel);
  std::printf("| model bytes here (bf16) | %s |\n", gb(2.0 * numel).c_str());
  std::printf("| changed elements v2 | %llu (%.3f%%) |\n", (unsigned long long)v2.changed_elements, 100.0 * v2.changed_elements / numel);
  if (!o.manifest_only) {
    std::printf("| delta bytes v2 (all parts) | %s (%.3f B per change; 1-ulp synthetic changes) |\n", gb(delta_bytes).c_str(),
                delta_bytes / v2.changed_elements);
    std::printf("| delta parts / per part (mean) | %zu / %s |\n", objects.size(), gb(delta_bytes / objects.size()).c_str());
    std::printf("| publish_part v2 per rank: median / max / sum (wall, one core) | %.3f s / %.3f s / %.1f s |\n",
                sorted_publish[sorted_publish.size() / 2], sorted_publish.back(), std::accumulate(publish_s.begin(), publish_s.end(), 0.0));
    std::printf("| all ranks, both versions, incl. data generation (wall) | %.1f s |\n", publish_total_s);
    std::printf("| store requests per publisher rank per step (v2; max) | %llu (%llu GET, %llu PUT, %llu HEAD) |\n",
                (unsigned long long)max_req, (unsigned long long)rank_count(1).get, (unsigned long long)rank_count(1).put,
                (unsigned long long)rank_count(1).head);
  } else {
    std::printf("| receipts of all ranks, both versions, from their tables%s (wall) | %.1f s |\n",
                o.index_parts ? " and their indexed parts up to the payloads" : "", publish_total_s);
  }
  if (have_parts) {
    std::printf("| per-part header (8 B + JSON header%s): mean / max | %s / %s |\n",
                o.compact_layout == compact::kLayout2 ? "" : ", chunk hashes included", gb(double(header_sum) / objects.size()).c_str(),
                gb(double(header_max)).c_str());
    if (records_sum)
      std::printf("| per-part index sections (bitmap, page hashes, records, block index entries): mean / of it records | %s / %s |\n",
                  gb(double(index_sum) / objects.size()).c_str(), gb(double(records_sum) / objects.size()).c_str());
    std::printf("| tensors with changes per part (records, or named tensors) / held by its rank | %.0f / %zu |\n",
                double(changed_tensors_sum) / objects.size(), T);
  }
  std::printf("| store requests of rank 0's commit (v2) | %llu (%llu GET, %llu PUT, %llu HEAD, %llu LIST) |\n",
              (unsigned long long)commit_req.total(), (unsigned long long)commit_req.get, (unsigned long long)commit_req.put,
              (unsigned long long)commit_req.head, (unsigned long long)commit_req.list);
  std::printf("| inter-rank bytes per step: receipt per rank (binary): mean / max | %.0f B / %llu B |\n", double(receipts_total) / o.ranks,
              (unsigned long long)receipt_max);
  std::printf("| inter-rank bytes per step: partials reduced per rank (int64 halves, 16 B x tensors) | %s |\n", gb(double(reduce_bytes)).c_str());
  std::printf("| inter-rank bytes per step: gathered at rank 0 (receipts) / outcome broadcast | %s / %llu B per rank |\n",
              gb(double(receipts_total)).c_str(), (unsigned long long)outcome_bytes);
  std::printf("| gathering the partials instead of reducing them: at rank 0 (8 B x tensors x ranks) | %s |\n",
              gb(8.0 * T * o.ranks).c_str());
  std::printf("| gathering the model instead (here / at full width, bf16) | %s / %s |\n", gb(2.0 * numel).c_str(), gb(2.0 * full_numel).c_str());
  std::printf("| rank 0: parse the receipts + join the sums / commit_parts (v2) | %.2f s / %.2f s |\n", p2, c2);
  std::printf("| rank 0: parse the receipts + join the sums / commit_parts (v1, anchor) | %.2f s / %.2f s |\n", p1, c1);
  std::printf("| peak RSS after the commits / after the manifest measures | %.2f GB / %.2f GB |\n", rss_after_commit, rss_after_manifest);
  std::printf("| manifest v2 bytes: format 3 (compact, as committed) | %s |\n", gb(double(manifest_bytes)).c_str());
  if (o.per_part_form)
    std::printf("| manifest v2 bytes: format 1 (per-part placements) | %s (%.0fx) |\n", gb(double(per_part_bytes)).c_str(),
                double(per_part_bytes) / manifest_bytes);
  std::printf("| placement patterns in memory / (part, tensor) placements they stand for | %zu / %llu |\n", patterns,
              (unsigned long long)entries);
  std::printf("| manifest write / parse, format 3 (patterns kept unexpanded) | %.2f s / %.2f s |\n", write_compact_s, parse_compact_s);
  if (o.per_part_form) std::printf("| manifest write / parse, format 1 | %.2f s / %.2f s |\n", write_per_part_s, parse_per_part_s);
  std::printf("| subscriber plan_catch_up 1 -> 2 (GET + parse manifest 2 + plan) | %.2f s: %s |\n", plan_follow_s,
              plan_follow->describe().c_str());
  std::printf("| subscriber plan_catch_up none -> 2 (manifests cached but 1) | %.2f s: %s |\n", plan_fresh_s,
              plan_fresh ? plan_fresh->describe().c_str() : "none");
  for (uint64_t q = 0; q < o.receiver_tp; ++q) {
    const ReceiverRank& x = rx[q];
    std::printf("| receiver rank %llu: (part, tensor) placements it meets / lookup time | %llu / %.3f s |\n", (unsigned long long)q,
                (unsigned long long)x.pairs, x.lookup_s);
    for (size_t g = 0; g < x.reads.size(); ++g) {
      const Reads& r = x.reads[g];
      std::printf("| receiver rank %llu, ranged reads at gap %s: head + index + blocks = bytes / requests / time (reads, checks and "
                  "reduced files) | %s + %s + %s = %s / %llu / %.3f s |\n",
                  (unsigned long long)q, kib(o.gaps[g]).c_str(), gb(double(r.head_bytes)).c_str(), gb(double(r.index_bytes)).c_str(),
                  gb(double(r.block_bytes)).c_str(), gb(double(r.bytes())).c_str(), (unsigned long long)r.requests, r.seconds);
    }
    std::printf("| receiver rank %llu: changes in its positions x B per change | %s (%.1f%% of the version's) |\n", (unsigned long long)q,
                gb(x.changes * bytes_per_change).c_str(), 100.0 * x.changes / std::max<uint64_t>(v2.changed_elements, 1));
  }
  for (size_t g = 0; have_parts && g < o.gaps.size(); ++g) {
    uint64_t bytes = 0, requests = 0;
    for (const auto& x : rx) {
      bytes += x.reads[g].bytes();
      requests += x.reads[g].requests + 2;  // LATEST (conditional) + the manifest
    }
    std::printf("| store load per step, %llu replicas x %llu ranks (ranged, gap %s) | %llu requests, %s of manifests, %s of parts |\n",
                (unsigned long long)o.replicas, (unsigned long long)o.receiver_tp, kib(o.gaps[g]).c_str(),
                (unsigned long long)(o.replicas * requests), gb(double(o.replicas * o.receiver_tp) * manifest_bytes).c_str(),
                gb(double(o.replicas) * bytes).c_str());
  }
  const sm::RequestCount sub = store->count("subscriber");
  std::printf("| subscriber requests while planning | %llu GET, %llu HEAD, %llu LIST |\n", (unsigned long long)sub.get,
              (unsigned long long)sub.head, (unsigned long long)sub.list);
  std::filesystem::remove_all(o.work);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deltasync-scale-model: %s\n", e.what());
    return 1;
  }
}
