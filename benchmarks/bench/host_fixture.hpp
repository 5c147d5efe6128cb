// The host-side problem most benchmarks share: a model's weights (`current`), the last
// published bits (`shadow`, differing from current at uniformly random positions), and helpers
// to put the shadow back after an encode so every sample diffs the same change set.
#pragma once
#include <chrono>
#include <string>
#include <vector>

#include "format/delta_file.hpp"
#include "core/sparse_delta.hpp"
#include "harness.hpp"
#include "inputs.hpp"

namespace deltasync::bench {

struct HostFixture {
  HostModel model;
  AlignedBytes current, shadow;
  std::vector<std::vector<int64_t>> changes;
  uint64_t changed = 0;

  std::vector<EncodeItem> encode_items() { return model.encode_items(current.data(), shadow.data()); }
  std::vector<TensorMeta> metas(DType dtype) const;
};

// Builds the fixture for a state with Elements, Dtype and Tensors axes (and ChangedShare; without
// it shadow == current). Returns
// nullptr after state.skip() when `arenas` copies of the weights plus `extra_bytes` would not fit
// in 70% of the memory the OS reports available (the machine is shared).
std::unique_ptr<HostFixture> make_host_fixture(State& state, int arenas, double extra_bytes = 0);

// True when the weights of every tensor are bit-identical in the two arenas (padding ignored).
bool same_weights(const HostModel& model, const uint8_t* a, const uint8_t* b);

// Undoes an encode's shadow update: writes the base bits back at the changed positions, so the
// next encode finds the same changes. O(changed), outside the timed region.
void restore_shadow(HostFixture& f, const SparseDelta& delta);

// Throws unless an encode found exactly the changes the fixture made (a benchmark of a wrong
// result is worthless).
void expect_changed(const HostFixture& f, const SparseDelta& delta, const char* benchmark);

// The fixture's change set encoded by the CPU twin, checked, with the shadow restored afterwards:
// the untimed setup of the benchmarks that start from a delta. `label` names the benchmark.
SparseDelta encode_untimed(HostFixture& f, const char* label);

// Seconds of fn() by the steady clock.
template <class Fn>
double time_seconds(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Where file-writing benchmarks put their files: --scratch, else $TMPDIR, else /tmp.
std::string scratch_path(const std::string& file_name);
void set_scratch_dir(const std::string& dir);

// Copies `bytes` from src to dst split into chunks over the CPU twin's worker pool.
void parallel_copy(uint8_t* dst, const uint8_t* src, uint64_t bytes);

}  // namespace deltasync::bench
