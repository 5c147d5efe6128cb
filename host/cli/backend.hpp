// Which engine a command runs on -- the CUDA engine when a GPU is present (or --gpu), the CPU
// twin otherwise (or --cpu); engine/select says what exists -- and where the command's host
// tensors (mapped or loaded files) live for it. Every step of a command is the engine's:
// encode, digests, the verified apply. The CLI only places tensors: on the CPU engine they are
// used where they are; on CUDA they are copied into the engine's memory (SyncEngine::allocate,
// write, read), so both backends are interchangeable byte for byte.
#pragma once
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "args.hpp"
#include "core/tensor.hpp"
#include "engine/engine.hpp"

namespace deltasync::cli {

enum class Backend { Cpu, Cuda };

// The switches every engine-using command accepts.
inline const std::set<std::string> kBackendSwitches = {"--cpu", "--gpu"};

// --cpu / --gpu, else CUDA when built in and a device is present. Throws for --gpu without one.
Backend choose_backend(const ParsedArgs& args);
const char* backend_name(Backend b);
std::unique_ptr<engine::SyncEngine> make_engine(Backend backend);

// Host tensors as the engine sees them: the host memory itself on the CPU engine, else a copy
// in one block of the engine's memory (each tensor 256-byte aligned). Valid while *this lives.
class PlacedTensors {
 public:
  PlacedTensors(engine::SyncEngine& engine, std::span<const ConstTensorRef> host);
  // Writable host tensors: download() brings the engine's copy back into them.
  PlacedTensors(engine::SyncEngine& engine, std::span<const TensorRef> host);

  std::vector<ConstTensorRef> views() const;
  // Writable tensors: only of the writable form (Error otherwise: the CPU engine would write
  // into the caller's read-only memory).
  std::vector<TensorRef> refs() const;
  // Tensor t := `bytes` (its full size), e.g. the next step of a trainer.
  void upload(size_t t, const void* bytes);
  // The engine's bits of every tensor back into the writable host tensors (no-op on the CPU).
  void download();

 private:
  void place(std::span<const ConstTensorRef> host);

  engine::SyncEngine& engine_;
  std::unique_ptr<engine::EngineMemory> memory_;
  bool writable_ = false;
  std::vector<TensorRef> host_;    // what the caller passed (data const-cast for the read-only form)
  std::vector<TensorRef> placed_;  // where the engine works on them
};

// Full digests of host tensors (e.g. a mapped file) on the engine, in batches of at most 1 GiB of
// engine memory (a tensor larger than that gets a batch of its own).
std::vector<uint64_t> engine_digests(engine::SyncEngine& engine, std::span<const ConstTensorRef> tensors);

}  // namespace deltasync::cli
