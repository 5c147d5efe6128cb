// CPU-twin benchmarks and the CPU's same-run peak (memcpy).
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include "engine/cpu_engine.hpp"
#include "format/delta_file.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "format/safetensors.hpp"
#include "host_fixture.hpp"

namespace deltasync::bench {

namespace {

const std::vector<std::string> kModelAxes{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};
const std::vector<std::string> kDenseAxes{kAxisElements, kAxisDtype, kAxisTensors};

std::string describe_cpu() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  return model + ", " + std::to_string(std::thread::hardware_concurrency()) + " hardware threads, CPU twin uses " +
         std::to_string(worker_count()) + " threads";
}

Registration cpu_device(DeviceInfo{"cpu", [] { return true; }, describe_cpu});

// --- peak: memcpy of one buffer, multithreaded as the CPU twin is, and on one thread -------

std::vector<Result> measure_memcpy(uint64_t bytes, const SamplingPolicy& policy) {
  AlignedBytes src = allocate_aligned(bytes), dst = allocate_aligned(bytes);
  fill_random({src.data(), src.size}, 0xC0FFEE);
  std::vector<Result> rows;
  const std::string buffer = format_bytes(static_cast<double>(bytes));
  for (bool multi : {true, false}) {
    State state("cpu", {}, policy);
    state.declare(0, 2.0 * static_cast<double>(bytes));  // read + written
    state.add_note("buffer", buffer);
    state.add_note("threads", std::to_string(multi ? worker_count() : 1));
    state.measure([&] {
      return time_seconds([&] {
        if (multi) parallel_copy(dst.data(), src.data(), bytes);
        else std::memcpy(dst.data(), src.data(), bytes);
      });
    });
    rows.push_back(state.result(multi ? "memcpy" : "memcpy_1t"));
  }
  return rows;
}

// One multithreaded memcpy of `bytes`, timed; buffers live as long as the returned callable.
std::function<double()> memcpy_sampler(uint64_t bytes) {
  auto src = std::make_shared<AlignedBytes>(allocate_aligned(bytes));
  auto dst = std::make_shared<AlignedBytes>(allocate_aligned(bytes));
  fill_random({src->data(), src->size}, 0xC0FFEE);
  parallel_copy(dst->data(), src->data(), bytes);  // first touch outside any timing
  return [src, dst, bytes] { return time_seconds([&] { parallel_copy(dst->data(), src->data(), bytes); }); };
}

Registration peak_cpu(PeakProvider{"cpu", memcpy_sampler, measure_memcpy, {"memcpy", "memcpy_1t"}});

// --- full copy of the weights: what a dense sync moves in memory ---------------------------

void full_copy(State& state) {
  auto f = make_host_fixture(state, 3);
  if (!f) return;
  AlignedBytes receiver = f->model.new_arena();
  const uint64_t bytes = f->model.total_elements() * f->model.width();
  state.declare(static_cast<double>(f->model.total_elements()), 2.0 * static_cast<double>(bytes));
  const auto src = f->model.const_refs(f->current.data());
  const auto dst = f->model.refs(receiver.data());
  state.measure([&] {
    return time_seconds([&] {
      for (size_t t = 0; t < src.size(); ++t)
        parallel_copy(static_cast<uint8_t*>(dst[t].data), static_cast<const uint8_t*>(src[t].data), src[t].numel * src[t].width);
    });
  });
}

Registration full_copy_cpu(Benchmark{"full_copy", "cpu", kDenseAxes,
                                     "baseline: copy every weight into a second buffer (what a dense sync moves)", full_copy});

// --- diff scan: the floor under encode -----------------------------------------------------

// Reads both buffers in 64-byte blocks (eight 64-bit XORs OR-ed together, which compilers
// vectorize) and counts the blocks that differ, on the CPU twin's pool, with no output: what any
// encode must at least do. encode's time over this row's time is what finding the changed
// elements inside differing blocks, compaction and the shadow update add.
void diff_scan(State& state) {
  auto f = make_host_fixture(state, 2);
  if (!f) return;
  const double n = static_cast<double>(f->model.total_elements());
  state.declare(n, 2.0 * n * f->model.width());
  const uint64_t blocks = f->model.arena_bytes() / 64;  // arenas are whole 64-byte lines
  constexpr uint64_t kChunkBlocks = uint64_t{1} << 15;   // 2 MiB per task, as the twin splits work
  const size_t tasks = (blocks + kChunkBlocks - 1) / kChunkBlocks;
  std::vector<uint64_t> differing(tasks);
  const auto* a = f->current.data();
  const auto* b = f->shadow.data();
  state.measure([&] {
    return time_seconds([&] {
      parallel_for(tasks, [&](size_t t) {
        uint64_t count = 0;
        const uint64_t end = std::min(blocks, (t + 1) * kChunkBlocks);
        for (uint64_t k = t * kChunkBlocks; k < end; ++k) {
          uint64_t diff = 0;
          for (int w = 0; w < 8; ++w) {
            uint64_t x, y;
            std::memcpy(&x, a + 64 * k + 8 * w, 8);
            std::memcpy(&y, b + 64 * k + 8 * w, 8);
            diff |= x ^ y;
          }
          count += diff != 0;
        }
        differing[t] = count;
      });
    });
  });
  uint64_t total = 0;
  for (uint64_t d : differing) total += d;
  if (f->changed > 0 && total == 0) throw Error("diff_scan: found no differing words in changed inputs");
}

Registration diff_scan_cpu(Benchmark{"diff_scan", "cpu", kModelAxes,
                                     "floor: word-at-a-time compare of both buffers, no output (what encode must at least read)",
                                     diff_scan});

// --- encode: diff + compaction + shadow update ---------------------------------------------

void encode(State& state) {
  auto f = make_host_fixture(state, 2, state.changed_share() * static_cast<double>(state.elements()) * (8 + 2 * state.width()));
  if (!f) return;
  const double n = static_cast<double>(f->model.total_elements());
  state.declare(n, 2.0 * n * f->model.width());  // floor: both buffers read once
  const auto items = f->encode_items();
  SparseDelta delta;
  bool checked = false;
  state.measure([&] {
    if (!delta.offsets.empty()) restore_shadow(*f, delta);
    const double s = time_seconds([&] { cpu::encode(items, delta); });
    if (!checked) expect_changed(*f, delta, "encode"), checked = true;
    return s;
  });
}

Registration encode_cpu(Benchmark{"encode", "cpu", kModelAxes,
                                  "diff current vs shadow bitwise, compact changed positions + values, update the shadow", encode});

// --- apply: scatter values at I32 indices (the file layout) --------------------------------

struct PatchSet {
  std::vector<std::vector<int32_t>> indices;
  std::vector<std::vector<uint8_t>> values;
  std::vector<PatchRef> refs;
};

PatchSet make_patches(const HostFixture& f) {
  PatchSet p;
  const uint32_t w = f.model.width();
  for (size_t t = 0; t < f.changes.size(); ++t) {
    const auto& c = f.changes[t];
    if (f.model.shapes()[t].numel > uint64_t{INT32_MAX}) throw Error("apply: tensor larger than I32 indices allow");
    p.indices.emplace_back(c.begin(), c.end());
    std::vector<uint8_t> v(c.size() * w);
    const uint8_t* cur = f.current.data() + f.model.offset(t);
    for (size_t j = 0; j < c.size(); ++j) std::memcpy(v.data() + j * w, cur + static_cast<uint64_t>(c[j]) * w, w);
    p.values.push_back(std::move(v));
  }
  for (size_t t = 0; t < f.changes.size(); ++t)
    p.refs.push_back({p.indices[t].size(), p.indices[t].data(), 4, p.values[t].data(), w});
  return p;
}

void apply(State& state) {
  auto f = make_host_fixture(state, 2, state.changed_share() * static_cast<double>(state.elements()) * (4 + state.width()));
  if (!f) return;
  const PatchSet patches = make_patches(*f);
  const auto targets = f->model.refs(f->shadow.data());
  const double k = static_cast<double>(f->changed), w = f->model.width();
  state.declare(k, k * (4 + w) + k * w);  // indices + values in, k elements written
  // Patching the shadow turns it into current; applying again writes the same bits, so every
  // sample does the same work without a reset.
  state.measure([&] { return time_seconds([&] { cpu::apply(targets, patches.refs); }); });
  if (!same_weights(f->model, f->shadow.data(), f->current.data()))
    throw Error("apply: result differs from the weights the patches came from");
}

Registration apply_cpu(Benchmark{"apply", "cpu", kModelAxes, "validate + scatter changed values at I32 indices into the weights", apply});

// --- delta files: write (serialize) and read (parse) ---------------------------------------

struct ScratchFile {
  std::string path;
  explicit ScratchFile(const std::string& name) : path(scratch_path(name)) {}
  ~ScratchFile() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

void serialize(State& state) {
  auto f = make_host_fixture(state, 2, state.changed_share() * static_cast<double>(state.elements()) * 40);
  if (!f) return;
  const SparseDelta delta = encode_untimed(*f, "delta file setup");
  const auto metas = f->metas(state.dtype());
  ScratchFile file("serialize.safetensors");
  DeltaInfo info;
  info.model_version = 1;
  info.base_version = 0;
  write_trl_delta(file.path, metas, delta.view(), info);
  const double file_bytes = static_cast<double>(std::filesystem::file_size(file.path));
  state.declare(static_cast<double>(f->changed), file_bytes);
  state.compare_with_copy_of(static_cast<uint64_t>(file_bytes));
  state.add_note("file", format_bytes(file_bytes));
  state.measure([&] { return time_seconds([&] { write_trl_delta(file.path, metas, delta.view(), info); }); });
}

Registration serialize_cpu(Benchmark{"serialize", "cpu", kModelAxes,
                                     "write a delta file (TRL layout, I32 indices; temp file, fsync, rename)", serialize});

void parse(State& state) {
  auto f = make_host_fixture(state, 2, state.changed_share() * static_cast<double>(state.elements()) * 40);
  if (!f) return;
  const SparseDelta delta = encode_untimed(*f, "delta file setup");
  const auto metas = f->metas(state.dtype());
  ScratchFile file("parse.safetensors");
  DeltaInfo info;
  info.model_version = 1;
  write_trl_delta(file.path, metas, delta.view(), info);
  const double file_bytes = static_cast<double>(std::filesystem::file_size(file.path));
  // Parsing maps the file and checks the header and layout; the data are read by apply.
  state.declare(static_cast<double>(f->changed), 0);
  state.add_note("file", format_bytes(file_bytes));
  state.measure([&] {
    return time_seconds([&] {
      const st::File opened = st::File::open(file.path);
      const ParsedDelta parsed = parse_trl_delta(opened);
      const auto patches = resolve_patches(parsed, metas, file.path);
      if (patches.size() != metas.size()) throw Error("parse: resolved patches for the wrong number of tensors");
    });
  });
}

Registration parse_cpu(Benchmark{"parse", "cpu", kModelAxes, "open (mmap) a delta file, check its layout, match it to the model", parse});

// --- end to end: encode -> file -> apply ---------------------------------------------------

void end_to_end(State& state) {
  auto f = make_host_fixture(state, 3, state.changed_share() * static_cast<double>(state.elements()) * 40);
  if (!f) return;
  AlignedBytes receiver = f->model.new_arena();
  std::memcpy(receiver.data(), f->shadow.data(), f->model.arena_bytes());  // the receiver holds the base
  const auto items = f->encode_items();
  const auto metas = f->metas(state.dtype());
  const auto targets = f->model.refs(receiver.data());
  ScratchFile file("e2e.safetensors");
  DeltaInfo info;
  info.model_version = 1;
  info.base_version = 0;
  SparseDelta delta;
  const double n = static_cast<double>(f->model.total_elements()), w = f->model.width(), k = static_cast<double>(f->changed);
  double file_bytes = 0;
  state.measure([&] {
    if (!delta.offsets.empty()) restore_shadow(*f, delta);
    return time_seconds([&] {
      cpu::encode(items, delta);
      write_trl_delta(file.path, metas, delta.view(), info);
      const st::File opened = st::File::open(file.path);
      const ParsedDelta parsed = parse_trl_delta(opened);
      const auto patches = resolve_patches(parsed, metas, file.path);
      cpu::apply(targets, patches);
      file_bytes = static_cast<double>(opened.size_bytes());
    });
  });
  if (state.skipped()) return;
  if (!same_weights(f->model, receiver.data(), f->current.data()))
    throw Error("e2e: the receiver's weights differ from the sender's after apply");
  // Encode floor + file written and read back + indices/values in and elements written.
  state.declare(n, 2 * n * w + 2 * file_bytes + k * (4 + 2 * w));
  state.add_note("file", format_bytes(file_bytes));
}

Registration e2e_cpu(Benchmark{"e2e", "cpu", kModelAxes,
                               "one sync step: encode -> write delta file -> open + parse -> apply to a second copy", end_to_end});

void end_to_end_full(State& state) {
  auto f = make_host_fixture(state, 3);
  if (!f) return;
  AlignedBytes receiver = f->model.new_arena();
  const auto metas = f->metas(state.dtype());
  const auto src = f->model.const_refs(f->current.data());
  std::vector<std::span<const uint8_t>> data;
  for (const auto& r : src) data.emplace_back(static_cast<const uint8_t*>(r.data), r.numel * r.width);
  const auto targets = f->model.refs(receiver.data());
  ScratchFile file("e2e_full.safetensors");
  DeltaInfo info;
  info.model_version = 1;
  double file_bytes = 0;
  state.measure([&] {
    return time_seconds([&] {
      write_anchor(file.path, metas, data, info);
      const st::File opened = st::File::open(file.path);
      for (size_t t = 0; t < metas.size(); ++t) {
        const auto bytes = opened.bytes(opened.at(metas[t].name));
        parallel_copy(static_cast<uint8_t*>(targets[t].data), bytes.data(), bytes.size());
      }
      file_bytes = static_cast<double>(opened.size_bytes());
    });
  });
  if (state.skipped()) return;
  if (!same_weights(f->model, receiver.data(), f->current.data()))
    throw Error("e2e_full: the receiver's weights differ from the sender's");
  const double weights = static_cast<double>(f->model.total_elements()) * f->model.width();
  state.declare(static_cast<double>(f->model.total_elements()), 2 * weights + 2 * file_bytes);
  state.add_note("file", format_bytes(file_bytes));
}

Registration e2e_full_cpu(Benchmark{"e2e_full", "cpu", kDenseAxes,
                                    "baseline: the same step shipping the whole weights (anchor file) instead of a delta",
                                    end_to_end_full});

}  // namespace

}  // namespace deltasync::bench
