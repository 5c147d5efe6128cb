// deltasync-ranged-plan: where a tensor-parallel rank's bytes go when it reads a compact delta by
// ranges (docs/stores.md, "Ranged reads"), counted by the subscriber's own ranged reader
// (ranged::read_needed, sync/ranged_fetch.hpp) over the bytes of a real encoded delta in memory --
// no store, no receiver, so a table of block sizes, layouts and request costs takes seconds, not
// minutes.
//
// The delta: a Qwen3-0.6B-shaped tensor table (what benchmarks/ranged_fetch.py publishes: the
// stand-in's Hugging Face names and order, tied embeddings), --share of every tensor's elements
// moved by one ulp, with base and result digests as a publisher writes them, encoded by the compact
// codec in container layout 1 (sealed by ranged::seal) or 2 (the indexed layout). Each rank's
// needed elements follow vLLM's tensor-parallel split as the stand-in of
// tests/python/vllm_standin.py makes it: column-parallel q/k/v and gate/up on dim 0, row-parallel
// o_proj/down_proj on dim 1, vocabulary-parallel embeddings on dim 0 (padded to 64 rows), norms
// replicated.
//
// Per tensor kind (the reader run on that kind's tensors alone) a rank's bytes are split into: the
// first reads (the header; in the indexed layout the presence bitmap and page hashes), the index reads (layout 1: the .cindex entries in whole
// chunks; layout 2: the record pages and block index entries) and the block reads (chosen blocks,
// in whole chunks in layout 1, and the gaps read through). "Ideal" is the rank's share of the
// kind's block bytes (its changes' fraction of each tensor's payload); the share of the kind is
// its index and block reads over the kind's block indexes and payloads.
//
//   deltasync-ranged-plan [--layers 28] [--share 0.01] [--blocks 16384,2048] [--tp 2,4] [--max-tiles 8]
//                         [--layouts 1,2] [--gap-bytes 0,16384]
// (--max-tiles: the codec's max_tiles, 1 is the layout without tiles; --gap-bytes: the request costs)
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
#include "format/sha256.hpp"
#include "codec/compact_table.hpp"
#include "sync/range_hashes.hpp"
#include "sync/ranged_fetch.hpp"
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

// The delta as the publisher uploads it (layout 1 sealed with chunk hashes; the indexed layout as
// written), its reference and its payload bytes per tensor.
struct Object {
  std::vector<uint8_t> bytes;
  protocol::ObjectRef ref;
  uint64_t header_bytes = 0;
  std::map<std::string, uint64_t> payload, index;  // per changed tensor: its blocks' and its block index's bytes
};

Object encode_and_upload(const std::vector<Tensor>& table, const SparseDelta& delta, const compact::Options& options) {
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
  Object o;
  o.bytes = ranged::seal(compact::serialize_compact_delta(metas, delta.view(), info, options), "delta");
  o.header_bytes = ranged::header_prefix_bytes(o.bytes, o.bytes.size(), "delta");
  o.ref = protocol::ObjectRef{"delta", o.bytes.size(), "", sha256_hex(std::span<const uint8_t>(o.bytes).first(o.header_bytes))};
  const st::File file = st::File::from_bytes(o.bytes, "delta");
  for (const compact::EncodedTensorView& e : compact::read_compact_file(file, metas).tensors) {
    o.payload[std::string(e.name)] = e.payload.size();
    o.index[std::string(e.name)] = e.block_index.size();
  }
  return o;
}

// "KEY N, ..., tensor entries N": what the header's bytes are made of.
std::string header_composition(const Object& o) {
  const auto j = nlohmann::ordered_json::parse(o.bytes.begin() + 8, o.bytes.begin() + static_cast<std::ptrdiff_t>(o.header_bytes));
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
  uint64_t ideal = 0;  // the rank's changes' share of the kinds' block bytes
  ranged::RangedDelta read;
};

