// deltasync-bench: runs the selected benchmarks over the cartesian product of their axes, on
// every selected device this machine has, measures each device's copy peak for the same sizes
// in the same run, adds the torch eager baseline rows, and prints one markdown report.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "core/error.hpp"
#include "host_fixture.hpp"
#include "options.hpp"
#include "report.hpp"
#include "torch_companion.hpp"

namespace deltasync::bench {

namespace {

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// The 1-minute load average: on a shared machine it says how much the numbers can be trusted.
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  return in >> one ? one : "unknown";
}

std::string hostname() {
  char buf[256] = {};
  return ::gethostname(buf, sizeof buf - 1) == 0 ? buf : "unknown";
}

// The commit of the source tree this binary was built from, when git can tell (read-only).
std::string source_commit() {
  const auto root = std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
  const std::string cmd = "git -C '" + root.string() + "' rev-parse --short HEAD 2>/dev/null";
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[128];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    ::pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  if (out.empty()) return "see git log";
  const std::string dirty = "git -C '" + root.string() + "' status --porcelain --untracked-files=no 2>/dev/null | head -c1";
  if (FILE* p = ::popen(dirty.c_str(), "r")) {
    if (std::fgetc(p) != EOF) out += " (with uncommitted changes)";
    ::pclose(p);
  }
  return out;
}

// Cartesian product of the axes a benchmark declares, in declaration order (last axis fastest).
std::vector<std::map<std::string, AxisValue>> states_of(const Benchmark& b, const AxisValues& axes) {
  std::vector<std::map<std::string, AxisValue>> out{{}};
  for (const auto& name : b.axes) {
    std::vector<std::map<std::string, AxisValue>> next;
    for (const auto& partial : out)
      for (const auto& v : axes.at(name)) {
        auto s = partial;
        s[name] = v;
        next.push_back(std::move(s));
      }
    out = std::move(next);
  }
  return out;
}

std::string state_label(const Benchmark& b, const std::map<std::string, AxisValue>& axes) {
  std::string s = b.name + " [" + b.device + "]";
  for (const auto& [k, v] : axes) s += " " + k + "=" + v.text;
  return s;
}

// Same-run peaks, measured once per device and buffer size, on demand.
class Peaks {
 public:
  explicit Peaks(const SamplingPolicy& policy) : policy_(policy) {}

  double gbps(const std::string& device, uint64_t bytes) {
    auto key = std::make_pair(device, bytes);
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    double peak = 0;
    for (const auto& provider : peak_providers()) {
      if (provider.device != device) continue;
      std::vector<Result> measured;
      try {
        measured = provider.measure(bytes, policy_);
      } catch (const std::exception& e) {
        Result r;
        r.benchmark = provider.reference_rows.front();
        r.device = device;
        r.skipped = e.what();
        measured.push_back(r);
      }
      for (const Result& r : measured)
        if (r.skipped.empty() && std::count(provider.reference_rows.begin(), provider.reference_rows.end(), r.benchmark))
          peak = std::max(peak, r.gbps());
      for (Result& r : measured) {
        r.peak_gbps = peak;
        rows_.push_back(std::move(r));
      }
    }
    cache_[key] = peak;
    return peak;
  }
  const std::vector<Result>& rows() const { return rows_; }

