// Output of a run: the markdown table (stdout), CSV and JSON files, and the "targets" summary
// that turns rows into the ratios the project's issues ask for.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "harness.hpp"

namespace deltasync::bench {

struct RunContext {
  std::string date;     // UTC, ISO 8601
  std::string host;
  std::string command;
  std::string commit;   // "see git log" when unknown
  std::vector<std::pair<std::string, std::string>> devices;  // name -> description
  std::vector<std::string> messages;                         // e.g. why torch rows are missing
};

std::string markdown_report(const RunContext& context, const std::vector<Result>& peaks, const std::vector<Result>& rows);
std::string csv_report(const std::vector<Result>& peaks, const std::vector<Result>& rows);
std::string json_report(const RunContext& context, const std::vector<Result>& peaks, const std::vector<Result>& rows);

// Lines like "CPU encode / memcpy at Elements=2^26, ChangedShare=0.01: 0.84 (target >= 0.7)".
std::vector<std::string> target_summary(const std::vector<Result>& rows);

// Writes text to a file (temporary name, then rename). Throws Error on failure.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace deltasync::bench
