// deltasync-realistic: simulates RL fine-tuning (AdamW, fp32 master weights, bf16 published
// weights) on a transformer-shaped model and measures, per step, how many bytes each encoding
// needs per changed element: the interoperable layout, that layout + zstd, a PULSE-style codec,
// and the compact codec, beside the order-0 entropy of the change set. Every compact delta is
// decoded against the previous checkpoint and applied, and the result compared with the new
// checkpoint bit for bit.
//
//   deltasync-realistic [--steps 24] [--lr 1e-6] [--layers 2] [--hidden 1024] ...
//   deltasync-realistic --densities 0.003,0.01,0.05   (picks the LR that gives each density)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sstream>
#include <string>
#include <vector>

#include "baselines.hpp"
#include "codec/compact_codec.hpp"
#include "engine/cpu_engine.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/parse_number.hpp"
#include "sim/training_sim.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  deltasync::sim::ModelShape shape;
  deltasync::sim::AdamW opt;
  int steps = 24;
  uint64_t seed = 42;
  std::vector<double> densities;  // empty: one run at opt.lr
  int calibration_steps = 0;  // 0: as many as measured_steps, so the measured density hits the target
  int measured_steps = 8;  // per density
  uint32_t block_elements = deltasync::compact::kDefaultBlockElements;
  uint32_t compact_version = deltasync::compact::kDefaultFormatVersion;
  uint32_t max_tiles = deltasync::compact::kDefaultMaxTiles;  // 1: the layout without tiles
  int zstd_level = 3;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "deltasync-realistic: %s\n"
               "usage: deltasync-realistic [--steps N] [--lr X] [--noise X] [--weight-decay X] [--seed N]\n"
               "         [--vocab N] [--hidden N] [--intermediate N] [--layers N] [--kv-dim N]\n"
               "         [--densities D1,D2,..] [--calibration-steps N] [--measured-steps N]\n"
               "         [--block-elements N] [--compact-version 1|2] [--max-tiles 1|2|4|8] [--zstd-level N]\n",
               why);
  std::exit(2);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage(("missing value for " + flag).c_str());
    const std::string value = argv[++i];
    const std::string what = "option " + flag;
    // Numbers by core/parse_number.hpp's rules, each range-checked against its field's type.
    auto integer = [&]<class T>(T& field) { field = deltasync::parse_decimal<T>(value, what, deltasync::ErrorKind::kInvalidArgument); };
    auto real = [&](double& field) { field = deltasync::parse_decimal_real(value, what, deltasync::ErrorKind::kInvalidArgument); };
    try {
      if (flag == "--steps") integer(c.steps);
      else if (flag == "--lr") real(c.opt.lr);
      else if (flag == "--noise") real(c.opt.noise_ratio);
      else if (flag == "--weight-decay") real(c.opt.weight_decay);
      else if (flag == "--seed") integer(c.seed);
      else if (flag == "--vocab") integer(c.shape.vocab);
      else if (flag == "--hidden") integer(c.shape.hidden);
      else if (flag == "--intermediate") integer(c.shape.intermediate);
      else if (flag == "--layers") integer(c.shape.layers);
      else if (flag == "--kv-dim") integer(c.shape.kv_heads_dim);
      else if (flag == "--calibration-steps") integer(c.calibration_steps);
      else if (flag == "--measured-steps") integer(c.measured_steps);
      else if (flag == "--block-elements") integer(c.block_elements);
      else if (flag == "--compact-version") integer(c.compact_version);
      else if (flag == "--max-tiles") integer(c.max_tiles);
      else if (flag == "--zstd-level") integer(c.zstd_level);
      else if (flag == "--densities") {
        std::stringstream ss(value);
        std::string item;
        while (std::getline(ss, item, ',')) {
          const double d = deltasync::parse_decimal_real(item, "option --densities", deltasync::ErrorKind::kInvalidArgument);
          if (d <= 0 || d >= 1) usage(("bad density " + item).c_str());
          c.densities.push_back(d);
        }
      } else {
        usage(("unknown flag " + flag).c_str());
      }
    } catch (const deltasync::Error& e) {
      usage(e.what());
    }
  }
  if (c.calibration_steps == 0) c.calibration_steps = c.measured_steps;
  if (c.steps < 1 || c.measured_steps < 1 || c.calibration_steps < 1) usage("step counts must be >= 1");
  return c;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// CPU time of the calling thread: the codec runs single-threaded here, and on a machine shared
