// HugeBuffer: the owning, huge-page-advised byte buffer for host copies of weights. Huge pages
// themselves are only a hint the kernel may decline, so no test requires them; the one that
// touches a large buffer reports whether they were granted.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <ranges>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/huge_buffer.hpp"

namespace {

using deltasync::HugeBuffer;
using deltasync::kHugePageBytes;

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

bool all_zero(std::span<const uint8_t> bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0; });
}

// kB of AnonHugePages in the mapping of /proc/self/smaps that contains `p` (-1 if not found).
long huge_kb_of_mapping(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= address(p) && address(p) < hi;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) return std::stol(line.substr(14));
  }
  return -1;
}

static_assert(!std::is_copy_constructible_v<HugeBuffer> && !std::is_copy_assignable_v<HugeBuffer>);
static_assert(std::is_nothrow_move_constructible_v<HugeBuffer> && std::is_nothrow_move_assignable_v<HugeBuffer>);
static_assert(std::ranges::contiguous_range<HugeBuffer> && std::ranges::sized_range<HugeBuffer>);

TEST(HugeBuffer, DefaultIsEmpty) {
  HugeBuffer buffer;
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_EQ(buffer.size(), 0u);
  EXPECT_TRUE(buffer.empty());
  EXPECT_TRUE(HugeBuffer(0).empty());
}

TEST(HugeBuffer, SmallBufferIsZeroedAndCacheLineAligned) {
  for (size_t size : {size_t{1}, size_t{63}, size_t{4097}, kHugePageBytes - 1}) {
    HugeBuffer buffer(size);
    ASSERT_NE(buffer.data(), nullptr);
    EXPECT_EQ(buffer.size(), size);
    EXPECT_EQ(address(buffer.data()) % 64, 0u) << size;
    EXPECT_TRUE(all_zero(buffer)) << size;
  }
}

TEST(HugeBuffer, LargeBufferIsZeroedWritableAndHugePageAligned) {
  // Not a multiple of the huge page (nor of 4 KiB): the ragged tail must still be usable.
  const size_t size = 3 * kHugePageBytes + 12345;
  HugeBuffer buffer(size);
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(buffer.size(), size);
  EXPECT_EQ(address(buffer.data()) % kHugePageBytes, 0u);
  EXPECT_TRUE(all_zero(buffer));
  for (size_t i = 0; i < size; ++i) buffer.data()[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t i = 0; i < size; i += 4093) ASSERT_EQ(buffer.data()[i], static_cast<uint8_t>(i * 131 + 7)) << i;
  EXPECT_EQ(buffer.data()[size - 1], static_cast<uint8_t>((size - 1) * 131 + 7));
  // Informational only: the kernel may refuse huge pages (THP off, fragmented memory).
  std::cout << "[ info     ] AnonHugePages of a " << size << "-byte buffer: " << huge_kb_of_mapping(buffer.data())
            << " kB\n";
}

TEST(HugeBuffer, ImpossibleSizesAreRefusedNotWrappedAround) {
  // Rounding these up to whole pages plus the alignment slack overflows size_t; a wrapped-around
  // size would map a few pages while size() claimed the whole request.
  for (size_t size : {SIZE_MAX, SIZE_MAX - kHugePageBytes, SIZE_MAX - 4095}) {
    EXPECT_THROW(HugeBuffer{size}, deltasync::Error) << size;
  }
}

TEST(HugeBuffer, MoveTransfersOwnership) {
  HugeBuffer first(kHugePageBytes);
  first.data()[5] = 42;
  const uint8_t* storage = first.data();

  HugeBuffer second(std::move(first));
  EXPECT_EQ(second.data(), storage);
  EXPECT_EQ(second.size(), kHugePageBytes);
  EXPECT_EQ(second.data()[5], 42);
  EXPECT_EQ(first.data(), nullptr);  // NOLINT(bugprone-use-after-move): a moved-from buffer is empty
  EXPECT_EQ(first.size(), 0u);

  HugeBuffer third(100);  // its own storage is released by the assignment
  third = std::move(second);
  EXPECT_EQ(third.data(), storage);
  EXPECT_EQ(third.size(), kHugePageBytes);
  EXPECT_TRUE(second.empty());  // NOLINT(bugprone-use-after-move)

  HugeBuffer& alias = third;
  third = std::move(alias);  // self-move keeps the contents
  EXPECT_EQ(third.data(), storage);
  EXPECT_EQ(third.data()[5], 42);
}

TEST(HugeBuffer, ViewsAsSpan) {
  HugeBuffer buffer(10);
  std::span<uint8_t> writable = buffer;
  writable[9] = 1;
  const HugeBuffer& view = buffer;
  std::span<const uint8_t> readable = view;
  EXPECT_EQ(readable.size(), 10u);
  EXPECT_EQ(readable[9], 1);
}

TEST(HugePageVector, IsZeroedOfTheRequestedSize) {
  for (size_t size : {size_t{0}, size_t{17}, 2 * kHugePageBytes + 3}) {
    std::vector<uint8_t> v = deltasync::huge_page_vector(size);
    EXPECT_EQ(v.size(), size);
    EXPECT_TRUE(all_zero(v)) << size;
  }
}

TEST(AdviseHugePages, AcceptsAnyRange) {
  // A hint: unaligned, tiny, empty or null ranges are ignored rather than rejected.
  HugeBuffer buffer(3 * kHugePageBytes);
  deltasync::advise_huge_pages(buffer.data() + 1, buffer.size() - 2);
  deltasync::advise_huge_pages(buffer.data() + 3, 100);
  deltasync::advise_huge_pages(nullptr, 0);
  buffer.data()[buffer.size() - 1] = 9;
  EXPECT_EQ(buffer.data()[buffer.size() - 1], 9);
}

}  // namespace
