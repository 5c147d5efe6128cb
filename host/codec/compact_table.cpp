#include "codec/compact_table.hpp"

#include <algorithm>
#include <mutex>

#include "core/error.hpp"
#include "core/little_endian.hpp"
#include "format/sha256.hpp"

namespace deltasync::compact {
namespace {

void put_u64(Sha256& h, uint64_t v) {
  uint8_t bytes[8];
  detail::store_le(bytes, v);
  h.update(bytes);
}

void put_text(Sha256& h, std::string_view text) {
  put_u64(h, text.size());
  h.update(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

}  // namespace

bool name_less(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (!is_digit(a[i]) || !is_digit(b[j])) {
      if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
      ++i, ++j;
      continue;
    }
    // Two digit runs: by value (leading zeros skipped, then length, then digits), then by length.
    size_t ie = i, je = j;
    while (ie < a.size() && is_digit(a[ie])) ++ie;
    while (je < b.size() && is_digit(b[je])) ++je;
    size_t iz = i, jz = j;
    while (iz + 1 < ie && a[iz] == '0') ++iz;
    while (jz + 1 < je && b[jz] == '0') ++jz;
    const std::string_view va = a.substr(iz, ie - iz), vb = b.substr(jz, je - jz);
    if (va.size() != vb.size()) return va.size() < vb.size();
    if (va != vb) return va < vb;
    if (ie - i != je - j) return ie - i < je - j;
    i = ie, j = je;
  }
  return a.size() - i < b.size() - j;
}

TensorTable::TensorTable(std::span<const TensorMeta> tensors) : tensors_(tensors.begin(), tensors.end()) {
  if (tensors_.size() > UINT32_MAX) throw BadInputError("tensor table: more than 2^32 - 1 tensors");
  sorted_.resize(tensors_.size());
  for (uint32_t i = 0; i < sorted_.size(); ++i) sorted_[i] = i;
  std::sort(sorted_.begin(), sorted_.end(), [&](uint32_t a, uint32_t b) { return name_less(tensors_[a].name, tensors_[b].name); });
  for (size_t o = 1; o < sorted_.size(); ++o)
    if (at(static_cast<uint32_t>(o)).name == at(static_cast<uint32_t>(o - 1)).name)
      throw BadInputError("tensor table: tensor " + at(static_cast<uint32_t>(o)).name + " appears twice");
  // Per tensor in ordinal order: name, dtype name (each a u64 length and its bytes), the number
  // of dimensions and every dimension (u64), all little-endian.
  Sha256 h;
  for (uint32_t o = 0; o < sorted_.size(); ++o) {
    const TensorMeta& t = at(o);
    put_text(h, t.name);
    put_text(h, dtype_name(t.dtype));
    put_u64(h, t.shape.size());
    for (uint64_t d : t.shape) put_u64(h, d);
  }
  sha256_hex_ = to_hex(h.finish());
}

std::shared_ptr<const TensorTable> TensorTable::of(std::span<const TensorMeta> tensors) {
  static std::mutex mutex;
  static std::shared_ptr<const TensorTable> last;
  {
    const std::lock_guard lock(mutex);
    if (last && std::equal(tensors.begin(), tensors.end(), last->tensors_.begin(), last->tensors_.end(), [](const auto& a, const auto& b) {
          return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape;
        }))
      return last;
  }
  auto built = std::make_shared<const TensorTable>(tensors);
  const std::lock_guard lock(mutex);
  last = built;
  return built;
}

std::optional<uint32_t> TensorTable::ordinal(std::string_view name) const {
  const auto it = std::lower_bound(sorted_.begin(), sorted_.end(), name,
                                   [&](uint32_t i, std::string_view n) { return name_less(tensors_[i].name, n); });
  if (it == sorted_.end() || tensors_[*it].name != name) return std::nullopt;
  return static_cast<uint32_t>(it - sorted_.begin());
}

}  // namespace deltasync::compact
