#include "options.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "core/parse_number.hpp"

namespace deltasync::bench {

namespace {

constexpr const char* kUsage = R"(usage: deltasync-bench [options]
  -b, --benchmark NAME     run only this benchmark (repeatable; --list shows names)
  -a, --axis SPEC          set an axis: "Elements=[2^20,2^26]", "ChangedShare=[0.001,0.01]",
                           "Dtype=[F8,BF16,F32]", "Tensors=[1,256,model]",
                           ranges "Elements=[2^20:2^28:2]" or "Elements[pow2]=[20:28:2]"
  -d, --devices LIST       cpu, cuda or all (default all: whatever this machine has)
      --min-samples N      samples per state before the noise test applies (default 5)
      --max-noise X        stop once the relative standard deviation is <= X (default 0.05)
      --timeout S          wall-clock seconds per state, setup excluded (default 5)
      --list               list benchmarks, their axes and the default axis values
      --csv FILE           also write the results as CSV
      --json FILE          also write the results (and the run's context) as JSON
      --markdown FILE      also write the markdown report to FILE
      --torch-python PATH  Python with torch, for the torch eager rows (default
                           $DELTASYNC_TORCH_PYTHON; none: no torch rows)
      --torch-script PATH  the companion script (default: benchmarks/torch_eager.py)
      --scratch DIR        folder for delta files of the file benchmarks (default $TMPDIR or /tmp)
)";

const std::set<std::string> kNumericAxes{kAxisElements, kAxisChangedShare};
const std::set<std::string> kKnownAxes{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// "2^26", "1e6", "67108864", "0.01", "1%" (the numbers by core/parse_number.hpp's rules). Sets
// `pow2_exponent` when written as 2^x.
double parse_number(const std::string& axis, const std::string& text, double* pow2_exponent = nullptr) {
  const std::string t = trim(text);
  const std::string what = "axis " + axis;
  if (t.size() > 2 && t[0] == '2' && t[1] == '^') {
    const auto e = parse_decimal(std::string_view(t).substr(2), 62, what + " exponent of 2", ErrorKind::kInvalidArgument);
    if (pow2_exponent) *pow2_exponent = static_cast<double>(e);
    return std::ldexp(1.0, static_cast<int>(e));
  }
  if (!t.empty() && t.back() == '%')
    return parse_decimal_real(std::string_view(t).substr(0, t.size() - 1), what + " percentage", ErrorKind::kInvalidArgument) / 100;
  return parse_decimal_real(t, what, ErrorKind::kInvalidArgument);
}

AxisValue make_value(const std::string& axis, const std::string& text) {
  AxisValue v{trim(text), 0};
  if (v.text.empty()) throw Error("axis " + axis + ": empty value");
  if (axis == kAxisElements) {
    v.number = parse_number(axis, v.text);
    if (v.number < 1 || v.number != std::floor(v.number)) throw Error("axis Elements: " + v.text + " is not a positive integer");
  } else if (axis == kAxisChangedShare) {
    v.number = parse_number(axis, v.text);
    if (v.number < 0 || v.number > 1) throw Error("axis ChangedShare: " + v.text + " is not within [0, 1]");
  } else if (axis == kAxisDtype) {
    axis_width(v.text);  // validates
  } else if (axis == kAxisTensors) {
    if (v.text != "model" && parse_decimal<uint64_t>(v.text, "axis Tensors", ErrorKind::kInvalidArgument) < 1)
      throw Error("axis Tensors: " + v.text + " is not a positive count or \"model\"");
  }
  return v;
}

std::string format_pow2(double exponent) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "2^%g", exponent);
  return buf;
}

std::vector<AxisValue> expand_range(const std::string& axis, const std::string& body, bool pow2) {
  std::vector<std::string> parts;
  std::stringstream ss(body);
  for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
  if (parts.size() < 2 || parts.size() > 3) throw Error("axis " + axis + ": range must be [first:last] or [first:last:step]");
  if (!kNumericAxes.count(axis)) throw Error("axis " + axis + ": ranges need a numeric axis");
  double e0 = -1, e1 = -1;
  double first = parse_number(axis, parts[0], &e0), last = parse_number(axis, parts[1], &e1);
  const double step = parts.size() == 3 ? parse_number(axis, parts[2]) : 1;
  if (!(step > 0)) throw Error("axis " + axis + ": range step must be positive");
  if (pow2) e0 = first, e1 = last;  // nvbench form: the bounds are exponents
  std::vector<AxisValue> out;
  if (e0 >= 0 && e1 >= 0) {
    for (double e = e0; e <= e1 + 1e-9; e += step) out.push_back(make_value(axis, format_pow2(e)));
  } else {
    for (double v = first; v <= last * (1 + 1e-12); v += step) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.10g", v);
      out.push_back(make_value(axis, buf));
    }
  }
  if (out.empty()) throw Error("axis " + axis + ": range is empty");
  if (out.size() > 1000) throw Error("axis " + axis + ": range has more than 1000 values");
  return out;
}

}  // namespace

