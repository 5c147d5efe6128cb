// Digest kernels. Work is cut into tiles (a fixed number of elements or changed positions of
// one tensor); a block sums the terms of a tile and adds the total to the tensor's accumulator
// with one 64-bit atomicAdd. Integer addition mod 2^64 is associative and commutative, so the
// result does not depend on tiling, scheduling or atomic order and equals the CPU sum bit for
// bit. Tiles never straddle a 2^32-element block, so a tile has a single seed.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#include "codec/digest_mix.hpp"
#include "device_buffers.cuh"
#include "refusal.cuh"

namespace deltasync::cuda {

namespace {

namespace mix = deltasync::digest_mix;

constexpr unsigned kThreads = 256;
// Elements per tile of a full digest (64K: 128 KiB of bf16 per block visit).
constexpr uint64_t kDigestTile = uint64_t{1} << 16;
// Changed positions per tile of a shift (random access, so smaller tiles).
constexpr uint64_t kShiftTile = uint64_t{1} << 12;
static_assert(mix::kBlockElements % kDigestTile == 0);

// One tensor (digest) or one patch (shift).
struct Job {
  const uint8_t* data = nullptr;      // tensor bits
  const void* indices = nullptr;      // shift: positions (int32 or int64)
  const uint8_t* old_bits = nullptr;  // shift: bits before, count × width
  uint64_t count = 0;                 // digest: elements; shift: positions
  uint64_t numel = 0;                 // tensor elements (bounds of a shift)
  uint64_t first_tile = 0;            // tiles of job j: first_tile[j] .. first_tile[j+1]
  uint32_t width = 0;
  uint32_t index_width = 8;
};

// Largest j with jobs[j].first_tile <= tile. Empty jobs share first_tile with their successor,
// so the answer is always a job that owns tiles.
__device__ uint32_t job_of_tile(const Job* jobs, uint32_t num_jobs, uint64_t tile) {
  uint32_t lo = 0, hi = num_jobs;  // invariant: answer in [lo, hi)
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (jobs[mid].first_tile <= tile) lo = mid;
    else hi = mid;
  }
  return lo;
}

__device__ uint64_t block_sum(uint64_t v) {
  __shared__ unsigned long long warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  uint64_t total = 0;
  if (warp == 0) {
    total = lane < kThreads / 32 ? warp_sums[lane] : 0;
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_down_sync(0xffffffffu, total, offset);
  }
  __syncthreads();  // warp_sums is reused by the next tile
  return total;     // valid in thread 0
}

__device__ uint32_t load_element(const uint8_t* p, uint32_t width) {
  switch (width) {
    case 1: return *p;
    case 2: return *reinterpret_cast<const uint16_t*>(p);
    default: return *reinterpret_cast<const uint32_t*>(p);
  }
}

// Old bits may come packed after tensors of other widths (the encoder's base_values), so they
// are read byte by byte: a 2- or 4-byte load there could be misaligned.
__device__ uint32_t load_unaligned(const uint8_t* p, uint32_t width) {
  uint32_t v = 0;
  for (uint32_t b = 0; b < width; ++b) v |= static_cast<uint32_t>(p[b]) << (8 * b);
  return v;
}

// Σ term over elements [begin, begin + n) of a tensor at `data`.
template <uint32_t W>
__device__ uint64_t tile_sum(const uint8_t* data, uint64_t begin, uint64_t n, uint64_t seed) {
  uint64_t sum = 0;
  const uint8_t* p = data + begin * W;
  uint64_t scalar_from = 0;
  // Tiles start at multiples of kDigestTile elements, so p is 16-byte aligned whenever the
  // tensor is: then read 16 bytes per load.
  if ((reinterpret_cast<uintptr_t>(data) & 15) == 0) {
    constexpr uint32_t kPerWord = 4 / W, kPerVec = 16 / W;
    constexpr uint32_t kMask = W == 4 ? 0xFFFFFFFFu : (1u << (8 * W)) - 1;
    const uint64_t vecs = n / kPerVec;
    const uint4* v = reinterpret_cast<const uint4*>(p);
    for (uint64_t k = threadIdx.x; k < vecs; k += kThreads) {
      const uint4 q = __ldg(v + k);
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
      const uint64_t pos = begin + k * kPerVec;
#pragma unroll
      for (uint32_t w = 0; w < 4; ++w)
#pragma unroll
        for (uint32_t e = 0; e < kPerWord; ++e)
          sum += mix::term(seed, pos + w * kPerWord + e, W == 4 ? words[w] : (words[w] >> (8 * W * e)) & kMask);
    }
    scalar_from = vecs * kPerVec;
  }
  for (uint64_t k = scalar_from + threadIdx.x; k < n; k += kThreads)
    sum += mix::term(seed, begin + k, load_element(p + k * W, W));
  return sum;
}

__global__ void __launch_bounds__(kThreads)
    digest_kernel(const Job* jobs, uint32_t num_jobs, uint64_t num_tiles, unsigned long long* acc) {
  for (uint64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const uint32_t j = job_of_tile(jobs, num_jobs, tile);
    const Job job = jobs[j];
    const uint64_t begin = (tile - job.first_tile) * kDigestTile;
    const uint64_t n = min(kDigestTile, job.count - begin);
    const uint64_t seed = mix::block_seed(job.width, begin >> mix::kBlockShift);
    uint64_t sum;
    switch (job.width) {
      case 1: sum = tile_sum<1>(job.data, begin, n, seed); break;
      case 2: sum = tile_sum<2>(job.data, begin, n, seed); break;
      default: sum = tile_sum<4>(job.data, begin, n, seed); break;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) atomicAdd(acc + j, static_cast<unsigned long long>(sum));
  }
}

__global__ void __launch_bounds__(kThreads)
    shift_kernel(const Job* jobs, uint32_t num_jobs, uint64_t num_tiles, unsigned long long* acc) {
  for (uint64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const uint32_t j = job_of_tile(jobs, num_jobs, tile);
    const Job job = jobs[j];
    const uint64_t begin = (tile - job.first_tile) * kShiftTile;
    const uint64_t end = min(begin + kShiftTile, job.count);
    uint64_t sum = 0;
    for (uint64_t k = begin + threadIdx.x; k < end; k += kThreads) {
      const uint64_t i = job.index_width == 4
                             ? static_cast<uint64_t>(static_cast<int64_t>(static_cast<const int32_t*>(job.indices)[k]))
                             : static_cast<uint64_t>(static_cast<const int64_t*>(job.indices)[k]);
      if (i >= job.numel) continue;
      const uint64_t seed = mix::block_seed(job.width, i >> mix::kBlockShift);
      sum += mix::term(seed, i, load_element(job.data + i * job.width, job.width)) -
             mix::term(seed, i, load_unaligned(job.old_bits + k * job.width, job.width));
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) atomicAdd(acc + j, static_cast<unsigned long long>(sum));
  }
}

bool valid_width(uint32_t w) { return w == 1 || w == 2 || w == 4; }

}  // namespace

