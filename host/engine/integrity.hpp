// Integrity of a delta chain: which base a delta applies to, what the weights must hash to
// before and after, and an apply that checks both and is transactional.
//
// Metadata keys (values are strings, as safetensors requires; digests are 16 lowercase hex
// digits, see digest.hpp; README documents them):
//   digest_algorithm  "sum-mix64-v1" — present whenever any of the digest keys below is
//   base_digests      delta: JSON object {tensor name: digest before the delta} for every
//                     tensor the delta changes
//   result_digests    delta: same names, digest after the delta
//   digests           anchor / full checkpoint written by deltasync: every tensor's digest
// A delta also records base_version (DeltaInfo::base_version, written by delta_file) and its
// model_version; both appear in the refusal message of check_base.
#pragma once
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "format/delta_file.hpp"
#include "format/safetensors.hpp"
#include "core/tensor.hpp"

namespace deltasync::integrity {

inline constexpr std::string_view kDigestAlgorithm = "sum-mix64-v1";

namespace keys {
inline constexpr const char* kDigestAlgorithm = "digest_algorithm";
inline constexpr const char* kBaseDigests = "base_digests";
inline constexpr const char* kResultDigests = "result_digests";
inline constexpr const char* kDigests = "digests";
}  // namespace keys

// Tensor name -> digest. std::less<> so lookups take a string_view.
using DigestMap = std::map<std::string, uint64_t, std::less<>>;

// What a delta promises: applied to version base_version whose changed tensors hash to `base`,
// it yields version model_version whose changed tensors hash to `result`.
struct DeltaDigests {
  uint64_t model_version = 0;
  std::optional<uint64_t> base_version;
  DigestMap base;
  DigestMap result;
};

// ---- computing -------------------------------------------------------------------------------

// Full digests of a set of tensors, keyed by name (CPU, multithreaded). For an anchor's
// `digests` or a receiver's starting state.
DigestMap digest_map(std::span<const ConstTensorRef> tensors);

// The digests a freshly encoded delta must record, in O(changed): for every tensor t with
// changes, base = base_digests[t] and result = base updated from delta.base_values to
// delta.values. `tensors` and `base_digests` are in the encode's tensor order. Throws Error when
// the delta has no base_values (a delta read back from a file) or sizes disagree.
DeltaDigests delta_digests(std::span<const TensorMeta> tensors, const DeltaView& delta,
                           std::span<const uint64_t> base_digests, uint64_t model_version,
                           std::optional<uint64_t> base_version);

// Brings a whole model's digests (encode tensor order) from the delta's base to its result in
// O(changed): digests[t] += shift of tensor t. The trainer side keeps its digests this way.
void advance_digests(std::span<uint64_t> digests, std::span<const TensorMeta> tensors, const DeltaView& delta);

// ---- metadata --------------------------------------------------------------------------------

// Adds digest_algorithm, base_digests and result_digests. The versions are not written here:
// they are DeltaInfo's typed fields (this overload sets info.model_version / base_version from
// `digests`, and info.digests: the same pairs typed, which the compact indexed layout records).
void put_delta_digests(st::Metadata& metadata, const DeltaDigests& digests);
void put_delta_digests(DeltaInfo& info, const DeltaDigests& digests);
// Adds digest_algorithm and digests (an anchor's or checkpoint's every tensor).
void put_checkpoint_digests(st::Metadata& metadata, const DigestMap& digests);

// Reads a delta's promises: std::nullopt when the file carries no digest keys at all (e.g. a
// delta written by TRL); Error("LABEL: reason") when anything is malformed: bad JSON, a
// non-object, a value that is not 16 lowercase hex digits, base and result naming different
// tensors, only one of the two present, a missing or unknown digest_algorithm. Typed digests
// (info.digests: a compact indexed delta's records) are taken as they are, with digest_algorithm.
std::optional<DeltaDigests> read_delta_digests(const DeltaInfo& info, const std::string& label);
// Reads an anchor's or checkpoint's `digests` (std::nullopt when absent; same strictness).
std::optional<DigestMap> read_checkpoint_digests(const st::Metadata& metadata, const std::string& label);

// A digest map under another metadata key (the partials of a shard's part or anchor slices,
// sync/shard_parts.hpp), with the same form and strictness as `digests`.
void put_digest_map(st::Metadata& metadata, const char* key, const DigestMap& digests);
std::optional<DigestMap> read_digest_map(const st::Metadata& metadata, const char* key, const std::string& label);

// ---- checks ----------------------------------------------------------------------------------

// Refuses a delta whose base is not the receiver's current state. When both versions are known
// and differ: Error("delta N expects base version B, found version C"). Otherwise, for the
// first tensor of `expected.base` (name order) whose current digest differs:
// Error("delta N expects base version B digest HEX for tensor NAME, found HEX") (B is
// "unknown" when the delta does not record it). A tensor the receiver does not have:
// Error("delta N expects base version B digest HEX for tensor NAME, found no such tensor").
// `current_digest(name)` returns the receiver's digest of that tensor, or nullopt if it has none.
void check_base(const DeltaDigests& expected, std::optional<uint64_t> current_version,
                const std::function<std::optional<uint64_t>(std::string_view)>& current_digest);
void check_base(const DeltaDigests& expected, std::optional<uint64_t> current_version, const DigestMap& current);

// Compares result digests computed after an apply (`actual`: name -> digest) with the promises.
// Throws Error("delta N result digest mismatch for tensor NAME: expected HEX, got HEX").
void check_result(const DeltaDigests& expected, const DigestMap& actual);

// The checks of a verified apply that need no tensor data: one patch and one current digest per
// target, unique target names, a base and a result digest for every tensor the delta changes
// (else BadInputError("delta N changes tensor NAME but records no base/result digest for it")),
// then check_base. Patch positions are not looked at (the transaction's write() does that).
void check_before_apply(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                        const DeltaDigests& expected, std::span<const uint64_t> current_digests,
                        std::optional<uint64_t> current_version);

struct ApplyReport {
  uint64_t tensors_changed = 0;
  uint64_t elements_changed = 0;
};

// The mechanics of a verified apply where the targets live (host tensors: apply_verified below;
// device tensors: engine::CudaPatchTransaction over kernels/; an inference engine's runtime
// parameters, sharded across ranks: MappedReceiver's); the policy is apply_verified's.
class PatchTransaction {
 public:
  virtual ~PatchTransaction() = default;
  // Validates every patch and writes them all, keeping the bits each write replaces, and sets
  // shifts[t] = digest(after) - digest(before) of targets[t] (mod 2^64), in O(changed) -- of
  // this rank's share of the target where the ranks share it (agree() sums the shares). An
  // invalid patch throws Error naming the tensor with nothing written.
  virtual void write(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                     std::span<uint64_t> shifts) = 0;
  // Puts back every bit the last write() replaced.
  virtual void undo(std::span<const TensorRef> targets) = 0;
  // The agreement of the ranks that apply one delta together. apply_verified calls it exactly
  // once per apply, after write() or after a failure on this rank before or during it (then
  // `refuse` is true and the shifts are 0), so no rank is left waiting for another. It sums
  // every rank's shifts in place (mod 2^64) and returns how many ranks refused, this one
  // included; every rank sees the same sums and count, so every rank decides alike. One rank:
  // the identity.
  virtual uint64_t agree(std::span<uint64_t> shifts, bool refuse) {
    (void)shifts;
    return refuse ? 1 : 0;
  }
  // False for a target whose bits are held nowhere (an engine's loader dropped it, as vLLM drops
  // a tied lm_head): it has no digest to compute, so it takes the delta's promised result.
  virtual bool holds(size_t target) const {
    (void)target;
    return true;
  }
};

// The one transactional verified apply. patches[t] patches targets[t] (count 0 where
// unchanged); current_digests[t] is the receiver's digest of targets[t] (all of them, or at
// least of the changed ones; the others are neither read nor written).
// Order: check versions, base digests and that the delta's digests name exactly the tensors it
// changes (check_before_apply); validate + scatter + shifts (transaction.write); result digests
// = current + shifts summed across the ranks (transaction.agree), compared (check_result). Any
// failure before the write throws with nothing written; any failure after it (another rank's
// refusal: Error("delta N: refused by R other rank(s); weights restored ..."), a result
// mismatch, anything else) undoes the write -- the targets are then bit-for-bit as before --
// and throws. On success current_digests is updated.
ApplyReport apply_verified(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                           const DeltaDigests& expected, std::span<uint64_t> current_digests,
                           std::optional<uint64_t> current_version, PatchTransaction& transaction);
// This rank's refusal of an apply whose inputs it could not make (a delta file it could not
// read or resolve): takes part in the agreement the other ranks hold for it (transaction.agree
// over `targets` zero shifts, refusing), then rethrows `failure`.
[[noreturn]] void refuse_apply(size_t targets, std::exception_ptr failure, PatchTransaction& transaction);
// Host tensors: the CPU transaction (validate, one scatter pass saving the old bits, O(changed)
// memory).
ApplyReport apply_verified(std::span<const TensorRef> targets, std::span<const PatchRef> patches,
                           const DeltaDigests& expected, std::span<uint64_t> current_digests,
                           std::optional<uint64_t> current_version = std::nullopt);

}  // namespace deltasync::integrity
