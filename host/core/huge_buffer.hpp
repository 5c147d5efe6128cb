// Host memory for whole copies of a model's weights, backed by 2 MiB huge pages where the kernel
// grants them.
//
// Why: the sparse paths (compact decode gathering base bits, apply scattering new bits) touch a
// few bytes at random positions spread over hundreds of MiB. With 4 KiB pages nearly every one
// of those accesses misses the TLB and pays a page walk; measured at 0.3% changed that is ~23 ns
// per change with 4 KiB pages against ~9.7 ns with 2 MiB pages. Linux's transparent huge pages
// are commonly in "madvise" mode, where only memory that asked for them (MADV_HUGEPAGE) and is
// 2 MiB aligned gets them, so the allocator has to ask.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace deltasync {

// 2 MiB: the x86-64 / arm64 (4 KiB granule) transparent huge page size.
inline constexpr size_t kHugePageBytes = size_t{1} << 21;

// An owning, move-only, zero-filled byte buffer. From kHugePageBytes up it is 2 MiB aligned and
// advised for huge pages (its own anonymous mapping, so the zeroes come from the kernel at first
// touch: no extra pass over the memory); smaller ones are ordinary 64-byte-aligned heap memory.
// Huge pages are a hint: where the kernel refuses, the buffer works the same with small pages.
class HugeBuffer {
 public:
  HugeBuffer() = default;
  explicit HugeBuffer(size_t bytes);  // throws deltasync::Error when memory is exhausted
  ~HugeBuffer();
  HugeBuffer(HugeBuffer&& other) noexcept;
  HugeBuffer& operator=(HugeBuffer&& other) noexcept;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  uint8_t* begin() { return data_; }
  uint8_t* end() { return data_ + size_; }
  const uint8_t* begin() const { return data_; }
  const uint8_t* end() const { return data_ + size_; }

 private:
  void release() noexcept;

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_bytes_ = 0;  // > 0: data_ is an anonymous mapping of this length; 0: heap memory
};

// Asks the kernel to back the 2 MiB-aligned part of [data, data + bytes) with huge pages. Only
// pages not yet touched are affected, so call it between allocating and first writing — for
// memory the caller does not allocate itself (e.g. a std::vector's, after reserve). A no-op where
// unsupported; never fails.
void advise_huge_pages(void* data, size_t bytes) noexcept;

// `bytes` zeroed bytes in a plain std::vector<uint8_t> (for members whose type others rely on),
// its storage advised for huge pages between allocation and resize's zero-fill.
std::vector<uint8_t> huge_page_vector(size_t bytes);

}  // namespace deltasync