struct Digester::State {
  detail::PinnedArray<Job> host_jobs;
  detail::DeviceArray<Job> device_jobs;
  detail::DeviceArray<unsigned long long> acc;
  cudaEvent_t uploaded = nullptr;  // the last descriptor upload has left host_jobs
  int sm_count = 0;
  TransferCounters transfer;  // the last call

  // Common tail of digest() and shifts(): upload `jobs` (already in host_jobs), zero the
  // accumulators, launch, copy the sums out.
  template <typename Kernel>
  cudaError_t launch(Kernel kernel, uint32_t num_jobs, uint64_t num_tiles, uint64_t* out, cudaStream_t stream) {
    cudaError_t err;
    if ((err = cudaMemcpyAsync(device_jobs.data(), host_jobs.data(), num_jobs * sizeof(Job), cudaMemcpyHostToDevice,
                               stream)) != cudaSuccess)
      return err;
    transfer.host_to_device_bytes += num_jobs * sizeof(Job);
    if ((err = cudaEventRecord(uploaded, stream)) != cudaSuccess) return err;
    if ((err = cudaMemsetAsync(acc.data(), 0, num_jobs * sizeof(unsigned long long), stream)) != cudaSuccess) return err;
    if (num_tiles > 0) {
      const uint64_t cap = static_cast<uint64_t>(sm_count > 0 ? sm_count : 1) * 8;
      const unsigned grid = static_cast<unsigned>(num_tiles < cap ? num_tiles : cap);
      kernel<<<grid, kThreads, 0, stream>>>(device_jobs.data(), num_jobs, num_tiles, acc.data());
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
    // `out` may be device memory (no host traffic) or pinned host memory.
    cudaPointerAttributes where{};
    if ((err = cudaPointerGetAttributes(&where, out)) != cudaSuccess) return err;
    if (where.type != cudaMemoryTypeDevice && where.type != cudaMemoryTypeManaged)
      transfer.device_to_host_bytes += num_jobs * sizeof(uint64_t);
    return cudaMemcpyAsync(out, acc.data(), num_jobs * sizeof(uint64_t), cudaMemcpyDefault, stream);
  }

  // Room for n jobs; waits until the previous upload no longer reads host_jobs.
  cudaError_t prepare(size_t n) {
    cudaError_t err;
    if (uploaded == nullptr && (err = cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming)) != cudaSuccess)
      return err;
    if ((err = cudaEventSynchronize(uploaded)) != cudaSuccess) return err;
    if ((err = host_jobs.reserve(n)) != cudaSuccess) return err;
    if ((err = device_jobs.reserve(n)) != cudaSuccess) return err;
    return acc.reserve(n);
  }
};

