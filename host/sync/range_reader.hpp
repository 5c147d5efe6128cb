// The reads of one ranged fetch (sync/ranged_fetch.hpp): requests and bytes counted, what was
// fetched kept by object offset (ranges that touch joined into one span), so that a later step
// views any range inside what an earlier one read and never fetches a byte twice.
#pragma once
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "sync/range_hashes.hpp"
#include "sync/ranged_fetch.hpp"

namespace deltasync::ranged {

class RangeReader {
 public:
  RangeReader(const RangeGet& get, uint64_t object_size, std::string label);
  // Fetches what `ranges` (object offsets) hold that is not held yet, one request per range left.
  // Returns the bytes fetched. A short read is a BadInputError naming the object.
  uint64_t fetch(std::span<const ByteRange> ranges);
  bool holds(ByteRange r) const;
  // A held range (Error if not: a planning bug), valid until the next fetch (which may join the
  // spans it lies in).
  std::span<const uint8_t> view(ByteRange r) const;
  uint64_t bytes() const { return bytes_; }
  uint64_t requests() const { return requests_; }

 private:
  const RangeGet& get_;
  uint64_t object_size_;
  std::string label_;
  std::map<uint64_t, std::vector<uint8_t>> held_;
  uint64_t bytes_ = 0, requests_ = 0;
};

// The indexed layout's steps after its header (ranged_indexed.cpp): `out` gets the reduced file,
// the chosen blocks and the index and block bytes; the reader's counters hold the rest.
void read_indexed(RangeReader& reader, const SealedHeader& header, const NeededRanges& needed, const PartScope& scope,
                  const ReadOptions& options, const std::string& label, RangedDelta& out);

}  // namespace deltasync::ranged
