#include "core/placement.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace deltasync {

bool Placement::contains(uint64_t position) const {
  if (empty() || position < first || position >= end()) return false;
  return (position - first) % run_stride < run_length;
}

Placement whole_placement(uint64_t numel) { return Placement{0, numel, numel, numel ? 1u : 0u}; }

Placement offset_placement(uint64_t offset, uint64_t numel) { return Placement{offset, numel, numel, numel ? 1u : 0u}; }

Placement shard_placement(std::span<const uint64_t> shape, size_t dim, uint64_t index, uint64_t parts) {
  if (dim >= shape.size())
    throw Error("placement: Shard(" + std::to_string(dim) + ") of a " + std::to_string(shape.size()) + "-dimensional tensor");
  if (parts == 0 || index >= parts)
    throw Error("placement: part " + std::to_string(index) + " of " + std::to_string(parts));
  const uint64_t size = shape[dim];
  const uint64_t chunk = (size + parts - 1) / parts;  // torch.chunk: ceil, the tail short or empty
  const uint64_t begin = std::min(size, chunk * index);
  const uint64_t rows = std::min(size, begin + chunk) - begin;
  uint64_t outer = 1, inner = 1;
  for (size_t d = 0; d < dim; ++d) outer *= shape[d];
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  if (rows == 0 || outer == 0 || inner == 0) return Placement{0, 0, 0, 0};
  // One contiguous range when nothing lies outside dim (Shard(0): outer == 1) or the part spans
  // all of dim (then begin == 0).
  if (outer == 1 || rows == size) return offset_placement(begin * inner, outer * rows * inner);
  return Placement{begin * inner, rows * inner, size * inner, outer};
}

Placement rule_placement(const PlacementRule& rule, std::span<const uint64_t> shape, uint64_t coordinate) {
  switch (rule.kind) {
    case PlacementRule::Kind::kShard:
      return shard_placement(shape, rule.dim, coordinate, rule.mesh_size);
    case PlacementRule::Kind::kReplicate: {
      uint64_t numel = 1;
      for (uint64_t d : shape) numel *= d;
      return coordinate == 0 ? whole_placement(numel) : Placement{};
    }
    case PlacementRule::Kind::kExplicit:
      break;
  }
  return Placement{};
}

void to_full_positions(std::span<int64_t> positions, const Placement& placement, const std::string& tensor) {
  const uint64_t n = placement.numel();
  for (int64_t& p : positions) {
    if (p < 0 || static_cast<uint64_t>(p) >= n)
      throw Error("placement: tensor " + tensor + ": local position " + std::to_string(p) + " outside its shard of " +
                  std::to_string(n) + " elements");
    p = static_cast<int64_t>(placement.full_position(static_cast<uint64_t>(p)));
  }
}

uint64_t for_each_overlap(const Placement& a, const Placement& b,
                          const std::function<void(uint64_t a_local, uint64_t b_local, uint64_t count)>& fn) {
  if (a.empty() || b.empty()) return 0;
  uint64_t shared = 0, i = 0, j = 0;
  // Runs of both are ascending and disjoint (run_stride >= run_length): a merge of two sorted lists.
  while (i < a.run_count && j < b.run_count) {
    const uint64_t a0 = a.first + i * a.run_stride, a1 = a0 + a.run_length;
    const uint64_t b0 = b.first + j * b.run_stride, b1 = b0 + b.run_length;
    const uint64_t lo = std::max(a0, b0), hi = std::min(a1, b1);
    if (lo < hi) {
      if (fn) fn(i * a.run_length + (lo - a0), j * b.run_length + (lo - b0), hi - lo);
      shared += hi - lo;
    }
    if (a1 <= b1) ++i;
    if (b1 <= a1) ++j;
  }
  return shared;
}

std::string placement_text(const Placement& p) {
  return "[" + std::to_string(p.first) + ", " + std::to_string(p.run_length) + ", " + std::to_string(p.run_stride) + ", " +
         std::to_string(p.run_count) + "]";
}

void check_tiling(std::span<const Placement> placements, std::span<const std::string> part_names, uint64_t numel,
                  const std::string& tensor, const std::string& label) {
  struct Interval {
    uint64_t begin, end;
    size_t part;
  };
  std::vector<Interval> runs;
  for (size_t k = 0; k < placements.size(); ++k) {
    const Placement& p = placements[k];
    if (p.empty()) continue;
    if (p.run_stride < p.run_length)
      throw BadInputError(label + ": tensor " + tensor + ": " + part_names[k] + " has runs of " + std::to_string(p.run_length) +
                          " elements every " + std::to_string(p.run_stride) + " (they overlap)");
    if (p.end() > numel)
      throw BadInputError(label + ": tensor " + tensor + ": " + part_names[k] + " reaches position " + std::to_string(p.end()) +
                          ", past its " + std::to_string(numel) + " elements");
    for (uint64_t r = 0; r < p.run_count; ++r) {
      const uint64_t b = p.first + r * p.run_stride;
      runs.push_back(Interval{b, b + p.run_length, k});
    }
  }
  std::sort(runs.begin(), runs.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  uint64_t covered = 0;  // every position below this is covered by the runs seen so far
  size_t last = 0;
  for (const Interval& r : runs) {
    if (r.begin < covered)
      throw BadInputError(label + ": tensor " + tensor + ": " + part_names[last] + " and " + part_names[r.part] +
                          " overlap at position " + std::to_string(r.begin));
    if (r.begin > covered)
      throw BadInputError(label + ": tensor " + tensor + ": no part covers positions " + std::to_string(covered) + ".." +
                          std::to_string(r.begin - 1));
    covered = r.end;
    last = r.part;
  }
  if (covered < numel)
    throw BadInputError(label + ": tensor " + tensor + ": no part covers positions " + std::to_string(covered) + ".." +
                        std::to_string(numel - 1));
}

}  // namespace deltasync
