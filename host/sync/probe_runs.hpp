// Learning where an engine puts each published element (torch_ext/python/deltasync/vllm/index_map.py):
// the engine's loader copies probe values (an element's global position + 2) into an integer
// twin of each runtime tensor; the runs of consecutive probe values in a twin are the map. This
// is the one read of every twin, O(elements), in blocks the compiler vectorizes.
#pragma once
#include <cstdint>
#include <vector>

namespace deltasync {

// Maximal runs of `twin` whose values are >= min_probe and step by exactly +1:
// twin[start[r] + k] == first[r] + k for k < length[r]. Values below min_probe (what no loader
// wrote, or zeros a loader filled in) belong to no run.
struct ProbeRuns {
  std::vector<int64_t> start, first, length;
};

ProbeRuns find_probe_runs(const int32_t* twin, uint64_t n, int64_t min_probe);
ProbeRuns find_probe_runs(const int64_t* twin, uint64_t n, int64_t min_probe);

}  // namespace deltasync
