// deltasync pull --store URL -o OUT [--version N]: brings the checkpoint OUT to version N (default:
// the newest) — created when missing, otherwise updated from the version its metadata records by
// the cheapest catch-up — and replaces it atomically. Weights that do not match their recorded
// version are rebuilt from an anchor.
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "args.hpp"
#include "checkpoint.hpp"
#include "command.hpp"
#include "deltasync/error.hpp"
#include "deltasync/subscriber.hpp"
#include "progress.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "pull --store URL -o OUT [--version N] [--quiet]";

int run_pull(const Args& raw) {
  ParsedArgs args(raw, {"--store", "-o", "--output", "--version"}, {"--quiet"});
  args.expect_positional(0, kUsage);
  const bool quiet = args.has("--quiet");
  const std::string out_path = args.get("-o").value_or(args.get("--output").value_or(""));
  if (out_path.empty()) throw Error("missing -o OUT: " + std::string(kUsage));
  const auto start = std::chrono::steady_clock::now();

  std::unique_ptr<Store> store = open_store(args.require("--store"));
  store->set_progress(terminal_progress("download", quiet));
  SubscriberOptions options;
  if (!quiet) options.log = [](const std::string& line) { std::fprintf(stderr, "pull: %s\n", line.c_str()); };
  Subscriber subscriber(*store, options);

  HostModel model;
  if (std::filesystem::exists(out_path)) {
    try {
      model = HostModel::load(out_path);
    } catch (const Error& e) {
      // An unreadable OUT is rebuilt from the store rather than refused: it is ours to replace.
      if (!quiet) std::fprintf(stderr, "pull: %s; rebuilding it from the store\n", e.what());
      model = HostModel{};
    }
  }
  const SyncReport report = subscriber.sync(model, args.get_u64("--version"));
  finish_progress();
  const bool changed = !report.from || *report.from != report.to || report.recovered;
  if (changed) model.save(out_path);
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!changed) {
    std::printf("%s: already at version %llu\n", out_path.c_str(), static_cast<unsigned long long>(report.to));
    return 0;
  }
  std::printf("%s: version %s -> %llu via %s; fetch %.3f s, apply %.3f s, command %.3f s%s%s\n", out_path.c_str(),
              report.from ? std::to_string(*report.from).c_str() : "none", static_cast<unsigned long long>(report.to),
              report.plan.describe().c_str(), report.fetch_seconds, report.apply_seconds, total,
              report.recovered ? "; recovered from an anchor: " : "", report.recovered ? report.recovery_reason.c_str() : "");
  return 0;
}

const bool registered = register_command({"pull", kUsage, &run_pull});

}  // namespace
}  // namespace deltasync::cli