 private:
  SamplingPolicy policy_;
  std::map<std::pair<std::string, uint64_t>, double> cache_;
  std::vector<Result> rows_;
};

// Bytes of the buffer a state's utilization is measured against: the weights, unless the
// benchmark named another size.
std::optional<uint64_t> peak_bytes_for(const std::map<std::string, std::string>& axes, std::optional<uint64_t> declared) {
  if (declared) return declared;
  auto e = axes.find(kAxisElements), d = axes.find(kAxisDtype);
  if (e == axes.end() || d == axes.end()) return std::nullopt;
  return static_cast<uint64_t>(axis_text_number(kAxisElements, e->second)) * axis_width(d->second);
}

void list_benchmarks(const Options& o) {
  std::cout << "benchmarks (name [device] axes: summary):\n";
  for (const auto& b : registry()) {
    std::cout << "  " << b.name << " [" << b.device << "]";
    for (const auto& a : b.axes) std::cout << ' ' << a;
    std::cout << ": " << b.summary << "\n";
  }
  std::cout << "axes (current values):\n";
  for (const auto& [name, values] : o.axes) {
    std::cout << "  " << name << "=[";
    for (size_t i = 0; i < values.size(); ++i) std::cout << (i ? "," : "") << values[i].text;
    std::cout << "]\n";
  }
  std::cout << "devices:";
  for (const auto& d : devices()) std::cout << ' ' << d.name << (d.available() ? "" : " (not available here)");
  std::cout << "\n";
}

int run(int argc, char** argv) {
  Options o = parse_options(argc, argv);
  if (o.list) {
    list_benchmarks(o);
    return 0;
  }
  if (!o.scratch_dir.empty()) set_scratch_dir(o.scratch_dir);
  for (const auto& name : o.benchmarks) {
    bool known = false;
    for (const auto& b : registry()) known |= b.name == name;
    if (!known) throw Error("benchmark \"" + name + "\": unknown (see --list)");
  }

  RunContext context;
  context.date = utc_now();
  context.host = hostname();
  context.command = o.command_line;
  context.commit = source_commit();
  const std::string load_at_start = load_average();
  std::set<std::string> usable;
  for (const auto& d : devices()) {
    if (!device_selected(o, d.name)) continue;
    if (d.available()) {
      usable.insert(d.name);
      context.devices.emplace_back(d.name, d.describe());
    } else {
      context.devices.emplace_back(d.name, "not available on this machine: not measured");
    }
  }
  // A device named explicitly (-d cuda) must be measured: an empty table would pass for success.
  if (o.devices != "all")
    for (const char* name : {"cpu", "cuda"}) {
      if (!device_selected(o, name) || usable.count(name)) continue;
      const bool built = std::any_of(devices().begin(), devices().end(), [&](const DeviceInfo& d) { return d.name == name; });
      throw Error(std::string("device ") + name + ": " +
                  (built ? "no usable device on this machine" : "this binary was built without it"));
    }

  Peaks peaks(o.policy);
  std::vector<Result> rows;
  std::vector<CompanionState> companion;
  std::vector<size_t> companion_rows;
  size_t total = 0, done = 0, failed = 0;
  // The reports so far, rewritten after every state: a run stopped by a time limit still leaves
  // the rows it measured (the torch eager rows come at the end).
  const auto save = [&](bool final) {
    std::vector<Result> ready;
    for (size_t i = 0; i < rows.size(); ++i)
      if (final || std::find(companion_rows.begin(), companion_rows.end(), i) == companion_rows.end()) ready.push_back(rows[i]);
    const std::string markdown = markdown_report(context, peaks.rows(), ready);
    if (final) std::cout << markdown;
    if (!o.markdown_path.empty()) write_text_file(o.markdown_path, markdown);
    if (!o.csv_path.empty()) write_text_file(o.csv_path, csv_report(peaks.rows(), ready));
    if (!o.json_path.empty()) write_text_file(o.json_path, json_report(context, peaks.rows(), ready));
  };
  auto selected = [&](const Benchmark& b) {
    return usable.count(b.device) &&
           (o.benchmarks.empty() || std::find(o.benchmarks.begin(), o.benchmarks.end(), b.name) != o.benchmarks.end());
  };
  for (const auto& b : registry())
    if (selected(b)) total += states_of(b, o.axes).size();

  for (const auto& b : registry()) {
    if (!selected(b)) continue;
    for (const auto& axes : states_of(b, o.axes)) {
      ++done;
      if (!b.companion.empty()) {
        companion.push_back({b.name, b.device, axes});
        companion_rows.push_back(rows.size());
        rows.emplace_back();  // filled after the companion ran
        continue;
      }
      std::fprintf(stderr, "[%zu/%zu] %s ...", done, total, state_label(b, axes).c_str());
      std::fflush(stderr);
      State state(b.device, axes, o.policy);
      for (const auto& provider : peak_providers())
        if (provider.device == b.device && provider.interleaved_sampler) state.set_reference(provider.interleaved_sampler);
      // A benchmark skips what this machine cannot hold (State::skip); an exception is a failure
      // (a wrong result, a CUDA error): its row says so and the run exits 1.
      try {
        b.run(state);
      } catch (const std::exception& e) {
        state.skip(std::string("FAILED: ") + e.what());
        ++failed;
      }
      Result r = state.result(b.name);
      if (r.skipped.empty()) {
        // The standalone peak row is measured either way (it is the table of peaks); an
        // interleaved reference, when the device has one, is the fairer denominator.
        if (auto bytes = state.reference_bytes(); bytes && *bytes > 0) {
          const double standalone = peaks.gbps(b.device, *bytes);
          if (!r.peak_interleaved) r.peak_gbps = standalone;
        }
        std::fprintf(stderr, " %s (%d samples)\n", format_seconds(r.median_s).c_str(), r.samples);
      } else {
        std::fprintf(stderr, " skipped: %s\n", r.skipped.c_str());
      }
      rows.push_back(std::move(r));
      save(false);
    }
  }

  if (!companion.empty()) {
    std::vector<Result> merged;
    if (o.torch_python.empty()) {
      merged = skipped_companion_rows(companion, "no --torch-python given");
      context.messages.push_back("torch eager rows not measured: pass --torch-python PATH (or set DELTASYNC_TORCH_PYTHON)");
    } else {
      std::fprintf(stderr, "torch eager baseline: %zu states via %s\n", companion.size(), o.torch_python.c_str());
      std::string message;
      merged = run_torch_companion(o.torch_python, o.torch_script.empty() ? default_torch_script() : o.torch_script, companion,
                                   o.policy, message);
      context.messages.push_back(message);
    }
    for (size_t i = 0; i < merged.size(); ++i) {
      Result& r = merged[i];
      if (r.skipped.empty())
        if (auto bytes = peak_bytes_for(r.axes, std::nullopt)) r.peak_gbps = peaks.gbps(r.device, *bytes);
      rows[companion_rows[i]] = std::move(r);
    }
  }

  context.messages.push_back("load average (1 min) at start " + load_at_start + ", at end " + load_average() + ", on " +
                             std::to_string(std::thread::hardware_concurrency()) + " hardware threads");
  if (failed > 0) context.messages.push_back(std::to_string(failed) + " state(s) FAILED (rows marked FAILED)");
  save(true);
  return failed > 0 ? 1 : 0;
}

}  // namespace

}  // namespace deltasync::bench

int main(int argc, char** argv) {
  try {
    return deltasync::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deltasync-bench: %s\n", e.what());
    return 2;
  }
}
