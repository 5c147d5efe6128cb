// deltasync-codec-core: compact codec encode/decode throughput per core, compact_version 1 and 2,
// untiled and tiled, in the same run, measured by thread CPU time (CLOCK_THREAD_CPUTIME_ID), so
// that other processes sharing the machine do not count -- what a busy build VM can still measure.
//
// The change set: one BF16 tensor of --elements (default 2^26: a 128 MiB base, 4x the L3 of the
// AMD EPYC this was written on, so the decoder's base gather comes from memory; a CPU whose last
// level cache holds it -- the 260 MB of the Xeon of 2026-12-07 -- needs --elements 268435456 for
// that), seen as a matrix of --cols columns (default
// 1024, a hidden size), --changed share of it changed (default 1%), uniformly placed; 90% of the
// changes are ±1 ulp, 10% random new values (about the value entropy of Adam steps on bf16
// weights). Decode runs against the base in memory. "tiles 1" codes it without tiles (index
// version 1, flat order), "tiles 8" with the writers' default (up to 8 column bands x 8 row
// stripes: the decoder puts the bands back in flat order).
//
// Rows: encode and decode on the calling thread (Options::parallel = false), changes per second
// of thread CPU time, best of --repeats; "unbased" is the decode without a base (what a
// receiver whose base is elsewhere runs: compact_two_phase.hpp); then decode with parallel_for
// over blocks on DELTASYNC_THREADS workers: changes per second of the CPU time of all workers
// (the process's CPU time over the call), as a share of the one-thread figure ("scaling": 1.0
// is linear; wall time is reported but is the shared machine's).
//
// Before the rows, the same core's memory in the same run (what bounds the decode with the base
// in memory): a sequential read of the base (GB/s) and the decoder's base gather alone -- the
// base bits at the change set's positions, ascending, prefetched 64 changes ahead as the decoder
// does (M changes/s: one new cache line per change at 1%).
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/compact_codec.hpp"
#include "core/parallel.hpp"

using namespace deltasync;

namespace {

double clock_seconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Times {
  double thread_cpu = 1e30, process_cpu = 1e30, wall = 1e30;
};

template <class F>
Times best_of(int repeats, F&& f) {
  Times best;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = clock_seconds(CLOCK_THREAD_CPUTIME_ID), p0 = clock_seconds(CLOCK_PROCESS_CPUTIME_ID),
                 w0 = clock_seconds(CLOCK_MONOTONIC);
    f();
    best.thread_cpu = std::min(best.thread_cpu, clock_seconds(CLOCK_THREAD_CPUTIME_ID) - t0);
    best.process_cpu = std::min(best.process_cpu, clock_seconds(CLOCK_PROCESS_CPUTIME_ID) - p0);
    best.wall = std::min(best.wall, clock_seconds(CLOCK_MONOTONIC) - w0);
  }
  return best;
}

double arg(int argc, char** argv, const char* name, double fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atof(argv[i + 1]);
  return fallback;
}

