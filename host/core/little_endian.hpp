// Little-endian loads and stores of unsigned integers at any (unaligned) address.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace deltasync::detail {

template <typename T>
void store_le(uint8_t* out, T v) {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(out, &v, sizeof(T));
  } else {
    for (size_t i = 0; i < sizeof(T); ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

template <typename T>
T load_le(const uint8_t* in) {
  T v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, in, sizeof(T));
  } else {
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(in[i]) << (8 * i);
  }
  return v;
}

}  // namespace deltasync::detail
