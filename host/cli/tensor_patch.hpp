// A delta's share for some of a model's tensors, patched into host tensors with a verified
// apply: what `apply` does for each shard of a checkpoint folder and `pull` for each tensor of
// OUT (checkpoint_receiver.hpp), so a delta is applied to a checkpoint one piece at a time by
// one implementation.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "backend.hpp"
#include "core/tensor.hpp"
#include "engine/engine.hpp"
#include "engine/integrity.hpp"

namespace deltasync::cli {

// The part of a delta that patches some tensors (one shard of a folder, the whole file, one
// tensor): patches[t] for the piece's tensor t, and the promises about those tensors.
struct FilePatch {
  std::vector<PatchRef> patches;
  std::optional<integrity::DeltaDigests> promises;
  uint64_t model_version = 0;
};

// The patches and promises of a delta (patches[t] for meta[t]) that concern meta[first, first + n).
FilePatch file_patch(std::span<const PatchRef> patches, uint64_t model_version, const std::optional<integrity::DeltaDigests>& promises,
                     std::span<const TensorMeta> meta, size_t first, size_t n);

// Every tensor a delta's digests name must be one it changes: split by piece, a promise naming a
// tensor of no piece would otherwise go unchecked.
void check_promises_name_changes(std::span<const PatchRef> patches, const integrity::DeltaDigests& promises,
                                 std::span<const TensorMeta> meta, const std::string& label);

// Full digests of the tensors the patch changes (0 for the others), in piece order, on the
// engine: `all` in its memory already, or host tensors it reads in batches.
std::vector<uint64_t> changed_digests(engine::SyncEngine& engine, const std::vector<ConstTensorRef>& all, const FilePatch& patch,
                                      bool in_engine_memory);

// Patches host tensors in place on the engine. With promises, the engine's verified apply (base
// digests checked before anything is written, result digests in O(changed) after, every byte
// restored on a mismatch); without, its validated scatter (nothing written for an invalid
// patch). Returns the digests after the apply (0 for unchanged tensors; empty without promises).
// Errors are prefixed with `label` (the delta's).
std::vector<uint64_t> patch_tensors(engine::SyncEngine& engine, std::span<const TensorRef> host, const FilePatch& patch,
                                    std::optional<uint64_t> version, const std::string& label);

}  // namespace deltasync::cli
