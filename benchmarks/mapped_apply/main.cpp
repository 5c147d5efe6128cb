// deltasync-mapped-apply: the vLLM receiver's apply (sync/mapped_receiver.hpp) by itself, on the
// Qwen3-0.6B shape, stage by stage -- what benchmarks/vllm_index_map.py measures inside a real
// vLLM worker, without vLLM's start-up, so that a change to the apply path is measured in seconds.
//
// The model: the published (Hugging Face) tensors of Qwen3-0.6B (vocabulary 151936, hidden 1024,
// 28 layers, 16 query / 8 KV heads of 128, intermediate 3072, tied embeddings: 596M bf16
// elements, 310 tensors) and runtime parameters as vLLM lays them out on one rank: q/k/v fused
// into one qkv_proj, gate/up into one gate_up_proj, everything else as published -- 310 runs.
// A Publisher (CPU engine) publishes to a folder store in a temporary folder; a Subscriber
// brings a MappedReceiver (CPU engine) to each version: the anchor, then per --shares share
// --repeats deltas that move that share of every tensor's elements by one ulp (positions drawn
// uniformly). After each delta the runtime parameters are compared with the published weights
// bit for bit (the run fails otherwise).
//
// Rows: per share, the best apply (fetch excluded: the receiver's apply, as SyncReport's
// apply_seconds) and its stages (MappedTimings, seconds), with the changes and the bytes the
// apply moves (positions 8 B + old and new bits 2 B each, per change); and, as the same-run
// yardstick, a memcpy of the changed elements' share of the model (2 B per change, contiguous).
//
//   deltasync-mapped-apply [--shares 0.01,0.15] [--repeats 3] [--layers 28] [--vocab 151936] [--compact-version 1]
//                          [--format compact] [--max-tiles 8]
// DELTASYNC_THREADS sets the worker threads (default: every core).
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/parse_number.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "store/store.hpp"
#include "sync/mapped_receiver.hpp"
#include "sync/publisher.hpp"
#include "sync/subscriber.hpp"

using namespace deltasync;

namespace {

double now_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The published tensors, in named_parameters() order, with the runtime parameter each lands in
// (fused ones share a parameter: `row0` is where the tensor's rows start in it).
struct Published {
  TensorMeta meta;
  std::string param;
  uint64_t row0 = 0;
};

std::vector<Published> qwen3_tensors(uint64_t layers, uint64_t vocab) {
  const uint64_t hidden = 1024, q = 16 * 128, kv = 8 * 128, inter = 3072;
  std::vector<Published> out;
  auto add = [&](std::string name, std::vector<uint64_t> shape, std::string param = "", uint64_t row0 = 0) {
    if (param.empty()) param = name;
    out.push_back({TensorMeta{std::move(name), DType::BF16, std::move(shape)}, std::move(param), row0});
  };
  add("model.embed_tokens.weight", {vocab, hidden});
  for (uint64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {q, hidden}, p + "self_attn.qkv_proj.weight", 0);
    add(p + "self_attn.k_proj.weight", {kv, hidden}, p + "self_attn.qkv_proj.weight", q);
    add(p + "self_attn.v_proj.weight", {kv, hidden}, p + "self_attn.qkv_proj.weight", q + kv);
    add(p + "self_attn.o_proj.weight", {hidden, q});
    add(p + "self_attn.q_norm.weight", {128});
    add(p + "self_attn.k_norm.weight", {128});
    add(p + "mlp.gate_proj.weight", {inter, hidden}, p + "mlp.gate_up_proj.weight", 0);
    add(p + "mlp.up_proj.weight", {inter, hidden}, p + "mlp.gate_up_proj.weight", inter);
    add(p + "mlp.down_proj.weight", {hidden, inter});
    add(p + "input_layernorm.weight", {hidden});
    add(p + "post_attention_layernorm.weight", {hidden});
  }
  add("model.norm.weight", {hidden});
  return out;
}

// Runtime parameters (vLLM's layout) and the map from the published tensors onto them.
struct Runtime {
  std::vector<std::vector<uint16_t>> memory;
  MappedModel model;
};

