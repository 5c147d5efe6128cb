// The benchmark harness: a registry of benchmarks, the axes they sweep, the sampling loop that
// decides when a measurement is good enough, and the result rows every reporter prints.
//
// Modelled on nvbench's vocabulary (benchmark, axis, state, samples, noise) without depending
// on it. A benchmark is a function of one State: it builds its inputs, declares how many
// elements and bytes one run must touch, and hands the harness a callable that performs one
// sample and returns its duration. The harness warms up, repeats until the noise is low enough
// or the per-state time budget is spent, and keeps the median.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace deltasync::bench {

// The axes every benchmark may sweep. A benchmark names the subset it depends on; the states
// it runs are the cartesian product of those axes' values.
inline constexpr const char* kAxisElements = "Elements";
inline constexpr const char* kAxisChangedShare = "ChangedShare";
inline constexpr const char* kAxisDtype = "Dtype";
inline constexpr const char* kAxisTensors = "Tensors";

// One axis value as given on the command line ("2^26", "0.01", "BF16", "model") and parsed.
struct AxisValue {
  std::string text;
  double number = 0;  // numeric axes only
};

using AxisValues = std::map<std::string, std::vector<AxisValue>>;

// Stopping rule for the sampling loop (command line: --min-samples, --max-noise, --timeout).
struct SamplingPolicy {
  int min_samples = 5;
  double max_noise = 0.05;  // relative spread of the samples (see relative_spread)
  double timeout_s = 5.0;   // wall-clock budget per state, inputs' setup excluded
  int max_samples = 1000;
};

// A measured state: one row of the table.
struct Result {
  std::string benchmark;
  std::string device;                      // "cpu" or "cuda"
  std::map<std::string, std::string> axes;  // only the axes the benchmark depends on
  int samples = 0;
  double median_s = 0;
  double noise = 0;  // relative spread (see relative_spread)
  double elements = 0;
  double bytes = 0;
  double peak_gbps = 0;  // same-run copy bandwidth of a buffer of `peak_bytes`; 0 if none
  // peak_gbps comes from copies interleaved with this state's samples: utilization() is then
  // the median of per-pair ratios (see State::set_reference), and peak_gbps the bandwidth that
  // ratio implies.
  bool peak_interleaved = false;
  std::string notes;
  std::string skipped;  // non-empty: not measured, and why

  double elements_per_s() const { return median_s > 0 ? elements / median_s : 0; }
  double gbps() const { return median_s > 0 ? bytes / median_s / 1e9 : 0; }
  double utilization() const { return peak_gbps > 0 ? gbps() / peak_gbps : 0; }
};

class State {
 public:
  State(std::string device, std::map<std::string, AxisValue> axes, const SamplingPolicy& policy);

  const std::string& device() const { return device_; }
  // Axis accessors; they throw if the benchmark did not declare the axis.
  uint64_t elements() const;
  double changed_share() const;
  DType dtype() const;              // from Dtype: "F8" means F8_E4M3 (both fp8 formats diff alike)
  uint32_t width() const;           // F8 -> 1, BF16/F16 -> 2, F32 -> 4
  std::string tensors() const;      // "1", "256", "model"
  const std::string& axis_text(const std::string& axis) const;
  bool has_axis(const std::string& axis) const { return axes_.count(axis) > 0; }

  // What one sample must touch, for the elements/s and GB/s columns.
  void declare(double elements, double bytes) { elements_ = elements, bytes_ = bytes; }
  // Utilization is computed against the same-run copy of a buffer of this many bytes (default:
  // the weights, Elements x width); 0: no utilization (e.g. a host<->device copy, which a
  // device-to-device peak does not bound).
  void compare_with_copy_of(uint64_t bytes) { peak_bytes_ = bytes; }
  void add_note(const std::string& key, const std::string& value);
  // Marks the state as not measured (e.g. the inputs would not fit in memory).
  void skip(const std::string& why) { skipped_ = why; }
  bool skipped() const { return !skipped_.empty(); }

