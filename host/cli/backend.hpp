// Which engine a command runs on: the CUDA kernels when a GPU is present (or --gpu), the CPU
// twin otherwise (or --cpu). Commands hand host buffers to these functions; the CUDA path
// moves them to the device and back, so both backends are interchangeable byte for byte.
#pragma once
#include <span>

#include "args.hpp"
#include "codec/compact_codec.hpp"
#include "codec/delta_io.hpp"
#include "core/sparse_delta.hpp"
#include "core/tensor.hpp"

namespace deltasync::cli {

enum class Backend { Cpu, Cuda };

// The switches every engine-using command accepts.
inline const std::set<std::string> kBackendSwitches = {"--cpu", "--gpu"};

// --cpu / --gpu, else CUDA when built in and a device is present. Throws for --gpu without one.
Backend choose_backend(const ParsedArgs& args);
const char* backend_name(Backend b);

// cpu::encode semantics on host buffers (shadows updated in place).
void encode_on(Backend backend, std::span<const EncodeItem> items, SparseDelta& out);
// encode_on, and the compact encoding of its result (compact::encode semantics, byte-identical
// on both backends). On CUDA the change set is compacted on the device before it is staged, so
// the compact bytes never wait for a host-side codec pass. `tensors` describes items in order.
void encode_compact_on(Backend backend, std::span<const EncodeItem> items, std::span<const TensorMeta> tensors,
                       const compact::Options& options, SparseDelta& out,
                       std::vector<compact::EncodedTensor>& encoded);
// A delta in the layout it will be written in: the change set, and for the compact layout its
// encoded tensors (from the GPU codec on the CUDA backend).
struct EncodedDelta {
  DeltaFormat format = DeltaFormat::Compact;
  SparseDelta changes;
  std::vector<compact::EncodedTensor> compact;
};
// encode_on, or encode_compact_on for the compact layout (default codec options).
void encode_delta_on(Backend backend, std::span<const EncodeItem> items, std::span<const TensorMeta> tensors,
                     DeltaFormat format, EncodedDelta& out);
// Writes it atomically; the compact tensors are moved into the file.
void write_encoded_delta(const std::string& path, std::span<const TensorMeta> tensors, EncodedDelta& delta,
                         const DeltaInfo& info);

// cpu::apply semantics on host buffers (nothing written on an invalid patch).
void apply_on(Backend backend, std::span<const TensorRef> targets, std::span<const PatchRef> patches);

#ifdef DELTASYNC_WITH_CUDA
void encode_cuda(std::span<const EncodeItem> items, SparseDelta& out);
// encode_cuda plus the GPU compact codec; `encoded` may be null (plain encode).
void encode_cuda(std::span<const EncodeItem> items, SparseDelta& out, std::span<const TensorMeta> tensors,
                 const compact::Options& options, std::vector<compact::EncodedTensor>* encoded);
void apply_cuda(std::span<const TensorRef> targets, std::span<const PatchRef> patches);
#endif

}  // namespace deltasync::cli
