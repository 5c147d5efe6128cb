// deltasync log --store URL [--json]: the versions a store holds, oldest first, with their kind,
// base, sizes and change counts, and where LATEST points.
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>

#include "args.hpp"
#include "checkpoint.hpp"
#include "command.hpp"
#include "core/error.hpp"
#include "sync/protocol.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage = "log --store URL [--json]";

std::string utc_time(uint64_t unix_ms) {
  std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

int run_log(const Args& raw) {
  ParsedArgs args(raw, {"--store"}, {"--json"});
  args.expect_positional(0, kUsage);
  std::unique_ptr<Store> store = open_store(args.require("--store"));
  protocol::Catalog catalog(*store);
  const std::vector<uint64_t> versions = catalog.refresh();
  const std::optional<uint64_t> latest = protocol::read_latest(*store);

  if (args.has("--json")) {
    nlohmann::json out;
    out["latest"] = latest ? nlohmann::json(*latest) : nlohmann::json(nullptr);
    out["versions"] = nlohmann::json::array();
    for (uint64_t v : versions) out["versions"].push_back(nlohmann::json::parse(protocol::to_json(*catalog.find(v))));
    std::printf("%s\n", out.dump(1).c_str());
    return 0;
  }
  std::printf("%-10s %-13s %-10s %12s %12s %12s %10s  %s\n", "version", "kind", "base", "delta", "anchor", "changed", "density",
              "created (UTC)");
  for (uint64_t v : versions) {
    const protocol::Manifest& m = *catalog.find(v);
    std::printf("%-10llu %-13s %-10s %12s %12s %12llu %9.4f%%  %s\n", static_cast<unsigned long long>(v), m.kind().c_str(),
                m.base_version ? std::to_string(*m.base_version).c_str() : "-",
                m.has_delta() ? human_bytes(double(m.delta_bytes())).c_str() : "-",
                m.has_anchor() ? human_bytes(double(m.anchor_bytes())).c_str() : "-",
                static_cast<unsigned long long>(m.changed_elements),
                m.total_elements ? 100.0 * double(m.changed_elements) / double(m.total_elements) : 0.0,
                utc_time(m.created_unix_ms).c_str());
  }
  std::printf("%zu versions; LATEST -> %s\n", versions.size(), latest ? std::to_string(*latest).c_str() : "(none)");
  return 0;
}

const bool registered = register_command({"log", kUsage, &run_log});

}  // namespace
}  // namespace deltasync::cli
