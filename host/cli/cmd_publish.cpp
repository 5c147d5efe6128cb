// deltasync publish CHECKPOINT --store URL --version N [--state DIR]: makes CHECKPOINT (a
// safetensors file or a checkpoint folder) version N
// of the store — a delta against the last published weights (the shadow), plus an anchor when
// one is due — and returns once the version is visible. It publishes as a new epoch of its run
// (--run-id, default "unnamed"); a store held by another run is refused unless --take-over.
//
// The shadow comes from --state DIR (DIR/shadow.safetensors, rewritten after each publish);
// without --state it is rebuilt by pulling the newest version from the store (correct, but a
// full download each time).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>
#include <type_traits>

#include "args.hpp"
#include "checkpoint.hpp"
#include "command.hpp"
#include "model_files.hpp"
#include "core/error.hpp"
#include "core/fields.hpp"
#include "core/parse_number.hpp"
#include "sync/protocol.hpp"
#include "sync/publisher.hpp"
#include "sync/publisher_resume.hpp"
#include "progress.hpp"

namespace deltasync::cli {
namespace {

// The flags the command has besides the publisher options.
constexpr const char* kOwnOptions[] = {"--store", "--version", "--state"};

// "--anchor-every" for the option field "anchor_every".
std::string flag_of(std::string_view field) {
  std::string flag = "--" + std::string(field);
  for (char& c : flag) c = c == '_' ? '-' : c;
  return flag;
}

// A value placeholder for the usage line, from the option's type.
template <class T>
const char* placeholder() {
  if constexpr (std::is_same_v<T, std::string>) return "NAME";
  else if constexpr (std::is_floating_point_v<T>) return "F";
  else return "N";
}

// The usage line: the command's own flags, then one per PublisherOptions field (its table).
const std::string& usage() {
  static const std::string text = [] {
    std::string u = "publish CHECKPOINT --store URL --version N [--state DIR]";
    fields::for_each(publisher_option_fields(), [&](const auto& f) {
      using T = typename std::decay_t<decltype(f)>::value_type;
      if constexpr (std::is_same_v<T, bool>) u += " [" + flag_of(f.name) + "]";  // a switch
      else u += " [" + flag_of(f.name) + " " + placeholder<T>() + "]";
    });
    return u + " [--quiet]";
  }();
  return text;
}

constexpr const char* kShadowFile = "shadow.safetensors";

uint64_t metadata_u64(const st::Metadata& md, const char* key, uint64_t fallback, const std::string& label) {
  auto it = md.find(key);
  if (it == md.end()) return fallback;
  return parse_decimal<uint64_t>(it->second, label + ": state metadata " + key);
}

// The shadow and publisher state from the store itself: the newest version's weights.
std::optional<std::pair<HostModel, PublisherState>> state_from_store(Store& store, bool quiet) {
  std::optional<StoreResume> resumed = resume_from_store(store);
  if (!resumed) return std::nullopt;
  if (!quiet) std::fprintf(stderr, "publish: no --state; rebuilt the shadow from version %llu in the store\n", static_cast<unsigned long long>(*resumed->state.last_version));
  return std::make_pair(std::move(resumed->shadow), resumed->state);
}

int run_publish(const Args& raw) {
  std::set<std::string> flags(std::begin(kOwnOptions), std::end(kOwnOptions));
  std::set<std::string> switches{"--quiet"};
  fields::for_each(publisher_option_fields(), [&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::value_type;
    (std::is_same_v<T, bool> ? switches : flags).insert(flag_of(f.name));
  });
  ParsedArgs args(raw, flags, switches);
  args.expect_positional(1, usage().c_str());
  const bool quiet = args.has("--quiet");
  const uint64_t version = args.get_u64("--version").value_or(0);
  if (!args.get("--version")) throw Error("missing required option --version: " + usage());
  const auto start = std::chrono::steady_clock::now();

  std::shared_ptr<Store> store = open_store(args.require("--store"));
  // A file or a checkpoint folder, mapped shard by shard (the publisher reads, never copies, it).
  const Checkpoint checkpoint = Checkpoint::open(args.positional()[0]);
  std::vector<TensorMeta> tensors = checkpoint.tensors();
  const std::vector<ConstTensorRef> current = checkpoint_views(checkpoint, tensors);

  // Every PublisherOptions field is a flag; the publisher checks the values (check_options).
  PublisherOptions options;
  fields::for_each(publisher_option_fields(), [&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::value_type;
    const std::string flag = flag_of(f.name);
    if constexpr (std::is_same_v<T, bool>) {
      if (args.has(flag)) f.get(options) = true;
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (auto v = args.get(flag)) f.get(options) = *v;
    } else if constexpr (std::is_floating_point_v<T>) {
      if (auto v = args.get_real(flag)) f.get(options) = *v;  // the one number rule: no sign, finite
    } else {
      if (auto v = args.get_u64(flag)) {
        if (*v > std::numeric_limits<T>::max()) throw Error("option " + flag + " is out of range: " + std::to_string(*v));
        f.get(options) = static_cast<T>(*v);
      }
    }
  });
  if (!quiet) options.log = [](const std::string& line) { std::fprintf(stderr, "publish: %s\n", line.c_str()); };

  // Where the shadow comes from: the state folder, or (after the claim below) the store.
  std::optional<std::string> state_dir = args.get("--state");
  std::optional<std::pair<HostModel, PublisherState>> restored;
  if (state_dir) {
    std::filesystem::create_directories(*state_dir);
    const std::string shadow_path = (std::filesystem::path(*state_dir) / kShadowFile).string();
    if (std::filesystem::exists(shadow_path)) {
      st::File file = st::File::open(shadow_path);
      HostModel shadow = HostModel::from_file(file);
      PublisherState state;
      state.last_version = shadow.version;
      if (!state.last_version) throw Error(shadow_path + ": state has no model_version");
      if (file.metadata().count("last_anchor_version"))
        state.last_anchor_version = metadata_u64(file.metadata(), "last_anchor_version", 0, shadow_path);
      state.delta_bytes_since_anchor = metadata_u64(file.metadata(), "delta_bytes_since_anchor", 0, shadow_path);
      restored.emplace(std::move(shadow), state);
    }
  }
  auto check_newer = [&] {
    if (restored && restored->second.last_version && version <= *restored->second.last_version)
      throw Error("version " + std::to_string(version) + " is not newer than the last published version " +
                  std::to_string(*restored->second.last_version));
  };
  auto check_absent = [&] {
    if (store->head(protocol::manifest_key(version)))
      throw Error(store->describe(protocol::manifest_key(version)) + ": version " + std::to_string(version) + " already exists");
  };
  if (state_dir) {  // refused before the claim below writes anything
    check_newer();
    check_absent();
  }

  // Claims the store (a new epoch of the run; another run is refused before anything is written),
  // then, without a state folder, resumes from what the store holds under that claim.
  Publisher publisher(store, tensors, options);
  if (!state_dir) {
    restored = state_from_store(*store, quiet);
    check_newer();
    check_absent();
  }

  store->set_progress(terminal_progress("upload", quiet));
  if (restored) publisher.restore(restored->first, restored->second);
  publisher.publish(version, current);
  publisher.flush();
  finish_progress();

  if (state_dir) {
    const PublisherState state = publisher.state();
    st::Metadata extra{{"delta_bytes_since_anchor", std::to_string(state.delta_bytes_since_anchor)}};
    if (state.last_anchor_version) extra["last_anchor_version"] = std::to_string(*state.last_anchor_version);
    // After a publish the shadow is the checkpoint just published.
    HostModel shadow = load_model(checkpoint, nullptr);
    shadow.version = version;
    shadow.save((std::filesystem::path(*state_dir) / kShadowFile).string(), extra);
  }

  const auto stats = publisher.stats();
  if (stats.empty()) throw Error("publish: no version was uploaded");
  const VersionStats& s = stats.back();
  uint64_t model_bytes = 0, elements = 0;
  for (const auto& t : tensors) {
    model_bytes += t.numel() * t.width();
    elements += t.numel();
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("version %llu visible in %s: %s%s%s (%llu of %llu elements changed), full weights %s; "
              "publish-to-visible %.3f s (encode %.3f s, upload %.3f s), command %.3f s\n",
              static_cast<unsigned long long>(version), store->url().c_str(),
              s.base_version ? ("delta " + human_bytes(double(s.delta_bytes)) + " from version " + std::to_string(*s.base_version)).c_str() : "",
              s.base_version && s.anchor ? " + " : "", s.anchor ? ("anchor " + human_bytes(double(s.anchor_bytes))).c_str() : "",
              static_cast<unsigned long long>(s.changed_elements), static_cast<unsigned long long>(elements),
              human_bytes(double(model_bytes)).c_str(), s.visible_seconds, s.encode_seconds, s.upload_seconds, total);
  return 0;
}

const bool registered = register_command({"publish", usage().c_str(), &run_publish});

}  // namespace
}  // namespace deltasync::cli
