// An anchor of slices (a shard-local publish: each part holds one rank's slices of many tensors,
// sync/shard_parts.hpp) streamed into full tensors a group at a time, so host memory stays
// bounded by about a part whatever the model's size.
//
// How: the parts' headers are read first (two ranged GETs each) and checked as a whole before
// any tensor byte moves: every part is for this version, its tensor table is contiguous and
// fills the part to its manifest size, every slice holds as many elements as its placement, a
// tensor's dtype and full shape agree across parts, its slices tile it exactly (check_tiling),
// and the sum of its slices' recorded digests is the manifest's digest (digests add up mod 2^64
// over positions). Then tensors go out in groups of at most `group_bytes` of full tensors (one
// larger tensor alone): for each group, each part's next byte range -- the group's slices in it
// -- is fetched with a ranged GET, every slice's digest recomputed and compared with its record
// before its bytes are placed, and the assembled group handed to `write` with its digests.
//
// Each part is read exactly once, front to back, so its SHA-256 is computed as it streams and
// compared with the manifest's when its last byte has arrived: after its slices were written
// (staged), before this returns. A failure throws Error naming the part and tensor; the caller
// keeps what `write` was given staged and discards it (Subscriber::stream_anchor's contract).
// A part whose tensors come in another order than the others' (no single order reads every part
// front to back) is refused with kUnsupported before `write` is called: the caller loads such an
// anchor whole, as before. Every shard-local publish writes its parts in one order.
//
// Memory: one group of full tensors plus one part's share of it. Requests: 2 per part for the
// headers, then (groups x parts) ranged GETs.
#pragma once
#include <cstdint>
#include <functional>
#include <span>

#include "core/tensor_meta.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"

namespace deltasync {

struct SliceStreamStats {
  uint64_t bytes_fetched = 0;
  uint64_t elements = 0;
  double fetch_seconds = 0;
};

// write(tensors, their full bits, their digests) for one group.
using TensorGroupWriter = std::function<void(std::span<const TensorMeta>, std::span<const std::span<const uint8_t>>,
                                             std::span<const uint64_t>)>;

SliceStreamStats stream_slice_anchor(Store& store, const protocol::Manifest& manifest, uint64_t group_bytes,
                                     const TensorGroupWriter& write);

}  // namespace deltasync
