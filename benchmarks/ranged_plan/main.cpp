// deltasync-ranged-plan: where a tensor-parallel rank's bytes go when it reads a sealed compact
// delta by ranges (docs/stores.md, "Ranged reads"), counted by the subscriber's own planner
// (sync/ranged_plan.hpp) on the header and block indexes of a real encoded and sealed delta --
// no store, no receiver, so a table of block sizes and band options takes seconds, not minutes.
//
// The delta: a Qwen3-0.6B-shaped tensor table (what benchmarks/ranged_fetch.py publishes: the
// stand-in's Hugging Face names and order, tied embeddings), --share of every tensor's elements
// moved by one ulp, with base and result digests in its metadata as a publisher writes them,
// encoded by the compact codec and sealed by ranged::seal. Each rank's needed elements follow
// vLLM's tensor-parallel split as the stand-in of tests/python/vllm_standin.py makes it:
// column-parallel q/k/v and gate/up on dim 0, row-parallel o_proj/down_proj on dim 1,
// vocabulary-parallel embeddings on dim 0 (padded to 64 rows), norms replicated.
//
// Per tensor kind (the planner run on that kind's tensors alone) the bytes above the rank's own
// share are split into: the index reads (the .cindex entries, rounded to chunks), block rounding
// (bytes of chosen blocks that hold changes of other ranks), chunk rounding (bytes of the chunks
// around the chosen blocks that are not theirs); the header is every rank's. "Ideal" is the
// rank's share of the kind's payload bytes (its changes' fraction of each tensor's .cdata).
//
//   deltasync-ranged-plan [--layers 28] [--share 0.01] [--blocks 16384,2048] [--tp 2,4] [--max-tiles 1,8]
// (--max-tiles: the codec's max_tiles, one run each; 1 is the layout without tiles)
#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "codec/compact_codec.hpp"
#include "core/error.hpp"
#include "core/parse_number.hpp"
#include "engine/integrity.hpp"
#include "store/sha256.hpp"
#include "sync/range_hashes.hpp"
#include "sync/ranged_plan.hpp"

using namespace deltasync;

namespace {

enum class Kind { Vocab, Column, Row, Replicated };
constexpr Kind kKinds[] = {Kind::Vocab, Kind::Column, Kind::Row, Kind::Replicated};
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Vocab: return "vocabulary-parallel (embed_tokens)";
    case Kind::Column: return "column-parallel (q/k/v, gate/up)";
    case Kind::Row: return "row-parallel (o_proj, down_proj)";
    default: return "replicated (norms)";
  }
}

struct Tensor {
  TensorMeta meta;
  Kind kind;
};

// The stand-in's HFModel: vocabulary 151936, hidden 1024, 16 query / 8 KV heads of 128,
// intermediate 3072, tied embeddings, in named_parameters() order.
std::vector<Tensor> qwen3_table(uint64_t layers) {
  const uint64_t vocab = 151936, hidden = 1024, q = 16 * 128, kv = 8 * 128, inter = 3072;
  std::vector<Tensor> out;
  auto add = [&](std::string name, std::vector<uint64_t> shape, Kind kind) {
    out.push_back({TensorMeta{std::move(name), DType::BF16, std::move(shape)}, kind});
  };
  add("model.embed_tokens.weight", {vocab, hidden}, Kind::Vocab);
  for (uint64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {q, hidden}, Kind::Column);
    add(p + "self_attn.k_proj.weight", {kv, hidden}, Kind::Column);
    add(p + "self_attn.v_proj.weight", {kv, hidden}, Kind::Column);
    add(p + "self_attn.o_proj.weight", {hidden, q}, Kind::Row);
    add(p + "mlp.gate_proj.weight", {inter, hidden}, Kind::Column);
    add(p + "mlp.up_proj.weight", {inter, hidden}, Kind::Column);
    add(p + "mlp.down_proj.weight", {hidden, inter}, Kind::Row);
    add(p + "input_layernorm.weight", {hidden}, Kind::Replicated);
    add(p + "post_attention_layernorm.weight", {hidden}, Kind::Replicated);
  }
  add("model.norm.weight", {hidden}, Kind::Replicated);
  return out;
}

