// The fixed small model the delta and anchor harnesses apply fuzzed files to, and the valid
// files made from it that seed their corpora (make_seeds.cpp). Both sides build it from the
// same code, so a seed is a delta of exactly the model the harness holds.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "codec/compact_codec.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "engine/cpu_engine.hpp"
#include "engine/host_model.hpp"
#include "engine/integrity.hpp"
#include "format/delta_file.hpp"

namespace deltasync::fuzz {

// The versions every seed delta goes between (what the manifest would say).
inline constexpr uint64_t kBaseVersion = 5;
inline constexpr uint64_t kNextVersion = 6;

// One tensor per weight width (2-byte bf16 and f16, 4-byte f32, 1-byte f8), a 2-D one among
// them, small enough that a fuzzer runs thousands of applies a second.
inline std::vector<TensorMeta> model_meta() {
  return {{"layers.0.attn.w", DType::BF16, {16, 8}},
          {"layers.0.norm", DType::F32, {32}},
          {"embed", DType::F16, {48}},
          {"head.scale", DType::F8_E4M3, {24}}};
}

inline uint64_t next_random(uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return state >> 33;
}

// The base model (version kBaseVersion), deterministic bits, digests computed.
inline HostModel base_model() {
  HostModel m;
  m.tensors = model_meta();
  uint64_t state = 12345;
  for (const auto& t : m.tensors) {
    std::vector<uint8_t> bytes(t.numel() * t.width());
    for (auto& b : bytes) b = static_cast<uint8_t>(next_random(state));
    m.data.push_back(std::move(bytes));
  }
  m.version = kBaseVersion;
  m.compute_digests();
  return m;
}

// The next model: about one element in five changed by a few low bits (an optimizer step), and
// the third tensor not at all (so a delta also has unchanged tensors).
inline HostModel next_model() {
  HostModel m = base_model();
  uint64_t state = 777;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    if (t == 2) continue;
    const uint32_t w = m.tensors[t].width();
    for (uint64_t i = 0; i < m.tensors[t].numel(); ++i)
      if (next_random(state) % 5 == 0) m.data[t][i * w] ^= static_cast<uint8_t>(1 + next_random(state) % 7);
  }
  m.version = kNextVersion;
  m.compute_digests();
  return m;
}

// A delta from base_model() to next_model() in `format`, with base and result digests, as the
// publisher writes it.
// The seed change set: base_model() -> next_model(), with the delta's digests.
struct SeedChanges {
  HostModel base;
  SparseDelta delta;
  DeltaInfo info;
};
inline SeedChanges seed_changes() {
  SeedChanges s{base_model(), {}, {}};
  const HostModel next = next_model();
  std::vector<EncodeItem> items;
  for (size_t t = 0; t < s.base.tensors.size(); ++t)
    items.push_back({s.base.tensors[t].name, next.data[t].data(), s.base.data[t].data(), s.base.tensors[t].numel(),
                     s.base.tensors[t].width()});
  const std::vector<uint64_t> base_digests = base_model().digests;
  cpu::encode(items, s.delta);
  integrity::put_delta_digests(
      s.info, integrity::delta_digests(s.base.tensors, s.delta.view(), base_digests, kNextVersion, kBaseVersion));
  return s;
}

// The compact one without tiles (block index version 1) in container layout 1: the file before
// tiles and the indexed layout existed, kept as a seed so that old files stay covered.
inline std::vector<uint8_t> seed_delta(DeltaFormat format) {
  const SeedChanges s = seed_changes();
  compact::Options untiled;
  untiled.max_tiles = 1;
  untiled.layout = compact::kLayout1;
  return serialize_delta(format, s.base.tensors, s.delta.view(), s.info, untiled);
}

// The same changes as a compact delta written with `options`.
inline std::vector<uint8_t> seed_compact_delta(const compact::Options& options) {
  const SeedChanges s = seed_changes();
  return compact::serialize_compact_delta(s.base.tensors, s.delta.view(), s.info, options);
}
// Options whose compact delta cuts the 2-D tensor into 2 x 2 tiles (blocks of 4 changes: its ~25
// changes make six blocks' worth), so its positions are coded band by band; in container layout
// `layout` (1: the seeds written before the indexed layout, byte for byte).
inline compact::Options tiled_seed_options(uint32_t version, uint32_t layout = compact::kLayout1) {
  compact::Options options;
  options.version = version;
  options.block_elements = 4;
  options.layout = layout;
  return options;
}

// next_model() as a one-part anchor of kNextVersion with its digests, as the publisher writes it.
inline std::vector<uint8_t> seed_anchor() {
  const HostModel next = next_model();
  std::vector<std::span<const uint8_t>> data;
  for (const auto& d : next.data) data.emplace_back(d);
  DeltaInfo info;
  info.model_version = kNextVersion;
  integrity::put_checkpoint_digests(info.extra, integrity::digest_map(next.const_refs()));
  return serialize_anchor(next.tensors, data, info);
}

// FUZZ_VERBOSE=1 in the environment: harnesses say why each input was refused or that it was
// accepted (triage, and a check that the seeds are accepted).
inline void note(const char* what, const char* detail = "") {
  static const bool verbose = std::getenv("FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%s%s%s\n", what, *detail ? ": " : "", detail);
}

// A harness's own check failed: print and abort, so libFuzzer records the input as a crash.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
  std::abort();
}

}  // namespace deltasync::fuzz
