// The one place that chooses between the CPU twin and the CUDA engine: callers (the CLI, the
// Python bindings) say where their tensors live, this returns the engine for that memory.
#pragma once
#include <memory>

#include "engine/engine.hpp"

namespace deltasync::engine {

// True when this build has the CUDA engine and a CUDA device can be used.
bool cuda_available();

// The engine for tensors in `device` memory. Throws Error("... built without CUDA" / "no CUDA
// device") when a CUDA engine is asked for and cannot be had.
std::unique_ptr<SyncEngine> make_engine(Device device, const EngineOptions& options = {});

}  // namespace deltasync::engine
