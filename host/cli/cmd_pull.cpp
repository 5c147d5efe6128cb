// deltasync pull --store URL -o OUT [--version N]: brings the checkpoint OUT to version N (default:
// the newest) — created when missing, otherwise updated from the version its metadata records by
// the cheapest catch-up — and replaces it atomically. Weights that do not match their recorded
// version are rebuilt from an anchor. OUT is a file, or a checkpoint folder (an existing folder,
// or a new name without .safetensors): a folder keeps its shard split, a new one is split in
// shards of at most --max-shard-bytes (5 GB, as save_pretrained does).
//
// OUT is read and written one tensor at a time, never loaded (checkpoint_receiver.hpp): host
// memory stays bounded by an anchor part or the largest tensor, plus the deltas, whatever the
// model's size. Each version is staged complete under temporary names, its digests checked
// against its manifest, and only then takes OUT's place.
//
// --follow SECONDS keeps OUT at the newest version: LATEST is polled every SECONDS (a
// conditional GET, nothing moves while it is unchanged) until interrupted, or until
// --until-version N has been reached.
#include <chrono>
#include <csignal>
#include <thread>
#include <cstdio>

#include "args.hpp"
#include "checkpoint_receiver.hpp"
#include "command.hpp"
#include "core/error.hpp"
#include "core/parse_number.hpp"
#include "sync/subscriber.hpp"
#include "progress.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage =
    "pull --store URL -o OUT [--version N | --follow SECONDS [--until-version N]] [--max-shard-bytes B] [--quiet]";

volatile std::sig_atomic_t stop_requested = 0;
void request_stop(int) { stop_requested = 1; }

// One line per update: where OUT came from, the plan and the time it took.
void print_update(const std::string& out_path, const SyncReport& report, double total) {
  std::printf("%s: version %s -> %llu via %s; fetch %.3f s, apply %.3f s, command %.3f s, %llu store requests%s%s\n", out_path.c_str(),
              report.from ? std::to_string(*report.from).c_str() : "none", static_cast<unsigned long long>(report.to),
              report.plan.describe().c_str(), report.fetch_seconds, report.apply_seconds, total,
              static_cast<unsigned long long>(report.store_requests),
              report.recovered ? "; recovered from an anchor: " : "", report.recovered ? report.recovery_reason.c_str() : "");
  std::fflush(stdout);
}

int follow(Subscriber& subscriber, CheckpointReceiver& weights, const std::string& out_path, double interval,
           std::optional<uint64_t> until) {
  std::signal(SIGINT, request_stop);
  std::signal(SIGTERM, request_stop);
  while (!stop_requested) {
    const auto start = std::chrono::steady_clock::now();
    std::optional<uint64_t> newest = subscriber.poll();
    if (newest && (!weights.version() || *weights.version() != *newest)) {
      try {
        const SyncReport report = subscriber.sync(weights, newest);
        weights.commit();
        print_update(out_path, report, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      } catch (const Error& e) {
        // A follower outlives one bad moment (store down, version deleted meanwhile): OUT keeps
        // its last good version and the next poll tries again (from the weights staged so far).
        std::fprintf(stderr, "deltasync pull: %s (retrying)\n", e.what());
      }
    }
    if (until && weights.version() && *weights.version() >= *until && !weights.staged()) return 0;
    const double delay = Subscriber::next_poll_delay(interval);  // jittered: replicas drift apart
    for (double waited = 0; waited < delay && !stop_requested; waited += 0.05)
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(0.05, delay - waited)));
  }
  return 0;
}

int run_pull(const Args& raw) {
  ParsedArgs args(raw, {"--store", "-o", "--output", "--version", "--follow", "--until-version", "--max-shard-bytes"}, {"--quiet"});
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

  const uint64_t max_shard_bytes = args.get_u64("--max-shard-bytes").value_or(kDefaultMaxShardBytes);
  if (max_shard_bytes == 0) throw Error("option --max-shard-bytes must be positive");
  std::string unreadable;
  CheckpointReceiver weights(out_path, max_shard_bytes, subscriber.catalog(), &unreadable);
  if (!unreadable.empty() && !quiet) std::fprintf(stderr, "pull: %s; rebuilding it from the store\n", unreadable.c_str());
  if (auto interval = args.get_real("--follow")) {
    if (!(*interval > 0))
      throw Error("option --follow " + quoted_input(*args.get("--follow")) + ": not a positive number of seconds", ErrorKind::kInvalidArgument);
    if (args.get("--version")) throw Error("--follow and --version exclude each other: " + std::string(kUsage));
    return follow(subscriber, weights, out_path, *interval, args.get_u64("--until-version"));
  }
  if (args.get("--until-version")) throw Error("--until-version needs --follow: " + std::string(kUsage));
  const SyncReport report = subscriber.sync(weights, args.get_u64("--version"));
  finish_progress();
  const bool changed = weights.staged();
  weights.commit();
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!changed) {
    std::printf("%s: already at version %llu\n", out_path.c_str(), static_cast<unsigned long long>(report.to));
    return 0;
  }
  print_update(out_path, report, total);
  return 0;
}

const bool registered = register_command({"pull", kUsage, &run_pull});

}  // namespace
}  // namespace deltasync::cli
