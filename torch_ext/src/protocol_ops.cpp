// The store protocol of the C++ library (host/include/deltasync/protocol.hpp) for the Python
// package: object keys, manifests (built, validated and serialized here, parsed here), commits
// (manifest by exclusive create, then LATEST), verified fetches, catch-up planning through a
// manifest catalog, retention. Thin: every rule lives in protocol.cpp; this file only converts
// arguments. Absent versions travel as None (arguments) or -1 (results).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "sync/protocol.hpp"
#include "store_registry.hpp"
#include "tensor_lists.hpp"

namespace deltasync::torch_ext {
namespace {

uint64_t to_version(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0, "deltasync.protocol: ", what, " must be non-negative, got ", v);
  return static_cast<uint64_t>(v);
}

std::optional<uint64_t> to_version(const std::optional<int64_t>& v, const char* what) {
  if (!v) return std::nullopt;
  return to_version(*v, what);
}

int64_t from_version(const std::optional<uint64_t>& v) { return v ? static_cast<int64_t>(*v) : -1; }

std::string new_nonce_op() { return protocol::new_nonce(); }

std::string delta_key_op(int64_t version, std::string nonce) { return protocol::delta_key(to_version(version, "version"), nonce); }

std::string anchor_part_key_op(int64_t version, std::string nonce, int64_t part) {
  return protocol::anchor_part_key(to_version(version, "version"), nonce, to_version(part, "part"));
}

// The manifest JSON of a version, exactly as the C++ publisher writes it; the text is parsed
// back strictly before it is returned, so a manifest the C++ reader would refuse is refused here.
std::string manifest_json(int64_t version, std::optional<int64_t> base_version, std::optional<std::string> delta_key,
                          int64_t delta_size, std::string delta_sha256, std::string delta_format, int64_t changed_elements,
                          std::vector<std::string> anchor_keys, std::vector<int64_t> anchor_sizes,
                          std::vector<std::string> anchor_sha256, std::optional<int64_t> latest_anchor, int64_t total_elements,
                          int64_t model_bytes, std::string digest_algorithm, std::vector<std::string> digest_names,
                          std::vector<std::string> digest_values, int64_t created_unix_ms) {
  TORCH_CHECK(anchor_keys.size() == anchor_sizes.size() && anchor_keys.size() == anchor_sha256.size(),
              "deltasync.protocol_manifest_json: anchor_keys, anchor_sizes and anchor_sha256 differ in length");
  TORCH_CHECK(digest_names.size() == digest_values.size(),
              "deltasync.protocol_manifest_json: digest_names and digest_values differ in length");
  protocol::Manifest m;
  m.version = to_version(version, "version");
  m.base_version = to_version(base_version, "base_version");
  if (delta_key) m.delta = protocol::ObjectRef{*delta_key, to_version(delta_size, "delta_size"), delta_sha256};
  m.delta_format = delta_format;
  m.changed_elements = to_version(changed_elements, "changed_elements");
  for (size_t i = 0; i < anchor_keys.size(); ++i)
    m.anchor_parts.push_back({anchor_keys[i], to_version(anchor_sizes[i], "anchor size"), anchor_sha256[i]});
  m.latest_anchor = to_version(latest_anchor, "latest_anchor");
  m.total_elements = to_version(total_elements, "total_elements");
  m.model_bytes = to_version(model_bytes, "model_bytes");
  m.digest_algorithm = digest_algorithm;
  for (size_t i = 0; i < digest_names.size(); ++i) m.digests[digest_names[i]] = digest_values[i];
  m.created_unix_ms = to_version(created_unix_ms, "created_unix_ms");
  std::string text = protocol::to_json(m);
  const std::string label = "deltasync.protocol_manifest_json: version " + std::to_string(version);
  translate_errors("deltasync.protocol_manifest_json", [&] { protocol::manifest_from_json(text, label); });
  return text;
}

// Makes a version visible (manifest by exclusive create, then LATEST); false when the version
// already exists with other contents.
bool commit_version(std::string url, std::string manifest_text) {
  auto store = store_for(url);
  return translate_errors("deltasync.protocol_commit_version", [&] {
    return protocol::commit_version(*store, protocol::manifest_from_json(manifest_text, "deltasync.protocol_commit_version"));
  });
}

// An object's bytes, checked against the size and SHA-256 its manifest names.
at::Tensor fetch_verified(std::string url, std::string key, int64_t size, std::string sha256) {
  auto store = store_for(url);
  std::vector<uint8_t> bytes = translate_errors("deltasync.protocol_fetch_verified", [&] {
    auto data = store->get(key);
    protocol::verify_object(protocol::ObjectRef{key, to_version(size, "size"), sha256}, data, store->describe(key));
    return data;
  });
  at::Tensor out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(out.mutable_data_ptr(), bytes.data(), bytes.size());
  return out;
}

// Keeps the newest `keep_anchors` anchors and what follows them; returns the deleted versions.
std::vector<int64_t> apply_retention(std::string url, int64_t keep_anchors) {
  auto store = store_for(url);
  return translate_errors("deltasync.protocol_apply_retention", [&] {
    auto report = protocol::apply_retention(*store, to_version(keep_anchors, "keep_anchors"));
    return std::vector<int64_t>(report.deleted_versions.begin(), report.deleted_versions.end());
  });
}

// protocol::Catalog as a torch class: one per reader, so manifests are fetched once each.
struct Catalog : torch::CustomClassHolder {
  explicit Catalog(const std::string& url) : store(store_for(url)), catalog(*store) {}

