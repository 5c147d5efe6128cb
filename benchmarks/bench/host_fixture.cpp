#include "host_fixture.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "engine/cpu_engine.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"

namespace deltasync::bench {

namespace {
std::string& scratch_dir() {
  static std::string dir;
  return dir;
}
}  // namespace

std::vector<TensorMeta> HostFixture::metas(DType dtype) const {
  std::vector<TensorMeta> out;
  for (const auto& s : model.shapes()) out.push_back({s.name, dtype, {s.numel}});
  return out;
}

std::unique_ptr<HostFixture> make_host_fixture(State& state, int arenas, double extra_bytes) {
  std::vector<TensorShape> shapes = model_shapes(state.tensors(), state.elements());
  HostModel model(std::move(shapes), state.width());
  const double share = state.has_axis(kAxisChangedShare) ? state.changed_share() : 0.0;
  const double expected_changed = share * static_cast<double>(model.total_elements());
  // Changes cost ~8 B of position each, plus what the benchmark asked for.
  const double need = static_cast<double>(arenas) * static_cast<double>(model.arena_bytes()) + expected_changed * 8 + extra_bytes;
  const uint64_t available = available_host_memory();
  if (available > 0 && need > 0.7 * static_cast<double>(available)) {
    state.skip("needs ~" + format_bytes(need) + ", " + format_bytes(static_cast<double>(available)) + " available");
    return nullptr;
  }
  auto f = std::make_unique<HostFixture>(HostFixture{std::move(model), {}, {}, {}, 0});
  f->current = f->model.new_arena();
  f->shadow = f->model.new_arena();
  fill_random({f->current.data(), f->current.size}, 0x5EED0001);
  f->changes = random_changes(f->model.shapes(), share, 0x5EED0002);
  f->changed = derive_changed_copy(f->model, f->current.data(), f->shadow.data(), f->changes, 0x5EED0003);
  if (state.has_axis(kAxisChangedShare)) state.add_note("changed", std::to_string(f->changed));
  return f;
}

bool same_weights(const HostModel& model, const uint8_t* a, const uint8_t* b) {
  for (size_t t = 0; t < model.shapes().size(); ++t)
    if (std::memcmp(a + model.offset(t), b + model.offset(t), model.shapes()[t].numel * model.width()) != 0) return false;
  return true;
}

void restore_shadow(HostFixture& f, const SparseDelta& delta) {
  const uint32_t w = f.model.width();
  parallel_for(delta.offsets.size() - 1, [&](size_t t) {
    uint8_t* base = f.shadow.data() + f.model.offset(t);
    const uint8_t* old_bits = delta.base_values.data() + delta.value_offsets[t];
    for (uint64_t j = delta.offsets[t]; j < delta.offsets[t + 1]; ++j, old_bits += w)
      std::memcpy(base + static_cast<uint64_t>(delta.indices[j]) * w, old_bits, w);
  });
}

SparseDelta encode_untimed(HostFixture& f, const char* label) {
  SparseDelta delta;
  const auto items = f.encode_items();
  cpu::encode(items, delta);
  expect_changed(f, delta, label);
  restore_shadow(f, delta);
  return delta;
}

void expect_changed(const HostFixture& f, const SparseDelta& delta, const char* benchmark) {
  const uint64_t found = delta.offsets.empty() ? 0 : delta.offsets.back();
  if (found != f.changed)
    throw Error(std::string(benchmark) + ": encode found " + std::to_string(found) + " changed elements, the inputs have " +
                std::to_string(f.changed));
}

void set_scratch_dir(const std::string& dir) { scratch_dir() = dir; }

std::string scratch_path(const std::string& file_name) {
  std::string dir = scratch_dir();
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = tmp && *tmp ? tmp : "/tmp";
  }
  // The pid keeps concurrent runs on a shared machine from overwriting each other's files.
  return (std::filesystem::path(dir) / ("deltasync-bench-" + std::to_string(::getpid()) + "-" + file_name)).string();
}

void parallel_copy(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  constexpr uint64_t kChunk = uint64_t{1} << 21;
  parallel_for((bytes + kChunk - 1) / kChunk, [&](size_t c) {
    const uint64_t begin = c * kChunk;
    std::memcpy(dst + begin, src + begin, std::min(kChunk, bytes - begin));
  });
}

}  // namespace deltasync::bench
