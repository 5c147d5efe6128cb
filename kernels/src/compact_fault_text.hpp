// The one-line reason of a GPU compact-decode block fault, in the CPU decoder's words
// (host/codec/compact_codec_block.cpp). Host-only; shared by the decoder and its tests.
#pragma once
#include <string>

#include "compact_decode_kernels.cuh"

namespace deltasync::cuda::detail {

// The reason text of a block fault, worded as host/codec/compact_codec_block.cpp words it.
inline std::string describe_fault(const CompactBlockFault& f) {
  const std::string kind = f.value_table ? "value" : "gap";
  switch (f.code) {
    case kFaultTableTruncated: return "frequency table truncated";
    case kFaultTableOverlong: return "frequency table has an overlong number";
    case kFaultTooManySymbols:
      return kind + " table has " + std::to_string(f.a) + " symbols (at most " + std::to_string(f.b) + ")";
    case kFaultTableEmpty: return kind + " table is empty";
    case kFaultTableExceedsScale: return kind + " table frequencies exceed the scale";
    case kFaultTableShortOfScale: return kind + " table frequencies do not sum to the scale";
    case kFaultTablesTrailing: return "frequency tables have trailing bytes";
    case kFaultRansTruncated: return "rANS stream truncated";
    case kFaultRansInitialState: return "rANS stream has an invalid initial state";
    case kFaultRawTruncated: return "raw bit stream truncated";
    case kFaultGapOutside:
      return "gap after position " + std::to_string(f.a) + " leads outside the tensor (" + std::to_string(f.b) +
             " elements)";
    case kFaultRansTrailing: return "rANS stream has trailing bytes or a bad final state";
    case kFaultRawTrailing: return "raw bit stream has trailing bytes";
    default: return "unknown fault " + std::to_string(f.code);
  }
}

}  // namespace deltasync::cuda::detail