// What rank `rank` of `tp` holds of a tensor, as flat spans of the full tensor.
std::vector<compact::ElementSpan> held(const Tensor& t, uint64_t rank, uint64_t tp) {
  const uint64_t numel = t.meta.numel();
  if (t.kind == Kind::Replicated || tp == 1) return {{0, numel}};
  const uint64_t rows = t.meta.shape[0], cols = t.meta.shape[1];
  if (t.kind == Kind::Row) {
    const uint64_t width = cols / tp;
    std::vector<compact::ElementSpan> out;
    for (uint64_t r = 0; r < rows; ++r) out.push_back({r * cols + rank * width, r * cols + (rank + 1) * width});
    return out;
  }
  // Column- and vocabulary-parallel: a range of rows (the vocabulary padded to a multiple of 64
  // first: the last rank's padding rows exist in no published tensor).
  const uint64_t padded = t.kind == Kind::Vocab ? (rows + 63) / 64 * 64 : rows;
  const uint64_t per = padded / tp;
  const uint64_t begin = std::min(rows, rank * per), end = std::min(rows, (rank + 1) * per);
  if (begin == end) return {};
  return {{begin * cols, end * cols}};
}

// --share of the elements of every tensor, moved by one ulp (+1 on the bit pattern, as the
// Python benchmark does), over pseudo-random bf16 base bits.
SparseDelta make_delta(const std::vector<Tensor>& table, double share, uint64_t seed) {
  SparseDelta d;
  d.offsets.push_back(0);
  d.value_offsets.push_back(0);
  std::mt19937_64 rng(seed);
  std::geometric_distribution<uint64_t> gap(share);
  for (const Tensor& t : table) {
    const uint64_t numel = t.meta.numel();
    for (uint64_t p = gap(rng); p < numel; p += 1 + gap(rng)) {
      d.indices.push_back(static_cast<int64_t>(p));
      const uint16_t base = static_cast<uint16_t>((rng() & 0x807f) | (0x7a << 7));  // ~ +-2^-5
      const uint16_t now = static_cast<uint16_t>(base + 1);
      d.base_values.push_back(static_cast<uint8_t>(base));
      d.base_values.push_back(static_cast<uint8_t>(base >> 8));
      d.values.push_back(static_cast<uint8_t>(now));
      d.values.push_back(static_cast<uint8_t>(now >> 8));
    }
    d.offsets.push_back(d.indices.size());
    d.value_offsets.push_back(d.values.size());
  }
  return d;
}

struct Sealed {
  std::vector<uint8_t> bytes;
  ranged::SealedHeader header;
};

Sealed encode_and_seal(const std::vector<Tensor>& table, const SparseDelta& delta, const compact::Options& options) {
  std::vector<TensorMeta> metas;
  for (const Tensor& t : table) metas.push_back(t.meta);
  integrity::DeltaDigests dd;
  dd.model_version = 2;
  dd.base_version = 1;
  std::mt19937_64 rng(7);
  for (size_t t = 0; t < table.size(); ++t) {
    if (delta.view().count(t) == 0) continue;
    dd.base.emplace(metas[t].name, rng());
    dd.result.emplace(metas[t].name, rng());
  }
  DeltaInfo info;
  integrity::put_delta_digests(info, dd);
  const std::vector<uint8_t> file = compact::serialize_compact_delta(metas, delta.view(), info, options);
  Sealed s;
  s.bytes = ranged::seal(file, "delta");
  protocol::ObjectRef ref{"delta", s.bytes.size(), "", ""};
  const uint64_t prefix = ranged::header_prefix_bytes(s.bytes, s.bytes.size(), "delta");
  ref.header_sha256 = sha256_hex(std::span<const uint8_t>(s.bytes).first(prefix));
  s.header = ranged::read_sealed_header(std::span<const uint8_t>(s.bytes).first(prefix), ref, "delta");
  return s;
}

