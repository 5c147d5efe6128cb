#include "torch_dtype.hpp"

namespace deltasync::torch_ext {

c10::ScalarType torch_dtype(DType t) {
  switch (t) {  // every DType (-Wswitch names one left out)
    case DType::BF16: return c10::kBFloat16;
    case DType::F16: return c10::kHalf;
    case DType::F32: return c10::kFloat;
    case DType::F8_E4M3: return c10::kFloat8_e4m3fn;
    case DType::F8_E5M2: return c10::kFloat8_e5m2;
    case DType::F64: return c10::kDouble;
    case DType::I8: return c10::kChar;
    case DType::U8: return c10::kByte;
    case DType::I16: return c10::kShort;
    case DType::U16: return c10::kUInt16;
    case DType::I32: return c10::kInt;
    case DType::U32: return c10::kUInt32;
    case DType::I64: return c10::kLong;
    case DType::U64: return c10::kUInt64;
    case DType::BOOL: return c10::kBool;
  }
  return c10::ScalarType::Undefined;
}

std::optional<DType> deltasync_dtype(c10::ScalarType t) {
  for (DType d : all_dtypes())
    if (torch_dtype(d) == t) return d;
  return std::nullopt;
}

}  // namespace deltasync::torch_ext
