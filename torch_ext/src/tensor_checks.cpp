#include "tensor_checks.hpp"

#include <c10/core/DispatchKey.h>
#include <c10/core/Layout.h>

#include <sstream>

namespace deltasync::torch_ext {

bool is_tensor_subclass(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python);
}

std::optional<std::string> unusable_reason(const at::Tensor& t, std::string_view subclass) {
  if (!t.defined()) return "is undefined (None)";
  if (is_tensor_subclass(t))
    return "is " + std::string(subclass) +
           ", not a plain tensor: pass plain tensors here; a sharded trainer (DTensor, FSDP2 fully_shard) "
           "publishes its shards with deltasync.ShardedDeltaPublisher on every rank";
  if (t.is_meta()) return std::string("is a meta tensor (it has no data)");
  if (t.layout() != c10::kStrided) {
    std::ostringstream layout;
    layout << t.layout();
    return "has layout " + layout.str() + "; deltasync needs dense (strided) tensors";
  }
  if (t.is_quantized())
    return "is quantized (" + std::string(c10::toString(t.scalar_type())) +
           "); deltasync ships bfloat16, float16, float32 and float8 weights";
  if (!t.is_contiguous()) return std::string("is not contiguous");
  if (t.numel() == 0) return std::nullopt;
  const uint64_t needed = (static_cast<uint64_t>(t.storage_offset()) + static_cast<uint64_t>(t.numel())) * t.element_size();
  if (!t.has_storage()) return std::string("has no storage");
  const uint64_t held = t.storage().nbytes();
  if (held < needed || t.storage().data() == nullptr)
    return "needs " + std::to_string(needed) + " bytes of its storage, which holds " + std::to_string(held) +
           " (resized or freed storage)";
  return std::nullopt;
}

}  // namespace deltasync::torch_ext
