// deltasync-scale-model: the real sharded publisher, receipts, commit, manifest and catch-up
// planning on the tensor table of a 1T-parameter MoE (benchmarks/scale/model_table.hpp), with the
// trailing dimensions scaled down so it runs on one small machine.
//
// What is real: every trainer rank is a ShardPublisher (CPU engine) over its FSDP2 Shard(0)
// placements, encoding and uploading its own delta part; receipts go through receipt_to_json /
// receipt_from_json; rank 0 commits with commit_parts (manifest_from_receipts, tiling checks,
// commit_version); the manifest is written and parsed by the protocol's code; a subscriber plans
// with Catalog + plan_catch_up.
// What is simulated: the ranks run one after another in this process (each rank's publisher lives
// for its two versions, then goes: 256 publishers at once would hold 256 copies of the table);
// the gather is files on disk; rank r concludes version 1 with the outcome rank 0 computes only
// after every rank ran (checked to match); the store is in memory and keeps only the sizes of the
// anchor objects; a receiver rank's byte planning is a stand-in (parts_overlapping below) until the
// ranged planner lands.
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
#include "scale/counting_store.hpp"
#include "scale/model_table.hpp"
#include "sync/protocol.hpp"
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
  // No publishing: the manifest of the ranks' placements (what their receipts would report), with
  // part sizes of realistic-cpu's 1.236 B per change, committed and measured like a published one.
  bool manifest_only = false;
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

// Stand-in for the ranged planner: true when a part's placement of a tensor and the positions a
// receiver rank holds share a position (both are strided runs).
bool overlaps(const Placement& a, const Placement& b) {
  if (a.empty() || b.empty()) return false;
  const Placement& few = a.run_count <= b.run_count ? a : b;
  const Placement& many = a.run_count <= b.run_count ? b : a;
  for (uint64_t r = 0; r < few.run_count; ++r) {
    const uint64_t lo = few.first + r * few.run_stride, hi = lo + few.run_length;
    if (hi <= many.first || lo >= many.end()) continue;
    const uint64_t k = lo > many.first ? (lo - many.first) / many.run_stride : 0;
    const uint64_t b0 = many.first + k * many.run_stride;
    if (b0 < hi && b0 + many.run_length > lo) return true;
    if (k + 1 < many.run_count && many.first + (k + 1) * many.run_stride < hi) return true;
  }
  return false;
}

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

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
    else throw Error("unknown option " + a + " (see benchmarks/README.md: deltasync-scale-model)", ErrorKind::kInvalidArgument);
  }
  return o;
}

