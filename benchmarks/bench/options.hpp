// Command line of deltasync-bench (nvbench-like flags; see benchmarks/README.md).
#pragma once
#include <string>
#include <vector>

#include "harness.hpp"

namespace deltasync::bench {

struct Options {
  std::vector<std::string> benchmarks;  // -b; empty: all
  AxisValues axes;                      // defaults, overridden per axis by -a
  std::string devices = "all";          // -d: cpu, cuda or all
  SamplingPolicy policy;
  bool list = false;
  std::string csv_path, json_path, markdown_path;
  std::string torch_python;  // --torch-python (or $DELTASYNC_TORCH_PYTHON); empty: no torch rows
  std::string torch_script;  // --torch-script; default: benchmarks/torch_eager.py of this source tree
  std::string scratch_dir;   // --scratch
  std::string command_line;  // as invoked, for the report
};

// Default axis values: Elements=[2^20,2^24,2^26], ChangedShare=[0.001,0.01,0.05], Dtype=[BF16],
// Tensors=[1].
AxisValues default_axes();

// Parses argv; throws Error with a one-line reason on anything malformed. --help prints usage
// and exits.
Options parse_options(int argc, char** argv);

// Parses one -a value: "Name=v", "Name=[v1,v2,...]", "Name=[a:b:step]" (if a and b are powers
// written 2^x, the step applies to the exponent: "Elements=[2^20:2^26:2]"), or
// "Name[pow2]=[20:26:2]" as nvbench spells it. Returns the axis name and its values.
std::pair<std::string, std::vector<AxisValue>> parse_axis(const std::string& spec);

// The number an axis value written as text stands for ("2^26", "1e6", "0.01", "1%"): how -a
// reads it, for a report that has only the text.
double axis_text_number(const std::string& axis, const std::string& text);

bool device_selected(const Options& options, const std::string& device);

}  // namespace deltasync::bench