// "KEY N, ..., tensor entries N": what the header's bytes are made of.
std::string header_composition(const Sealed& s) {
  const auto j = nlohmann::ordered_json::parse(s.bytes.begin() + 8, s.bytes.begin() + static_cast<std::ptrdiff_t>(s.header.data_offset));
  std::string out;
  uint64_t entries = 0;
  for (const auto& [key, value] : j.items()) {
    if (key != "__metadata__") {
      entries += key.size() + value.dump().size() + 4;
      continue;
    }
    for (const auto& [k, v] : value.items()) out += k + " " + std::to_string(v.dump().size() + k.size() + 4) + ", ";
  }
  return out + "tensor entries " + std::to_string(entries);
}

struct Breakdown {
  uint64_t ideal = 0, index = 0;
  int64_t block_rounding = 0;  // negative by a few bytes where the ideal's integer shares round up
  uint64_t chunk_rounding = 0, total = 0;
};

// The planner on the tensors of `kinds` only; ideal = the rank's share of their payload bytes.
Breakdown plan(const std::vector<Tensor>& table, const SparseDelta& delta, const Sealed& s, uint64_t rank, uint64_t tp,
               std::initializer_list<Kind> kinds) {
  ranged::NeededRanges needed;
  Breakdown b;
  const DeltaView view = delta.view();
  for (size_t t = 0; t < table.size(); ++t) {
    if (std::find(kinds.begin(), kinds.end(), table[t].kind) == kinds.end()) continue;
    std::vector<compact::ElementSpan> spans = held(table[t], rank, tp);
    if (spans.empty()) continue;
    // The rank's changes of this tensor, for its ideal share of the payload.
    uint64_t mine = 0;
    size_t k = 0;
    for (uint64_t i = view.offsets[t]; i < view.offsets[t + 1]; ++i) {
      const auto p = static_cast<uint64_t>(view.indices[i]);
      while (k < spans.size() && spans[k].end <= p) ++k;
      if (k < spans.size() && spans[k].begin <= p) ++mine;
    }
    if (const st::TensorInfo* data = s.header.find(table[t].meta.name + ".cdata"); data && view.count(t) > 0)
      b.ideal += data->nbytes() * mine / view.count(t);
    needed.emplace(table[t].meta.name, ranged::NeededTensor{table[t].meta.shape, std::move(spans)});
  }
  const auto cindex = [&](const std::string& name) {
    const st::TensorInfo* t = s.header.find(name + ".cindex");
    return std::span<const uint8_t>(s.bytes).subspan(s.header.data_offset + t->begin, t->nbytes());
  };
  const ranged::ObjectReadPlan p = ranged::plan_object_reads(s.header, needed, {}, cindex, "delta");
  uint64_t chosen = 0;
  for (const auto& reads : p.blocks)
    for (const auto& r : reads.ranges) chosen += r.length;
  uint64_t block_chunks = 0;
  for (const auto& r : p.block_chunks) block_chunks += r.length;
  for (const auto& r : p.index_chunks) b.index += r.length;
  b.block_rounding = static_cast<int64_t>(chosen) - static_cast<int64_t>(b.ideal);
  // Chunks the index reads brought are not read again; what the block chunks add beyond the
  // chosen blocks' own bytes is chunk rounding (negative when an index chunk carried blocks).
  b.chunk_rounding = block_chunks - std::min(block_chunks, chosen);
  b.total = p.bytes() - p.header_bytes;
  return b;
}

std::vector<uint64_t> numbers(const std::string& text, const std::string& what) {
  std::vector<uint64_t> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    out.push_back(parse_decimal<uint64_t>(text.substr(at, comma - at), what, ErrorKind::kInvalidArgument));
    at = comma + 1;
  }
  return out;
}

std::string pct(uint64_t part, uint64_t whole) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", whole ? static_cast<double>(part) / static_cast<double>(whole) : 0.0);
  return buf;
}

}  // namespace

