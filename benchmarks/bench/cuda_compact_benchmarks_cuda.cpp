// CUDA benchmarks of the GPU compact codec (kernels/include/deltasync/cuda/compact.hpp), the
// twins of cpu_codec_benchmarks.cpp's compact rows, declared the same way, plus the row the
// issue's target is about: GPU encode + compact (to host bytes) against the plain GPU encode.
// Timing as in cuda_benchmarks_cuda.cpp: CUDA events on one stream around the region, with the
// L2 flushed before every sample.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#include "deltasync/compact_codec.hpp"
#include "deltasync/cpu_engine.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/engine.hpp"
#include "deltasync/error.hpp"
#include "host_fixture.hpp"

namespace deltasync::bench {

namespace {

using deltasync::cuda::check;

const std::vector<std::string> kModelAxes{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};

class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) : size_(bytes) { check(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), "bench: cudaMalloc"); }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_;
};

// Stream, events and L2-flush buffer of this file's benchmarks.
class CompactGpu {
 public:
  static CompactGpu& get() {
    static CompactGpu gpu;
    return gpu;
  }
  cudaStream_t stream() const { return stream_; }
  template <class Fn>
  double time(Fn&& region) {
    check(cudaMemsetAsync(flush_->data(), 0, flush_->size(), stream_), "bench: L2 flush");
    check(cudaEventRecord(begin_, stream_), "bench: cudaEventRecord");
    region();
    check(cudaEventRecord(end_, stream_), "bench: cudaEventRecord");
    check(cudaEventSynchronize(end_), "bench: cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, begin_, end_), "bench: cudaEventElapsedTime");
    return ms / 1e3;
  }

 private:
  CompactGpu() {
    int device = 0, l2 = 0;
    check(cudaGetDevice(&device), "bench: cudaGetDevice");
    check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "bench: L2 size");
    flush_ = std::make_unique<DeviceBytes>(std::max<size_t>(2 * static_cast<size_t>(l2), size_t{1} << 20));
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "bench: cudaStreamCreate");
    check(cudaEventCreate(&begin_), "bench: cudaEventCreate");
    check(cudaEventCreate(&end_), "bench: cudaEventCreate");
  }
  std::unique_ptr<DeviceBytes> flush_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
};

bool fits_on_device(State& state, double bytes) {
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "bench: cudaMemGetInfo");
  if (bytes <= 0.9 * static_cast<double>(free)) return true;
  state.skip("needs ~" + format_bytes(bytes) + " of device memory, " + format_bytes(static_cast<double>(free)) + " free");
  return false;
}

// The fixture's weights on the device (current, shadow, and the shadow's pristine copy).
struct DeviceModel {
  std::unique_ptr<HostFixture> host;
  std::unique_ptr<DeviceBytes> current, shadow, base;
  std::vector<EncodeItem> encode_items() const { return host->model.encode_items(current->data(), shadow->data()); }
  void reset_shadow(cudaStream_t s) const {
    check(cudaMemcpyAsync(shadow->data(), base->data(), base->size(), cudaMemcpyDeviceToDevice, s), "bench: reset shadow");
  }
};

// `changed_bytes_factor`: device bytes per expected change beside the three weight copies
// (delta, scratch, outputs).
std::unique_ptr<DeviceModel> make_device_model(State& state, double changed_bytes_factor) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  auto host = make_host_fixture(state, 2);
  if (!host) return nullptr;
  const size_t bytes = host->model.arena_bytes();
  if (!fits_on_device(state, 3.0 * static_cast<double>(bytes) + k_est * changed_bytes_factor)) return nullptr;
  auto m = std::make_unique<DeviceModel>();
  m->current = std::make_unique<DeviceBytes>(bytes);
  m->shadow = std::make_unique<DeviceBytes>(bytes);
  m->base = std::make_unique<DeviceBytes>(bytes);
  check(cudaMemcpy(m->current->data(), host->current.data(), bytes, cudaMemcpyHostToDevice), "bench: upload");
  check(cudaMemcpy(m->base->data(), host->shadow.data(), bytes, cudaMemcpyHostToDevice), "bench: upload");
  check(cudaMemcpy(m->shadow->data(), host->shadow.data(), bytes, cudaMemcpyHostToDevice), "bench: upload");
  m->host = std::move(host);
  return m;
}

cuda::DeviceDeltaView device_view(const cuda::Encoder& e) {
  return {e.num_tensors(),    e.device_offsets(), e.device_value_offsets(),
          e.device_indices(), e.device_values(),  e.device_base_values()};
}

double encoded_bytes(const std::vector<compact::EncodedTensor>& encoded) {
  double bytes = 0;
  for (const auto& e : encoded) bytes += static_cast<double>(e.block_index.size() + e.payload.size());
  return bytes;
}

