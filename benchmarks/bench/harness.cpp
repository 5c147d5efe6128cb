#include "harness.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace deltasync::bench {

std::vector<Benchmark>& registry() {
  static std::vector<Benchmark> benchmarks;
  return benchmarks;
}

std::vector<PeakProvider>& peak_providers() {
  static std::vector<PeakProvider> providers;
  return providers;
}

std::vector<DeviceInfo>& devices() {
  static std::vector<DeviceInfo> list;
  return list;
}

State::State(std::string device, std::map<std::string, AxisValue> axes, const SamplingPolicy& policy)
    : device_(std::move(device)), axes_(std::move(axes)), policy_(policy) {}

const std::string& State::axis_text(const std::string& axis) const {
  auto it = axes_.find(axis);
  if (it == axes_.end()) throw Error("benchmark uses axis " + axis + " without declaring it");
  return it->second.text;
}

uint64_t State::elements() const {
  axis_text(kAxisElements);
  return static_cast<uint64_t>(axes_.at(kAxisElements).number);
}

double State::changed_share() const {
  axis_text(kAxisChangedShare);
  return axes_.at(kAxisChangedShare).number;
}

// Short names are accepted on the command line ("F8" is F8_E4M3: both fp8 formats diff alike).
static DType parse_weight_dtype(const std::string& text) {
  std::string upper = text;
  std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
  if (upper == "F8" || upper == "FP8") return DType::F8_E4M3;
  if (upper == "FP16") return DType::F16;
  if (upper == "FP32") return DType::F32;
  auto t = dtype_from_name(upper);
  if (!t || !is_weight_dtype(*t)) throw Error("axis Dtype: " + text + " is not one of F8, BF16, F16, F32");
  return *t;
}

uint32_t axis_width(const std::string& dtype_text) { return dtype_width(parse_weight_dtype(dtype_text)); }

DType State::dtype() const { return parse_weight_dtype(axis_text(kAxisDtype)); }

uint32_t State::width() const { return dtype_width(dtype()); }

std::string State::tensors() const { return axis_text(kAxisTensors); }

void State::add_note(const std::string& key, const std::string& value) {
  if (!notes_.empty()) notes_ += ' ';
  notes_ += key + '=' + value;
}

std::optional<uint64_t> State::reference_bytes() const {
  if (peak_bytes_) return peak_bytes_;
  if (!has_axis(kAxisElements) || !has_axis(kAxisDtype)) return std::nullopt;
  return elements() * width();
}

void State::measure(const std::function<double()>& sample) {
  if (skipped()) return;
  std::function<double()> reference;
  if (make_reference_)
    if (auto bytes = reference_bytes(); bytes && *bytes > 0) reference = make_reference_(*bytes), reference_size_ = *bytes;
  sample();  // warm-up: first-touch faults, pool start, allocator growth, cache state
  if (reference) reference();
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  samples_.clear();
  reference_samples_.clear();
  for (;;) {
    samples_.push_back(sample());
    if (reference) reference_samples_.push_back(reference());
    const int n = static_cast<int>(samples_.size());
    if (n >= policy_.max_samples) break;
    if (elapsed() >= policy_.timeout_s && n >= 1) break;
    if (n >= policy_.min_samples && relative_spread(samples_) <= policy_.max_noise) break;
  }
}

Result State::result(const std::string& benchmark) const {
  Result r;
  r.benchmark = benchmark;
  r.device = device_;
  for (const auto& [name, value] : axes_) r.axes[name] = value.text;
  r.samples = static_cast<int>(samples_.size());
  r.median_s = median_of(samples_);
  r.noise = relative_spread(samples_);
  r.elements = elements_;
  r.bytes = bytes_;
  r.notes = notes_;
  r.skipped = skipped_;
  if (!reference_samples_.empty() && r.skipped.empty() && r.median_s > 0 && r.bytes > 0) {
    // Utilization is the median over sample pairs of (this sample's bandwidth / the copy's just
    // after it): each pair saw nearly the same machine load. peak_gbps is set so that
    // Result::utilization() returns that median.
    std::vector<double> ratios;
    for (size_t i = 0; i < samples_.size() && i < reference_samples_.size(); ++i)
      ratios.push_back((r.bytes / samples_[i]) / (2.0 * static_cast<double>(reference_size_) / reference_samples_[i]));
    r.peak_gbps = r.gbps() / median_of(ratios);
    r.peak_interleaved = true;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f", r.peak_gbps);
    r.notes += std::string(r.notes.empty() ? "" : " ") + "copy=" + buf + "GB/s";
  }
  return r;
}

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double relative_spread(const std::vector<double>& v) {
  if (v.size() < 2) return 0;
  const double m = median_of(v);
  std::vector<double> deviations;
  deviations.reserve(v.size());
  for (double x : v) deviations.push_back(std::fabs(x - m));
  return m > 0 ? 1.4826 * median_of(std::move(deviations)) / m : 0;
}

uint64_t available_host_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

static std::string with_unit(double v, const char* const* units, int n_units, double step) {
  int u = 0;
  while (u + 1 < n_units && std::fabs(v) >= step) v /= step, ++u;
  char buf[64];
  std::snprintf(buf, sizeof buf, v >= 100 ? "%.0f %s" : v >= 10 ? "%.1f %s" : "%.2f %s", v, units[u]);
  std::string s = buf;
  while (!s.empty() && s.back() == ' ') s.pop_back();  // unit-less rates
  return s;
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  return with_unit(bytes, units, 5, 1024);
}

std::string format_seconds(double s) {
  char buf[64];
  if (s >= 1) std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.3f us", s * 1e6);
  return buf;
}

std::string format_rate(double per_s) {
  static const char* units[] = {"", "K", "M", "G", "T"};
  return with_unit(per_s, units, 5, 1000);
}

}  // namespace deltasync::bench
