#include "engine/host_model.hpp"

#include <cstring>

#include "codec/digest.hpp"
#include "core/error.hpp"
#include "core/huge_buffer.hpp"
#include "engine/integrity.hpp"
#include "format/model_version.hpp"
#include "core/parallel.hpp"

namespace deltasync {

uint64_t HostModel::bytes() const {
  uint64_t total = 0;
  for (const auto& d : data) total += d.size();
  return total;
}

uint64_t HostModel::elements() const {
  uint64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

std::vector<TensorRef> HostModel::refs() {
  std::vector<TensorRef> out;
  out.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) out.push_back(TensorRef{tensors[t].name, data[t].data(), tensors[t].numel(), tensors[t].width()});
  return out;
}

std::vector<ConstTensorRef> HostModel::const_refs() const {
  std::vector<ConstTensorRef> out;
  out.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) out.push_back(ConstTensorRef{tensors[t].name, data[t].data(), tensors[t].numel(), tensors[t].width()});
  return out;
}

void HostModel::compute_digests() {
  auto refs = const_refs();
  digests = digest_tensors(refs);
}

HostModel HostModel::from_file(const st::File& file) {
  HostModel m;
  m.tensors = model_tensors(file);
  m.data.reserve(m.tensors.size());
  // Huge pages: a subscriber applies sparse deltas at random positions in these tensors, which
  // with 4 KiB pages costs a page walk per change (see huge_buffer.hpp).
  for (size_t t = 0; t < m.tensors.size(); ++t)
    m.data.push_back(huge_page_vector(file.bytes(file.at(m.tensors[t].name)).size()));
  // Copy in parallel: for a large checkpoint the copy is memory-bound per core.
  parallel_for(m.tensors.size(), [&](size_t t) {
    auto bytes = file.bytes(file.at(m.tensors[t].name));
    if (!bytes.empty()) std::memcpy(m.data[t].data(), bytes.data(), bytes.size());
  });
  m.version = read_model_version(file.metadata(), file.label());
  return m;
}

HostModel HostModel::load(const std::string& path) { return from_file(st::File::open(path)); }

void HostModel::save(const std::string& path, const st::Metadata& extra) const {
  std::vector<st::WriteTensor> out;
  out.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) out.push_back(st::WriteTensor{tensors[t].name, tensors[t].dtype, tensors[t].shape, data[t]});
  st::Metadata md = extra;
  if (version) md["model_version"] = std::to_string(*version);
  if (digests.size() == tensors.size()) {
    integrity::DigestMap map;
    for (size_t t = 0; t < tensors.size(); ++t) map.emplace(tensors[t].name, digests[t]);
    integrity::put_checkpoint_digests(md, map);
  }
  st::write_file(path, out, md);
}

}  // namespace deltasync
