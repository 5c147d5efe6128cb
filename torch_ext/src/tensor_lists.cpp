#include "tensor_lists.hpp"

#include <c10/util/Exception.h>

#include "tensor_checks.hpp"

namespace deltasync::torch_ext {

std::vector<std::string> tensor_labels(const char* list, size_t n, const OptionalNames& names) {
  if (names) {
    TORCH_CHECK(names->size() == n, "deltasync: ", names->size(), " names given for ", n, " tensors in ", list);
    return *names;
  }
  std::vector<std::string> labels;
  labels.reserve(n);
  for (size_t i = 0; i < n; ++i) labels.push_back(std::string(list) + "[" + std::to_string(i) + "]");
  return labels;
}

uint32_t element_width(const at::Tensor& t, const std::string& label) {
  const auto width = static_cast<uint32_t>(t.element_size());
  TORCH_CHECK(width == 1 || width == 2 || width == 4, "deltasync: tensor ", label, ": dtype ", t.scalar_type(),
              " has ", width, "-byte elements (supported: 1, 2 or 4 bytes, e.g. bfloat16, float16, float32, float8)");
  return width;
}

void check_usable(const at::Tensor& t, const std::string& label) {
  const std::optional<std::string> reason = unusable_reason(t);
  TORCH_CHECK(!reason, "deltasync: tensor ", label, " ", reason.value_or(""));
}

namespace {

// Usable at all, then on the dispatched device and on the first tensor's.
void check_placed(const at::Tensor& t, const std::string& label, c10::DeviceType device, const c10::Device& first) {
  check_usable(t, label);
  TORCH_CHECK(t.device().type() == device, "deltasync: tensor ", label, " is on ", t.device(), ", expected ",
              c10::DeviceTypeName(device, /*lower_case=*/true));
  TORCH_CHECK(t.device() == first, "deltasync: tensor ", label, " is on ", t.device(), " but the first tensor is on ",
              first, " (one call handles one device)");
}

}  // namespace

EncodeArgs encode_args(at::TensorList current, at::TensorList shadow, const OptionalNames& names,
                       c10::DeviceType device) {
  TORCH_CHECK(!current.empty(), "deltasync.encode: empty tensor list");
  TORCH_CHECK(current.size() == shadow.size(), "deltasync.encode: ", current.size(), " current tensors but ",
              shadow.size(), " shadows");
  EncodeArgs args;
  args.labels = tensor_labels("current", current.size(), names);
  args.items.reserve(current.size());
  const c10::Device first = current[0].device();
  for (size_t i = 0; i < current.size(); ++i) {
    const std::string& label = args.labels[i];
    const at::Tensor& cur = current[i];
    const at::Tensor& sh = shadow[i];
    check_placed(cur, label, device, first);
    check_placed(sh, label + " (shadow)", device, first);
    const uint32_t width = element_width(cur, label);
    TORCH_CHECK(sh.element_size() == width, "deltasync.encode: tensor ", label, ": shadow has ", sh.element_size(),
                "-byte elements, current has ", width);
    TORCH_CHECK(sh.numel() == cur.numel(), "deltasync.encode: tensor ", label, ": shadow has ", sh.numel(),
                " elements, current has ", cur.numel());
    args.items.push_back(EncodeItem{label, cur.const_data_ptr(), sh.mutable_data_ptr(),
                                    static_cast<uint64_t>(cur.numel()), width});
  }
  return args;
}

ApplyArgs apply_args(at::TensorList targets, const at::Tensor& indices, const at::Tensor& values,
                     const at::Tensor& counts_host, const OptionalNames& names, c10::DeviceType device) {
  TORCH_CHECK(!targets.empty(), "deltasync.apply: empty tensor list");
  TORCH_CHECK(counts_host.scalar_type() == at::kLong && counts_host.dim() == 1 &&
                  counts_host.numel() == static_cast<int64_t>(targets.size()),
              "deltasync.apply: counts must be a 1-D int64 tensor with one entry per target (", targets.size(),
              "), got ", counts_host.scalar_type(), " of shape ", counts_host.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
              "deltasync.apply: indices must be int64 or int32, got ", indices.scalar_type());
  TORCH_CHECK(indices.dim() == 1, "deltasync.apply: indices must be 1-D, got shape ", indices.sizes());
  ApplyArgs args;
  args.labels = tensor_labels("targets", targets.size(), names);
  const c10::Device first = targets[0].device();
  check_placed(indices, "indices", device, first);
  check_placed(values, "values", device, first);

  const at::Tensor counts = counts_host.contiguous();
  const int64_t* count = counts.const_data_ptr<int64_t>();
  const auto index_width = static_cast<uint32_t>(indices.element_size());
  const auto* index_bytes = static_cast<const uint8_t*>(indices.const_data_ptr());
  const auto* value_bytes = static_cast<const uint8_t*>(values.const_data_ptr());
  const uint64_t total_indices = static_cast<uint64_t>(indices.numel());
  const uint64_t total_value_bytes = static_cast<uint64_t>(values.numel()) * values.element_size();
  uint64_t index_at = 0, value_at = 0;
  args.targets.reserve(targets.size());
  args.patches.reserve(targets.size());
  for (size_t t = 0; t < targets.size(); ++t) {
    const std::string& label = args.labels[t];
    check_placed(targets[t], label, device, first);
    const uint32_t width = element_width(targets[t], label);
    TORCH_CHECK(count[t] >= 0, "deltasync.apply: tensor ", label, ": negative count ", count[t]);
    const auto n = static_cast<uint64_t>(count[t]);
    TORCH_CHECK(n <= total_indices - index_at, "deltasync.apply: counts add up to more than the ", total_indices,
                " indices given (at tensor ", label, ")");
    TORCH_CHECK(n * width <= total_value_bytes - value_at, "deltasync.apply: tensor ", label, ": values hold ",
                total_value_bytes, " bytes, too few for the counts and widths of the targets");
    args.targets.push_back(TensorRef{label, targets[t].mutable_data_ptr(), static_cast<uint64_t>(targets[t].numel()), width});
    args.patches.push_back(PatchRef{n, index_bytes + index_at * index_width, index_width, value_bytes + value_at, width});
    index_at += n;
    value_at += n * width;
  }
  TORCH_CHECK(index_at == total_indices, "deltasync.apply: counts add up to ", index_at, " but ", total_indices,
              " indices were given");
  TORCH_CHECK(value_at == total_value_bytes, "deltasync.apply: the patches need ", value_at, " value bytes but ",
              total_value_bytes, " were given");
  return args;
}

}  // namespace deltasync::torch_ext