Runtime runtime_for(const std::vector<Published>& published) {
  Runtime rt;
  std::vector<std::string> names;
  std::vector<uint64_t> rows, cols;
  for (const Published& p : published) {
    auto it = std::find(names.begin(), names.end(), p.param);
    const uint64_t c = p.meta.shape.size() == 2 ? p.meta.shape[1] : 1;
    if (it == names.end()) {
      names.push_back(p.param);
      rows.push_back(0);
      cols.push_back(c);
      it = names.end() - 1;
    }
    const size_t k = static_cast<size_t>(it - names.begin());
    rows[k] = std::max(rows[k], p.row0 + p.meta.numel() / c);
  }
  for (size_t k = 0; k < names.size(); ++k) {
    rt.memory.emplace_back(rows[k] * cols[k], 0);
    const std::vector<uint64_t> shape = cols[k] == 1 ? std::vector<uint64_t>{rows[k]} : std::vector<uint64_t>{rows[k], cols[k]};
    rt.model.params_meta.push_back(TensorMeta{names[k], DType::BF16, shape});
  }
  for (size_t k = 0; k < names.size(); ++k)
    rt.model.params.push_back(TensorRef{rt.model.params_meta[k].name, rt.memory[k].data(), rt.memory[k].size(), 2});
  for (size_t t = 0; t < published.size(); ++t) {
    const Published& p = published[t];
    rt.model.hf.push_back(p.meta);
    const auto k = static_cast<uint32_t>(std::find(names.begin(), names.end(), p.param) - names.begin());
    const auto n = static_cast<int64_t>(p.meta.numel());
    rt.model.runs.push_back(MappedRuns{static_cast<uint32_t>(t), k, {0}, {n}, {static_cast<int64_t>(p.row0 * cols[k])}});
    rt.model.owned.push_back(OwnedRanges{static_cast<uint32_t>(t), {0}, {n}});
  }
  return rt;
}

std::vector<double> parse_list(const std::string& text) {
  std::vector<double> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    out.push_back(parse_decimal_real(text.substr(at, comma - at), "--shares"));
    at = comma + 1;
  }
  return out;
}

