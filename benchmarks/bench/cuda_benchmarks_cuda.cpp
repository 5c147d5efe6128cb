// CUDA benchmarks (built only with the CUDA backend) and the GPU's same-run peak (device-to-
// device copy). Plain C++ on the CUDA runtime API: the kernels are the library's, this file only
// drives them. Timing: CUDA events around the measured region on one stream, after a warm-up;
// before every sample a write of twice the L2 size evicts what the previous sample left there,
// so each sample starts cold, as a training step's encode does.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "cuda_buffers.hpp"
#include "cuda_device_fixture.hpp"
#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "format/delta_file.hpp"
#include "core/error.hpp"
#include "format/safetensors.hpp"
#include "host_fixture.hpp"

namespace deltasync::bench {

namespace {

using deltasync::cuda::check;

const std::vector<std::string> kModelAxes{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};
const std::vector<std::string> kDenseAxes{kAxisElements, kAxisDtype, kAxisTensors};

std::string describe_gpu() {
  int device = 0, driver = 0, runtime = 0;
  cudaDeviceProp p{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&p, device) != cudaSuccess) return "unknown GPU";
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s, sm_%d%d, %d SMs, %.0f GiB, L2 %.0f MiB, CUDA driver API %d.%d, runtime %d.%d", p.name, p.major,
                p.minor, p.multiProcessorCount, static_cast<double>(p.totalGlobalMem) / (1 << 30),
                static_cast<double>(p.l2CacheSize) / (1 << 20), driver / 1000, driver % 1000 / 10, runtime / 1000,
                runtime % 1000 / 10);
  return buf;
}

Registration cuda_device(DeviceInfo{"cuda", [] { return deltasync::cuda::device_available(); }, describe_gpu});

// --- peak: device-to-device copy ---------------------------------------------------------

std::vector<Result> measure_d2d(uint64_t bytes, const SamplingPolicy& policy) {
  Gpu& gpu = Gpu::get();
  DeviceBytes src(bytes), dst(bytes);
  check(cudaMemsetAsync(src.data(), 0x5A, bytes, gpu.stream()), "bench: cudaMemset");
  State state("cuda", {}, policy);
  state.declare(0, 2.0 * static_cast<double>(bytes));  // read + written
  state.add_note("buffer", format_bytes(static_cast<double>(bytes)));
  state.measure([&] {
    return gpu.time([&] { check(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, gpu.stream()), "bench: d2d"); });
  });
  return {state.result("d2d_copy")};
}

// A GPU is not shared the way this project's CPUs are: the standalone d2d peak is the
// denominator (no interleaved copies, which would also disturb the L2 between samples).
Registration peak_cuda(PeakProvider{"cuda", {}, measure_d2d, {"d2d_copy"}});

// --- the model on the device ---------------------------------------------------------------

// Downloads a device arena and compares it with the host's current weights.
void expect_current(const DeviceFixture& f, const uint8_t* device_arena, const char* benchmark) {
  AlignedBytes copy = f.host->model.new_arena();
  check(cudaDeviceSynchronize(), "bench: download");  // the timed work ran on a non-blocking stream
  check(cudaMemcpy(copy.data(), device_arena, f.host->model.arena_bytes(), cudaMemcpyDeviceToHost), "bench: download");
  if (!same_weights(f.host->model, copy.data(), f.host->current.data()))
    throw Error(std::string(benchmark) + ": the device weights differ from the expected result");
}

// --- benchmarks ----------------------------------------------------------------------------

void full_copy(State& state) {
  auto f = make_device_fixture(state, 4);
  if (!f) return;
  DeviceBytes receiver(f->host->model.arena_bytes());
  Gpu& gpu = Gpu::get();
  const auto src = f->host->model.const_refs(f->current->data());
  const auto dst = f->host->model.refs(receiver.data());
  const double n = static_cast<double>(f->host->model.total_elements());
  state.declare(n, 2 * n * f->host->model.width());
  state.measure([&] {
    return gpu.time([&] {
      for (size_t t = 0; t < src.size(); ++t)
        check(cudaMemcpyAsync(dst[t].data, src[t].data, src[t].numel * src[t].width, cudaMemcpyDeviceToDevice, gpu.stream()), "bench: copy");
    });
  });
}

