// The dtype table: one row per DType, in enum order, so width and name lookups are an index.
#include "core/dtype.hpp"

#include <array>

namespace deltasync {
namespace {

struct DTypeRow {
  DType type;
  std::string_view name;  // safetensors spelling
  uint32_t width;         // bytes per element
  bool weight;            // diffed and patched by deltasync
};

constexpr std::array<DTypeRow, 15> kDTypes{{
    {DType::BF16, "BF16", 2, true},
    {DType::F16, "F16", 2, true},
    {DType::F32, "F32", 4, true},
    {DType::F8_E4M3, "F8_E4M3", 1, true},
    {DType::F8_E5M2, "F8_E5M2", 1, true},
    {DType::F64, "F64", 8, false},
    {DType::I8, "I8", 1, false},
    {DType::U8, "U8", 1, false},
    {DType::I16, "I16", 2, false},
    {DType::U16, "U16", 2, false},
    {DType::I32, "I32", 4, false},
    {DType::U32, "U32", 4, false},
    {DType::I64, "I64", 8, false},
    {DType::U64, "U64", 8, false},
    {DType::BOOL, "BOOL", 1, false},
}};

// The table is indexed by the enum value; a reordered enum must fail to compile, not misreport.
constexpr bool table_matches_enum() {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (static_cast<size_t>(kDTypes[i].type) != i) return false;
  }
  return true;
}
static_assert(table_matches_enum(), "kDTypes must list DType values in enum order");

const DTypeRow& row(DType t) { return kDTypes.at(static_cast<size_t>(t)); }

}  // namespace

uint32_t dtype_width(DType t) { return row(t).width; }

std::string_view dtype_name(DType t) { return row(t).name; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const DTypeRow& r : kDTypes) {
    if (r.name == name) return r.type;
  }
  return std::nullopt;
}

bool is_weight_dtype(DType t) { return row(t).weight; }

std::span<const DType> all_dtypes() {
  static const auto types = [] {
    std::array<DType, kDTypes.size()> out{};
    for (size_t i = 0; i < kDTypes.size(); ++i) out[i] = kDTypes[i].type;
    return out;
  }();
  return types;
}

}  // namespace deltasync