// Moves about `share` of every tensor's elements by one ulp, up or down; returns the changes.
uint64_t bump(std::vector<std::vector<uint16_t>>& weights, double share, std::mt19937_64& rng) {
  std::geometric_distribution<uint64_t> gap(share);
  uint64_t changed = 0;
  for (auto& w : weights)
    for (uint64_t at = gap(rng); at < w.size(); at += 1 + gap(rng)) {
      w[at] = static_cast<uint16_t>(w[at] + ((rng() & 1) ? 1 : -1));
      ++changed;
    }
  return changed;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<double> shares{0.01, 0.15};
  int repeats = 3;
  uint64_t layers = 28, vocab = 151936;
  PublisherOptions options;
  options.anchor_every = 0;
  options.anchor_share = 1e9;  // deltas only after the first anchor
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--shares") shares = parse_list(value);
    else if (flag == "--repeats") repeats = static_cast<int>(parse_decimal(value, 1000, "--repeats"));
    else if (flag == "--layers") layers = parse_decimal(value, 1000, "--layers");
    else if (flag == "--vocab") vocab = parse_decimal(value, uint64_t{1} << 24, "--vocab");
    else if (flag == "--compact-version") options.compact_version = static_cast<uint32_t>(parse_decimal(value, 2, "--compact-version"));
    else if (flag == "--format") options.delta_format = value;
    else if (flag == "--max-tiles") options.compact_max_tiles = static_cast<uint32_t>(parse_decimal(value, 8, "--max-tiles"));
    else throw BadInputError("unknown flag " + flag);
  }

  const std::vector<Published> published = qwen3_tensors(layers, vocab);
  std::vector<TensorMeta> meta;
  uint64_t elements = 0;
  for (const Published& p : published) {
    meta.push_back(p.meta);
    elements += p.meta.numel();
  }
  // The trainer's weights: random bf16 of a weight's magnitudes (|w| ~ 0.02).
  std::vector<std::vector<uint16_t>> weights(published.size());
  std::mt19937_64 rng(7);
  for (size_t t = 0; t < published.size(); ++t) {
    weights[t].resize(published[t].meta.numel());
    for (auto& w : weights[t]) w = static_cast<uint16_t>(0x3c00 + (rng() & 0x3ff) + ((rng() & 1) << 15));
  }
  std::vector<ConstTensorRef> current;
  for (size_t t = 0; t < published.size(); ++t)
    current.push_back(ConstTensorRef{meta[t].name, weights[t].data(), weights[t].size(), 2});

  const std::filesystem::path folder = std::filesystem::temp_directory_path() / ("deltasync-mapped-apply-" + std::to_string(getpid()));
  std::filesystem::create_directories(folder);
  struct Cleanup {
    std::filesystem::path p;
    ~Cleanup() { std::filesystem::remove_all(p); }
  } cleanup{folder};
  std::shared_ptr<Store> store = open_store("file://" + folder.string());

  Runtime rt = runtime_for(published);
  const std::vector<MappedRuns> receiver_runs = rt.model.runs;
  engine::CpuSyncEngine receiver_engine;
  MappedReceiver receiver(std::move(rt.model), receiver_engine, nullptr);
  Publisher publisher(store, meta, options);
  Subscriber subscriber(*store);

  std::printf("# deltasync-mapped-apply: Qwen3-0.6B shape (vocabulary %llu, %llu layers, %llu bf16 elements, %zu tensors, %llu runs), "
              "%u threads, delta format %s, compact_version %u, compact_max_tiles %u\n\n",
              static_cast<unsigned long long>(vocab), static_cast<unsigned long long>(layers), static_cast<unsigned long long>(elements), published.size(),
              static_cast<unsigned long long>(receiver.map_runs()), worker_count(), options.delta_format.c_str(),
              options.compact_version, options.compact_max_tiles);
  uint64_t version = 0;
  publisher.publish(version, current);
  publisher.flush();
  const SyncReport anchor = subscriber.sync(receiver);
  std::printf("anchor: %.3f s (fetch %.3f s)\n\n", anchor.total_seconds, anchor.fetch_seconds);

  // Where each published tensor sits in the runtime parameters, to check them after each delta.
  std::vector<std::pair<const uint16_t*, uint64_t>> placed;
  for (const MappedRuns& r : receiver_runs) placed.emplace_back(rt.memory[r.param].data() + r.rt_start[0], r.length[0]);
  auto runtime_holds_weights = [&] {
    for (size_t t = 0; t < weights.size(); ++t)
      if (std::memcmp(placed[t].first, weights[t].data(), weights[t].size() * 2) != 0) return false;
    return true;
  };
  if (!runtime_holds_weights()) throw Error("the anchor did not land where the map says");

  std::printf("| share | changes | apply s | parse | map | gather | pack | scatter | digest | apply bytes GB/s | memcpy GB/s (same bytes) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const double share : shares) {
    SyncReport best;
    MappedTimings best_stages;
    double best_apply = 1e30;
    for (int r = 0; r < repeats; ++r) {
      const uint64_t changed = bump(weights, share, rng);
      publisher.publish(++version, current);
      publisher.flush();
      receiver.reset_timings();
      const SyncReport report = subscriber.sync(receiver);
      if (report.deltas != std::vector<uint64_t>{version} || report.changed_elements != changed)
        throw Error("version " + std::to_string(version) + " was not applied as one delta of " + std::to_string(changed) + " changes");
      if (!runtime_holds_weights()) throw Error("version " + std::to_string(version) + ": the runtime parameters differ from the published weights");
      if (report.apply_seconds < best_apply) {
        best_apply = report.apply_seconds;
        best = report;
        best_stages = receiver.timings();
      }
    }
    // Same-run yardstick: memcpy of the bytes the apply moves (12 B per change: position, old and new bits).
    const uint64_t bytes = best.changed_elements * 12;
    std::vector<uint8_t> from(bytes, 1), to(bytes, 0);
    double copy = 1e30;
    for (int r = 0; r < 3; ++r) {
      const double t0 = now_seconds();
      std::memcpy(to.data(), from.data(), bytes);
      copy = std::min(copy, now_seconds() - t0);
    }
    const MappedTimings& s = best_stages;
    std::printf("| %.2f | %llu | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %.2f |\n", share,
                static_cast<unsigned long long>(best.changed_elements), best_apply, s.parse, s.map, s.gather, s.pack, s.scatter,
                s.digest, static_cast<double>(bytes) / best_apply / 1e9, static_cast<double>(bytes) / copy / 1e9);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "deltasync-mapped-apply: %s\n", e.what());
  return 1;
}
