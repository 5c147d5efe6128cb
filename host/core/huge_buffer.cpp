#include "core/huge_buffer.hpp"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "core/error.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace deltasync {

namespace {

uintptr_t round_up(uintptr_t value, uintptr_t multiple) { return (value + multiple - 1) / multiple * multiple; }
uintptr_t round_down(uintptr_t value, uintptr_t multiple) { return value / multiple * multiple; }

[[noreturn]] void out_of_memory(size_t bytes) {
  throw Error("host memory: cannot allocate " + std::to_string(bytes) + " bytes");
}

}  // namespace

void advise_huge_pages(void* data, size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Only whole 2 MiB-aligned pages can become huge pages; advising the ragged ends would just
  // split the mapping for nothing.
  const uintptr_t begin = round_up(reinterpret_cast<uintptr_t>(data), kHugePageBytes);
  const uintptr_t end = round_down(reinterpret_cast<uintptr_t>(data) + bytes, kHugePageBytes);
  // The result is ignored on purpose: EINVAL (kernel without transparent huge pages) or any other
  // refusal leaves ordinary pages, which are correct, only slower.
  if (begin < end) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

std::vector<uint8_t> huge_page_vector(size_t bytes) {
  std::vector<uint8_t> v;
  if (bytes >= kHugePageBytes) {
    v.reserve(bytes);
    v.push_back(0);  // makes data() the start of the reserved storage (guaranteed once non-empty)
    advise_huge_pages(v.data(), bytes);
  }
  v.resize(bytes);
  return v;
}

HugeBuffer::HugeBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  // No allocation can be this large, and the roundings below (up to a page plus the alignment
  // slack) would wrap around to a small size for it.
  if (bytes > SIZE_MAX - 2 * kHugePageBytes) out_of_memory(bytes);
#if defined(__linux__)
  if (bytes >= kHugePageBytes) {
    // mmap only promises 4 KiB alignment: map one huge page more than needed and unmap the
    // unaligned head and the unused tail. The last partial 2 MiB stays in small pages rather
    // than rounding the buffer up (that would cost up to 2 MiB of memory per buffer).
    const size_t length = round_up(bytes, 4096);
    const size_t padded = length + kHugePageBytes;
    void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) out_of_memory(bytes);
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = round_up(start, kHugePageBytes);
    if (aligned > start) munmap(raw, aligned - start);
    if (const uintptr_t tail = start + padded - (aligned + length); tail > 0)
      munmap(reinterpret_cast<void*>(aligned + length), tail);
    data_ = reinterpret_cast<uint8_t*>(aligned);
    mapped_bytes_ = length;
    advise_huge_pages(data_, length);
    return;
  }
#endif
  data_ = static_cast<uint8_t*>(std::aligned_alloc(64, round_up(bytes, 64)));
  if (!data_) out_of_memory(bytes);
  std::memset(data_, 0, bytes);
}

HugeBuffer::~HugeBuffer() { release(); }

HugeBuffer::HugeBuffer(HugeBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_bytes_(std::exchange(other.mapped_bytes_, 0)) {}

HugeBuffer& HugeBuffer::operator=(HugeBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
  }
  return *this;
}

void HugeBuffer::release() noexcept {
#if defined(__linux__)
  if (mapped_bytes_ > 0) {
    munmap(data_, mapped_bytes_);
  } else {
    std::free(data_);
  }
#else
  std::free(data_);
#endif
  data_ = nullptr;
  size_ = 0;
  mapped_bytes_ = 0;
}

}  // namespace deltasync
