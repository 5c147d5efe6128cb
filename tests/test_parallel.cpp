// The CPU twin's worker pool (core/parallel): every index runs exactly once, the first
// exception comes back to the caller and the pool keeps working, and calls from inside a task
// or from several threads at once complete (run on the caller's thread when the pool is busy).
// Its synchronization is what the TSan build (scripts/test --sanitize) checks.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/parallel.hpp"

namespace {

using deltasync::parallel_for;

TEST(Parallel, EveryIndexRunsExactlyOnce) {
  for (size_t n : {1, 2, 7, 1000, 100000}) {
    std::vector<std::atomic<int>> hits(n);
    parallel_for(n, [&](size_t i) { hits[i].fetch_add(1, std::memory_order_relaxed); });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(Parallel, WritesOfTasksAreVisibleToTheCallerAfterwards) {
  std::vector<uint64_t> out(50000, 0);  // plain, non-atomic writes: the pool's join orders them
  for (int round = 0; round < 20; ++round) {
    parallel_for(out.size(), [&](size_t i) { out[i] += i; });
    uint64_t sum = 0;
    for (uint64_t v : out) sum += v;
    ASSERT_EQ(sum, uint64_t(round + 1) * (out.size() * (out.size() - 1) / 2));
  }
}

TEST(Parallel, FirstExceptionIsRethrownAndThePoolStaysUsable) {
  EXPECT_THROW(parallel_for(1000, [](size_t i) {
                 if (i % 100 == 7) throw std::runtime_error("task failed");
               }),
               std::runtime_error);
  std::atomic<size_t> count{0};
  parallel_for(1000, [&](size_t) { count.fetch_add(1); });
  EXPECT_EQ(count.load(), 1000u);
}

TEST(Parallel, NestedAndConcurrentCallsComplete) {
  std::atomic<size_t> inner{0};
  parallel_for(16, [&](size_t) { parallel_for(10, [&](size_t) { inner.fetch_add(1); }); });
  EXPECT_EQ(inner.load(), 160u);

  std::vector<size_t> sums(4, 0);
  std::vector<std::thread> callers;
  for (size_t c = 0; c < sums.size(); ++c)
    callers.emplace_back([&, c] {
      for (int round = 0; round < 20; ++round) {
        std::vector<size_t> part(1000, 0);
        parallel_for(part.size(), [&](size_t i) { part[i] = i; });
        for (size_t v : part) sums[c] += v;
      }
    });
  for (auto& t : callers) t.join();
  for (size_t s : sums) EXPECT_EQ(s, 20u * (999u * 1000u / 2));
}

}  // namespace