  // Runs one untimed warm-up, then samples until the policy is met. `sample` does any reset
  // it needs, then returns the seconds of its timed region only. With an interleaved reference
  // (see set_reference), one copy of reference_bytes() is timed after every sample.
  void measure(const std::function<double()>& sample);

  // Makes measure() time the device's copy of `bytes` bytes after every sample, so the peak the
  // utilization divides by saw the same machine load as the benchmark (on a shared machine a
  // peak measured minutes apart can be off by 2x). `make_sampler(bytes)` returns a callable
  // timing one copy.
  using SamplerFactory = std::function<std::function<double()>(uint64_t bytes)>;
  void set_reference(SamplerFactory make_sampler) { make_reference_ = std::move(make_sampler); }
  // Bytes of the buffer the utilization is measured against: compare_with_copy_of's, else
  // Elements x width when the state has both axes; nullopt or 0: no utilization.
  std::optional<uint64_t> reference_bytes() const;

  Result result(const std::string& benchmark) const;

 private:
  std::string device_;
  std::map<std::string, AxisValue> axes_;
  SamplingPolicy policy_;
  double elements_ = 0, bytes_ = 0;
  std::optional<uint64_t> peak_bytes_;
  std::vector<double> samples_;
  std::vector<double> reference_samples_;
  uint64_t reference_size_ = 0;
  SamplerFactory make_reference_;
  std::string notes_;
  std::string skipped_;
};

struct Benchmark {
  std::string name;
  std::string device;  // "cpu" or "cuda"
  std::vector<std::string> axes;
  std::string summary;  // one line for --list
  std::function<void(State&)> run;  // empty for companion rows
  // Non-empty: the state is measured by a companion script (e.g. "torch"), not by `run`.
  std::string companion = {};
};

// Same-run peak of a device: copy bandwidth (bytes read + written per second) of one buffer of
// `bytes` bytes. Registered per device; results are cached per size and also reported as rows.
struct PeakProvider {
  std::string device;
  // When set, states of this device interleave one copy with every sample (State::set_reference).
  State::SamplerFactory interleaved_sampler = {};
  std::function<std::vector<Result>(uint64_t bytes, const SamplingPolicy& policy)> measure;
  // The peak is the best bandwidth among these rows (CPU: memcpy on the twin's threads and on
  // one thread; on a busy machine either can be the faster, and the better one is the harder
  // yardstick).
  std::vector<std::string> reference_rows;
};

// A device kind this binary can measure: "cpu" always; "cuda" when built with CUDA. available()
// is asked at run time (a CUDA build on a machine without a GPU measures the CPU only);
// describe() gives the context line for the report (CPU model, GPU name and driver).
struct DeviceInfo {
  std::string name;
  std::function<bool()> available;
  std::function<std::string()> describe;
};

// Benchmarks, peak providers and devices register themselves from static initializers in their
// files, so a CUDA-only file adds its benchmarks by being compiled in.
std::vector<Benchmark>& registry();
std::vector<PeakProvider>& peak_providers();
std::vector<DeviceInfo>& devices();
struct Registration {
  explicit Registration(Benchmark b) { registry().push_back(std::move(b)); }
  explicit Registration(PeakProvider p) { peak_providers().push_back(std::move(p)); }
  explicit Registration(DeviceInfo d) { devices().push_back(std::move(d)); }
};

// Bytes per element of a Dtype axis value ("F8", "BF16", "F32", ...); throws on anything else.
uint32_t axis_width(const std::string& dtype_text);

// Median of a set of samples, and their relative spread: 1.4826 x the median absolute deviation
// over the median. For normally distributed noise that equals the relative standard deviation
// nvbench reports, but one sample stretched by a preemption (common on a shared machine) moves
// it little, so the stopping rule is not held hostage by outliers.
double median_of(std::vector<double> v);
double relative_spread(const std::vector<double>& v);

// Bytes of memory the OS reports as available (MemAvailable), or 0 if unknown.
uint64_t available_host_memory();

// Human-readable formatting shared by reporters and notes.
std::string format_bytes(double bytes);
std::string format_seconds(double s);
std::string format_rate(double per_s);

}  // namespace deltasync::bench
