#include "core/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/parse_number.hpp"

namespace deltasync {

namespace {

thread_local bool t_inside_pool_task = false;

// One job at a time: callers that find the pool busy (another thread's parallel_for, or a
// nested call from inside a task) run their tasks on their own thread instead of waiting, so
// the pool can never deadlock.
class Pool {
 public:
  explicit Pool(unsigned threads) {
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }
  ~Pool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void run(size_t n, const std::function<void(size_t)>& fn) {
    std::unique_lock busy(submit_mutex_, std::try_to_lock);
    if (!busy.owns_lock() || t_inside_pool_task || workers_.empty() || n == 1) {
      run_serial(n, fn);
      return;
    }
    {
      std::lock_guard lock(mutex_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      error_ = nullptr;
      active_ = workers_.size();
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static void run_serial(size_t n, const std::function<void(size_t)>& fn) {
    for (size_t i = 0; i < n; ++i) fn(i);
  }

  void drain() {
    t_inside_pool_task = true;
    for (size_t i; (i = next_.fetch_add(1)) < n_;) {
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_);  // stop handing out work
      }
    }
    t_inside_pool_task = false;
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
      }
      drain();
      std::lock_guard lock(mutex_);
      if (--active_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex submit_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  std::exception_ptr error_;
  size_t active_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

Pool& pool() {
  static Pool instance(worker_count());
  return instance;
}

}  // namespace

unsigned worker_count() {
  static const unsigned count = [] {
    if (const char* env = std::getenv("DELTASYNC_THREADS"); env && *env) {
      const auto v = parse_decimal<unsigned>(env, "DELTASYNC_THREADS", ErrorKind::kInvalidArgument);
      if (v > 0) return v;
    }
    return std::max(1u, std::thread::hardware_concurrency());
  }();
  return count;
}

void parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  pool().run(n, fn);
}

}  // namespace deltasync
