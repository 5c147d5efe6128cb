// A rank's delta part of the indexed layout without its payloads: what the scale model writes at
// the full table's width (--index-parts), where publishing the data is out of reach, so that the
// receivers' ranged reads of the parts' headers, records and block index entries are measured,
// not extrapolated. The part is the real container (compact::indexed::build_head): one record per
// tensor whose slice changed, block indexes cut as the publisher cuts them (compact::choose_tiles,
// blocks of block_elements changes per tile) over the changes the slice would have at `changed`,
// spread evenly over its coded positions; each block's payload is `bytes_per_change` x its changes
// of zero bytes, which the store does not keep (CountingStore::put_head) and the block hashes are
// of.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "codec/compact_format.hpp"
#include "codec/compact_table.hpp"
#include "sync/shard_receipts.hpp"

namespace deltasync::scale_model {

struct IndexPart {
  std::vector<uint8_t> head;  // the object's bytes before its payloads
  uint64_t size = 0;          // the whole object's
  uint64_t changes = 0, records = 0;
};

IndexPart index_part(const compact::TensorTable& table, std::span<const ShardTensor> tensors, uint64_t rank, double changed,
                     double bytes_per_change, const compact::Options& options);

}  // namespace deltasync::scale_model
