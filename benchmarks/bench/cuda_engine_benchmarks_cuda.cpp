// CUDA benchmarks of the sync engine (engine::CudaSyncEngine), the calls the Publisher and the
// Subscriber make per version:
//   engine_encode_coded   trainer-visible time of encode with want_coded: diff against the
//                         device shadow, compact coding on the device, coded bytes + digest
//                         shifts to pinned host memory (the call returns with them staged)
//   engine_apply_compact  subscriber pause of a compact delta: upload, decode on the device,
//                         verified apply (base and result digests checked)
// Each against the same-run device copy of the weights (the harness's interleaved peak), with the
// engine's own counts of host waits and host<->device bytes per changed element as notes. The
// Qwen3-0.6B shape is Elements=596049920 Tensors=model (310 tensors); a 7B shape is
// Elements=7e9 Tensors=model.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>

#include "codec/compact_codec.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "cuda_buffers.hpp"
#include "cuda_device_fixture.hpp"
#include "engine/cpu_engine.hpp"
#include "engine/cuda/cuda_calls.hpp"
#include "engine/cuda/cuda_sync_engine.hpp"
#include "engine/integrity.hpp"
#include "host_fixture.hpp"

namespace deltasync::bench {

namespace {

using deltasync::cuda::check;

const std::vector<std::string> kModelAxes{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};

std::string two_decimals(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

void add_transfer_notes(State& state, const engine::TransferCounters& t, double changed) {
  state.add_note("host_syncs", std::to_string(t.host_syncs));
  state.add_note("d2h_B/changed", two_decimals(changed > 0 ? static_cast<double>(t.device_to_host_bytes) / changed : 0));
  state.add_note("h2d_B/changed", two_decimals(changed > 0 ? static_cast<double>(t.host_to_device_bytes) / changed : 0));
}

// The engine's shadow takes one more copy of the weights; the encoder's and the compact coder's
// outputs and scratch are a few dozen bytes per change.
void engine_encode_coded(State& state) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  auto m = make_device_fixture(state, 4, k_est * (8 + 4 * state.width() + 64));
  if (!m) return;
  Gpu& gpu = Gpu::get();
  const HostModel& model = m->host->model;
  const auto base = model.const_refs(m->base->data());        // version 1
  const auto current = model.const_refs(m->current->data());  // version 2: ChangedShare differs
  engine::CudaSyncEngine engine;
  engine.set_stream(gpu.stream());
  engine::EncodeRequest request;
  request.want_coded = true;

  // Untimed check first: the coded bytes are the CPU codec's for the CPU twin's change set.
  engine.reset_shadow(base);
  engine::StagedDelta staged;
  engine.encode(current, request, staged);
  const SparseDelta delta = encode_untimed(*m->host, "engine_encode_coded setup");
  const auto expected = compact::encode(m->host->metas(state.dtype()), delta.view(), request.compact);
  bool same = expected.size() == staged.coded.size();
  for (size_t i = 0; same && i < expected.size(); ++i)
    same = expected[i].block_index == staged.coded[i].block_index && expected[i].payload == staged.coded[i].payload;
  if (!same) throw Error("engine_encode_coded: device-coded bytes differ from the CPU codec's");

  // Every sample is a real publish step: the shadow holds version 2 after the check, so the
  // samples alternate encoding version 1 and version 2, each differing from the shadow at the
  // same ChangedShare.
  const double n = static_cast<double>(model.total_elements()), k = static_cast<double>(delta.indices.size());
  state.declare(n, 2 * n * model.width());  // floor: read the weights and the shadow once
  bool next_is_base = true;
  state.measure([&] {
    const auto& input = next_is_base ? base : current;
    next_is_base = !next_is_base;
    return gpu.time([&] { engine.encode(input, request, staged); });
  });
  if (state.skipped()) return;
  double coded = 0;
  for (const auto& e : staged.coded) coded += static_cast<double>(e.block_index.size() + e.payload.size());
  state.add_note("coded_B/changed", two_decimals(k > 0 ? coded / k : 0));
  add_transfer_notes(state, staged.transfer, k);
}

Registration engine_encode_coded_cuda(Benchmark{
    "engine_encode_coded", "cuda", kModelAxes,
    "CudaSyncEngine::encode with want_coded: diff + device compact coding + coded bytes to pinned host (trainer-visible)",
    engine_encode_coded});

// A compact delta file from `from` to `to` (host bits of the fixture), with its digests.
std::vector<uint8_t> compact_delta_file(const HostModel& model, DType dtype, const uint8_t* from, const uint8_t* to,
                                        uint64_t version, SparseDelta& delta) {
  auto from_copy = model.new_arena();
  std::memcpy(from_copy.data(), from, model.arena_bytes());
  auto items = model.encode_items(to, from_copy.data());
  cpu::encode(items, delta);
  std::vector<TensorMeta> metas;
  for (const auto& s : model.shapes()) metas.push_back({s.name, dtype, {s.numel}});
  const auto base_digests = digest_tensors(model.const_refs(from));
  const integrity::DeltaDigests digests = integrity::delta_digests(metas, delta.view(), base_digests, version, version - 1);
  DeltaInfo info;
  integrity::put_delta_digests(info, digests);
  return serialize_delta(DeltaFormat::Compact, metas, delta.view(), info);
}

void engine_apply_compact(State& state) {
  const double k_est = state.changed_share() * static_cast<double>(state.elements());
  auto m = make_device_fixture(state, 3, k_est * (8 + 4 * state.width() + 64));
  if (!m) return;
  Gpu& gpu = Gpu::get();
  const HostModel& model = m->host->model;
  std::vector<TensorMeta> metas;
  for (const auto& s : model.shapes()) metas.push_back({s.name, state.dtype(), {s.numel}});
  // Forward (shadow bits -> current bits) and back, so that samples alternate real deltas on
  // the same device weights (which start at the shadow's bits, m->base).
  SparseDelta forward_delta, back_delta;
  const st::File forward = st::File::from_bytes(
      compact_delta_file(model, state.dtype(), m->host->shadow.data(), m->host->current.data(), 2, forward_delta), "forward");
  const st::File back = st::File::from_bytes(
      compact_delta_file(model, state.dtype(), m->host->current.data(), m->host->shadow.data(), 3, back_delta), "back");
  const auto targets = model.refs(m->base->data());
  std::vector<uint64_t> digests = digest_tensors(model.const_refs(m->host->shadow.data()));
  engine::CudaSyncEngine engine;
  engine.set_stream(gpu.stream());

  const double k = static_cast<double>(forward_delta.indices.size()), w = model.width();
  const double coded = static_cast<double>(forward.size_bytes());
  state.declare(k, coded + k * (8 + 3 * w));  // the coded delta in; positions, base and new bits
  engine::TransferCounters last;
  bool next_is_forward = true;
  state.measure([&] {
    const st::File& file = next_is_forward ? forward : back;
    const engine::DeltaToApply delta{&file, next_is_forward ? 2u : 3u, next_is_forward ? 2u - 1 : 3u - 1};
    next_is_forward = !next_is_forward;
    last = {};
    // The receiver's version is left unknown: the alternation breaks the chain of versions, the
    // digests still check every base and result.
    return gpu.time([&] { engine.apply(delta, metas, targets, digests, std::nullopt, last); });
  });
  if (state.skipped()) return;
  // The weights end at one of the two states, bit for bit.
  const auto device_digests = engine.digests(model.const_refs(m->base->data()));
  if (device_digests != digests) throw Error("engine_apply_compact: device weights disagree with the tracked digests");
  state.add_note("coded_B/changed", two_decimals(k > 0 ? coded / k : 0));
  add_transfer_notes(state, last, k);
}

Registration engine_apply_compact_cuda(Benchmark{
    "engine_apply_compact", "cuda", kModelAxes,
    "CudaSyncEngine::apply of a compact delta: upload, device decode, verified apply (subscriber pause)",
    engine_apply_compact});

}  // namespace

}  // namespace deltasync::bench
