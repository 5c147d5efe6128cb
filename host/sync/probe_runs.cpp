#include "sync/probe_runs.hpp"

namespace deltasync {
namespace {

constexpr uint64_t kBlock = 16;  // elements tested at once (branch-free, vectorized)

template <class T>
ProbeRuns find(const T* v, uint64_t n, int64_t min_probe) {
  ProbeRuns out;
  uint64_t i = 0;
  while (i < n) {
    // Outside a run: skip whole blocks holding no probe value, then single elements.
    while (i + kBlock <= n) {
      bool any = false;
      for (uint64_t k = 0; k < kBlock; ++k) any |= static_cast<int64_t>(v[i + k]) >= min_probe;
      if (any) break;
      i += kBlock;
    }
    while (i < n && static_cast<int64_t>(v[i]) < min_probe) ++i;
    if (i == n) break;
    // A run starts at i: extend it by whole blocks that continue it exactly, then by elements
    // (64-bit arithmetic: a twin may hold anything a loader wrote, near the type's limits too).
    const uint64_t start = i;
    const int64_t first = static_cast<int64_t>(v[i]);
    ++i;
    while (i + kBlock <= n) {
      const int64_t expect = first + static_cast<int64_t>(i - start);
      bool ok = true;
      for (uint64_t k = 0; k < kBlock; ++k) ok &= static_cast<int64_t>(v[i + k]) == expect + static_cast<int64_t>(k);
      if (!ok) break;
      i += kBlock;
    }
    while (i < n && static_cast<int64_t>(v[i]) == first + static_cast<int64_t>(i - start)) ++i;
    out.start.push_back(static_cast<int64_t>(start));
    out.first.push_back(first);
    out.length.push_back(static_cast<int64_t>(i - start));
  }
  return out;
}

}  // namespace

ProbeRuns find_probe_runs(const int32_t* twin, uint64_t n, int64_t min_probe) { return find(twin, n, min_probe); }
ProbeRuns find_probe_runs(const int64_t* twin, uint64_t n, int64_t min_probe) { return find(twin, n, min_probe); }

}  // namespace deltasync