std::string fixed(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

// The GPU bytes must be the CPU codec's bytes (a benchmark of a wrong result is worthless).
void expect_cpu_bytes(const std::vector<compact::EncodedTensor>& gpu, std::span<const TensorMeta> metas,
                      const SparseDelta& delta, const char* benchmark) {
  const auto cpu = compact::encode(metas, delta.view());
  bool same = gpu.size() == cpu.size();
  for (size_t i = 0; same && i < cpu.size(); ++i)
    same = gpu[i].block_index == cpu[i].block_index && gpu[i].payload == cpu[i].payload;
  if (!same) throw Error(std::string(benchmark) + ": GPU compact bytes differ from the CPU codec's");
}

SparseDelta cpu_delta(HostFixture& f) {
  SparseDelta delta;
  const auto items = f.encode_items();
  cpu::encode(items, delta);
  expect_changed(f, delta, "compact setup");
  restore_shadow(f, delta);
  return delta;
}

void compact_encode(State& state) {
  auto m = make_device_model(state, 8 + 2 * state.width() * 2 + 24);
  if (!m) return;
  CompactGpu& gpu = CompactGpu::get();
  cuda::Encoder diff;
  check(diff.encode(m->encode_items(), gpu.stream()), "encode");
  const auto metas = m->host->metas(state.dtype());
  const double k = static_cast<double>(diff.total_changed()), w = m->host->model.width();
  state.declare(k, k * (8 + 2 * w));  // positions, new and base bits read (as the CPU row)
  cuda::CompactEncoder encoder;
  std::vector<compact::EncodedTensor> encoded;
  state.measure([&] { return gpu.time([&] { encoded = encoder.encode(metas, device_view(diff), gpu.stream()); }); });
  if (state.skipped()) return;
  expect_cpu_bytes(encoded, metas, cpu_delta(*m->host), "compact_encode");
  state.add_note("B/changed", fixed(k > 0 ? encoded_bytes(encoded) / k : 0));
  state.add_note("workspace", format_bytes(static_cast<double>(encoder.workspace_bytes())));
}

Registration compact_encode_cuda(Benchmark{"compact_encode", "cuda", kModelAxes,
                                           "compact codec on the device from cuda::Encoder's output, bytes to host",
                                           compact_encode});

void compact_decode(State& state) {
  auto m = make_device_model(state, 8 + 3 * state.width() + 4);
  if (!m) return;
  CompactGpu& gpu = CompactGpu::get();
  const SparseDelta delta = cpu_delta(*m->host);
  const auto metas = m->host->metas(state.dtype());
  const auto encoded = compact::encode(metas, delta.view());
  std::vector<compact::EncodedTensorView> views;
  for (const auto& e : encoded) views.push_back({e.name, e.block_index, e.payload});
  const auto base = m->host->model.const_refs(m->base->data());
  const double k = static_cast<double>(delta.indices.size()), w = m->host->model.width();
  state.declare(k, encoded_bytes(encoded) + k * (8 + 3 * w));  // as the CPU row
  cuda::CompactDecoder decoder;
  state.measure([&] { return gpu.time([&] { decoder.decode(views, metas, base, "bench", gpu.stream()); }); });
  if (state.skipped()) return;
  const cuda::DeviceDecodedDelta& d = decoder.decode(views, metas, base, "bench", gpu.stream());
  std::vector<int64_t> indices(d.offsets.back());
  check(cudaMemcpy(indices.data(), d.indices, indices.size() * sizeof(int64_t), cudaMemcpyDeviceToHost), "bench: download");
  if (indices != delta.indices) throw Error("compact_decode: decoded positions differ from the encoded ones");
  state.add_note("B/changed", fixed(k > 0 ? encoded_bytes(encoded) / k : 0));
}

Registration compact_decode_cuda(Benchmark{"compact_decode", "cuda", kModelAxes,
                                           "compact decode on the device (host-validated index, device blocks + gather)",
                                           compact_decode});

// The target row: diff + compaction + compact encode to host bytes, with the plain
// encode of the same model timed beside it (note "plain_encode" and the ratio).
void encode_compact(State& state) {
  auto m = make_device_model(state, 8 + 2 * state.width() * 2 + 24);
  if (!m) return;
  CompactGpu& gpu = CompactGpu::get();
  const auto items = m->encode_items();
  const auto metas = m->host->metas(state.dtype());
  const double n = static_cast<double>(m->host->model.total_elements());
  state.declare(n, 2 * n * m->host->model.width());  // as the plain encode row
  cuda::Encoder diff;
  cuda::CompactEncoder encoder;
  std::vector<double> plain;
  for (int i = 0; i < 7; ++i) {
    m->reset_shadow(gpu.stream());
    plain.push_back(gpu.time([&] { check(diff.encode(items, gpu.stream()), "encode"); }));
  }
  std::vector<double> combined;
  std::vector<compact::EncodedTensor> encoded;
  state.measure([&] {
    m->reset_shadow(gpu.stream());
    const double s = gpu.time([&] {
      check(diff.encode(items, gpu.stream()), "encode");
      encoded = encoder.encode(metas, device_view(diff), gpu.stream());
    });
    combined.push_back(s);
    return s;
  });
  if (state.skipped()) return;
  expect_cpu_bytes(encoded, metas, cpu_delta(*m->host), "encode_compact");
  const double plain_s = median_of(plain), combined_s = median_of(combined);
  state.add_note("plain_encode", format_seconds(plain_s));
  state.add_note("x_plain", fixed(plain_s > 0 ? combined_s / plain_s : 0));
}

Registration encode_compact_cuda(Benchmark{"encode_compact", "cuda", kModelAxes,
                                           "GPU encode + compact encode to host bytes, vs the plain GPU encode (x_plain)",
                                           encode_compact});

}  // namespace

}  // namespace deltasync::bench
