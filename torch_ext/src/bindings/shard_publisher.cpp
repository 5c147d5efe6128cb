// Binding of deltasync::ShardPublisher (sync/shard_publish.hpp): the Python ShardedDeltaPublisher
// passes each rank's local shards and says where they sit (a placement spec per tensor, read from
// the DTensor's placements); the C++ side claims the store (rank 0), encodes, uploads, checks the
// receipts and commits. The broadcast of the claim, the gather of the receipts and the broadcast
// of the outcome are torch.distributed calls in Python.
#include <pybind11/stl.h>
#include <torch/extension.h>

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

Placement placement_of(const Spec& spec, uint64_t local_numel, const std::string& name) {
  const auto& [kind, shape, a, b, c] = spec;
  uint64_t numel = 1;
  for (uint64_t d : shape) numel *= d;
  Placement p;
  if (kind == "shard") {
    p = shard_placement(shape, a, b, c);
  } else if (kind == "replicate") {
    p = a == 0 ? whole_placement(numel) : Placement{};
    if (a != 0) return p;  // another rank publishes it; its local copy is not looked at
  } else if (kind == "offset") {
    p = offset_placement(a, local_numel);
  } else {
    throw Error("deltasync.ShardedDeltaPublisher: tensor " + name + ": unknown placement kind '" + kind + "'",
                ErrorKind::kInvalidArgument);
  }
  if (p.numel() != local_numel)
    throw Error("deltasync.ShardedDeltaPublisher: tensor " + name + ": the local shard holds " + std::to_string(local_numel) +
                    " elements, its placement " + placement_text(p) + " in " + shape_text(shape) + " " + std::to_string(p.numel()),
                ErrorKind::kInvalidArgument);
  return p;
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
    for (size_t t = 0; t < names.size(); ++t)
      tensors.push_back(ShardTensor{TensorMeta{names[t], set.meta[t].dtype, std::get<1>(specs[t])},
                                    placement_of(specs[t], set.meta[t].numel(), names[t])});
    store_ = open_store(store_url);
    publisher_ = std::make_unique<ShardPublisher>(store_, std::move(tensors), rank, claim_from_json(claim, "claim outcome"),
                                                  engine_for(set, engine::EngineOptions{}), std::move(o));
  }

  bool anchor_due(uint64_t version) const { return publisher_->anchor_due(version); }

  std::string publish_part(uint64_t version, const std::vector<at::Tensor>& local, bool anchor) {
    const TensorSet set = tensor_set(names_, local, "deltasync.ShardedDeltaPublisher.publish");
    py::gil_scoped_release nogil;
    return receipt_to_json(publisher_->publish_part(version, set.const_refs(), anchor));
  }

  // Rank 0: the gathered receipts (JSON, rank order) -> the outcome (JSON), committed or not.
  std::string commit(const std::vector<std::string>& receipts) {
    py::gil_scoped_release nogil;
    std::vector<PartReceipt> parsed;
    try {
      for (size_t r = 0; r < receipts.size(); ++r) parsed.push_back(receipt_from_json(receipts[r], "receipt of rank " + std::to_string(r)));
    } catch (const std::exception& e) {
      CommitOutcome failed;
      failed.error = e.what();
      return outcome_to_json(failed);
    }
    return outcome_to_json(commit_parts(*store_, parsed, publisher_->state().last_anchor_version, publisher_->fence()));
  }

  std::string failed_receipt(uint64_t version, const std::string& error) const { return receipt_to_json(publisher_->failed(version, error)); }

  void conclude(const std::string& outcome) { publisher_->conclude(outcome_from_json(outcome, "commit outcome")); }

  // Resume (sync/shard_resume.hpp): this rank's recovery receipt (JSON) for the all-gather ...
  std::string recover() {
    py::gil_scoped_release nogil;
    return receipt_to_json(publisher_->recover());
  }
  // ... and every rank's, in rank order: `since`, or None for a store empty at the claim.
  py::object adopt(const std::vector<std::string>& receipts) {
    std::optional<uint64_t> since;
    {
      py::gil_scoped_release nogil;
      std::vector<PartReceipt> parsed;
      for (size_t r = 0; r < receipts.size(); ++r) parsed.push_back(receipt_from_json(receipts[r], "resume receipt of rank " + std::to_string(r)));
      since = publisher_->adopt(parsed);
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
      .def("commit", &ShardPublisherBinding::commit, py::arg("receipts"))
      .def("failed_receipt", &ShardPublisherBinding::failed_receipt, py::arg("version"), py::arg("error"))
      .def("conclude", &ShardPublisherBinding::conclude, py::arg("outcome"))
      .def("recover", &ShardPublisherBinding::recover)
      .def("adopt", &ShardPublisherBinding::adopt, py::arg("receipts"))
      .def("resume_report", &ShardPublisherBinding::resume_report)
      .def_property_readonly("fence", &ShardPublisherBinding::fence)
      .def("state", &ShardPublisherBinding::state)
      .def("placements", &ShardPublisherBinding::placements);
  m.def("claim_for_group", &claim_for_group_json, py::arg("store"), py::arg("options"));
}

}  // namespace deltasync::torch_ext
