// The schemas of torch.ops.deltasync. Mutated arguments are declared with (a!) so that
// functionalization, torch.compile and opcheck know the shadows / targets change in place.
// Fake (meta) implementations live in Python (deltasync/_fake.py): their output sizes are
// data-dependent and are expressed with unbacked symbolic sizes.
#include <torch/library.h>

TORCH_LIBRARY(deltasync, m) {
  m.set_python_module("deltasync._fake");
  // Bitwise diff of current[t] against shadow[t] for every t; afterwards every shadow equals its
  // current tensor bit for bit. Returns the changed flat positions (int64, ascending within each
  // tensor, tensors in list order), the new bits of those elements as raw bytes (uint8,
  // count × element size per tensor) and per-tensor counts (int64, on the tensors' device).
  m.def(
      "encode(Tensor[] current, Tensor(a!)[] shadow, str[]? names=None) -> (Tensor indices, Tensor values, Tensor counts)",
      {at::Tag::pt2_compliant_tag});
  // Same, plus the shadow's bits before the encode (what the delta applies to), laid out like
  // values: what digest updates and relative value codecs need.
  m.def(
      "encode_with_base(Tensor[] current, Tensor(a!)[] shadow, str[]? names=None) -> (Tensor indices, Tensor values, "
      "Tensor base_values, Tensor counts)",
      {at::Tag::pt2_compliant_tag});
  // Scatters counts[t] (index, value) pairs into targets[t] for every t, in place. Values are
  // read as raw bytes (any dtype; count × element size of the target per tensor). Every patch is
  // validated first (indices strictly ascending and in range); on any error nothing is written
  // and the message names the tensor (names[t] when given).
  m.def("apply(Tensor(a!)[] targets, Tensor indices, Tensor values, Tensor counts, str[]? names=None) -> ()",
        {at::Tag::pt2_compliant_tag});
  // 64-bit order-independent digest of each tensor's bits (deltasync/digest_mix.hpp), returned
  // as an int64 tensor on the CPU whose entries reinterpret the unsigned digests.
  m.def("digest(Tensor[] tensors) -> Tensor", {at::Tag::pt2_compliant_tag});
  // How far each tensor's digest moves when the elements at `indices` change from old_values to
  // new_values (the layout encode returns; widths[t] bytes per element of tensor t): digest after
  // = digest before + shift (mod 2^64). O(changed); CPU tensors.
  m.def("digest_shift(Tensor indices, Tensor old_values, Tensor new_values, Tensor counts, int[] widths) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}