// with other jobs the thread's own CPU time is the honest "per core" figure (wall time would
// count the time other processes held the core).
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Single-thread memcpy bandwidth (read + write counted once, as bytes copied per second), the
// yardstick DESIGN.md §9 asks CPU throughput to be set against.
double memcpy_gbps() {
  std::vector<uint8_t> a(256 << 20, 1), b(256 << 20);
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const double t0 = thread_seconds();
    std::memcpy(b.data(), a.data(), a.size());
    best = std::min(best, thread_seconds() - t0);
  }
  return a.size() / best / 1e9;
}

// Sizes and times of one delta (sums, so that several steps can be pooled).
struct Measure {
  uint64_t elements = 0, changed = 0;
  uint64_t interop = 0, interop_zstd = 0, pulse = 0, ours = 0;
  double entropy = 0, entropy_gaps = 0, entropy_values = 0;
  double encode_s = 0, decode_s = 0;
  Measure& operator+=(const Measure& o) {
    elements += o.elements;
    changed += o.changed;
    interop += o.interop;
    interop_zstd += o.interop_zstd;
    pulse += o.pulse;
    ours += o.ours;
    entropy += o.entropy;
    entropy_gaps += o.entropy_gaps;
    entropy_values += o.entropy_values;
    encode_s += o.encode_s;
    decode_s += o.decode_s;
    return *this;
  }
};

// Owns the published copy (encode shadow) and the receiver's copy (patched from compact deltas).
class Pipeline {
 public:
  Pipeline(const deltasync::sim::TrainingSim& sim, const Config& config) : sim_(sim), config_(config) { resync(); }

  // Both copies := the simulator's current weights (after a reset).
  void resync() {
    const auto& meta = sim_.tensors();
    published_.assign(meta.size(), {});
    receiver_.assign(meta.size(), {});
    for (size_t t = 0; t < meta.size(); ++t) {
      published_[t].assign(sim_.bf16(t), sim_.bf16(t) + meta[t].numel());
      receiver_[t] = published_[t];
    }
  }

  // Diffs the simulator against the published copy and measures every encoding. With
  // `full`, also times and checks the compact codec (decode + apply on the receiver).
  Measure measure(bool full) {
    namespace ds = deltasync;
    const auto& meta = sim_.tensors();
    std::vector<ds::EncodeItem> items;
    for (size_t t = 0; t < meta.size(); ++t)
      items.push_back({meta[t].name, sim_.bf16(t), published_[t].data(), meta[t].numel(), 2});
    ds::cpu::encode(items, delta_);
    const ds::DeltaView view = delta_.view();

    Measure m;
    m.elements = sim_.total_elements();
    m.changed = view.total_changed();
    if (!full) return m;
    m.interop = realistic::interop_bytes(meta, view);
    m.interop_zstd = realistic::interop_zstd_bytes(meta, view, config_.zstd_level);
    m.pulse = realistic::pulse_bytes(meta, view);
    const auto bound = realistic::order0_entropy(meta, view);
    m.entropy = bound.total();
    m.entropy_gaps = bound.gap_bytes;
    m.entropy_values = bound.value_bytes;

    // Per-core figures: the codec's own thread only.
    ds::compact::Options options;
    options.block_elements = config_.block_elements;
    options.version = config_.compact_version;
    options.max_tiles = config_.max_tiles;
    options.parallel = false;
    double t0 = thread_seconds();
    const auto encoded = ds::compact::encode(meta, view, options);
    m.encode_s = thread_seconds() - t0;
    for (const auto& e : encoded) m.ours += e.block_index.size() + e.payload.size();

    std::vector<ds::compact::EncodedTensorView> views;
    for (const auto& e : encoded) views.push_back(e.view());
    std::vector<ds::ConstTensorRef> base;
    std::vector<ds::TensorRef> targets;
    for (size_t t = 0; t < meta.size(); ++t) {
      base.push_back({meta[t].name, receiver_[t].data(), meta[t].numel(), 2});
      targets.push_back({meta[t].name, receiver_[t].data(), meta[t].numel(), 2});
    }
    ds::compact::DecodedDelta& decoded = decoded_;  // reused across steps, as a subscriber would
    t0 = thread_seconds();
    ds::compact::decode(views, meta, base, "step", decoded, options);
    m.decode_s = thread_seconds() - t0;
    ds::cpu::apply(targets, decoded.patches(meta));
    for (size_t t = 0; t < meta.size(); ++t) {
      if (receiver_[t] != published_[t]) {
        std::fprintf(stderr, "deltasync-realistic: compact round trip differs in %s\n", meta[t].name.c_str());
        std::exit(1);
      }
    }
    return m;
  }

 private:
  const deltasync::sim::TrainingSim& sim_;
  const Config& config_;
  std::vector<std::vector<uint16_t>> published_, receiver_;
  deltasync::SparseDelta delta_;
  deltasync::compact::DecodedDelta decoded_;
};