Registration full_copy_cuda(Benchmark{"full_copy", "cuda", kDenseAxes, "baseline: device copy of every weight (what a dense sync moves)",
                                      full_copy});

void encode_with(State& state, deltasync::cuda::SelectStrategy select) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  auto f = make_device_fixture(state, 3, k_est * (8 + 2 * state.width()) * 2);
  if (!f) return;
  Gpu& gpu = Gpu::get();
  deltasync::cuda::Encoder encoder(deltasync::cuda::EncoderOptions{select});
  const auto items = f->encode_items();
  const double n = static_cast<double>(f->host->model.total_elements());
  state.declare(n, 2 * n * f->host->model.width());
  bool checked = false;
  state.measure([&] {
    f->reset_shadow(gpu.stream());
    const double s = gpu.time([&] { check(encoder.encode(items, gpu.stream()), "encode"); });
    if (!checked) {
      if (encoder.total_changed() != f->host->changed)
        throw Error("encode: found " + std::to_string(encoder.total_changed()) + " changed elements, the inputs have " +
                    std::to_string(f->host->changed));
      checked = true;
    }
    return s;
  });
  if (state.skipped()) return;
  expect_current(*f, f->shadow->data(), "encode (shadow update)");
  state.add_note("peak_workspace", format_bytes(static_cast<double>(encoder.peak_workspace_bytes())));
}

void encode(State& state) { encode_with(state, deltasync::cuda::SelectStrategy::kTwoPass); }
void encode_single_pass(State& state) { encode_with(state, deltasync::cuda::SelectStrategy::kSinglePass); }

Registration encode_cuda(Benchmark{"encode", "cuda", kModelAxes,
                                   "diff + compaction + shadow update on the device (two-pass select, the default; one host sync)",
                                   encode});
Registration encode_single_pass_cuda(Benchmark{"encode_single_pass", "cuda", kModelAxes,
                                               "the same with the single-pass (decoupled look-back) select",
                                               encode_single_pass});

void stage(State& state) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  auto f = make_device_fixture(state, 3, k_est * (8 + 2 * state.width()) * 2);
  if (!f) return;
  Gpu& gpu = Gpu::get();
  deltasync::cuda::Encoder encoder;
  const auto items = f->encode_items();
  check(encoder.encode(items, gpu.stream()), "encode");
  gpu.sync();
  const double k = static_cast<double>(encoder.total_changed()), w = f->host->model.width();
  const double T = static_cast<double>(items.size());
  state.declare(k, k * (8 + 2 * w) + 2 * (T + 1) * 8);  // indices, values, base values, offsets
  state.compare_with_copy_of(0);  // device -> host: the d2d peak does not bound it
  state.measure([&] { return gpu.time([&] { check(encoder.stage(gpu.stream()), "stage"); }); });
  if (state.skipped()) return;
  if (encoder.staged().total_changed() != f->host->changed) throw Error("stage: staged delta has the wrong number of changes");
  state.add_note("staged", format_bytes(k * (8 + 2 * w)));
}

Registration stage_cuda(Benchmark{"stage", "cuda", kModelAxes, "copy the compacted delta into pinned host memory (reused buffers)", stage});

// Patches on the device: I32 indices and values of every tensor, packed.
struct DevicePatches {
  std::unique_ptr<DeviceBytes> indices, values, base_values;
  std::vector<PatchRef> refs;
  std::vector<const void*> old_bits;
};

