// The torch eager baseline: what a user writes today (`ne` + `nonzero` + `index_select` to
// encode, `index_copy_` to apply), measured by benchmarks/torch_eager.py on the same problems
// as the native rows, and merged into the same table.
#pragma once
#include <string>
#include <vector>

#include "harness.hpp"

namespace deltasync::bench {

struct CompanionState {
  std::string benchmark;  // "torch_encode" or "torch_apply"
  std::string device;
  std::map<std::string, AxisValue> axes;
};

// Runs the script once for all states with `python`; returns one Result per state in order (a
// skipped Result with the reason when the script could not measure it). `message` receives a
// line for the report (torch version, or why no rows came back).
std::vector<Result> run_torch_companion(const std::string& python, const std::string& script,
                                        const std::vector<CompanionState>& states, const SamplingPolicy& policy,
                                        std::string& message);

// One skipped Result per state, carrying `why`.
std::vector<Result> skipped_companion_rows(const std::vector<CompanionState>& states, const std::string& why);

// benchmarks/torch_eager.py next to this source file's folder (where the build came from).
std::string default_torch_script();

}  // namespace deltasync::bench