AxisValues default_axes() {
  AxisValues axes;
  for (const char* e : {"2^20", "2^24", "2^26"}) axes[kAxisElements].push_back(make_value(kAxisElements, e));
  for (const char* s : {"0.001", "0.01", "0.05"}) axes[kAxisChangedShare].push_back(make_value(kAxisChangedShare, s));
  axes[kAxisDtype].push_back(make_value(kAxisDtype, "BF16"));
  axes[kAxisTensors].push_back(make_value(kAxisTensors, "1"));
  return axes;
}

std::pair<std::string, std::vector<AxisValue>> parse_axis(const std::string& spec) {
  const auto eq = spec.find('=');
  if (eq == std::string::npos) throw Error("axis \"" + spec + "\": expected Name=[values]");
  std::string name = trim(spec.substr(0, eq));
  bool pow2 = false;
  if (name.size() > 6 && name.substr(name.size() - 6) == "[pow2]") pow2 = true, name = trim(name.substr(0, name.size() - 6));
  if (!kKnownAxes.count(name)) throw Error("axis \"" + name + "\": unknown (axes: Elements, ChangedShare, Dtype, Tensors)");
  std::string body = trim(spec.substr(eq + 1));
  if (!body.empty() && body.front() == '[') {
    if (body.back() != ']') throw Error("axis " + name + ": missing ']'");
    body = body.substr(1, body.size() - 2);
  }
  std::vector<AxisValue> values;
  if (body.find(':') != std::string::npos) {
    values = expand_range(name, body, pow2);
  } else {
    std::stringstream ss(body);
    for (std::string item; std::getline(ss, item, ',');)
      values.push_back(make_value(name, pow2 ? format_pow2(parse_number(name, item)) : item));
  }
  if (values.empty()) throw Error("axis " + name + ": no values");
  return {name, values};
}

double axis_text_number(const std::string& axis, const std::string& text) { return parse_number(axis, text); }

bool device_selected(const Options& options, const std::string& device) {
  if (options.devices == "all") return true;
  std::stringstream ss(options.devices);
  for (std::string d; std::getline(ss, d, ',');)
    if (trim(d) == device) return true;
  return false;
}

Options parse_options(int argc, char** argv) {
  Options o;
  o.axes = default_axes();
  for (int i = 0; i < argc; ++i) o.command_line += (i ? " " : "") + std::string(argv[i]);
  if (const char* env = std::getenv("DELTASYNC_TORCH_PYTHON")) o.torch_python = env;
  auto value = [&](int& i, const std::string& flag) -> std::string {
    if (i + 1 >= argc) throw Error("option " + flag + " needs a value");
    return argv[++i];
  };
  auto positive = [](const std::string& flag, const std::string& text) {
    const double v = parse_decimal_real(text, "option " + flag, ErrorKind::kInvalidArgument);
    if (!(v > 0)) throw Error("option " + flag + " " + quoted_input(text) + ": not a positive number", ErrorKind::kInvalidArgument);
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (a == "-b" || a == "--benchmark") {
      o.benchmarks.push_back(value(i, a));
    } else if (a == "-a" || a == "--axis") {
      auto [name, values] = parse_axis(value(i, a));
      o.axes[name] = std::move(values);
    } else if (a == "-d" || a == "--devices") {
      o.devices = value(i, a);
      std::stringstream ss(o.devices);
      for (std::string d; std::getline(ss, d, ',');)
        if (trim(d) != "cpu" && trim(d) != "cuda" && trim(d) != "all") throw Error("option -d: unknown device \"" + d + "\" (cpu, cuda, all)");
    } else if (a == "--min-samples") {
      o.policy.min_samples = static_cast<int>(positive(a, value(i, a)));
    } else if (a == "--max-noise") {
      o.policy.max_noise = positive(a, value(i, a));
    } else if (a == "--timeout") {
      o.policy.timeout_s = positive(a, value(i, a));
    } else if (a == "--list") {
      o.list = true;
    } else if (a == "--csv") {
      o.csv_path = value(i, a);
    } else if (a == "--json") {
      o.json_path = value(i, a);
    } else if (a == "--markdown") {
      o.markdown_path = value(i, a);
    } else if (a == "--torch-python") {
      o.torch_python = value(i, a);
    } else if (a == "--torch-script") {
      o.torch_script = value(i, a);
    } else if (a == "--scratch") {
      o.scratch_dir = value(i, a);
    } else {
      throw Error("unknown option \"" + a + "\" (try --help)");
    }
  }
  return o;
}

}  // namespace deltasync::bench
