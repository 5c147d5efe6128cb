// deltasync demo: the main job on an embedded default. A transformer-shaped bf16 model of tens
// of millions of elements is trained by AdamW at an RL learning rate; after every step the
// trainer encodes the change against its shadow, writes a delta file, and a receiver holding a
// second copy reads it, checks it against its digests, applies it and is compared bit for bit
// with the trainer. One line per step: share changed, delta vs full bytes, and the times.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "args.hpp"
#include "backend.hpp"
#include "checkpoint.hpp"
#include "codec/delta_io.hpp"
#include "codec/compact_codec.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"
#include "sim/training_sim.hpp"

namespace deltasync::cli {
namespace {

constexpr const char* kUsage =
    "demo [--steps 20] [--lr 1e-6] [--vocab 32000] [--hidden 1024] [--intermediate 2816] [--layers 2] "
    "[--format compact|trl] [--dir DIR] [--keep] [--cpu|--gpu]";

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// A copy of the model's bits held by one side (the trainer's shadow or the receiver's weights).
struct ModelCopy {
  std::vector<std::vector<uint8_t>> tensors;
  std::vector<TensorRef> refs(const std::vector<TensorMeta>& meta) {
    std::vector<TensorRef> out;
    for (size_t t = 0; t < meta.size(); ++t) out.push_back({meta[t].name, tensors[t].data(), meta[t].numel(), 2});
    return out;
  }
  std::vector<ConstTensorRef> views(const std::vector<TensorMeta>& meta) const {
    std::vector<ConstTensorRef> out;
    for (size_t t = 0; t < meta.size(); ++t) out.push_back({meta[t].name, tensors[t].data(), meta[t].numel(), 2});
    return out;
  }
};

ModelCopy snapshot(const sim::TrainingSim& trainer) {
  ModelCopy copy;
  for (size_t t = 0; t < trainer.tensors().size(); ++t) {
    const auto* bits = reinterpret_cast<const uint8_t*>(trainer.bf16(t));
    copy.tensors.emplace_back(bits, bits + trainer.tensors()[t].numel() * 2);
  }
  return copy;
}

int run_demo(const Args& raw) {
  ParsedArgs args(raw, {"--steps", "--lr", "--vocab", "--hidden", "--intermediate", "--layers", "--format", "--dir", "--seed"},
                  {"--cpu", "--gpu", "--keep"});
  args.expect_positional(0, kUsage);
  const Backend backend = choose_backend(args);
  const uint64_t steps = args.get_u64("--steps").value_or(20);
  const double lr = args.get_real("--lr").value_or(1e-6);
  const DeltaFormat format = parse_delta_format(args.get("--format").value_or("compact"));
  sim::ModelShape shape;
  shape.vocab = args.get_u64("--vocab").value_or(32000);
  shape.hidden = args.get_u64("--hidden").value_or(1024);
  shape.intermediate = args.get_u64("--intermediate").value_or(2816);
  shape.layers = args.get_u64("--layers").value_or(2);
  shape.kv_heads_dim = shape.hidden;
  const std::filesystem::path dir =
      args.get("--dir").value_or((std::filesystem::temp_directory_path() / "deltasync-demo").string());
  std::filesystem::create_directories(dir);

  sim::TrainingSim trainer(shape, args.get_u64("--seed").value_or(42));
  const std::vector<TensorMeta>& meta = trainer.tensors();
  const uint64_t full_bytes = trainer.total_elements() * 2;
  std::printf("deltasync demo: %zu bf16 tensors, %.1fM elements (%s), AdamW lr=%g, %llu steps, %s deltas, %s backend, files in %s\n",
              meta.size(), trainer.total_elements() / 1e6, human_bytes(full_bytes).c_str(), lr,
              static_cast<unsigned long long>(steps), std::string(delta_format_name(format)).c_str(),
              backend_name(backend), dir.c_str());

  // Version 0 is shared by both sides (what an anchor would give them). Both run on the one
  // engine: the trainer's weights and the receiver's copy placed in its memory, the shadow
  // taken from the trainer's, every step encoded, written, read back and applied verified.
  const std::unique_ptr<engine::SyncEngine> engine = make_engine(backend);
  ModelCopy receiver = snapshot(trainer);
  std::vector<ConstTensorRef> trainer_views;
  for (size_t t = 0; t < meta.size(); ++t) trainer_views.push_back({meta[t].name, trainer.bf16(t), meta[t].numel(), 2});
  PlacedTensors trainer_weights(*engine, trainer_views);
  const std::vector<TensorRef> receiver_host = receiver.refs(meta);
  PlacedTensors receiver_weights(*engine, std::span<const TensorRef>(receiver_host));
  engine->reset_shadow(trainer_weights.views());
  std::vector<uint64_t> trainer_digests = engine->digests(trainer_weights.views());
  std::vector<uint64_t> receiver_digests = trainer_digests;
  uint64_t receiver_version = 0;

  std::printf("%4s %9s %12s %10s %8s %9s %9s %9s %10s  %s\n", "step", "changed", "delta", "vs full", "B/chg",
              "train ms", "encode ms", "write ms", "apply ms", "receiver");
  sim::AdamW opt;
  opt.lr = lr;
  engine::EncodeRequest request;
  request.want_coded = format == DeltaFormat::Compact;
  request.tensors = meta;  // their shapes decide the compact layout's tiles
  engine::StagedDelta staged;  // reused across steps
  uint64_t sum_delta_bytes = 0;
  for (uint64_t version = 1; version <= steps; ++version) {
    auto t0 = Clock::now();
    trainer.step(opt);
    const double train_ms = ms_since(t0);

    // Trainer: diff against the shadow (which then equals the new weights), record digests.
    t0 = Clock::now();
    for (size_t t = 0; t < meta.size(); ++t) trainer_weights.upload(t, trainer.bf16(t));
    engine->encode(trainer_weights.views(), request, staged);
    staged.fill_offsets(meta);
    integrity::DeltaDigests promises{version, version - 1, {}, {}};
    std::vector<uint64_t> next_digests = trainer_digests;
    staged.advance_digests(next_digests, meta);
    for (size_t t = 0; t < meta.size(); ++t) {
      if (staged.counts[t] == 0) continue;
      promises.base.emplace(meta[t].name, trainer_digests[t]);
      promises.result.emplace(meta[t].name, next_digests[t]);
    }
    trainer_digests = next_digests;
    DeltaInfo info;
    integrity::put_delta_digests(info, promises);
    const double encode_ms = ms_since(t0);

    t0 = Clock::now();
    char name[64];
    std::snprintf(name, sizeof name, "delta-%06llu.safetensors", static_cast<unsigned long long>(version));
    const std::string path = (dir / name).string();
    if (staged.coded_on_device)
      compact::write_compact_delta(path, meta, staged.changes.view(), info, std::move(staged.coded));
    else
      write_delta(path, format, meta, staged.changes.view(), info);
    const double write_ms = ms_since(t0);

    // Receiver: read the file; the engine verifies its base, applies it in place and verifies
    // the result.
    t0 = Clock::now();
    const st::File file = st::File::open(path);
    engine::TransferCounters transfer;
    engine->apply(engine::DeltaToApply{&file, version, version - 1}, meta, receiver_weights.refs(), receiver_digests,
                  receiver_version, transfer);
    receiver_version = version;
    const double apply_ms = ms_since(t0);
    receiver_weights.download();

    bool identical = true;
    for (size_t t = 0; t < meta.size() && identical; ++t)
      identical = std::memcmp(receiver.tensors[t].data(), trainer.bf16(t), meta[t].numel() * 2) == 0;
    const uint64_t changed = staged.total_changed();
    const uint64_t bytes = file.size_bytes();
    sum_delta_bytes += bytes;
    std::printf("%4llu %8.3f%% %12s %9.1fx %8.2f %9.0f %9.1f %9.1f %10.1f  %s\n",
                static_cast<unsigned long long>(version), 100.0 * changed / trainer.total_elements(),
                human_bytes(bytes).c_str(), double(full_bytes) / bytes, changed ? double(bytes) / changed : 0.0,
                train_ms, encode_ms, write_ms, apply_ms, identical ? "bit-identical" : "MISMATCH");
    std::fflush(stdout);
    if (!identical) throw Error("receiver differs from the trainer after version " + std::to_string(version));
    if (!args.has("--keep")) std::filesystem::remove(path);
  }
  std::printf("done: %llu versions, %s of deltas instead of %s of full weights (%.1fx less), receiver bit-identical at every step\n",
              static_cast<unsigned long long>(steps), human_bytes(sum_delta_bytes).c_str(),
              human_bytes(double(full_bytes) * steps).c_str(), double(full_bytes) * steps / sum_delta_bytes);
  return 0;
}

const bool registered = register_command({"demo", kUsage, &run_demo});

}  // namespace
}  // namespace deltasync::cli