// The same core's memory: sequential read GB/s of the base, and the decoder's gather alone.
void memory_probe(const std::vector<uint16_t>& base, const std::vector<int64_t>& positions, int repeats) {
  volatile uint64_t sink = 0;
  const Times read = best_of(repeats, [&] {
    uint64_t sum = 0;
    const auto* words = reinterpret_cast<const uint64_t*>(base.data());
    for (size_t i = 0; i < base.size() / 4; ++i) sum += words[i];
    sink = sum;
  });
  const Times gather = best_of(repeats, [&] {
    uint64_t sum = 0;
    const size_t n = positions.size();
    for (size_t i = 0; i < n; ++i) {
      if (i + 64 < n) __builtin_prefetch(base.data() + positions[i + 64]);
      sum += base[static_cast<size_t>(positions[i])];
    }
    sink = sum;
  });
  std::printf("one core, same run: sequential read %.1f GB/s; base gather alone (prefetched 64 ahead) %.1f M changes/s\n\n",
              static_cast<double>(base.size()) * 2 / read.thread_cpu / 1e9,
              static_cast<double>(positions.size()) / gather.thread_cpu / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t elements = static_cast<uint64_t>(arg(argc, argv, "--elements", double(uint64_t{1} << 26)));
  const uint64_t cols = static_cast<uint64_t>(arg(argc, argv, "--cols", 1024));
  const double share = arg(argc, argv, "--changed", 0.01);
  const int repeats = static_cast<int>(arg(argc, argv, "--repeats", 5));
  if (cols == 0 || elements % cols != 0) {
    std::fprintf(stderr, "--cols must divide --elements\n");
    return 2;
  }

  std::mt19937_64 rng(42);
  std::vector<uint16_t> base(elements), current;
  for (auto& b : base) {  // bf16 weights of magnitude ~1e-2, random signs
    const uint32_t exponent = 117 + static_cast<uint32_t>(rng() % 6);
    b = static_cast<uint16_t>((rng() & 1) << 15 | exponent << 7 | (rng() & 0x7F));
  }
  current = base;
  const uint64_t step = static_cast<uint64_t>(1.0 / share);
  for (uint64_t i = rng() % step; i < elements; i += 1 + rng() % (2 * step - 1)) {
    uint16_t& c = current[i];
    const uint32_t kind = static_cast<uint32_t>(rng() % 10);
    if (kind == 0) c = static_cast<uint16_t>(rng());
    else c = static_cast<uint16_t>(c + ((kind & 1) ? 1 : -1));  // ±1 ulp in the ordered sense for |x| (sign kept)
    if (c == base[i]) c ^= 1;
  }
  SparseDelta delta;
  delta.offsets = {0};
  delta.value_offsets = {0};
  for (uint64_t i = 0; i < elements; ++i) {
    if (current[i] == base[i]) continue;
    delta.indices.push_back(static_cast<int64_t>(i));
    const auto* n = reinterpret_cast<const uint8_t*>(&current[i]);
    const auto* b = reinterpret_cast<const uint8_t*>(&base[i]);
    delta.values.insert(delta.values.end(), n, n + 2);
    delta.base_values.insert(delta.base_values.end(), b, b + 2);
  }
  delta.offsets.push_back(delta.indices.size());
  delta.value_offsets.push_back(delta.values.size());
  const double changed = static_cast<double>(delta.indices.size());
  const std::vector<TensorMeta> meta{TensorMeta{"w", DType::BF16, {elements / cols, cols}}};
  const std::vector<ConstTensorRef> refs{ConstTensorRef{"w", base.data(), elements, 2}};
  const std::vector<ConstTensorRef> unbased{ConstTensorRef{"w", nullptr, elements, 2}};

  // --profile V / --profile-encode V: only decode (--unbased 1: without the base) or encode
  // version V with --tiles T (default 8), --repeats times (for a profiler).
  const uint32_t profile = static_cast<uint32_t>(arg(argc, argv, "--profile", 0));
  const uint32_t profile_encode = static_cast<uint32_t>(arg(argc, argv, "--profile-encode", 0));
  if (profile != 0 || profile_encode != 0) {
    compact::Options serial;
    serial.parallel = false;
    serial.version = profile != 0 ? profile : profile_encode;
    serial.max_tiles = static_cast<uint32_t>(arg(argc, argv, "--tiles", 8));
    std::vector<compact::EncodedTensor> encoded;
    if (profile_encode != 0) {
      const Times enc = best_of(repeats, [&] { encoded = compact::encode(meta, delta.view(), serial); });
      std::printf("version %u tiles %u encode 1t %.1f M/s\n", serial.version, serial.max_tiles, changed / enc.thread_cpu / 1e6);
      return 0;
    }
    encoded = compact::encode(meta, delta.view(), serial);
    std::vector<compact::EncodedTensorView> views;
    for (const auto& e : encoded) views.push_back(e.view());
    compact::DecodedDelta decoded;
    const bool without_base = arg(argc, argv, "--unbased", 0) != 0;
    const Times dec = best_of(repeats, [&] { compact::decode(views, meta, without_base ? unbased : refs, "bench", decoded, serial); });
    std::printf("version %u tiles %u decode%s 1t %.1f M/s\n", serial.version, serial.max_tiles, without_base ? " unbased" : "",
                changed / dec.thread_cpu / 1e6);
    return 0;
  }
  std::printf("elements=%llu (%llu x %llu) changed=%.0f (%.3f%%) repeats=%d workers=%u\n",
              static_cast<unsigned long long>(elements), static_cast<unsigned long long>(elements / cols),
              static_cast<unsigned long long>(cols), changed, 100.0 * changed / static_cast<double>(elements), repeats,
              worker_count());
  memory_probe(base, delta.indices, repeats);
  std::printf("| version | tiles | B/changed | encode 1t M/s | decode 1t M/s | unbased 1t M/s | decode %ut M/s per core | scaling | decode %ut wall ms |\n",
              worker_count(), worker_count());
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (uint32_t version : {compact::kFormatVersion1, compact::kFormatVersion2}) {
    for (uint32_t max_tiles : {1u, compact::kDefaultMaxTiles}) {
      compact::Options serial;
      serial.parallel = false;
      serial.version = version;
      serial.max_tiles = max_tiles;
      std::vector<compact::EncodedTensor> encoded;
      const Times enc = best_of(repeats, [&] { encoded = compact::encode(meta, delta.view(), serial); });
      double bytes = 0;
      for (const auto& e : encoded) bytes += static_cast<double>(e.block_index.size() + e.payload.size());
      std::vector<compact::EncodedTensorView> views;
      for (const auto& e : encoded) views.push_back(e.view());
      compact::DecodedDelta decoded;
      const Times dec = best_of(repeats, [&] { compact::decode(views, meta, refs, "bench", decoded, serial); });
      if (decoded.storage.indices != delta.indices || decoded.storage.values != delta.values) {
        std::fprintf(stderr, "decoded changes differ (version %u, tiles %u)\n", version, max_tiles);
        return 1;
      }
      const Times bare = best_of(repeats, [&] { compact::decode(views, meta, unbased, "bench", decoded, serial); });
      if (decoded.storage.indices != delta.indices) {
        std::fprintf(stderr, "unbased decode: positions differ (version %u, tiles %u)\n", version, max_tiles);
        return 1;
      }
      compact::Options parallel = serial;
      parallel.parallel = true;
      const Times par = best_of(repeats, [&] { compact::decode(views, meta, refs, "bench", decoded, parallel); });
      const double one = changed / dec.thread_cpu / 1e6, many = changed / par.process_cpu / 1e6;
      std::printf("| %u | %u | %.4f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f |\n", version, max_tiles, bytes / changed,
                  changed / enc.thread_cpu / 1e6, one, changed / bare.thread_cpu / 1e6, many, many / one, par.wall * 1e3);
    }
  }
  return 0;
}
