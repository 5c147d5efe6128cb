// The run finder that learns vLLM's index maps: maximal runs of consecutive probe values, with
// values below the first probe (untouched, zero-filled) in no run, in every position relative to
// its 16-element blocks, and in int32 and int64 twins alike.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "sync/probe_runs.hpp"

namespace ds = deltasync;

namespace {

// The definition, one element at a time.
template <class T>
ds::ProbeRuns reference(const std::vector<T>& v, int64_t min_probe) {
  ds::ProbeRuns out;
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t x = static_cast<int64_t>(v[i]);
    if (x < min_probe) continue;
    const bool extends = !out.start.empty() && out.start.back() + out.length.back() == static_cast<int64_t>(i) &&
                         out.first.back() + out.length.back() == x;
    if (extends) {
      ++out.length.back();
    } else {
      out.start.push_back(static_cast<int64_t>(i));
      out.first.push_back(x);
      out.length.push_back(1);
    }
  }
  return out;
}

template <class T>
void expect_same(const std::vector<T>& v, int64_t min_probe) {
  const ds::ProbeRuns got = ds::find_probe_runs(v.data(), v.size(), min_probe);
  const ds::ProbeRuns want = reference(v, min_probe);
  EXPECT_EQ(got.start, want.start);
  EXPECT_EQ(got.first, want.first);
  EXPECT_EQ(got.length, want.length);
}

}  // namespace

TEST(ProbeRuns, ShardedRowsPaddingAndUntouchedStretches) {
  // Two rows of a column shard (probe values 10..19 and 40..49), zeros (padding), untouched (-2).
  std::vector<int32_t> v;
  for (int i = 0; i < 10; ++i) v.push_back(10 + i);
  for (int i = 0; i < 10; ++i) v.push_back(40 + i);
  v.insert(v.end(), 37, 0);
  v.insert(v.end(), 5, -2);
  v.push_back(7);
  const ds::ProbeRuns r = ds::find_probe_runs(v.data(), v.size(), 2);
  EXPECT_EQ(r.start, (std::vector<int64_t>{0, 10, 62}));
  EXPECT_EQ(r.first, (std::vector<int64_t>{10, 40, 7}));
  EXPECT_EQ(r.length, (std::vector<int64_t>{10, 10, 1}));
}

TEST(ProbeRuns, RepeatedValuesAndStepsOtherThanOneBreakRuns) {
  const std::vector<int32_t> v{5, 5, 5, 6, 8, 9, 1, 2, 3};
  const ds::ProbeRuns r = ds::find_probe_runs(v.data(), v.size(), 2);
  EXPECT_EQ(r.start, (std::vector<int64_t>{0, 1, 2, 4, 7}));
  EXPECT_EQ(r.length, (std::vector<int64_t>{1, 1, 2, 2, 2}));
}

TEST(ProbeRuns, BreaksAtEveryOffsetInsideAndAcrossBlocksMatchTheDefinition) {
  for (size_t n : {0, 1, 15, 16, 17, 31, 32, 33, 100, 1000}) {
    for (size_t cut = 0; cut < n; cut += 7) {
      std::vector<int32_t> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(100 + i);
      v[cut] += 3;  // one broken step
      expect_same(v, 2);
      v[cut] = 0;  // one zero inside a run
      expect_same(v, 2);
    }
  }
}

TEST(ProbeRuns, RandomTwinsMatchTheDefinitionInBothWidths) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> wide;
    while (wide.size() < 3000) {
      const int kind = static_cast<int>(rng() % 4);
      const size_t len = 1 + rng() % 70;
      const int64_t base = static_cast<int64_t>(rng() % 100000) + 2;
      for (size_t k = 0; k < len; ++k) wide.push_back(kind == 0 ? 0 : kind == 1 ? -2 : base + static_cast<int64_t>(k));
    }
    std::vector<int32_t> narrow(wide.begin(), wide.end());
    expect_same(wide, 2);
    expect_same(narrow, 2);
  }
}

TEST(ProbeRuns, ValuesNearTheTypeLimitsDoNotOverflow) {
  const std::vector<int32_t> v{INT32_MAX - 1, INT32_MAX, INT32_MIN, INT32_MAX};
  const ds::ProbeRuns r = ds::find_probe_runs(v.data(), v.size(), 2);
  EXPECT_EQ(r.start, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(r.length, (std::vector<int64_t>{2, 1}));
}
