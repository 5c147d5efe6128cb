// Binding of deltasync::ShardPublisher (sync/shard_publish.hpp): the Python ShardedDeltaPublisher
// passes each rank's local shards and says where they sit (a placement spec per tensor, read from
// the DTensor's placements: the rule rank 0 derives every rank's placement from); the C++ side
// claims the store (rank 0), encodes, uploads, writes and checks the receipts and commits. The
// broadcast of the claim, the reduce of the partials (int64 halves), the gather of the receipts
// (bytes; and of the tables when rank 0 needs them) and the broadcast of the outcome are
// torch.distributed calls in Python.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>
#include <optional>

#include "bindings/fence_dict.hpp"
#include "bindings/log_callback.hpp"
#include "bindings/module.hpp"
#include "bindings/records.hpp"
#include "bindings/tensor_set.hpp"
#include "core/error.hpp"
#include "core/placement.hpp"
#include "store/store.hpp"
#include "sync/shard_publish.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {
namespace {

// One tensor's spec from Python: (kind, full_shape, a, b, c) with kind
//   "shard"      Shard(dim=a) of a 1-D mesh: this rank is coordinate b of c
//   "replicate"  Replicate(): coordinate a of the mesh (0 publishes it)
//   "offset"     a plain per-rank tensor whose elements start at full flat position a
using Spec = std::tuple<std::string, std::vector<uint64_t>, uint64_t, uint64_t, uint64_t>;

ShardTensor shard_tensor_of(const Spec& spec, const TensorMeta& local, const std::string& name) {
  const auto& [kind, shape, a, b, c] = spec;
  ShardTensor x{TensorMeta{name, local.dtype, shape}, {}, {}};
  if (kind == "shard") {
    x.rule = PlacementRule{PlacementRule::Kind::kShard, static_cast<uint32_t>(a), c, b};
  } else if (kind == "replicate") {
    x.rule = PlacementRule{PlacementRule::Kind::kReplicate, 0, 0, a};
  } else if (kind != "offset") {
    throw Error("deltasync.ShardedDeltaPublisher: tensor " + name + ": unknown placement kind '" + kind + "'",
                ErrorKind::kInvalidArgument);
  }
  x.placement = kind == "offset" ? offset_placement(a, local.numel()) : rule_placement(x.rule, shape, x.rule.coordinate);
  // A replicated tensor on another coordinate: another rank publishes it, its local copy is not looked at.
  if (kind == "replicate" && a != 0) return x;
  if (x.placement.numel() != local.numel())
    throw Error("deltasync.ShardedDeltaPublisher: tensor " + name + ": the local shard holds " + std::to_string(local.numel()) +
                    " elements, its placement " + placement_text(x.placement) + " in " + shape_text(shape) + " " +
                    std::to_string(x.placement.numel()),
                ErrorKind::kInvalidArgument);
  return x;
}

py::bytes as_bytes(const std::vector<uint8_t>& b) { return py::bytes(reinterpret_cast<const char*>(b.data()), b.size()); }

std::span<const uint8_t> bytes_view(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

// A receipt as Python passes it on: (bytes for the gather, int64 partial halves for the reduce).
py::tuple receipt_pair(const PartReceipt& r) {
  const std::vector<int64_t> halves = split_partials(r.partials);
  at::Tensor t = at::empty({static_cast<int64_t>(halves.size())}, at::kLong);
  std::memcpy(t.data_ptr<int64_t>(), halves.data(), halves.size() * sizeof(int64_t));
  return py::make_tuple(as_bytes(receipt_to_bytes(r)), t);
}

// The reduce's sums (int64, on any device) back as digests.
std::vector<uint64_t> summed_digests(const at::Tensor& summed, size_t tensors) {
  const at::Tensor host = summed.to(at::kCPU).contiguous();
  if (host.scalar_type() != at::kLong) throw Error("deltasync.ShardedDeltaPublisher: summed partials must be int64", ErrorKind::kInvalidArgument);
  return join_partials(std::span<const int64_t>(host.data_ptr<int64_t>(), static_cast<size_t>(host.numel())), tensors, "summed partials");
}

std::vector<PartReceipt> parse_receipts(const std::vector<std::string>& receipts, const char* what) {
  std::vector<PartReceipt> parsed;
  for (size_t r = 0; r < receipts.size(); ++r)
    parsed.push_back(receipt_from_bytes(bytes_view(receipts[r]), std::string(what) + " of rank " + std::to_string(r)));
  return parsed;
}

std::vector<std::vector<ShardTensor>> parse_tables(const std::optional<std::vector<std::string>>& tables) {
  std::vector<std::vector<ShardTensor>> out;
  if (!tables) return out;
  for (size_t r = 0; r < tables->size(); ++r) out.push_back(table_from_bytes(bytes_view((*tables)[r]), "tensor table of rank " + std::to_string(r)));
  return out;
}

PublisherOptions options_from(const py::dict& options) {
  PublisherOptions o;
  for (const std::string& key : set_fields(o, publisher_option_fields(), options, "deltasync.ShardedDeltaPublisher"))
    throw Error("deltasync.ShardedDeltaPublisher: unknown option '" + key + "'", ErrorKind::kInvalidArgument);
  return o;
}

// Rank 0, at the group's start-up: the claim's outcome (JSON) for every rank. Bad options are
// raised by every rank's constructor alike, so they only make the claim's error here.
std::string claim_for_group_json(const std::string& store_url, const py::dict& options) {
  ClaimOutcome claim;
  try {
    const PublisherOptions o = options_from(options);
    const std::shared_ptr<Store> store = open_store(store_url);
    py::gil_scoped_release nogil;
    claim = claim_for_group(*store, o);
  } catch (const std::exception& e) {
    claim.error = e.what();
  }
  return claim_to_json(claim);
}

class ShardPublisherBinding {
 public:
  ShardPublisherBinding(const std::string& store_url, const std::vector<std::string>& names, const std::vector<at::Tensor>& local,
                        const std::vector<Spec>& specs, uint64_t rank, const std::string& claim, const py::dict& options,
                        py::object log)
      : names_(names) {
    const TensorSet set = tensor_set(names, local, "deltasync.ShardedDeltaPublisher");
    if (specs.size() != names.size()) throw Error("deltasync.ShardedDeltaPublisher: one placement per tensor is needed");
    PublisherOptions o = options_from(options);
    o.log = log_callback(std::move(log));
    std::vector<ShardTensor> tensors;
    for (size_t t = 0; t < names.size(); ++t) tensors.push_back(shard_tensor_of(specs[t], set.meta[t], names[t]));
    store_ = open_store(store_url);
    publisher_ = std::make_unique<ShardPublisher>(store_, std::move(tensors), rank, claim_from_json(claim, "claim outcome"),
                                                  engine_for(set, engine::EngineOptions{}), std::move(o));
  }

  bool anchor_due(uint64_t version) const { return publisher_->anchor_due(version); }

  // (receipt bytes, partial halves): the halves go to the reduce, the bytes to the gather.
  py::tuple publish_part(uint64_t version, const std::vector<at::Tensor>& local, bool anchor) {
    const TensorSet set = tensor_set(names_, local, "deltasync.ShardedDeltaPublisher.publish");
    PartReceipt receipt;
    {
      py::gil_scoped_release nogil;
      receipt = publisher_->publish_part(version, set.const_refs(), anchor);
    }
    return receipt_pair(receipt);
  }
  py::tuple failed_receipt(uint64_t version, const std::string& error) const { return receipt_pair(publisher_->failed(version, error)); }

  // This rank's whole table: what rank 0 gathers when a receipt's hashes differ from its own.
  py::bytes table() const { return as_bytes(table_to_bytes(publisher_->tensors())); }
  bool tables_needed(const std::vector<std::string>& receipts) const {
    return deltasync::tables_needed(parse_receipts(receipts, "receipt"), publisher_->tensors());
  }

  // Rank 0: the gathered receipts (rank order), the reduced partial halves, and every rank's table
  // when a first call answered needs_tables -> the outcome (JSON), committed or not.
  std::string commit(const std::vector<std::string>& receipts, const at::Tensor& summed,
                     const std::optional<std::vector<std::string>>& tables) {
    const std::vector<uint64_t> digests = summed_digests(summed, publisher_->tensors().size());
    py::gil_scoped_release nogil;
    std::vector<PartReceipt> parsed;
    std::vector<std::vector<ShardTensor>> parsed_tables;
    try {
      parsed = parse_receipts(receipts, "receipt");
      parsed_tables = parse_tables(tables);
    } catch (const std::exception& e) {
      CommitOutcome failed;
      failed.error = e.what();
      return outcome_to_json(failed);
    }
    const GatheredReceipts gathered{parsed, digests, publisher_->tensors(), parsed_tables};
    return outcome_to_json(commit_parts(*store_, gathered, publisher_->state().last_anchor_version, publisher_->fence()));
  }

  void conclude(const std::string& outcome) { publisher_->conclude(outcome_from_json(outcome, "commit outcome")); }

  // Resume (sync/shard_resume.hpp): this rank's recovery receipt and partial halves for the
  // all-gather and the all-reduce ...
  py::tuple recover() {
    PartReceipt receipt;
    {
      py::gil_scoped_release nogil;
      receipt = publisher_->recover();
    }
    return receipt_pair(receipt);
  }
  // ... and every rank's, in rank order, with the summed halves (and every rank's table when
  // tables_needed): `since`, or None for a store empty at the claim.
  py::object adopt(const std::vector<std::string>& receipts, const at::Tensor& summed, const std::optional<std::vector<std::string>>& tables) {
    std::optional<uint64_t> since;
    const std::vector<uint64_t> digests = summed_digests(summed, publisher_->tensors().size());
    {
      py::gil_scoped_release nogil;
      const std::vector<PartReceipt> parsed = parse_receipts(receipts, "resume receipt");
      const std::vector<std::vector<ShardTensor>> parsed_tables = parse_tables(tables);
      since = publisher_->adopt(parsed, digests, parsed_tables);
    }
    return since ? py::object(py::int_(*since)) : py::none();
  }
  py::dict resume_report() const {
    const ResumeCounters c = publisher_->resume_counters();
    py::dict d;
    d["bytes_read"] = c.bytes_read;
    d["header_reads"] = c.header_reads;
    d["whole_objects"] = c.whole_objects;
    d["ranged_reads"] = c.ranged_reads;
    d["seconds"] = c.seconds;
    return d;
  }

  py::dict state() const {
    const PublisherState s = publisher_->state();
    py::dict d;
    d["last_version"] = s.last_version ? py::object(py::int_(*s.last_version)) : py::none();
    d["last_anchor_version"] = s.last_anchor_version ? py::object(py::int_(*s.last_anchor_version)) : py::none();
    d["delta_bytes_since_anchor"] = s.delta_bytes_since_anchor;
    return d;
  }

  py::dict fence() const { return fence_dict(publisher_->fence()); }

  // (name, [first, run_length, run_stride, run_count]) of what this rank publishes.
  std::vector<std::pair<std::string, std::vector<uint64_t>>> placements() const {
    std::vector<std::pair<std::string, std::vector<uint64_t>>> out;
    for (const auto& t : publisher_->tensors())
      out.emplace_back(t.full.name, std::vector<uint64_t>{t.placement.first, t.placement.run_length, t.placement.run_stride, t.placement.run_count});
    return out;
  }

 private:
  std::vector<std::string> names_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<ShardPublisher> publisher_;
};

}  // namespace

void bind_shard_publisher(py::module_& m) {
  py::class_<ShardPublisherBinding>(m, "ShardPublisher")
      .def(py::init<const std::string&, const std::vector<std::string>&, const std::vector<at::Tensor>&, const std::vector<Spec>&,
                    uint64_t, const std::string&, const py::dict&, py::object>(),
           py::arg("store"), py::arg("names"), py::arg("local"), py::arg("specs"), py::arg("rank"), py::arg("claim"),
           py::arg("options"), py::arg("log") = py::none())
      .def("anchor_due", &ShardPublisherBinding::anchor_due, py::arg("version"))
      .def("publish_part", &ShardPublisherBinding::publish_part, py::arg("version"), py::arg("local"), py::arg("anchor"))
      .def("commit", &ShardPublisherBinding::commit, py::arg("receipts"), py::arg("summed"), py::arg("tables") = py::none())
      .def("failed_receipt", &ShardPublisherBinding::failed_receipt, py::arg("version"), py::arg("error"))
      .def("table", &ShardPublisherBinding::table)
      .def("tables_needed", &ShardPublisherBinding::tables_needed, py::arg("receipts"))
      .def("conclude", &ShardPublisherBinding::conclude, py::arg("outcome"))
      .def("recover", &ShardPublisherBinding::recover)
      .def("adopt", &ShardPublisherBinding::adopt, py::arg("receipts"), py::arg("summed"), py::arg("tables") = py::none())
      .def("resume_report", &ShardPublisherBinding::resume_report)
      .def_property_readonly("fence", &ShardPublisherBinding::fence)
      .def("state", &ShardPublisherBinding::state)
      .def("placements", &ShardPublisherBinding::placements);
  m.def("claim_for_group", &claim_for_group_json, py::arg("store"), py::arg("options"));
}

}  // namespace deltasync::torch_ext