void print_header() {
  std::printf(
      "| step | changed | interop B/el | interop+zstd | PULSE-style | **compact** | entropy bound | compact / "
      "entropy | compact / PULSE | encode GB/s/core | decode GB/s/core |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
}

void print_row(const std::string& label, const Measure& m) {
  const double k = static_cast<double>(m.changed);
  if (m.changed == 0) {
    std::printf("| %s | 0 | - | - | - | - | - | - | - | - | - |\n", label.c_str());
    return;
  }
  std::printf("| %s | %.3f%% | %.3f | %.3f | %.3f | **%.3f** | %.3f (gaps %.3f + values %.3f) | %.3f | %.3f | %.2f | %.2f |\n",
              label.c_str(), 100.0 * k / m.elements, m.interop / k, m.interop_zstd / k, m.pulse / k, m.ours / k,
              m.entropy / k, m.entropy_gaps / k, m.entropy_values / k, m.ours / m.entropy,
              static_cast<double>(m.ours) / m.pulse, m.interop / m.encode_s / 1e9, m.interop / m.decode_s / 1e9);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) try {
  const Config config = parse(argc, argv);
  deltasync::sim::TrainingSim sim(config.shape, config.seed);
  Pipeline pipeline(sim, config);

  std::printf("## deltasync-realistic\n\n");
  std::printf("model: %zu bf16 tensors, %.1f M elements (vocab %llu, hidden %llu, intermediate %llu, layers %llu); "
              "AdamW beta1 %.3g beta2 %.4g eps %.0e weight decay %.3g, gradient noise %.1fx signal; "
              "compact blocks of %u changes (compact_version %u, max_tiles %u); interop+zstd at level %d; %u worker threads; single-thread memcpy %.2f GB/s\n\n",
              sim.tensors().size(), sim.total_elements() / 1e6, (unsigned long long)config.shape.vocab,
              (unsigned long long)config.shape.hidden, (unsigned long long)config.shape.intermediate,
              (unsigned long long)config.shape.layers, config.opt.beta1, config.opt.beta2, config.opt.eps,
              config.opt.weight_decay, config.opt.noise_ratio, config.block_elements, config.compact_version, config.max_tiles, config.zstd_level,
              deltasync::worker_count(), memcpy_gbps());
  std::printf("Bytes per changed element (tensor payload; the safetensors header is the same for every layout). "
              "Throughput = interoperable-layout bytes of the delta per second of the codec thread's CPU time (one core; the codec runs single-threaded here).\n\n");

  if (config.densities.empty()) {
    std::printf("lr %.3g, %d steps\n\n", config.opt.lr, config.steps);
    print_header();
    Measure total;
    for (int s = 1; s <= config.steps; ++s) {
      sim.step(config.opt);
      const Measure m = pipeline.measure(true);
      print_row(std::to_string(s), m);
      total += m;
    }
    print_row("all", total);
    return 0;
  }

  // Density sweep: for each target, scale the LR until the first steps change about that share
  // (density is close to proportional to LR while it is small), then measure.
  std::vector<std::pair<double, Measure>> rows;
  double lr = config.opt.lr;
  for (const double target : config.densities) {
    deltasync::sim::AdamW opt = config.opt;
    for (int round = 0; round < 5; ++round) {
      opt.lr = lr;
      sim.reset();
      pipeline.resync();
      uint64_t changed = 0, elements = 0;
      for (int s = 0; s < config.calibration_steps; ++s) {
        sim.step(opt);
        const Measure m = pipeline.measure(false);
        changed += m.changed;
        elements += m.elements;
      }
      const double density = static_cast<double>(changed) / elements;
      std::fprintf(stderr, "target %.4f: lr %.3g gives %.4f\n", target, lr, density);
      if (density > 0 && std::abs(density / target - 1) < 0.03) break;
      lr *= density > 0 ? std::clamp(target / density, 0.2, 5.0) : 5.0;
    }
    opt.lr = lr;
    sim.reset();
    pipeline.resync();
    Measure pooled;
    for (int s = 0; s < config.measured_steps; ++s) {
      sim.step(opt);
      pooled += pipeline.measure(true);
    }
    rows.emplace_back(lr, pooled);
  }
  std::printf("density sweep: %d steps per target after LR calibration; rows pool all steps\n\n", config.measured_steps);
  print_header();
  for (size_t i = 0; i < rows.size(); ++i) {
    char label[64];
    std::snprintf(label, sizeof label, "target %.1f%% (lr %.2g)", 100 * config.densities[i], rows[i].first);
    print_row(label, rows[i].second);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "deltasync-realistic: %s\n", e.what());
  return 1;
}
