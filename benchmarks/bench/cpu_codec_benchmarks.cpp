// CPU benchmarks of the integrity digests and the compact codec.
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "codec/compact_codec.hpp"
#include "engine/cpu_engine.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "host_fixture.hpp"

namespace deltasync::bench {

namespace {

const std::vector<std::string> kModelAxes{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};
const std::vector<std::string> kDenseAxes{kAxisElements, kAxisDtype, kAxisTensors};

// --- digests -------------------------------------------------------------------------------

void digest_full(State& state) {
  auto f = make_host_fixture(state, 2);
  if (!f) return;
  const auto refs = f->model.const_refs(f->current.data());
  const double n = static_cast<double>(f->model.total_elements());
  state.declare(n, n * f->model.width());  // one read of the weights
  std::vector<uint64_t> digests;
  state.measure([&] { return time_seconds([&] { digests = digest_tensors(refs); }); });
  if (!state.skipped() && digests.size() != refs.size()) throw Error("digest: wrong number of digests");
}

Registration digest_cpu(Benchmark{"digest", "cpu", kDenseAxes,
                                  "full per-tensor digest of the weights (audit of an anchor; one read)", digest_full});

void digest_update(State& state) {
  auto f = make_host_fixture(state, 2, state.changed_share() * static_cast<double>(state.elements()) * 24);
  if (!f) return;
  const SparseDelta delta = encode_untimed(*f, "codec setup");
  const uint32_t w = f->model.width();
  std::vector<PatchRef> patches;
  std::vector<const void*> old_bits;
  for (size_t t = 0; t + 1 < delta.offsets.size(); ++t) {
    patches.push_back(delta.view().patch(t, w));
    old_bits.push_back(delta.base_values.data() + delta.value_offsets[t]);
  }
  const double k = static_cast<double>(f->changed);
  state.declare(k, k * (8 + 2.0 * w));  // positions, new and old bits read
  state.measure([&] { return time_seconds([&] { digest_shifts(patches, old_bits); }); });
}

Registration digest_update_cpu(Benchmark{"digest_update", "cpu", kModelAxes,
                                         "O(changed) digest shifts of a delta (the receiver's base/result check)",
                                         digest_update});

// --- compact codec -------------------------------------------------------------------------

std::vector<compact::EncodedTensorView> views_of(const std::vector<compact::EncodedTensor>& encoded) {
  std::vector<compact::EncodedTensorView> views;
  for (const auto& e : encoded) views.push_back(e.view());
  return views;
}

double encoded_bytes(const std::vector<compact::EncodedTensor>& encoded) {
  double bytes = 0;
  for (const auto& e : encoded) bytes += static_cast<double>(e.block_index.size() + e.payload.size());
  return bytes;
}

std::string per_change(double bytes, uint64_t changed) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", changed ? bytes / static_cast<double>(changed) : 0.0);
  return buf;
}

void compact_encode(State& state) {
  auto f = make_host_fixture(state, 2, state.changed_share() * static_cast<double>(state.elements()) * 40);
  if (!f) return;
  const SparseDelta delta = encode_untimed(*f, "codec setup");
  const auto metas = f->metas(state.dtype());
  const double k = static_cast<double>(f->changed), w = f->model.width();
  state.declare(k, k * (8 + 2 * w));  // positions, new and base bits read
  std::vector<compact::EncodedTensor> encoded;
  state.measure([&] { return time_seconds([&] { encoded = compact::encode(metas, delta.view()); }); });
  if (state.skipped()) return;
  state.add_note("B/changed", per_change(encoded_bytes(encoded), f->changed));
}

Registration compact_encode_cpu(Benchmark{"compact_encode", "cpu", kModelAxes,
                                          "compact codec: gaps + ordered value deltas, rANS, independent blocks", compact_encode});

void compact_decode(State& state) {
  auto f = make_host_fixture(state, 2, state.changed_share() * static_cast<double>(state.elements()) * 60);
  if (!f) return;
  const SparseDelta delta = encode_untimed(*f, "codec setup");
  const auto metas = f->metas(state.dtype());
  const auto encoded = compact::encode(metas, delta.view());
  const auto views = views_of(encoded);
  const auto base = f->model.const_refs(f->shadow.data());
  const double k = static_cast<double>(f->changed), w = f->model.width();
  state.declare(k, encoded_bytes(encoded) + k * (8 + 3 * w));  // stream in, base gathered, patches out
  compact::DecodedDelta decoded;
  state.measure([&] { return time_seconds([&] { compact::decode(views, metas, base, "bench", decoded); }); });
  if (state.skipped()) return;
  if (decoded.storage.indices != delta.indices || decoded.storage.values != delta.values)
    throw Error("compact_decode: decoded changes differ from the encoded ones");
  state.add_note("B/changed", per_change(encoded_bytes(encoded), f->changed));
}

Registration compact_decode_cpu(Benchmark{"compact_decode", "cpu", kModelAxes,
                                          "compact codec decode against the base (validated positions + base gather)",
                                          compact_decode});

// --- end to end through the compact format -------------------------------------------------

void end_to_end_compact(State& state) {
  auto f = make_host_fixture(state, 3, state.changed_share() * static_cast<double>(state.elements()) * 60);
  if (!f) return;
  AlignedBytes receiver = f->model.new_arena();
  std::memcpy(receiver.data(), f->shadow.data(), f->model.arena_bytes());
  const auto items = f->encode_items();
  const auto metas = f->metas(state.dtype());
  const auto targets = f->model.refs(receiver.data());
  const auto base = f->model.const_refs(receiver.data());
  const std::string path = scratch_path("e2e_compact.safetensors");
  DeltaInfo info;
  info.model_version = 1;
  info.base_version = 0;
  SparseDelta delta;
  compact::DecodedDelta decoded;
  double file_bytes = 0;
  // The receiver decodes against its base, so it must hold the base again before every sample.
  auto reset = [&] {
    if (delta.offsets.empty()) return;
    restore_shadow(*f, delta);
    const uint32_t w = f->model.width();
    for (size_t t = 0; t + 1 < delta.offsets.size(); ++t)
      for (uint64_t j = delta.offsets[t]; j < delta.offsets[t + 1]; ++j)
        std::memcpy(receiver.data() + f->model.offset(t) + static_cast<uint64_t>(delta.indices[j]) * w,
                    delta.base_values.data() + j * w, w);
  };
  state.measure([&] {
    reset();
    return time_seconds([&] {
      cpu::encode(items, delta);
      compact::write_compact_delta(path, metas, delta.view(), info);
      const st::File opened = st::File::open(path);
      const auto patches = compact::decode_compact_delta(opened, metas, base, decoded);
      cpu::apply(targets, patches);
      file_bytes = static_cast<double>(opened.size_bytes());
    });
  });
  std::error_code ec;
  std::filesystem::remove(path, ec);
  if (state.skipped()) return;
  if (!same_weights(f->model, receiver.data(), f->current.data()))
    throw Error("e2e_compact: the receiver's weights differ from the sender's after apply");
  const double n = static_cast<double>(f->model.total_elements()), w = f->model.width(), k = static_cast<double>(f->changed);
  state.declare(n, 2 * n * w + 2 * file_bytes + k * (8 + 3 * w));
  state.add_note("file", format_bytes(file_bytes));
  state.add_note("B/changed", per_change(file_bytes, f->changed));
}

Registration e2e_compact_cpu(Benchmark{"e2e_compact", "cpu", kModelAxes,
                                       "one sync step through the compact format: encode -> compact file -> decode -> apply",
                                       end_to_end_compact});

}  // namespace

}  // namespace deltasync::bench
