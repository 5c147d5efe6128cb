// Element types that appear in checkpoints and delta files, with their safetensors spellings.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace deltasync {

enum class DType : uint8_t { BF16, F16, F32, F8_E4M3, F8_E5M2, F64, I8, U8, I16, U16, I32, U32, I64, U64, BOOL };

// Bytes per element.
uint32_t dtype_width(DType t);
// The safetensors name ("BF16", "F8_E4M3", ...).
std::string_view dtype_name(DType t);
std::optional<DType> dtype_from_name(std::string_view name);
// Weight dtypes deltasync diffs and patches: BF16, F16, F32, F8_E4M3, F8_E5M2.
bool is_weight_dtype(DType t);
// Every DType, in enum order (what a table derived from this one walks).
std::span<const DType> all_dtypes();

}  // namespace deltasync
