#include "backend.hpp"

#include "core/error.hpp"
#include "engine/cpu_engine.hpp"
#include "engine/select.hpp"
#ifdef DELTASYNC_WITH_CUDA
#include "deltasync/cuda/engine.hpp"
#endif

namespace deltasync::cli {

Backend choose_backend(const ParsedArgs& args) {
  if (args.has("--cpu") && args.has("--gpu")) throw Error("--cpu and --gpu are exclusive");
  if (args.has("--cpu")) return Backend::Cpu;
  // What this build and machine offer is engine/select's to say (one place for the whole tree).
  if (engine::cuda_available()) return Backend::Cuda;
#ifdef DELTASYNC_WITH_CUDA
  if (args.has("--gpu")) throw Error("--gpu: no CUDA device is available");
#else
  if (args.has("--gpu")) throw Error("--gpu: this build of deltasync has no CUDA backend");
#endif
  return Backend::Cpu;
}

const char* backend_name(Backend b) { return b == Backend::Cuda ? "cuda" : "cpu"; }

void encode_on(Backend backend, std::span<const EncodeItem> items, SparseDelta& out) {
#ifdef DELTASYNC_WITH_CUDA
  if (backend == Backend::Cuda) return encode_cuda(items, out);
#endif
  (void)backend;
  cpu::encode(items, out);
}

void encode_compact_on(Backend backend, std::span<const EncodeItem> items, std::span<const TensorMeta> tensors,
                       const compact::Options& options, SparseDelta& out,
                       std::vector<compact::EncodedTensor>& encoded) {
#ifdef DELTASYNC_WITH_CUDA
  if (backend == Backend::Cuda) return encode_cuda(items, out, tensors, options, &encoded);
#endif
  (void)backend;
  cpu::encode(items, out);
  encoded = compact::encode(tensors, out.view(), options);
}

void encode_delta_on(Backend backend, std::span<const EncodeItem> items, std::span<const TensorMeta> tensors,
                     DeltaFormat format, EncodedDelta& out) {
  out.format = format;
  out.compact.clear();
  if (format == DeltaFormat::Compact) return encode_compact_on(backend, items, tensors, {}, out.changes, out.compact);
  encode_on(backend, items, out.changes);
}

void write_encoded_delta(const std::string& path, std::span<const TensorMeta> tensors, EncodedDelta& delta,
                         const DeltaInfo& info) {
  if (delta.format == DeltaFormat::Compact)
    return compact::write_compact_delta(path, tensors, delta.changes.view(), info, std::move(delta.compact));
  write_delta(path, delta.format, tensors, delta.changes.view(), info);
}

void apply_on(Backend backend, std::span<const TensorRef> targets, std::span<const PatchRef> patches) {
#ifdef DELTASYNC_WITH_CUDA
  if (backend == Backend::Cuda) return apply_cuda(targets, patches);
#endif
  (void)backend;
  cpu::apply(targets, patches);
}

}  // namespace deltasync::cli