// Nothing here can fail: a failed device query leaves the grid at one block per tile batch,
// and the event is made by the first call (which returns its error).
Digester::Digester() : state_(new State) {
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&state_->sm_count, cudaDevAttrMultiProcessorCount, device);
  cudaGetLastError();  // a failed query must not leave a sticky error for the caller
}

Digester::~Digester() {
  if (state_->uploaded) cudaEventDestroy(state_->uploaded);
  delete state_;
}

namespace {

// What the kernels cannot read, refused with a reason (the engine checks widths first, with the
// CPU twin's words): element loads are 1, 2 or 4 bytes wide and need aligned data. `reads`: the
// kernels read the tensor at all (a shift reads only the changed positions).
cudaError_t check_tensor(const ConstTensorRef& t, bool reads) {
  const std::string name(t.name);
  if (!valid_width(t.width))
    return detail::refuse("digest: tensor " + name + " has " + std::to_string(t.width) +
                          "-byte elements; digests cover 1-, 2- and 4-byte elements");
  if (!reads) return cudaSuccess;
  if (t.data == nullptr) return detail::refuse("digest: tensor " + name + " has no data");
  if (reinterpret_cast<uintptr_t>(t.data) % t.width != 0)
    return detail::refuse("digest: tensor " + name + ": data not aligned to its " + std::to_string(t.width) + "-byte elements");
  return cudaSuccess;
}

}  // namespace

cudaError_t Digester::digest(std::span<const ConstTensorRef> tensors, uint64_t* out, cudaStream_t stream) {
  state_->transfer = {};
  if (tensors.empty()) return cudaSuccess;
  if (out == nullptr) return cudaErrorInvalidValue;
  for (const auto& t : tensors) DELTASYNC_RETURN_IF_ERROR(check_tensor(t, t.numel > 0));
  if (cudaError_t err = state_->prepare(tensors.size()); err != cudaSuccess) return err;
  uint64_t tiles = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    Job& job = state_->host_jobs.data()[t];
    job = Job{};
    job.data = static_cast<const uint8_t*>(tensors[t].data);
    job.count = job.numel = tensors[t].numel;
    job.width = tensors[t].width;
    job.first_tile = tiles;
    tiles += (tensors[t].numel + kDigestTile - 1) / kDigestTile;
  }
  return state_->launch(digest_kernel, static_cast<uint32_t>(tensors.size()), tiles, out, stream);
}

cudaError_t Digester::shifts(std::span<const ConstTensorRef> targets, std::span<const PatchRef> patches,
                             std::span<const void* const> old_bits, uint64_t* out, cudaStream_t stream) {
  state_->transfer = {};
  if (targets.size() != patches.size() || old_bits.size() != patches.size()) return cudaErrorInvalidValue;
  if (targets.empty()) return cudaSuccess;
  if (out == nullptr) return cudaErrorInvalidValue;
  for (size_t t = 0; t < targets.size(); ++t) {
    const PatchRef& p = patches[t];
    DELTASYNC_RETURN_IF_ERROR(check_tensor(targets[t], p.count > 0));
    if (p.count == 0) continue;  // nothing of it is read (the Applier's checks skip it too)
    if (p.index_width != 4 && p.index_width != 8) return cudaErrorInvalidValue;
    if (p.indices == nullptr || old_bits[t] == nullptr) return cudaErrorInvalidValue;  // the data: check_tensor
    if (reinterpret_cast<uintptr_t>(p.indices) % p.index_width != 0)
      return detail::refuse("digest: tensor " + std::string(targets[t].name) + ": positions not aligned to their " +
                            std::to_string(p.index_width) + "-byte integers");
  }
  if (cudaError_t err = state_->prepare(targets.size()); err != cudaSuccess) return err;
  uint64_t tiles = 0;
  for (size_t t = 0; t < targets.size(); ++t) {
    Job& job = state_->host_jobs.data()[t];
    job = Job{};
    job.data = static_cast<const uint8_t*>(targets[t].data);
    job.indices = patches[t].indices;
    job.index_width = patches[t].index_width;
    job.old_bits = static_cast<const uint8_t*>(old_bits[t]);
    job.count = patches[t].count;
    job.numel = targets[t].numel;
    job.width = targets[t].width;
    job.first_tile = tiles;
    tiles += (patches[t].count + kShiftTile - 1) / kShiftTile;
  }
  return state_->launch(shift_kernel, static_cast<uint32_t>(targets.size()), tiles, out, stream);
}

const TransferCounters& Digester::transfer() const { return state_->transfer; }

}  // namespace deltasync::cuda