// --manifest-only: versions 1 (anchor) and 2 (delta) committed from the placements every rank
// would report, without publishing (the real manifest writer, commit_version and readers).
void commit_synthetic(const Options& o, const std::vector<sm::ModelTensor>& table, Store& store, const protocol::Fence& fence) {
  protocol::Manifest a;
  a.version = 1;
  a.latest_anchor = 1;
  a.digest_algorithm = "sum-mix64-v1";
  a.fence = fence;
  protocol::Manifest d = a;
  d.version = 2;
  d.base_version = 1;
  d.delta_format = "compact";
  for (const auto& t : table) {
    a.digests[t.meta.name] = d.digests[t.meta.name] = "0123456789abcdef";
    a.total_elements += t.meta.numel();
  }
  d.total_elements = a.total_elements;
  a.model_bytes = d.model_bytes = 2 * a.total_elements;
  const std::string sha(64, '0');
  for (uint64_t r = 0; r < o.ranks; ++r) {
    a.anchor_parts.push_back(protocol::ObjectRef{protocol::anchor_part_key(1, "000000000000", r), a.model_bytes / o.ranks, sha});
    protocol::DeltaPart part;
    uint64_t held = 0;
    for (const auto& t : table) {
      const Placement pl = shard_placement(t.meta.shape, 0, r, o.ranks);
      if (pl.empty()) continue;
      part.placements.emplace(t.meta.name, pl);
      held += pl.numel();
    }
    if (part.placements.empty()) continue;
    const uint64_t changes = static_cast<uint64_t>(held * o.changed);
    d.changed_elements += changes;
    part.object = protocol::ObjectRef{protocol::delta_key(2, protocol::new_nonce()), static_cast<uint64_t>(changes * 1.236), sha};
    d.delta_parts.push_back(std::move(part));
  }
  if (!protocol::commit_version(store, a) || !protocol::commit_version(store, d)) throw Error("synthetic versions already exist");
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
  store->act_as("claim");
  const ClaimOutcome claim = claim_for_group(*store, popts);
  if (!claim.fence) throw Error("claim refused: " + claim.error);
  const std::string claim_json = claim_to_json(claim);

  std::vector<double> publish_s(o.ranks), encode_bytes(o.ranks);
  std::vector<uint64_t> receipt_bytes(o.ranks);
  uint64_t v2_changed = 0;
  double publish_total_s = 0, p1 = 0, c1 = 0, p2 = 0, c2 = 0;
  CommitOutcome v2;
  if (o.manifest_only) {
    commit_synthetic(o, table, *store, *claim.fence);
  } else {
  // 1. Every trainer rank: version 1 (anchor), then version 2 (delta), its receipts to "rank 0".
  CommitOutcome predicted_v1;
  predicted_v1.version = 1;
  predicted_v1.committed = true;
  predicted_v1.anchor = true;
  const double t_publish = now_s();
  for (uint64_t r = 0; r < o.ranks; ++r) {
    std::vector<ShardTensor> tensors;
    tensors.reserve(T);
    for (const auto& t : table) tensors.push_back(ShardTensor{t.meta, shard_placement(t.meta.shape, 0, r, o.ranks)});
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
    const PartReceipt r1 = pub.publish_part(1, refs, pub.anchor_due(1));
    std::ofstream(o.work + "/v1-" + std::to_string(r) + ".json") << receipt_to_json(r1);
    pub.conclude(predicted_v1);
    fill(2);
    store->act_as("rank " + std::to_string(r) + " v2");
    const double t0 = now_s();
    const PartReceipt r2 = pub.publish_part(2, refs, pub.anchor_due(2));
    publish_s[r] = now_s() - t0;
    if (r2.anchor) throw Error("rank " + std::to_string(r) + ": version 2 came out as an anchor");
    const std::string j2 = receipt_to_json(r2);
    receipt_bytes[r] = j2.size();
    std::ofstream(o.work + "/v2-" + std::to_string(r) + ".json") << j2;
    for (const auto& x : r2.tensors) v2_changed += x.changed;
    if ((r + 1) % 32 == 0) std::fprintf(stderr, "rank %llu published (%.0f s)\n", (unsigned long long)r, now_s() - t_publish);
  }
  publish_total_s = now_s() - t_publish;

  // 2. Rank 0 commits version 1, then version 2, from the receipts as they arrive over the wire.
  auto commit = [&](uint64_t v, std::optional<uint64_t> latest_anchor, double& parse_s, double& commit_s) {
    std::vector<PartReceipt> receipts;
    receipts.reserve(o.ranks);
    const double t0 = now_s();
    for (uint64_t r = 0; r < o.ranks; ++r) {
      const std::string path = o.work + "/v" + std::to_string(v) + "-" + std::to_string(r) + ".json";
      receipts.push_back(receipt_from_json(read_text(path), path));
    }
    const double t1 = now_s();
    store->act_as("commit v" + std::to_string(v));
    CommitOutcome out = commit_parts(*store, receipts, latest_anchor, *claim.fence);
    parse_s = t1 - t0;
    commit_s = now_s() - t1;
    if (!out.committed) throw Error("commit of version " + std::to_string(v) + " failed: " + out.error);
    return out;
  };
  const CommitOutcome v1 = commit(1, std::nullopt, p1, c1);
  if (!v1.anchor || v1.delta_bytes != 0) throw Error("version 1's outcome differs from the one the ranks concluded with");
  v2 = commit(2, 1, p2, c2);
  }
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
  uint64_t entries = 0;
  for (const auto& p : m->delta_parts) entries += p.placements.size();
  uint64_t per_part_bytes = 0;
  double write_per_part_s = 0, parse_per_part_s = 0;
  if (o.per_part_form) {
    t0 = now_s();
    std::string old_text = protocol::to_json(*m, protocol::PlacementForm::kPerPart);
    write_per_part_s = now_s() - t0;
    per_part_bytes = old_text.size();
    m.reset();  // one parsed manifest at a time
    t0 = now_s();
    m = protocol::manifest_from_json(old_text, "manifest 2 (format 1)");
    parse_per_part_s = now_s() - t0;
    if (protocol::to_json(*m) != text) throw Error("format 1 read back other placements");
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

  // 5. Each receiver rank's needed parts (stand-in planner: parts whose placements overlap the
  // rank's TP/EP positions) and the changes inside its positions (what a ranged fetch must carry).
  std::unordered_map<std::string_view, size_t> index;
  for (size_t t = 0; t < T; ++t) index.emplace(table[t].meta.name, t);
  const double bytes_per_change = double(m->delta_bytes()) / double(m->changed_elements);
  struct ReceiverRank {
    uint64_t parts = 0, part_bytes = 0, changes = 0, pairs = 0;
    double plan_s = 0;
  };
  std::vector<ReceiverRank> rx(o.receiver_tp);
  for (uint64_t q = 0; q < o.receiver_tp; ++q) {
    std::vector<Placement> need(T);
    for (size_t t = 0; t < T; ++t) need[t] = sm::receiver_placement(table[t], o.shape, q, o.receiver_tp);
    t0 = now_s();
    for (const auto& part : m->delta_parts) {
      uint64_t hits = 0;  // every (part, tensor) pair is looked at: what a per-tensor range planner visits
      for (const auto& [name, pl] : part.placements) hits += overlaps(pl, need[index.at(name)]);
      rx[q].pairs += hits;
      if (hits) {
        ++rx[q].parts;
        rx[q].part_bytes += part.object.size;
      }
    }
    rx[q].plan_s = now_s() - t0;
    for (size_t t = 0; t < T; ++t)
      for (uint64_t i = 0; i < need[t].numel(); ++i) rx[q].changes += changed_at(t, need[t].full_position(i), threshold);
  }

  // 6. The table.
  const double delta_bytes = double(v2.delta_bytes);
  std::vector<double> sorted_publish = publish_s;
  std::sort(sorted_publish.begin(), sorted_publish.end());
  auto rank_count = [&](uint64_t r) { return store->count("rank " + std::to_string(r) + " v2"); };
  uint64_t max_req = 0, sum_req = 0;
  for (uint64_t r = 0; r < o.ranks; ++r) {
    max_req = std::max(max_req, rank_count(r).total());
    sum_req += rank_count(r).total();
  }
  const sm::RequestCount commit_req = store->count("commit v2");
  const uint64_t receipts_total = std::accumulate(receipt_bytes.begin(), receipt_bytes.end(), uint64_t{0});
  const uint64_t digest_raw = 8 * T;  // one 64-bit partial per tensor per rank (every rank holds a slice of nearly all)

  std::printf("| measure | value |\n|---|---|\n");
  if (o.manifest_only)
    std::printf("| mode | manifest only: placements of %llu FSDP2 Shard(0) ranks, part sizes 1.236 B x changes (no publish) |\n",
                (unsigned long long)o.ranks);
  std::printf("| tensors / params here / params at full width | %zu / %llu / %llu |\n", T, (unsigned long long)numel,
              (unsigned long long)full_numel);
  std::printf("| model bytes here (bf16) | %s |\n", gb(2.0 * numel).c_str());
  if (!o.manifest_only) {
  std::printf("| changed elements v2 | %llu (%.3f%%) |\n", (unsigned long long)v2.changed_elements, 100.0 * v2.changed_elements / numel);
  std::printf("| delta bytes v2 (all parts) | %s (%.3f B per change; 1-ulp synthetic changes) |\n", gb(delta_bytes).c_str(),
              delta_bytes / v2.changed_elements);
  std::printf("| delta parts / per part (mean) | %zu / %s |\n", m->delta_parts.size(), gb(delta_bytes / m->delta_parts.size()).c_str());
  std::printf("| publish_part v2 per rank: median / max / sum (wall, one core) | %.3f s / %.3f s / %.1f s |\n",
              sorted_publish[sorted_publish.size() / 2], sorted_publish.back(),
              std::accumulate(publish_s.begin(), publish_s.end(), 0.0));
  std::printf("| all ranks, both versions, incl. data generation (wall) | %.1f s |\n", publish_total_s);
  std::printf("| store requests per publisher rank per step (v2; max) | %llu (%llu GET, %llu PUT, %llu HEAD) |\n",
              (unsigned long long)max_req, (unsigned long long)rank_count(1).get, (unsigned long long)rank_count(1).put,
              (unsigned long long)rank_count(1).head);
  std::printf("| store requests of rank 0's commit (v2) | %llu (%llu GET, %llu PUT, %llu HEAD, %llu LIST) |\n",
              (unsigned long long)commit_req.total(), (unsigned long long)commit_req.get, (unsigned long long)commit_req.put, (unsigned long long)commit_req.head,
              (unsigned long long)commit_req.list);
  std::printf("| inter-rank bytes per step: receipt per rank (JSON) | %s (of which digest partials, raw: %s) |\n",
              gb(double(receipts_total) / o.ranks).c_str(), gb(double(digest_raw)).c_str());
  std::printf("| inter-rank bytes per step: gathered at rank 0 / outcome broadcast | %s / %llu B per rank |\n", gb(double(receipts_total)).c_str(),
              (unsigned long long)outcome_bytes);
  std::printf("| gathering the model instead (here / at full width, bf16) | %s / %s |\n", gb(2.0 * numel).c_str(), gb(2.0 * full_numel).c_str());
  std::printf("| rank 0: parse the receipts / commit_parts (v2) | %.2f s / %.2f s |\n", p2, c2);
  std::printf("| rank 0: parse the receipts / commit_parts (v1, anchor) | %.2f s / %.2f s |\n", p1, c1);
  }
  std::printf("| peak RSS after the commits / after the manifest measures | %.2f GB / %.2f GB |\n", rss_after_commit, rss_after_manifest);
  std::printf("| manifest v2 bytes: format 2 (compact, as committed) | %s |\n", gb(double(manifest_bytes)).c_str());
  if (o.per_part_form)
    std::printf("| manifest v2 bytes: format 1 (per-part placements) | %s (%.0fx) |\n", gb(double(per_part_bytes)).c_str(),
                double(per_part_bytes) / manifest_bytes);
  std::printf("| placement entries (parts x tensors held) | %llu |\n", (unsigned long long)entries);
  std::printf("| manifest write / parse, format 2 | %.2f s / %.2f s |\n", write_compact_s, parse_compact_s);
  if (o.per_part_form) std::printf("| manifest write / parse, format 1 | %.2f s / %.2f s |\n", write_per_part_s, parse_per_part_s);
  std::printf("| subscriber plan_catch_up 1 -> 2 (GET + parse manifest 2 + plan) | %.2f s: %s |\n", plan_follow_s,
              plan_follow->describe().c_str());
  std::printf("| subscriber plan_catch_up none -> 2 (manifests cached but 1) | %.2f s: %s |\n", plan_fresh_s,
              plan_fresh ? plan_fresh->describe().c_str() : "none");
  for (uint64_t q = 0; q < o.receiver_tp; ++q)
    std::printf("| receiver rank %llu: parts overlapping (stand-in) / (part, tensor) pairs / their bytes / changes in its positions x B per change / plan time | "
                "%llu / %llu / %s / %s / %.3f s |\n",
                (unsigned long long)q, (unsigned long long)rx[q].parts, (unsigned long long)rx[q].pairs, gb(double(rx[q].part_bytes)).c_str(),
                gb(rx[q].changes * bytes_per_change).c_str(), rx[q].plan_s);
  const sm::RequestCount sub = store->count("subscriber");
  const uint64_t rx_requests = 1 + 1 + rx[0].parts;  // LATEST (conditional) + manifest + one GET per overlapping part
  std::printf("| requests per receiver rank per step, whole-part stand-in | %llu (1 LATEST + 1 manifest + %llu parts) |\n",
              (unsigned long long)rx_requests, (unsigned long long)rx[0].parts);
  std::printf("| store load per step, %llu replicas x %llu ranks (stand-in) | %llu requests, %s of manifests, %s of parts |\n",
              (unsigned long long)o.replicas, (unsigned long long)o.receiver_tp, (unsigned long long)(o.replicas * o.receiver_tp * rx_requests),
              gb(double(o.replicas * o.receiver_tp) * manifest_bytes).c_str(),
              gb(double(o.replicas) * std::accumulate(rx.begin(), rx.end(), 0.0, [](double a, const ReceiverRank& x) { return a + x.part_bytes; }))
                  .c_str());
  std::printf("| subscriber requests while planning | %llu GET, %llu HEAD, %llu LIST |\n", (unsigned long long)sub.get,
              (unsigned long long)sub.head, (unsigned long long)sub.list);
  (void)v2_changed;
  (void)encode_bytes;
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