// The subscriber's ranged reader on the tensors of `kinds` only, through an in-memory ranged GET.
Breakdown plan(const std::vector<Tensor>& table, const compact::TensorTable& tensor_table, const SparseDelta& delta, const Object& o,
               uint64_t rank, uint64_t tp, uint64_t gap, std::initializer_list<Kind> kinds) {
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
    if (const auto it = o.payload.find(table[t].meta.name); it != o.payload.end()) b.ideal += it->second * mine / view.count(t);
    needed.emplace(table[t].meta.name, ranged::NeededTensor{table[t].meta.shape, std::move(spans)});
  }
  const ranged::RangeGet get = [&](uint64_t offset, uint64_t length) {
    return std::vector<uint8_t>(o.bytes.begin() + static_cast<std::ptrdiff_t>(offset), o.bytes.begin() + static_cast<std::ptrdiff_t>(offset + length));
  };
  b.read = ranged::read_needed(get, o.ref, needed, {}, {&tensor_table, gap}, "delta");
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
  std::vector<uint64_t> max_tiles{compact::kDefaultMaxTiles}, layouts{compact::kLayout1, compact::kLayout2};
  std::vector<uint64_t> gaps{0, ranged::kDefaultGapBytes};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") layers = parse_decimal<uint64_t>(value, flag, ErrorKind::kInvalidArgument);
    else if (flag == "--share") share = parse_decimal_real(value, flag, ErrorKind::kInvalidArgument);
    else if (flag == "--blocks") blocks = numbers(value, flag);
    else if (flag == "--tp") tps = numbers(value, flag);
    else if (flag == "--max-tiles") max_tiles = numbers(value, flag);
    else if (flag == "--layouts") layouts = numbers(value, flag);
    else if (flag == "--gap-bytes") gaps = numbers(value, flag);
    else throw Error("unknown option " + flag + " (--layers, --share, --blocks, --tp, --max-tiles, --layouts, --gap-bytes)", ErrorKind::kInvalidArgument);
  }
  const std::vector<Tensor> table = qwen3_table(layers);
  std::vector<TensorMeta> metas;
  for (const Tensor& t : table) metas.push_back(t.meta);
  const compact::TensorTable tensor_table(metas);
  const SparseDelta delta = make_delta(table, share, 1);
  uint64_t params = 0;
  for (const Tensor& t : table) params += t.meta.numel();
  std::printf("Qwen3-0.6B-shaped table, %llu layers, %.0fM parameters, bf16; %.2f%% of every tensor's elements moved by one "
              "ulp: %llu changes.\n\n",
              static_cast<unsigned long long>(layers), params / 1e6, share * 100,
              static_cast<unsigned long long>(delta.view().total_changed()));
  std::printf("| block elements | max tiles | layout | gap | delta bytes | header | TP | rank | kind | ideal | first read | index reads | "
              "block reads | requests | share of the kind | share of the delta |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (uint64_t block : blocks)
    for (const uint64_t most : max_tiles)
      for (const uint64_t layout : layouts) {
        compact::Options options;
        options.block_elements = static_cast<uint32_t>(block);
        options.max_tiles = static_cast<uint32_t>(most);
        options.layout = static_cast<uint32_t>(layout);
        const Object o = encode_and_upload(table, delta, options);
        const uint64_t whole = o.bytes.size();
        std::fprintf(stderr, "blocks %llu, tiles %llu, layout %llu: header %llu bytes: %s\n", static_cast<unsigned long long>(block),
                     static_cast<unsigned long long>(most), static_cast<unsigned long long>(layout),
                     static_cast<unsigned long long>(o.header_bytes), header_composition(o).c_str());
        for (const uint64_t gap : gaps)
          for (uint64_t tp : tps)
            for (uint64_t rank = 0; rank < tp; ++rank) {
              auto row = [&](const char* kind, const Breakdown& b, const std::string& kind_share, const std::string& delta_share) {
                std::printf("| %llu | %llu | %llu | %llu | %llu | %llu | %llu | %llu | %s | %llu | %llu | %llu | %llu | %llu | %s | %s |\n",
                            static_cast<unsigned long long>(block), static_cast<unsigned long long>(most),
                            static_cast<unsigned long long>(layout), static_cast<unsigned long long>(gap), static_cast<unsigned long long>(whole),
                            static_cast<unsigned long long>(o.header_bytes), static_cast<unsigned long long>(tp),
                            static_cast<unsigned long long>(rank), kind, static_cast<unsigned long long>(b.ideal),
                            static_cast<unsigned long long>(b.read.head_bytes), static_cast<unsigned long long>(b.read.index_bytes),
                            static_cast<unsigned long long>(b.read.block_bytes), static_cast<unsigned long long>(b.read.requests),
                            kind_share.c_str(), delta_share.c_str());
              };
              for (Kind kind : kKinds) {
                const Breakdown b = plan(table, tensor_table, delta, o, rank, tp, gap, {kind});
                // The kind's block indexes and payloads: its share is of those (beyond the first read).
                uint64_t kind_bytes = 0;
                for (const Tensor& t : table)
                  if (t.kind == kind && o.payload.count(t.meta.name)) kind_bytes += o.payload.at(t.meta.name) + o.index.at(t.meta.name);
                row(kind_name(kind), b, pct(b.read.index_bytes + b.read.block_bytes, kind_bytes), "");
              }
              const Breakdown all = plan(table, tensor_table, delta, o, rank, tp, gap, {Kind::Vocab, Kind::Column, Kind::Row, Kind::Replicated});
              row("**whole delta**", all, "", "**" + pct(all.read.bytes_fetched, whole) + "**");
            }
      }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "deltasync-ranged-plan: %s\n", e.what());
  return 1;
}
