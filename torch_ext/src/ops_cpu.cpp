// CPU implementations of torch.ops.deltasync: thin wrappers over deltasync::cpu (the same code
// the CLI and the C++ publisher use), so results are byte-identical to theirs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "engine/cpu_engine.hpp"
#include "core/sparse_delta.hpp"
#include "tensor_lists.hpp"
#ifdef DELTASYNC_TORCH_WITH_DIGEST
#include "codec/digest.hpp"
#endif

namespace deltasync::torch_ext {
namespace {

// Hands a vector's buffer to a tensor without copying (the tensor's deleter frees it).
template <class T>
at::Tensor adopt(std::vector<T>&& data, at::ScalarType dtype, uint64_t numel) {
  auto owner = std::make_unique<std::vector<T>>(std::move(data));
  void* ptr = owner->data();
  auto tensor = at::from_blob(
      ptr, {static_cast<int64_t>(numel)}, [keep = owner.get()](void*) { delete keep; }, at::TensorOptions().dtype(dtype));
  owner.release();
  return tensor;
}

at::Tensor counts_from_offsets(const std::vector<uint64_t>& offsets) {
  at::Tensor counts = at::empty({static_cast<int64_t>(offsets.size()) - 1}, at::kLong);
  auto* out = counts.mutable_data_ptr<int64_t>();
  for (size_t t = 0; t + 1 < offsets.size(); ++t) out[t] = static_cast<int64_t>(offsets[t + 1] - offsets[t]);
  return counts;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> encode_with_base_cpu(at::TensorList current,
                                                                                at::TensorList shadow,
                                                                                const OptionalNames& names) {
  EncodeArgs args = encode_args(current, shadow, names, c10::DeviceType::CPU);
  SparseDelta delta;
  translate_errors("deltasync.encode", [&] { cpu::encode(args.items, delta); });
  const uint64_t changed = delta.offsets.back();
  const uint64_t value_bytes = delta.value_offsets.back();
  at::Tensor counts = counts_from_offsets(delta.offsets);
  // The engine may leave spare capacity in its vectors; the tensors show only the used part.
  return {adopt(std::move(delta.indices), at::kLong, changed), adopt(std::move(delta.values), at::kByte, value_bytes),
          adopt(std::move(delta.base_values), at::kByte, value_bytes), counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_cpu(at::TensorList current, at::TensorList shadow,
                                                          const OptionalNames& names) {
  auto [indices, values, base_values, counts] = encode_with_base_cpu(current, shadow, names);
  return {indices, values, counts};
}

void apply_cpu(at::TensorList targets, const at::Tensor& indices, const at::Tensor& values, const at::Tensor& counts,
               const OptionalNames& names) {
  const ApplyArgs args = apply_args(targets, indices, values, counts.cpu(), names, c10::DeviceType::CPU);
  translate_errors("deltasync.apply", [&] { cpu::apply(args.targets, args.patches); });
}

at::Tensor digest_cpu(at::TensorList tensors) {
#ifdef DELTASYNC_TORCH_WITH_DIGEST
  TORCH_CHECK(!tensors.empty(), "deltasync.digest: empty tensor list");
  const std::vector<std::string> labels = tensor_labels("tensors", tensors.size(), std::nullopt);
  std::vector<ConstTensorRef> refs;
  refs.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    TORCH_CHECK(tensors[t].device().is_cpu(), "deltasync.digest: tensor ", labels[t], " is on ", tensors[t].device());
    check_usable(tensors[t], labels[t]);
    refs.push_back(ConstTensorRef{labels[t], tensors[t].const_data_ptr(), static_cast<uint64_t>(tensors[t].numel()),
                                  element_width(tensors[t], labels[t])});
  }
  const std::vector<uint64_t> digests = translate_errors("deltasync.digest", [&] { return digest_tensors(refs); });
  at::Tensor out = at::empty({static_cast<int64_t>(digests.size())}, at::kLong);
  std::memcpy(out.mutable_data_ptr<int64_t>(), digests.data(), digests.size() * sizeof(uint64_t));
  return out;
#else
  (void)tensors;
  TORCH_CHECK(false, "deltasync.digest: this build has no digest support (deltasync/digest.hpp was missing)");
#endif
}

at::Tensor digest_shift_cpu(const at::Tensor& indices, const at::Tensor& old_values, const at::Tensor& new_values,
                            const at::Tensor& counts, c10::IntArrayRef widths) {
#ifdef DELTASYNC_TORCH_WITH_DIGEST
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.is_contiguous(),
              "deltasync.digest_shift: indices must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 1 &&
                  counts.numel() == static_cast<int64_t>(widths.size()),
              "deltasync.digest_shift: counts must be 1-D int64 with one entry per width");
  const at::Tensor old_bytes = old_values.contiguous(), new_bytes = new_values.contiguous(), n = counts.contiguous();
  const uint64_t value_bytes = static_cast<uint64_t>(new_bytes.numel()) * new_bytes.element_size();
  TORCH_CHECK(static_cast<uint64_t>(old_bytes.numel()) * old_bytes.element_size() == value_bytes,
              "deltasync.digest_shift: old and new values differ in size");
  std::vector<PatchRef> patches;
  std::vector<const void*> old_bits;
  uint64_t index_at = 0, value_at = 0;
  for (size_t t = 0; t < widths.size(); ++t) {
    const int64_t count = n.const_data_ptr<int64_t>()[t];
    const int64_t width = widths[t];
    TORCH_CHECK(width == 1 || width == 2 || width == 4, "deltasync.digest_shift: width ", width, " is not 1, 2 or 4");
    TORCH_CHECK(count >= 0 && index_at + count <= static_cast<uint64_t>(indices.numel()) &&
                    value_at + count * width <= value_bytes,
                "deltasync.digest_shift: counts and widths do not match the indices and values given");
    patches.push_back(PatchRef{static_cast<uint64_t>(count), indices.const_data_ptr<int64_t>() + index_at, 8,
                               static_cast<const uint8_t*>(new_bytes.const_data_ptr()) + value_at,
                               static_cast<uint32_t>(width)});
    old_bits.push_back(static_cast<const uint8_t*>(old_bytes.const_data_ptr()) + value_at);
    index_at += count;
    value_at += count * width;
  }
  TORCH_CHECK(index_at == static_cast<uint64_t>(indices.numel()) && value_at == value_bytes,
              "deltasync.digest_shift: counts and widths do not cover the indices and values given");
  const std::vector<uint64_t> shifts =
      translate_errors("deltasync.digest_shift", [&] { return digest_shifts(patches, old_bits); });
  at::Tensor out = at::empty({static_cast<int64_t>(shifts.size())}, at::kLong);
  std::memcpy(out.mutable_data_ptr<int64_t>(), shifts.data(), shifts.size() * sizeof(uint64_t));
  return out;
#else
  (void)indices, (void)old_values, (void)new_values, (void)counts, (void)widths;
  TORCH_CHECK(false, "deltasync.digest_shift: this build has no digest support (deltasync/digest.hpp was missing)");
#endif
}

void register_cpu_kernels(torch::Library& m) {
  m.impl("encode", &encode_cpu);
  m.impl("encode_with_base", &encode_with_base_cpu);
  m.impl("apply", &apply_cpu);
  m.impl("digest", &digest_cpu);
  m.impl("digest_shift", &digest_shift_cpu);
}

}  // namespace

TORCH_LIBRARY_IMPL(deltasync, CPU, m) { register_cpu_kernels(m); }
// Sparse and quantized CPU tensors come to the same kernels, whose tensor check refuses them with
// one line naming the tensor (tensor_checks.hpp), instead of the dispatcher's page on a missing
// kernel.
TORCH_LIBRARY_IMPL(deltasync, SparseCPU, m) { register_cpu_kernels(m); }
TORCH_LIBRARY_IMPL(deltasync, QuantizedCPU, m) { register_cpu_kernels(m); }

}  // namespace deltasync::torch_ext
