// The stores the operators use, opened once per URL (options and credentials from the
// environment, as the CLI opens them) and shared by the store and protocol bindings.
#pragma once
#include <memory>
#include <string>

#include "store/store.hpp"

namespace deltasync::torch_ext {

// The store of `url` (file://, a plain path, s3://, http(s)://); throws c10::Error
// (RuntimeError in Python) for a URL open_store refuses.
std::shared_ptr<Store> store_for(const std::string& url);

}  // namespace deltasync::torch_ext