DevicePatches upload_patches(const HostFixture& f) {
  const uint32_t w = f.model.width();
  const uint64_t k = f.changed;
  std::vector<int32_t> idx;
  std::vector<uint8_t> vals(k * w), base(k * w);
  idx.reserve(k);
  std::vector<uint64_t> starts;
  for (size_t t = 0; t < f.changes.size(); ++t) {
    starts.push_back(idx.size());
    const uint8_t* cur = f.current.data() + f.model.offset(t);
    const uint8_t* old = f.shadow.data() + f.model.offset(t);
    for (int64_t i : f.changes[t]) {
      std::memcpy(vals.data() + idx.size() * w, cur + static_cast<uint64_t>(i) * w, w);
      std::memcpy(base.data() + idx.size() * w, old + static_cast<uint64_t>(i) * w, w);
      idx.push_back(static_cast<int32_t>(i));
    }
  }
  DevicePatches p;
  p.indices = std::make_unique<DeviceBytes>(k * 4);
  p.values = std::make_unique<DeviceBytes>(k * w);
  p.base_values = std::make_unique<DeviceBytes>(k * w);
  check(cudaMemcpy(p.indices->data(), idx.data(), k * 4, cudaMemcpyHostToDevice), "bench: upload indices");
  check(cudaMemcpy(p.values->data(), vals.data(), k * w, cudaMemcpyHostToDevice), "bench: upload values");
  check(cudaMemcpy(p.base_values->data(), base.data(), k * w, cudaMemcpyHostToDevice), "bench: upload base values");
  check(cudaDeviceSynchronize(), "bench: upload");  // see make_device_fixture
  for (size_t t = 0; t < f.changes.size(); ++t) {
    p.refs.push_back({f.changes[t].size(), p.indices->data() + starts[t] * 4, 4, p.values->data() + starts[t] * w, w});
    p.old_bits.push_back(p.base_values->data() + starts[t] * w);
  }
  return p;
}

void apply(State& state) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  auto f = make_device_fixture(state, 3, k_est * (4 + 2 * state.width()));
  if (!f) return;
  Gpu& gpu = Gpu::get();
  const DevicePatches patches = upload_patches(*f->host);
  const auto targets = f->host->model.refs(f->shadow->data());
  deltasync::cuda::Applier applier;
  const double k = static_cast<double>(f->host->changed), w = f->host->model.width();
  state.declare(k, k * (4 + w) + k * w);
  state.measure([&] { return gpu.time([&] { check(applier.apply(targets, patches.refs, gpu.stream()), "apply"); }); });
  if (state.skipped()) return;
  if (applier.status().bad_tensor >= 0) throw Error("apply: " + deltasync::cuda::describe(applier.status(), targets));
  expect_current(*f, f->shadow->data(), "apply");
}

Registration apply_cuda(Benchmark{"apply", "cuda", kModelAxes, "validate + scatter at I32 indices, one launch for all tensors", apply});

void digest(State& state) {
  auto f = make_device_fixture(state, 3);
  if (!f) return;
  Gpu& gpu = Gpu::get();
  const auto refs = f->host->model.const_refs(f->current->data());
  DeviceBytes out(refs.size() * 8);
  deltasync::cuda::Digester digester;
  const double n = static_cast<double>(f->host->model.total_elements());
  state.declare(n, n * f->host->model.width());
  state.measure([&] {
    return gpu.time([&] { check(digester.digest(refs, reinterpret_cast<uint64_t*>(out.data()), gpu.stream()), "digest"); });
  });
}

Registration digest_cuda(Benchmark{"digest", "cuda", kDenseAxes, "full per-tensor digests of the weights, one launch", digest});

void digest_update(State& state) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  auto f = make_device_fixture(state, 3, k_est * (4 + 2 * state.width()));
  if (!f) return;
  Gpu& gpu = Gpu::get();
  const DevicePatches patches = upload_patches(*f->host);
  const auto targets = f->host->model.const_refs(f->current->data());
  DeviceBytes out(targets.size() * 8);
  deltasync::cuda::Digester digester;
  const double k = static_cast<double>(f->host->changed), w = f->host->model.width();
  state.declare(k, k * (4 + 2 * w));
  state.measure([&] {
    return gpu.time([&] {
      check(digester.shifts(targets, patches.refs, patches.old_bits, reinterpret_cast<uint64_t*>(out.data()), gpu.stream()), "digest shifts");
    });
  });
}