int main(int argc, char** argv) try {
  uint64_t layers = 28;
  double share = 0.01;
  std::vector<uint64_t> blocks{16384, 2048}, tps{2, 4};
  std::vector<uint64_t> max_tiles{1, compact::kDefaultMaxTiles};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") layers = parse_decimal<uint64_t>(value, flag, ErrorKind::kInvalidArgument);
    else if (flag == "--share") share = parse_decimal_real(value, flag, ErrorKind::kInvalidArgument);
    else if (flag == "--blocks") blocks = numbers(value, flag);
    else if (flag == "--tp") tps = numbers(value, flag);
    else if (flag == "--max-tiles") max_tiles = numbers(value, flag);
    else throw Error("unknown option " + flag + " (--layers, --share, --blocks, --tp, --max-tiles)", ErrorKind::kInvalidArgument);
  }
  const std::vector<Tensor> table = qwen3_table(layers);
  const SparseDelta delta = make_delta(table, share, 1);
  uint64_t params = 0;
  for (const Tensor& t : table) params += t.meta.numel();
  std::printf("Qwen3-0.6B-shaped table, %llu layers, %.0fM parameters, bf16; %.2f%% of every tensor's elements moved by one "
              "ulp: %llu changes.\n\n",
              static_cast<unsigned long long>(layers), params / 1e6, share * 100,
              static_cast<unsigned long long>(delta.view().total_changed()));
  std::printf("| block elements | max tiles | delta bytes | header | TP | rank | kind | ideal | index reads | block rounding | "
              "chunk rounding | share of the kind | share of the delta |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (uint64_t block : blocks) {
    for (const uint64_t most : max_tiles) {
      compact::Options options;
      options.block_elements = static_cast<uint32_t>(block);
      options.max_tiles = static_cast<uint32_t>(most);
      const std::string tiling = std::to_string(most);
      const Sealed s = encode_and_seal(table, delta, options);
      const uint64_t whole = s.bytes.size();
      std::fprintf(stderr, "blocks %llu, tiles %s: header %llu bytes: %s\n", static_cast<unsigned long long>(block), tiling.c_str(),
                   static_cast<unsigned long long>(s.header.data_offset), header_composition(s).c_str());
      for (uint64_t tp : tps) {
        for (uint64_t rank = 0; rank < tp; ++rank) {
          for (Kind kind : kKinds) {
            const Breakdown b = plan(table, delta, s, rank, tp, {kind});
            // The kind's whole payload + indexes: its share is of those.
            uint64_t kind_bytes = 0;
            for (const Tensor& t : table)
              if (t.kind == kind)
                for (const char* suffix : {".cindex", ".cdata"})
                  if (const st::TensorInfo* e = s.header.find(t.meta.name + suffix)) kind_bytes += e->nbytes();
            std::printf("| %llu | %s | %llu | %llu | %llu | %llu | %s | %llu | %llu | %lld | %llu | %s | %s |\n",
                        static_cast<unsigned long long>(block), tiling.c_str(),
                        static_cast<unsigned long long>(whole), static_cast<unsigned long long>(s.header.data_offset),
                        static_cast<unsigned long long>(tp), static_cast<unsigned long long>(rank), kind_name(kind),
                        static_cast<unsigned long long>(b.ideal), static_cast<unsigned long long>(b.index),
                        static_cast<long long>(b.block_rounding), static_cast<unsigned long long>(b.chunk_rounding),
                        pct(b.total, kind_bytes).c_str(), pct(b.total, whole).c_str());
          }
          const Breakdown all = plan(table, delta, s, rank, tp, {Kind::Vocab, Kind::Column, Kind::Row, Kind::Replicated});
          std::printf("| %llu | %s | %llu | %llu | %llu | %llu | **whole delta** | %llu | %llu | %lld | %llu | | **%s** |\n",
                      static_cast<unsigned long long>(block), tiling.c_str(),
                      static_cast<unsigned long long>(whole), static_cast<unsigned long long>(s.header.data_offset),
                      static_cast<unsigned long long>(tp), static_cast<unsigned long long>(rank),
                      static_cast<unsigned long long>(all.ideal), static_cast<unsigned long long>(all.index),
                      static_cast<long long>(all.block_rounding), static_cast<unsigned long long>(all.chunk_rounding),
                      pct(all.total + s.header.data_offset, whole).c_str());
        }
      }
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "deltasync-ranged-plan: %s\n", e.what());
  return 1;
}
