#include "progress.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>

#include "checkpoint.hpp"

namespace deltasync::cli {
namespace {
std::atomic<bool> drawn{false};
std::mutex draw_mutex;
}  // namespace

ProgressFn terminal_progress(const std::string& label, bool quiet) {
  if (quiet || !::isatty(STDERR_FILENO)) return {};
  auto last = std::make_shared<std::chrono::steady_clock::time_point>();
  return [label, last](uint64_t done, uint64_t total) {
    std::lock_guard<std::mutex> lock(draw_mutex);
    auto now = std::chrono::steady_clock::now();
    if (done < total && now - *last < std::chrono::milliseconds(200)) return;
    *last = now;
    const int width = 30;
    int filled = total ? static_cast<int>(width * double(done) / double(total)) : width;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, ' ');
    std::fprintf(stderr, "\r%s [%s] %3d%%  %s / %s", label.c_str(), bar.c_str(), total ? int(100.0 * done / total) : 100,
                 human_bytes(double(done)).c_str(), human_bytes(double(total)).c_str());
    std::fflush(stderr);
    drawn = true;
  };
}

void finish_progress() {
  if (drawn.exchange(false)) std::fprintf(stderr, "\n");
}

}  // namespace deltasync::cli