Registration digest_update_cuda(Benchmark{"digest_update", "cuda", kModelAxes, "O(changed) digest shifts after a scatter",
                                          digest_update});

// --- end to end: GPU diff -> pinned host -> file -> GPU apply ------------------------------

void end_to_end(State& state) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  auto f = make_device_fixture(state, 4, k_est * (8 + 2 * state.width()) * 3);
  if (!f) return;
  Gpu& gpu = Gpu::get();
  const HostModel& model = f->host->model;
  DeviceBytes receiver(model.arena_bytes());
  check(cudaMemcpy(receiver.data(), f->base->data(), model.arena_bytes(), cudaMemcpyDeviceToDevice), "bench: receiver");
  check(cudaDeviceSynchronize(), "bench: receiver");  // a device-to-device copy does not wait for itself
  const uint32_t w = model.width();
  DeviceBytes indices(std::max<uint64_t>(f->host->changed, 1) * 8), values(std::max<uint64_t>(f->host->changed, 1) * w);
  // The receiver reads the mapped file's patches into pinned memory (parallel copies), then one
  // upload each for indices and values: a pageable copy straight out of the mapping runs at a
  // fraction of the link's bandwidth.
  PinnedBytes pinned(std::max<uint64_t>(f->host->changed, 1) * (8 + w));
  deltasync::cuda::Encoder encoder;
  deltasync::cuda::Applier applier;
  const auto items = f->encode_items();
  const auto metas = f->host->metas(state.dtype());
  const auto targets = model.refs(receiver.data());
  const std::string path = scratch_path("e2e_cuda.safetensors");
  DeltaInfo info;
  info.model_version = 1;
  info.base_version = 0;
  double file_bytes = 0;
  // Where the step's time goes (last sample): GPU encode + stage to pinned memory, the file
  // write (temp name, fsync, rename), open + parse, upload + apply.
  double phase_ms[4] = {};
  state.measure([&] {
    f->reset_shadow(gpu.stream());
    gpu.sync();
    return time_seconds([&] {
      auto t0 = std::chrono::steady_clock::now();
      const auto lap = [&t0](double& ms) {
        const auto now = std::chrono::steady_clock::now();
        ms = std::chrono::duration<double, std::milli>(now - t0).count();
        t0 = now;
      };
      check(encoder.encode(items, gpu.stream()), "encode");
      check(encoder.stage(gpu.stream()), "stage");
      gpu.sync();
      lap(phase_ms[0]);
      write_trl_delta(path, metas, encoder.staged(), info);
      lap(phase_ms[1]);
      const st::File opened = st::File::open(path);
      const ParsedDelta parsed = parse_trl_delta(opened);
      std::vector<PatchRef> patches = resolve_patches(parsed, metas, path);
      lap(phase_ms[2]);
      // Gather every patch into the pinned buffer (indices, then values), upload both in one
      // copy each, then one scatter for all tensors.
      uint64_t index_bytes = 0, value_bytes = 0;
      for (const PatchRef& p : patches) {
        index_bytes += p.count * p.index_width;
        value_bytes += p.count * p.value_width;
      }
      if (index_bytes + value_bytes > pinned.size()) throw Error("e2e: the delta is larger than the pinned buffer");
      uint8_t* const pinned_indices = pinned.data();
      uint8_t* const pinned_values = pinned.data() + index_bytes;
      uint64_t index_at = 0, value_at = 0;
      for (PatchRef& p : patches) {
        if (p.count == 0) continue;
        const uint64_t ib = p.count * p.index_width, vb = p.count * p.value_width;
        parallel_copy(pinned_indices + index_at, static_cast<const uint8_t*>(p.indices), ib);
        parallel_copy(pinned_values + value_at, static_cast<const uint8_t*>(p.values), vb);
        p.indices = indices.data() + index_at;
        p.values = values.data() + value_at;
        index_at += ib;
        value_at += vb;
      }
      if (index_bytes > 0) {
        check(cudaMemcpyAsync(indices.data(), pinned_indices, index_bytes, cudaMemcpyHostToDevice, gpu.stream()), "upload indices");
        check(cudaMemcpyAsync(values.data(), pinned_values, value_bytes, cudaMemcpyHostToDevice, gpu.stream()), "upload values");
      }
      cuda::apply_checked(applier, targets, patches, gpu.stream());
      lap(phase_ms[3]);
      file_bytes = static_cast<double>(opened.size_bytes());
    });
  });
  std::error_code ec;
  std::filesystem::remove(path, ec);
  if (state.skipped()) return;
  expect_current(*f, receiver.data(), "e2e");
  char phases[160];
  std::snprintf(phases, sizeof phases, "encode+stage %.1f / write %.1f / open+parse %.1f / upload+apply %.1f ms",
                phase_ms[0], phase_ms[1], phase_ms[2], phase_ms[3]);
  state.add_note("phases", phases);
  const double n = static_cast<double>(model.total_elements()), k = static_cast<double>(f->host->changed);
  state.declare(n, 2 * n * w + k * (8 + 2 * w) + 2 * file_bytes + k * (4 + 2.0 * w));
  state.add_note("file", format_bytes(file_bytes));
  state.add_note("peak_workspace", format_bytes(static_cast<double>(encoder.peak_workspace_bytes())));
}

