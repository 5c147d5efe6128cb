// deltasync pull --store URL -o OUT [--version N]: brings the checkpoint OUT to version N (default:
// the newest) — created when missing, otherwise updated from the version its metadata records by
// the cheapest catch-up — and replaces it atomically. Weights that do not match their recorded
// version are rebuilt from an anchor. OUT is a file, or a checkpoint folder (an existing folder,
// or a new name without .safetensors): a folder keeps its shard split, a new one is split in
// shards of at most --max-shard-bytes (5 GB, as save_pretrained does).
//
// --follow SECONDS keeps OUT at the newest version: LATEST is polled every SECONDS (a
// conditional GET, nothing moves while it is unchanged) until interrupted, or until
// --until-version N has been reached.
#include <chrono>
#include <csignal>
#include <thread>
#include <cstdio>
#include <filesystem>

#include "args.hpp"
#include "checkpoint.hpp"
#include "model_files.hpp"
#include "command.hpp"
#include "codec/digest.hpp"
#include "streamed_output.hpp"
#include "core/error.hpp"
#include "core/parse_number.hpp"
#include "sync/subscriber.hpp"
#include "progress.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage =
    "pull --store URL -o OUT [--version N | --follow SECONDS [--until-version N]] [--max-shard-bytes B] [--quiet]";

// Where OUT lives and how it is split.
struct Output {
  std::string path;
  FolderLayout layout;
  bool has_layout = false;
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
  void save(const HostModel& model) const { save_model(model, path, has_layout ? &layout : nullptr, max_shard_bytes); }
};

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

int follow(Subscriber& subscriber, HostModel& model, const Output& out, double interval, std::optional<uint64_t> until) {
  const std::string& out_path = out.path;
  std::signal(SIGINT, request_stop);
  std::signal(SIGTERM, request_stop);
  while (!stop_requested) {
    const auto start = std::chrono::steady_clock::now();
    std::optional<uint64_t> newest = subscriber.poll();
    if (newest && (!model.version || *model.version != *newest)) {
      try {
        const SyncReport report = subscriber.sync(model, newest);
        out.save(model);
        print_update(out_path, report, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      } catch (const Error& e) {
        // A follower outlives one bad moment (store down, version deleted meanwhile): OUT keeps
        // its last good version and the next poll tries again.
        std::fprintf(stderr, "deltasync pull: %s (retrying)\n", e.what());
      }
    }
    if (until && model.version && *model.version >= *until) return 0;
    const double delay = Subscriber::next_poll_delay(interval);  // jittered: replicas drift apart
    for (double waited = 0; waited < delay && !stop_requested; waited += 0.05)
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(0.05, delay - waited)));
  }
  return 0;
}

// A catch-up that is one anchor (a fresh OUT, or one too far behind for deltas) streams into
// OUT part by part, each part verified before it is written and dropped after: memory is one
// part, never the model. nullopt: another plan (deltas onto OUT, already current) or an anchor
// of slices, which the subscriber loads whole (below).
std::optional<SyncReport> pull_anchor_streamed(Subscriber& subscriber, const Output& out, std::optional<uint64_t> target) {
  if (!target) target = subscriber.poll();
  if (!target) return std::nullopt;  // the subscriber says why
  std::optional<uint64_t> from;
  FolderLayout layout;
  bool has_layout = false;
  if (std::filesystem::exists(out.path)) {
    try {
      const Checkpoint existing = Checkpoint::open(out.path);
      from = existing.recorded_version();
      if (existing.is_folder()) {
        layout = layout_of(existing);
        has_layout = true;
      }
    } catch (const Error&) {
      from.reset();  // unreadable: rebuilt from the store (the loading path says so)
      return std::nullopt;
    }
  }
  if (from && *from == *target) return std::nullopt;
  const auto plan = protocol::plan_catch_up(subscriber.catalog(), from, *target);
  if (!plan || !plan->anchor_version || !plan->deltas.empty()) return std::nullopt;
  const protocol::Manifest* anchor = subscriber.catalog().find(*plan->anchor_version);
  if (!anchor) return std::nullopt;
  const std::vector<TensorMeta> tensors = subscriber.published_tensors(*target);
  std::vector<uint64_t> digests;
  for (const TensorMeta& t : tensors) {
    const auto it = anchor->digests.find(t.name);
    if (it == anchor->digests.end()) {
      digests.clear();  // a manifest without digests: the shards record none
      break;
    }
    digests.push_back(digest_from_hex(it->second, "manifest of version " + std::to_string(anchor->version)));
  }
  StreamedOutput output(out.path, tensors, *target, digests, has_layout ? &layout : nullptr, out.max_shard_bytes);
  SyncReport report;
  try {
    report = subscriber.stream_anchor(*plan->anchor_version, [&](std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                                                std::span<const uint64_t>) {
      for (size_t t = 0; t < meta.size(); ++t) output.write(meta[t], bytes[t]);
    });
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kUnsupported) return std::nullopt;
    throw;
  }
  output.commit();
  report.from = from;
  return report;
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

  Output out{out_path, {}, false, args.get_u64("--max-shard-bytes").value_or(kDefaultMaxShardBytes)};
  if (out.max_shard_bytes == 0) throw Error("option --max-shard-bytes must be positive");
  const bool following = args.get("--follow").has_value() || args.get("--until-version").has_value();
  if (!following) {
    if (auto streamed = pull_anchor_streamed(subscriber, out, args.get_u64("--version"))) {
      finish_progress();
      print_update(out_path, *streamed, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      return 0;
    }
  }
  HostModel model;
  if (std::filesystem::exists(out_path)) {
    try {
      const Checkpoint existing = Checkpoint::open(out_path);
      model = load_model(existing, existing.is_folder() ? &out.layout : nullptr);
      out.has_layout = existing.is_folder();
    } catch (const Error& e) {
      // An unreadable OUT is rebuilt from the store rather than refused: it is ours to replace.
      if (!quiet) std::fprintf(stderr, "pull: %s; rebuilding it from the store\n", e.what());
      model = HostModel{};
      out.layout = {};
      out.has_layout = false;
    }
  }
  if (auto interval = args.get_real("--follow")) {
    if (!(*interval > 0))
      throw Error("option --follow " + quoted_input(*args.get("--follow")) + ": not a positive number of seconds", ErrorKind::kInvalidArgument);
    if (args.get("--version")) throw Error("--follow and --version exclude each other: " + std::string(kUsage));
    return follow(subscriber, model, out, *interval, args.get_u64("--until-version"));
  }
  if (args.get("--until-version")) throw Error("--until-version needs --follow: " + std::string(kUsage));
  const SyncReport report = subscriber.sync(model, args.get_u64("--version"));
  finish_progress();
  const bool changed = !report.from || *report.from != report.to || report.recovered;
  if (changed) out.save(model);
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
