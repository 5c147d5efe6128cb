// Per-tensor 64-bit digests (definition in digest_mix.hpp): full computation on the CPU, the
// O(changed) update a delta implies, and the 16-hex-digit text form stored in file metadata.
// The CUDA twin is deltasync/cuda/digest.hpp; both give the same bits.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/placement.hpp"
#include "core/tensor.hpp"

namespace deltasync {

// Digest of a whole tensor (multithreaded). Throws Error naming the tensor unless its width is
// 1, 2 or 4 bytes.
uint64_t digest_tensor(const ConstTensorRef& tensor);

// Digests of several tensors, out[t] for tensors[t]. All tensors are cut into chunks of 2^20
// elements that run on the worker pool together, so many small tensors cost no more than one
// big one. One read of the data, word-at-a-time loads.
std::vector<uint64_t> digest_tensors(std::span<const ConstTensorRef> tensors);
// The same for local shards: tensors[t] holds the full positions placements[t] names (its
// numel equals the placement's), and out[t] is the Σ term over those full positions -- the
// shard's partial, which adds up (mod 2^64) across the shards of a tensor to its digest.
// digest_tensors is this with whole placements.
std::vector<uint64_t> digest_placed_tensors(std::span<const ConstTensorRef> tensors, std::span<const Placement> placements);
// The element widths a digest covers (1, 2, 4): BadInputError("digest: tensor NAME has N-byte
// elements; ...") otherwise. Every engine checks with these words before hashing.
void check_digest_width(uint32_t width, std::string_view name);

// Σ term over `count` contiguous elements whose first one is element `first` of its tensor;
// `bits` points at that element. Single-threaded. Slices of a tensor add up (mod 2^64) to the
// tensor's digest, whatever the cut.
uint64_t digest_slice(uint32_t width, const void* bits, uint64_t first, uint64_t count);

// Σ term(indices[k], bits[k]) over k < count; positions may come in any order. `index_width` is
// 4 (int32) or 8 (int64), as in PatchRef.
uint64_t digest_scattered(uint32_t width, uint64_t count, const void* indices, uint32_t index_width,
                          const void* bits);

// Σ term(indices[k], tensor[indices[k]]): the current terms of the elements at `indices`
// (validated positions inside the tensor), read in place. Used after a scatter to hash what the
// weights now hold rather than what the patch said to write.
uint64_t digest_at(const ConstTensorRef& tensor, uint64_t count, const void* indices, uint32_t index_width);

// The digest of a tensor after the elements at `indices` (distinct positions) changed from
// `old_bits` to `new_bits` (count × width bytes each): digest − Σ term(old) + Σ term(new).
// O(count); nothing is validated (callers validate the patch first).
uint64_t digest_update(uint64_t digest, uint32_t width, uint64_t count, const int64_t* indices, const void* old_bits,
                       const void* new_bits);
// Same for a patch: new bits are patch.values, width is patch.value_width.
uint64_t digest_update(uint64_t digest, const PatchRef& patch, const void* old_bits);

// The amount by which a tensor's digest moves when `patch` replaces `old_bits`
// (digest_update(d, patch, old) == d + digest_shift(patch, old)). Shifts of many patches are
// computed in parallel chunks by digest_shifts: out[t] for patches[t], old_bits[t].
uint64_t digest_shift(const PatchRef& patch, const void* old_bits);
std::vector<uint64_t> digest_shifts(std::span<const PatchRef> patches, std::span<const void* const> old_bits);

// 16 lowercase hex digits, most significant first (the form stored in metadata).
std::string digest_to_hex(uint64_t digest);
// Parses exactly 16 lowercase hex digits (core/parse_number.hpp); throws
// BadInputError("LABEL: digest 'TEXT': not 16 lowercase hex digits") otherwise.
uint64_t digest_from_hex(std::string_view text, std::string_view label);

}  // namespace deltasync
