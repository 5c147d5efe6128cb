// deltasync's object stores (folder, S3-compatible, HTTP; host/include/deltasync/store.hpp) as
// torch.ops, so the Python package reaches every store the C++ library supports (file://
// included: the package has no store of its own). Stores are
// opened once per URL (options from the environment, as the CLI does) and reused.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "store/store.hpp"
#include "store_registry.hpp"
#include "tensor_lists.hpp"

namespace deltasync::torch_ext {

std::shared_ptr<Store> store_for(const std::string& url) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<Store>> stores;
  std::lock_guard lock(mutex);
  auto& slot = stores[url];
  if (!slot) slot = translate_errors("deltasync.store", [&] { return std::shared_ptr<Store>(open_store(url)); });
  return slot;
}

namespace {

std::span<const uint8_t> bytes_of(const at::Tensor& data) {
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous(), "deltasync.store: object bytes must be a contiguous CPU tensor");
  return {static_cast<const uint8_t*>(data.const_data_ptr()), static_cast<size_t>(data.numel()) * data.element_size()};
}

at::Tensor store_get(std::string url, std::string key) {
  auto store = store_for(url);
  std::vector<uint8_t> bytes;
  try {
    bytes = store->get(key);
  } catch (const NotFoundError& e) {
    // A stable marker the Python side turns into its NotFound exception.
    TORCH_CHECK(false, "deltasync.store_get: no such object: ", e.what());
  } catch (const Error& e) {
    TORCH_CHECK(false, "deltasync.store_get: ", e.what());
  }
  at::Tensor out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(out.mutable_data_ptr(), bytes.data(), bytes.size());
  return out;
}

void store_put(std::string url, std::string key, const at::Tensor& data) {
  auto store = store_for(url);
  translate_errors("deltasync.store_put", [&] { store->put(key, bytes_of(data)); });
}

bool store_put_if_absent(std::string url, std::string key, const at::Tensor& data) {
  auto store = store_for(url);
  return translate_errors("deltasync.store_put_if_absent", [&] { return store->put_if_absent(key, bytes_of(data)); });
}

bool store_exists(std::string url, std::string key) {
  auto store = store_for(url);
  return translate_errors("deltasync.store_exists", [&] { return store->head(key).has_value(); });
}

std::vector<std::string> store_list(std::string url, std::string prefix) {
  auto store = store_for(url);
  return translate_errors("deltasync.store_list", [&] {
    std::vector<std::string> keys;
    for (const ObjectInfo& info : store->list(prefix)) keys.push_back(info.key);
    return keys;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deltasync, m) {
  m.def("store_get(str url, str key) -> Tensor", &store_get);
  m.def("store_put(str url, str key, Tensor data) -> ()", &store_put);
  m.def("store_put_if_absent(str url, str key, Tensor data) -> bool", &store_put_if_absent);
  m.def("store_exists(str url, str key) -> bool", &store_exists);
  m.def("store_list(str url, str prefix) -> str[]", &store_list);
}

}  // namespace deltasync::torch_ext
