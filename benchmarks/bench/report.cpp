#include "report.hpp"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "options.hpp"

namespace deltasync::bench {

namespace {

const std::vector<std::string> kAxisOrder{kAxisElements, kAxisChangedShare, kAxisDtype, kAxisTensors};

std::vector<std::string> used_axes(const std::vector<Result>& rows) {
  std::vector<std::string> out;
  for (const auto& a : kAxisOrder)
    for (const auto& r : rows)
      if (r.axes.count(a)) {
        out.push_back(a);
        break;
      }
  return out;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string axis_or_dash(const Result& r, const std::string& axis) {
  auto it = r.axes.find(axis);
  return it == r.axes.end() ? "-" : it->second;
}

std::string markdown_table(const std::vector<Result>& rows) {
  const auto axes = used_axes(rows);
  std::ostringstream out;
  out << "| benchmark | device |";
  for (const auto& a : axes) out << ' ' << a << " |";
  out << " samples | median | noise | elem/s | GB/s | util | notes |\n|---|---|";
  for (size_t i = 0; i < axes.size(); ++i) out << "---|";
  out << "---:|---:|---:|---:|---:|---:|---|\n";
  for (const auto& r : rows) {
    out << "| " << r.benchmark << " | " << r.device << " |";
    for (const auto& a : axes) out << ' ' << axis_or_dash(r, a) << " |";
    if (!r.skipped.empty()) {
      out << " - | - | - | - | - | - | skipped: " << r.skipped << " |\n";
      continue;
    }
    out << ' ' << r.samples << " | " << format_seconds(r.median_s) << " | " << fixed(100 * r.noise, 1) << "% | "
        << (r.elements > 0 ? format_rate(r.elements_per_s()) : "-") << " | " << (r.bytes > 0 ? fixed(r.gbps(), 2) : "-")
        << " | " << (r.bytes > 0 && r.peak_gbps > 0 ? fixed(r.utilization(), 2) : "-") << " | " << r.notes << " |\n";
  }
  return out.str();
}

double axis_number(const Result& r, const std::string& axis) {
  auto it = r.axes.find(axis);
  if (it == r.axes.end()) return NAN;
  return axis_text_number(axis, it->second);
}

std::string axes_label(const Result& r) {
  std::string s;
  for (const auto& a : kAxisOrder) {
    auto it = r.axes.find(a);
    if (it == r.axes.end()) continue;
    s += (s.empty() ? "" : ", ") + a + "=" + it->second;
  }
  return s;
}

// The row of `benchmark` on `device` with the same values on the axes both have.
const Result* matching(const std::vector<Result>& rows, const Result& like, const std::string& benchmark, const std::string& device) {
  for (const auto& r : rows) {
    if (r.benchmark != benchmark || r.device != device || !r.skipped.empty() || r.median_s <= 0) continue;
    bool same = true;
    for (const auto& [axis, value] : r.axes) {
      auto it = like.axes.find(axis);
      if (it != like.axes.end() && it->second != value) same = false;
    }
    if (same) return &r;
  }
  return nullptr;
}

std::string device_label(const std::string& device) { return device == "cuda" ? "GPU" : "CPU"; }

}  // namespace

std::vector<std::string> target_summary(const std::vector<Result>& rows) {
  std::vector<std::string> lines;
  for (const auto& r : rows) {
    if (!r.skipped.empty() || r.median_s <= 0) continue;
    const double n = axis_number(r, kAxisElements), share = axis_number(r, kAxisChangedShare);
    const bool one_percent = std::fabs(share - 0.01) < 1e-12;
    if (r.benchmark == "encode" && one_percent && r.peak_gbps > 0) {
      const bool gpu = r.device == "cuda";
      const double min_n = gpu ? std::ldexp(1.0, 28) : std::ldexp(1.0, 26), target = gpu ? 0.8 : 0.7;
      if (n >= min_n)
        lines.push_back(device_label(r.device) + " encode / same-run " + (gpu ? "device copy" : "memcpy") + " bandwidth at " +
                        axes_label(r) + ": " + fixed(r.utilization(), 2) + " (target >= " + fixed(target, 1) + ")");
    }
    if (r.benchmark == "apply" && r.device == "cuda" && one_percent)
      lines.push_back("GPU apply at " + axes_label(r) + ": " + fixed(r.median_s * 1e3 * 1e8 / n, 4) +
                      " ms per 1e8 elements (target < 0.1 ms)");
    if (r.benchmark == "e2e") {
      std::string line = device_label(r.device) + " end-to-end step at " + axes_label(r) + ": " + format_seconds(r.median_s);
      if (const Result* full = matching(rows, r, "e2e_full", r.device))
        line += " vs " + format_seconds(full->median_s) + " shipping the full weights (" + fixed(full->median_s / r.median_s, 1) + "x)";
      if (r.device == "cuda" && n >= 1e9 && one_percent) line += " (target < 100 ms for 1e9 elements)";
      lines.push_back(line);
    }
    if (r.benchmark == "torch_encode" || r.benchmark == "torch_apply") {
      const std::string ours = r.benchmark.substr(6);
      if (const Result* o = matching(rows, r, ours, r.device))
        lines.push_back(device_label(r.device) + " " + ours + " vs torch eager at " + axes_label(r) + ": " + format_seconds(o->median_s) +
                        " vs " + format_seconds(r.median_s) + " (" + fixed(r.median_s / o->median_s, 1) + "x)");
    }
  }
  return lines;
}

std::string markdown_report(const RunContext& c, const std::vector<Result>& peaks, const std::vector<Result>& rows) {
  std::ostringstream out;
  out << "## deltasync-bench results\n\n";
  out << "- date: " << c.date << "\n- host: " << c.host << "\n";
  for (const auto& [name, description] : c.devices) out << "- " << name << ": " << description << "\n";
  out << "- command: `" << c.command << "`\n- commit: " << c.commit << "\n";
  for (const auto& m : c.messages) out << "- note: " << m << "\n";
  if (!peaks.empty()) out << "\n### Same-run peaks (copy bandwidth, bytes read + written)\n\n" << markdown_table(peaks);
  if (!rows.empty()) out << "\n### Benchmarks\n\n" << markdown_table(rows);
  const auto lines = target_summary(rows);
  if (!lines.empty()) {
    out << "\n### Targets and comparisons\n\n";
    for (const auto& l : lines) out << "- " << l << "\n";
  }
  return out.str();
}

std::string csv_report(const std::vector<Result>& peaks, const std::vector<Result>& rows) {
  std::vector<Result> all = peaks;
  all.insert(all.end(), rows.begin(), rows.end());
  std::ostringstream out;
  out << "benchmark,device";
  for (const auto& a : kAxisOrder) out << ',' << a;
  out << ",samples,median_s,noise,elements,bytes,elements_per_s,gb_per_s,peak_gb_per_s,utilization,notes,skipped\n";
  auto quoted = [](const std::string& s) {
    std::string q = "\"";
    for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    return q + "\"";
  };
  for (const auto& r : all) {
    out << r.benchmark << ',' << r.device;
    for (const auto& a : kAxisOrder) out << ',' << (r.axes.count(a) ? r.axes.at(a) : "");
    out << ',' << r.samples << ',' << r.median_s << ',' << r.noise << ',' << r.elements << ',' << r.bytes << ','
        << r.elements_per_s() << ',' << r.gbps() << ',' << r.peak_gbps << ',' << r.utilization() << ',' << quoted(r.notes) << ','
        << quoted(r.skipped) << '\n';
  }
  return out.str();
}

std::string json_report(const RunContext& c, const std::vector<Result>& peaks, const std::vector<Result>& rows) {
  nlohmann::json j;
  j["context"] = {{"date", c.date}, {"host", c.host}, {"command", c.command}, {"commit", c.commit}, {"messages", c.messages}};
  for (const auto& [name, description] : c.devices) j["context"]["devices"][name] = description;
  auto row = [](const Result& r) {
    return nlohmann::json{{"benchmark", r.benchmark},
                          {"device", r.device},
                          {"axes", r.axes},
                          {"samples", r.samples},
                          {"median_s", r.median_s},
                          {"noise", r.noise},
                          {"elements", r.elements},
                          {"bytes", r.bytes},
                          {"elements_per_s", r.elements_per_s()},
                          {"gb_per_s", r.gbps()},
                          {"peak_gb_per_s", r.peak_gbps},
                          {"utilization", r.utilization()},
                          {"notes", r.notes},
                          {"skipped", r.skipped}};
  };
  j["peaks"] = nlohmann::json::array();
  for (const auto& r : peaks) j["peaks"].push_back(row(r));
  j["results"] = nlohmann::json::array();
  for (const auto& r : rows) j["results"].push_back(row(r));
  j["targets"] = target_summary(rows);
  return j.dump(2) + "\n";
}

void write_text_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(path + ": cannot write");
    out << text;
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp);
      throw Error(path + ": write failed");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    throw Error(path + ": " + ec.message());
  }
}

}  // namespace deltasync::bench
