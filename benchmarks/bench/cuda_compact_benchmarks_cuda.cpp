// CUDA benchmarks of the GPU compact codec (kernels/include/deltasync/cuda/compact.hpp), the
// twins of cpu_codec_benchmarks.cpp's compact rows, declared the same way, plus the row the
// issue's target is about: GPU encode + compact (to host bytes) against the plain GPU encode.
// Timing by cuda_buffers.hpp's Gpu, as in cuda_benchmarks_cuda.cpp: CUDA events on one stream
// around the region, with the L2 flushed before every sample.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#include "cuda_buffers.hpp"
#include "cuda_device_fixture.hpp"
#include "codec/compact_codec.hpp"
#include "engine/cpu_engine.hpp"
#include "deltasync/cuda/compact.hpp"
#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/compact_decode.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "core/error.hpp"
#include "host_fixture.hpp"

namespace deltasync::bench {

namespace {

using deltasync::cuda::check;

const std::vector<std::string> kModelAxes{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};

// `changed_bytes_factor`: device bytes per expected change beside the three weight copies
// (delta, scratch, outputs).
std::unique_ptr<DeviceFixture> make_device_model(State& state, double changed_bytes_factor) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  return make_device_fixture(state, 3, k_est * changed_bytes_factor);
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

void compact_encode(State& state) {
  auto m = make_device_model(state, 8 + 2 * state.width() * 2 + 24);
  if (!m) return;
  Gpu& gpu = Gpu::get();
  cuda::Encoder diff;
  check(diff.encode(m->encode_items(), gpu.stream()), "encode");
  const auto metas = m->host->metas(state.dtype());
  const double k = static_cast<double>(diff.total_changed()), w = m->host->model.width();
  state.declare(k, k * (8 + 2 * w));  // positions, new and base bits read (as the CPU row)
  cuda::CompactEncoder encoder;
  std::vector<compact::EncodedTensor> encoded;
  state.measure([&] { return gpu.time([&] { encoded = cuda::encode_compact(encoder, metas, device_view(diff), gpu.stream()); }); });
  if (state.skipped()) return;
  expect_cpu_bytes(encoded, metas, encode_untimed(*m->host, "compact setup"), "compact_encode");
  state.add_note("B/changed", fixed(k > 0 ? encoded_bytes(encoded) / k : 0));
  state.add_note("workspace", format_bytes(static_cast<double>(encoder.workspace_bytes())));
}

Registration compact_encode_cuda(Benchmark{"compact_encode", "cuda", kModelAxes,
                                           "compact codec on the device from cuda::Encoder's output, bytes to host",
                                           compact_encode});

void compact_decode(State& state) {
  auto m = make_device_model(state, 8 + 3 * state.width() + 4);
  if (!m) return;
  Gpu& gpu = Gpu::get();
  const SparseDelta delta = encode_untimed(*m->host, "compact setup");
  const auto metas = m->host->metas(state.dtype());
  const auto encoded = compact::encode(metas, delta.view());
  std::vector<compact::EncodedTensorView> views;
  for (const auto& e : encoded) views.push_back(e.view());
  const auto base = m->host->model.const_refs(m->base->data());
  const double k = static_cast<double>(delta.indices.size()), w = m->host->model.width();
  state.declare(k, encoded_bytes(encoded) + k * (8 + 3 * w));  // as the CPU row
  engine::DeviceCompactDecode decoder;
  state.measure([&] { return gpu.time([&] { decoder.decode(views, metas, base, "bench", gpu.stream()); }); });
  if (state.skipped()) return;
  const cuda::DeviceDecodedDelta& d = decoder.decode(views, metas, base, "bench", gpu.stream());
  std::vector<int64_t> indices(d.offsets.back());
  check(cudaStreamSynchronize(gpu.stream()), "bench: download");
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
  Gpu& gpu = Gpu::get();
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
      encoded = cuda::encode_compact(encoder, metas, device_view(diff), gpu.stream());
    });
    combined.push_back(s);
    return s;
  });
  if (state.skipped()) return;
  expect_cpu_bytes(encoded, metas, encode_untimed(*m->host, "compact setup"), "encode_compact");
  const double plain_s = median_of(plain), combined_s = median_of(combined);
  state.add_note("plain_encode", format_seconds(plain_s));
  state.add_note("x_plain", fixed(plain_s > 0 ? combined_s / plain_s : 0));
}

Registration encode_compact_cuda(Benchmark{"encode_compact", "cuda", kModelAxes,
                                           "GPU encode + compact encode to host bytes, vs the plain GPU encode (x_plain)",
                                           encode_compact});

}  // namespace

}  // namespace deltasync::bench
