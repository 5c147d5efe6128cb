#include "torch_companion.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/parallel.hpp"
#include "host_fixture.hpp"
#include "inputs.hpp"
#include "report.hpp"

namespace deltasync::bench {

namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

const std::vector<std::string> kCompanionAxes{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};

Registration torch_encode_cpu(Benchmark{"torch_encode", "cpu", kCompanionAxes,
                                        "baseline: torch eager ne + nonzero + index_select (+ shadow index_copy_), per tensor",
                                        {}, "torch"});
Registration torch_apply_cpu(Benchmark{"torch_apply", "cpu", kCompanionAxes,
                                       "baseline: torch eager index_copy_ with I64 indices, per tensor", {}, "torch"});
Registration torch_encode_cuda(Benchmark{"torch_encode", "cuda", kCompanionAxes,
                                         "baseline: torch eager encode on the GPU (nonzero synchronizes per tensor)", {},
                                         "torch"});
Registration torch_apply_cuda(Benchmark{"torch_apply", "cuda", kCompanionAxes, "baseline: torch eager index_copy_ on the GPU",
                                        {}, "torch"});

}  // namespace

std::vector<Result> skipped_companion_rows(const std::vector<CompanionState>& states, const std::string& why) {
  std::vector<Result> out;
  for (const auto& s : states) {
    Result r;
    r.benchmark = s.benchmark;
    r.device = s.device;
    for (const auto& [k, v] : s.axes) r.axes[k] = v.text;
    r.skipped = why;
    out.push_back(r);
  }
  return out;
}

std::string default_torch_script() {
  // __FILE__ is the absolute path CMake compiled: <source>/benchmarks/bench/torch_companion.cpp.
  return (std::filesystem::path(__FILE__).parent_path().parent_path() / "torch_eager.py").string();
}

std::vector<Result> run_torch_companion(const std::string& python, const std::string& script,
                                        const std::vector<CompanionState>& states, const SamplingPolicy& policy,
                                        std::string& message) {
  std::vector<Result> out;
  auto all_skipped = [&](const std::string& why) {
    out = skipped_companion_rows(states, why);
    message = why;
    return out;
  };
  if (states.empty()) return out;
  if (!std::filesystem::exists(script)) return all_skipped("torch script " + script + " not found (--torch-script)");

  nlohmann::json request;
  request["threads"] = worker_count();
  request["policy"] = {{"min_samples", policy.min_samples},
                       {"max_noise", policy.max_noise},
                       {"timeout_s", policy.timeout_s},
                       {"max_samples", policy.max_samples}};
  request["states"] = nlohmann::json::array();
  for (size_t i = 0; i < states.size(); ++i) {
    const auto& s = states[i];
    nlohmann::json st;
    st["id"] = i;
    st["benchmark"] = s.benchmark;
    st["device"] = s.device;
    const uint64_t elements = static_cast<uint64_t>(s.axes.at(kAxisElements).number);
    std::vector<uint64_t> sizes;
    try {
      for (const auto& shape : model_shapes(s.axes.at(kAxisTensors).text, elements)) sizes.push_back(shape.numel);
    } catch (const std::exception& e) {
      st["error"] = e.what();
    }
    st["tensor_sizes"] = sizes;
    st["width"] = axis_width(s.axes.at(kAxisDtype).text);
    st["changed_share"] = s.axes.at(kAxisChangedShare).number;
    request["states"].push_back(st);
  }
  const std::string request_path = scratch_path("torch-request.json"), result_path = scratch_path("torch-result.json");
  write_text_file(request_path, request.dump());
  const std::string command = shell_quote(python) + " " + shell_quote(script) + " --request " + shell_quote(request_path) +
                              " --output " + shell_quote(result_path);
  const int status = std::system(command.c_str());
  std::filesystem::remove(request_path);
  if (status != 0) {
    std::filesystem::remove(result_path);
    const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    const std::string why = rc == 3 ? "torch is not importable by " + python
                                    : "`" + python + " " + script + "` " +
                                          (rc >= 0 ? "exited with status " + std::to_string(rc) : "was killed by a signal");
    return all_skipped("torch eager rows missing: " + why);
  }
  nlohmann::json result;
  try {
    std::ifstream in(result_path);
    result = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    std::filesystem::remove(result_path);
    return all_skipped(std::string("torch eager rows missing: unreadable result: ") + e.what());
  }
  std::filesystem::remove(result_path);
  all_skipped("torch script returned no row for this state");
  for (const auto& row : result.at("results")) {
    const size_t id = row.at("id").get<size_t>();
    if (id >= out.size()) continue;
    Result& r = out[id];
    r.skipped = row.value("skipped", "");
    r.samples = row.value("samples", 0);
    r.median_s = row.value("median_s", 0.0);
    r.noise = row.value("noise", 0.0);
    r.elements = row.value("elements", 0.0);
    r.bytes = row.value("bytes", 0.0);
    r.notes = row.value("notes", "");
  }
  message = "torch eager rows measured with " + result.value("torch", std::string("torch")) + " (" + python + ")";
  return out;
}

}  // namespace deltasync::bench