Registration e2e_cuda(Benchmark{"e2e", "cuda", kModelAxes,
                                "one sync step: GPU encode -> pinned host -> delta file -> open + parse -> upload -> GPU apply",
                                end_to_end});

void end_to_end_full(State& state) {
  auto f = make_device_fixture(state, 4);
  if (!f) return;
  Gpu& gpu = Gpu::get();
  const HostModel& model = f->host->model;
  DeviceBytes receiver(model.arena_bytes());
  PinnedBytes staging(model.arena_bytes());
  const auto metas = f->host->metas(state.dtype());
  const auto src = model.const_refs(f->current->data());
  const auto dst = model.refs(receiver.data());
  std::vector<std::span<const uint8_t>> data;
  for (size_t t = 0; t < src.size(); ++t) data.emplace_back(staging.data() + model.offset(t), src[t].numel * src[t].width);
  const std::string path = scratch_path("e2e_full_cuda.safetensors");
  DeltaInfo info;
  info.model_version = 1;
  double file_bytes = 0;
  state.measure([&] {
    return time_seconds([&] {
      check(cudaMemcpyAsync(staging.data(), f->current->data(), model.arena_bytes(), cudaMemcpyDeviceToHost, gpu.stream()), "download");
      gpu.sync();
      write_anchor(path, metas, data, info);
      const st::File opened = st::File::open(path);
      for (size_t t = 0; t < metas.size(); ++t) {
        const auto bytes = opened.bytes(opened.at(metas[t].name));
        check(cudaMemcpyAsync(dst[t].data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, gpu.stream()), "upload");
      }
      gpu.sync();
      file_bytes = static_cast<double>(opened.size_bytes());
    });
  });
  std::error_code ec;
  std::filesystem::remove(path, ec);
  if (state.skipped()) return;
  expect_current(*f, receiver.data(), "e2e_full");
  const double weights = static_cast<double>(model.total_elements()) * model.width();
  state.declare(static_cast<double>(model.total_elements()), 2 * weights + 2 * file_bytes);
  state.add_note("file", format_bytes(file_bytes));
}

Registration e2e_full_cuda(Benchmark{"e2e_full", "cuda", kDenseAxes,
                                     "baseline: the same step shipping the whole weights (D2H, anchor file, H2D)", end_to_end_full});

}  // namespace

}  // namespace deltasync::bench