  // The version's manifest as JSON (the C++ serializer's text of the strictly parsed manifest),
  // or "" when the version does not exist.
  std::string find(int64_t version) {
    return translate_errors("deltasync.Catalog.find", [&] {
      const protocol::Manifest* m = catalog.find(to_version(version, "version"));
      return m ? protocol::to_json(*m) : std::string();
    });
  }

  // The newest visible version (LATEST or the newest listed manifest), -1 when none. Stores
  // that cannot list (http) are asked for LATEST only, from the first refusal on.
  int64_t newest() {
    return translate_errors("deltasync.Catalog.newest", [&] {
      if (can_list) {
        try {
          return from_version(catalog.newest(true));
        } catch (const Error& e) {
          if (std::string(e.what()).find("listing is not supported") == std::string::npos) throw;
          can_list = false;
        }
      }
      return from_version(catalog.newest(false));
    });
  }

  // protocol::plan_catch_up: (found, anchor version or -1, delta versions in order, bytes).
  std::tuple<bool, int64_t, std::vector<int64_t>, int64_t> plan(std::optional<int64_t> current, int64_t target,
                                                                bool allow_current) {
    return translate_errors("deltasync.Catalog.plan", [&] {
      auto plan = protocol::plan_catch_up(catalog, to_version(current, "current"), to_version(target, "target"), allow_current);
      if (!plan) return std::make_tuple(false, int64_t{-1}, std::vector<int64_t>{}, int64_t{0});
      return std::make_tuple(true, from_version(plan->anchor_version),
                             std::vector<int64_t>(plan->deltas.begin(), plan->deltas.end()), static_cast<int64_t>(plan->bytes));
    });
  }

  void forget(int64_t version) { catalog.forget(to_version(version, "version")); }

  std::shared_ptr<Store> store;  // outlives `catalog`, which refers to it
  protocol::Catalog catalog;
  bool can_list = true;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(deltasync, m) {
  m.def("protocol_new_nonce() -> str", &new_nonce_op);
  m.def("protocol_delta_key(int version, str nonce) -> str", &delta_key_op);
  m.def("protocol_anchor_part_key(int version, str nonce, int part) -> str", &anchor_part_key_op);
  m.def(
      "protocol_manifest_json(int version, int? base_version, str? delta_key, int delta_size, str delta_sha256, "
      "str delta_format, int changed_elements, str[] anchor_keys, int[] anchor_sizes, str[] anchor_sha256, "
      "int? latest_anchor, int total_elements, int model_bytes, str digest_algorithm, str[] digest_names, "
      "str[] digest_values, int created_unix_ms) -> str",
      &manifest_json);
  m.def("protocol_commit_version(str url, str manifest) -> bool", &commit_version);
  m.def("protocol_fetch_verified(str url, str key, int size, str sha256) -> Tensor", &fetch_verified);
  m.def("protocol_apply_retention(str url, int keep_anchors) -> int[]", &apply_retention);
  m.class_<Catalog>("Catalog")
      .def(torch::init<std::string>())
      .def("find", &Catalog::find)
      .def("newest", &Catalog::newest)
      .def("plan", &Catalog::plan)
      .def("forget", &Catalog::forget);
}

}  // namespace deltasync::torch_ext
