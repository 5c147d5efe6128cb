// The GPU compact decoder's verdict on a decode, which every kernel after the block decode
// reads (compact_decode_kernels.cuh writes it; compact_tile_kernels.cuh skips a failed decode).
#pragma once
#include <cstdint>

namespace deltasync::cuda::detail {

inline constexpr uint32_t kNoBadBlock = 0xFFFFFFFFu;
struct CompactDecodeStatus {
  uint32_t first_bad_block;        // lowest block with a fault, or kNoBadBlock
  uint32_t first_unordered_block;  // lowest block starting at or before its predecessor's last
  uint32_t first_crossing_block;   // lowest block of a tiled tensor ending in another tile than it starts in
};

}  // namespace deltasync::cuda::detail
