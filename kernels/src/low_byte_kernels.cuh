// Kernels of the low-byte shadow encoder (host dispatch: low_byte_encoder.cu). The tensors of
// one encode are numbered as one sequence of global element ids (tensor t owns ids
// [start[t], start[t + 1])), so a single CUB count and a single CUB select cover the whole set:
//   1. count   CUB reduce of "low byte differs" over every id (sizes the output: one host wait)
//   2. select  CUB select of the ids whose low byte differs, ascending
//   3. offsets per tensor, the number of selected ids before its first id (binary search)
//   4. finish  per selected id: the element's full bits, the shadow's byte, the local position
// The select reads the shadow and the finish writes it, so they must run in this order on one
// stream (they do). Finding an id's tensor is a binary search over T + 1 starts that stay in L1.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <iterator>

namespace deltasync::cuda::detail {

struct LowByteTensor {
  const uint16_t* current;  // numel 2-byte elements
  uint8_t* shadow;          // numel low bytes
  uint64_t start;           // first global id
};

// The tensor holding global id g: the last t with start[t] <= g (empty tensors share their
// start with the next one and are skipped).
__device__ inline uint32_t low_byte_tensor_of(const uint64_t* starts, uint32_t num_tensors, uint64_t g) {
  uint32_t lo = 0, hi = num_tensors;  // starts[lo] <= g < starts[hi]
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (starts[mid] <= g) lo = mid;
    else hi = mid;
  }
  return lo;
}

// "The low byte of element g differs from the shadow's", as a CUB select predicate and, cast to
// an integer, as the count's input. Little-endian: the low byte is the value's low 8 bits.
struct LowByteChanged {
  const LowByteTensor* tensors;
  const uint64_t* starts;
  uint32_t num_tensors;
  __device__ bool operator()(int64_t id) const {
    const uint64_t g = static_cast<uint64_t>(id);
    const LowByteTensor t = tensors[low_byte_tensor_of(starts, num_tensors, g)];
    const uint64_t i = g - t.start;
    return static_cast<uint8_t>(t.current[i]) != t.shadow[i];
  }
};

struct LowByteChangedCount {
  LowByteChanged changed;
  __device__ int64_t operator()(int64_t id) const { return changed(id) ? 1 : 0; }
};

// The select's output: ids go to data[0, capacity), and what would land past it is dropped.
// The output is sized by the count pass, and the select finds as many ids unless `current` was
// written between the two passes (a caller's race): then the result is wrong, but nothing is
// written, or later read, outside the buffers (the kernels below take at most `capacity` ids).
struct BoundedIds {
  using difference_type = ptrdiff_t;
  using value_type = int64_t;
  using pointer = void;
  struct reference {
    int64_t* at;
    __host__ __device__ reference& operator=(int64_t id) {
      if (at != nullptr) *at = id;
      return *this;
    }
  };
  using iterator_category = std::random_access_iterator_tag;

  int64_t* data;
  int64_t capacity;
  int64_t offset = 0;

  __host__ __device__ reference operator[](difference_type k) const {
    const int64_t at = offset + k;
    return reference{at >= 0 && at < capacity ? data + at : nullptr};
  }
  __host__ __device__ reference operator*() const { return (*this)[0]; }
  __host__ __device__ BoundedIds operator+(difference_type k) const { return BoundedIds{data, capacity, offset + k}; }
  __host__ __device__ BoundedIds& operator+=(difference_type k) {
    offset += k;
    return *this;
  }
  __host__ __device__ BoundedIds& operator++() {
    ++offset;
    return *this;
  }
  __host__ __device__ difference_type operator-(const BoundedIds& other) const { return offset - other.offset; }
};

// What the select left in the ids buffer: its count, at most the buffer's capacity.
__device__ inline uint64_t selected_ids(const int64_t* num_selected, uint64_t capacity) {
  const auto n = static_cast<uint64_t>(*num_selected);
  return n < capacity ? n : capacity;
}

// offsets[t] = number of selected ids below starts[t], for t = 0..T (starts[T] = all ids).
__global__ void low_byte_offsets_kernel(const uint64_t* starts, uint32_t num_tensors, const int64_t* ids,
                                        const int64_t* num_selected, uint64_t capacity, uint64_t* offsets,
                                        uint64_t* value_offsets) {
  const uint64_t n = selected_ids(num_selected, capacity);
  for (uint64_t t = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; t <= num_tensors;
       t += uint64_t{gridDim.x} * blockDim.x) {
    uint64_t lo = 0, hi = n;  // first k with ids[k] >= starts[t]
    while (lo < hi) {
      const uint64_t mid = (lo + hi) / 2;
      if (static_cast<uint64_t>(ids[mid]) < starts[t]) lo = mid + 1;
      else hi = mid;
    }
    offsets[t] = lo;
    value_offsets[t] = 2 * lo;
  }
}

// For every selected id: values[k] = the element's bits, the shadow's byte catches up, and the
// id becomes the position inside its tensor.
__global__ void low_byte_finish_kernel(const LowByteTensor* tensors, const uint64_t* starts, uint32_t num_tensors,
                                       int64_t* ids, const int64_t* num_selected, uint64_t capacity, uint16_t* values) {
  const uint64_t count = selected_ids(num_selected, capacity);
  for (uint64_t k = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; k < count; k += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t g = static_cast<uint64_t>(ids[k]);
    const LowByteTensor t = tensors[low_byte_tensor_of(starts, num_tensors, g)];
    const uint64_t i = g - t.start;
    const uint16_t v = t.current[i];
    values[k] = v;
    t.shadow[i] = static_cast<uint8_t>(v);
    ids[k] = static_cast<int64_t>(i);
  }
}

// shadow := low byte of current, for every global id.
__global__ void low_byte_take_kernel(const LowByteTensor* tensors, const uint64_t* starts, uint32_t num_tensors,
                                     uint64_t total) {
  for (uint64_t g = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; g < total; g += uint64_t{gridDim.x} * blockDim.x) {
    const LowByteTensor t = tensors[low_byte_tensor_of(starts, num_tensors, g)];
    const uint64_t i = g - t.start;
    t.shadow[i] = static_cast<uint8_t>(t.current[i]);
  }
}

}  // namespace deltasync::cuda::detail
