// The CPU twin of the CUDA kernels: the same operations on host memory, multithreaded, with
// byte-identical results. It is the reference in tests and the backend where no GPU exists.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/sparse_delta.hpp"
#include "core/tensor.hpp"

namespace deltasync::cpu {

// Compares every item's current bits with its shadow, writes the changed positions (ascending)
// and their current bits into `out` (reusing its capacity), and copies the changed bits into
// the shadow so that afterwards shadow == current. Throws Error on a bad width.
void encode(std::span<const EncodeItem> items, SparseDelta& out);

// Validates every patch against its target (same index: patches[t] patches targets[t]): widths
// match, indices strictly ascending and inside the tensor. On any violation throws Error naming
// the tensor and writes nothing; otherwise scatters all values.
void apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches);

// Copies sources[t]'s elements at positions[t] (any order; values ignored) into `out`, patch
// after patch, back to back. Throws Error("gather: tensor NAME: position I out of range") for
// the first position outside its tensor, in patch order; `out` is then unspecified.
void gather(std::span<const ConstTensorRef> sources, std::span<const PatchRef> positions, std::span<uint8_t> out);
// gather's checks before it reads any position, with its messages and in its order (a source's
// element width, a position list's index width, then the output's size), for `out_bytes` of
// output; returns where each tensor's bits start in the output (T + 1 entries: the last is the
// total). Every engine's gather runs these first.
std::vector<uint64_t> gather_layout(std::span<const ConstTensorRef> sources, std::span<const PatchRef> positions,
                                    uint64_t out_bytes);

// Only the validation half of apply (throws the same errors).
void validate(std::span<const TensorRef> targets, std::span<const PatchRef> patches);

}  // namespace deltasync::cpu
