// A small persistent worker pool for the CPU twin. Work is split into independent tasks with
// parallel_for; a call returns when all of its tasks are done. The calling thread works too.
#pragma once
#include <cstddef>
#include <functional>

namespace deltasync {

// Number of threads parallel_for uses (DELTASYNC_THREADS overrides hardware_concurrency; unset,
// empty or 0 keeps it; anything but decimal digits is an Error).
unsigned worker_count();

// Runs fn(i) for i in [0, n) on the pool. Exceptions thrown by fn are rethrown (the first one).
void parallel_for(size_t n, const std::function<void(size_t)>& fn);

}  // namespace deltasync
