"""A stand-in for the parts of vLLM that the deltasync worker extension relies on, written for
the tests (vLLM itself needs a GPU build). It reproduces vLLM's conventions, not its code:

- parameters carry `weight_loader(param, loaded_weight[, loaded_shard_id])` and the attributes
  `output_dim` / `input_dim` that the loaders read;
- QKVParallelLinear fuses q/k/v along the output dim (shard ids "q", "k", "v"); each rank holds
  its q heads, then its kv heads (replicated when tp_size > num_kv_heads);
- MergedColumnParallelLinear fuses gate/up (shard ids 0, 1), each sharded by rank;
- RowParallelLinear shards along the input dim (dim 1); its bias is not sharded;
- VocabParallelEmbedding / ParallelLMHead pad the vocabulary to a multiple of 64 and shard rows;
  padding rows are zero-filled by the loader; a tied lm_head shares the embedding's parameter
  and the model's load_weights skips "lm_head.weight";
- the model's load_weights maps Hugging Face names through a stacked_params_mapping.

TP ranks are simulated by building one model per rank (tp_rank, tp_size given explicitly).
A worker object exposes `model_runner.model` like vLLM's GPU worker.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import Parameter


@dataclass(frozen=True)
class TP:
    rank: int = 0
    size: int = 1


def set_weight_attrs(param: Parameter, attrs: dict) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


def default_weight_loader(param: Parameter, loaded_weight: torch.Tensor) -> None:
    assert param.size() == loaded_weight.size(), (param.size(), loaded_weight.size())
    param.data.copy_(loaded_weight)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TP, dtype: torch.dtype):
        super().__init__()
        assert output_size % tp.size == 0
        self.tp = tp
        self.weight = Parameter(torch.empty(output_size // tp.size, input_size, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "input_dim": 1, "weight_loader": self.weight_loader})
        self.bias = None
        if bias:
            self.bias = Parameter(torch.empty(output_size // tp.size, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        output_dim = getattr(param, "output_dim", None)
        data = param.data
        if output_dim is not None:
            shard = data.shape[output_dim]
            loaded_weight = loaded_weight.narrow(output_dim, self.tp.rank * shard, shard)
        assert data.shape == loaded_weight.shape
        data.copy_(loaded_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TP, dtype: torch.dtype):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp, dtype)

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        assert isinstance(loaded_shard_id, int)
        output_dim = param.output_dim
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp.size
        size = self.output_sizes[loaded_shard_id] // self.tp.size
        data = param.data.narrow(output_dim, offset, size)
        loaded_weight = loaded_weight.narrow(output_dim, self.tp.rank * size, size)
        assert data.shape == loaded_weight.shape
        data.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int, bias: bool,
                 tp: TP, dtype: torch.dtype):
        self.head_size = head_size
        self.num_heads = total_num_heads // tp.size
        if tp.size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp.size // total_num_kv_heads
        else:
            self.num_kv_heads = total_num_kv_heads // tp.size
            self.num_kv_head_replicas = 1
        output = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp.size
        super().__init__(hidden_size, output, bias, tp, dtype)

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        assert loaded_shard_id in ("q", "k", "v")
        output_dim = param.output_dim
        if loaded_shard_id == "q":
            offset, size = 0, self.num_heads * self.head_size
            shard_rank = self.tp.rank
        else:
            size = self.num_kv_heads * self.head_size
            offset = self.num_heads * self.head_size + (size if loaded_shard_id == "v" else 0)
            shard_rank = self.tp.rank // self.num_kv_head_replicas
        data = param.data.narrow(output_dim, offset, size)
        loaded_weight = loaded_weight.narrow(output_dim, shard_rank * size, size)
        assert data.shape == loaded_weight.shape
        data.copy_(loaded_weight)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TP, dtype: torch.dtype):
        super().__init__()
        assert input_size % tp.size == 0
        self.tp = tp
        self.weight = Parameter(torch.empty(output_size, input_size // tp.size, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "input_dim": 1, "weight_loader": self.weight_loader})
        self.bias = None
        if bias:
            self.bias = Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        input_dim = getattr(param, "input_dim", None)
        data = param.data
        if input_dim is not None:
            shard = data.shape[input_dim]
            loaded_weight = loaded_weight.narrow(input_dim, self.tp.rank * shard, shard)
        assert data.shape == loaded_weight.shape
        data.copy_(loaded_weight)


def pad_vocab_size(vocab_size: int, pad_to: int = 64) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TP, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.org_vocab_size = num_embeddings
        padded = pad_vocab_size(num_embeddings)
        self.per_partition = padded // tp.size
        self.start = tp.rank * self.per_partition
        self.org_end = min(self.start + self.per_partition, num_embeddings)
        self.weight = Parameter(torch.empty(self.per_partition, embedding_dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        output_dim = param.output_dim
        assert loaded_weight.shape[output_dim] == self.org_vocab_size
        rows = max(0, self.org_end - self.start)
        loaded_weight = loaded_weight.narrow(output_dim, self.start, rows)
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(0)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class Config:
    vocab_size: int = 100
    hidden_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    intermediate_size: int = 48
    num_layers: int = 2
    tie_word_embeddings: bool = False
    qkv_bias: bool = True


class DecoderLayer(nn.Module):
    def __init__(self, c: Config, tp: TP, dtype: torch.dtype):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads,
                                                    c.qkv_bias, tp, dtype)
        self.self_attn.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, False, tp, dtype)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2, False, tp, dtype)
        self.mlp.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, False, tp, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, dtype)


class StandinForCausalLM(nn.Module):
    """Qwen2-shaped, with vLLM's runtime parameter layout. Like a vLLM engine, it starts with
    weights loaded (those of HFModel(config, seed=start_seed)): the loaders zero-fill the
    vocabulary padding then, which deltasync's anchors leave as they are."""

    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: Config, tp: TP = TP(), dtype: torch.dtype = torch.bfloat16, start_seed: int = 1):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.model.layers = nn.ModuleList(DecoderLayer(config, tp, dtype) for _ in range(config.num_layers))
        self.model.norm = RMSNorm(config.hidden_size, dtype)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        with torch.no_grad():
            self.load_weights(HFModel(config, dtype, seed=start_seed).named_parameters())

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, loaded_weight in weights:
            if self.config.tie_word_embeddings and "lm_head.weight" in name:
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params[name]
                param.weight_loader(param, loaded_weight, shard_id)
                break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)
            loaded.add(name)
        return loaded


class HFModel(nn.Module):
    """The trainer's model with Hugging Face parameter names and shapes (what gets published)."""

    def __init__(self, c: Config, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        p = lambda *shape: nn.Parameter((torch.randn(*shape, generator=g) * 0.05).to(dtype))  # noqa: E731
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = p(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList()
        for _ in range(c.num_layers):
            layer = nn.Module()
            attn = layer.self_attn = nn.Module()
            for proj, rows in (("q_proj", c.num_heads), ("k_proj", c.num_kv_heads), ("v_proj", c.num_kv_heads)):
                m = nn.Module()
                m.weight = p(rows * c.head_dim, c.hidden_size)
                if c.qkv_bias:
                    m.bias = p(rows * c.head_dim)
                setattr(attn, proj, m)
            attn.o_proj = nn.Module()
            attn.o_proj.weight = p(c.hidden_size, c.num_heads * c.head_dim)
            mlp = layer.mlp = nn.Module()
            for proj in ("gate_proj", "up_proj"):
                m = nn.Module()
                m.weight = p(c.intermediate_size, c.hidden_size)
                setattr(mlp, proj, m)
            mlp.down_proj = nn.Module()
            mlp.down_proj.weight = p(c.hidden_size, c.intermediate_size)
            layer.input_layernorm = nn.Module()
            layer.input_layernorm.weight = p(c.hidden_size)
            layer.post_attention_layernorm = nn.Module()
            layer.post_attention_layernorm.weight = p(c.hidden_size)
            self.model.layers.append(layer)
        self.model.norm = nn.Module()
        self.model.norm.weight = p(c.hidden_size)
        self.lm_head = nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight if c.tie_word_embeddings else p(c.vocab_size, c.hidden_size)


class ModelRunner:
    def __init__(self, model: nn.Module):
        self.model = model


class StandinWorker:
    """vLLM's worker as a worker extension sees it: self.model_runner.model, self.rank, and the
    tensor-parallel CPU group (vLLM's get_tp_group().cpu_group) as `group`."""

    def __init__(self, model: nn.Module, rank: int = 0, group=None):
        self.model_runner = ModelRunner(model)
        self.rank = rank
        self.group = group
        self.device = next(model.parameters()).device

    def _deltasync_group(self):
        return (self.group, self.rank) if self.group is not None else (None, 0)


def tp_groups(size: int) -> list:
    """One gloo process group per rank of a `size`-rank group inside this process (ranks run on
    threads, see on_all_ranks); [None] for one rank."""
    if size == 1:
        return [None]
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    groups = [None] * size

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, datetime.timedelta(seconds=60))

    on_threads([lambda r=r: make(r) for r in range(size)])
    return groups


def on_threads(calls: list) -> list:
    """Runs every call on its own thread, as vLLM runs each rank in its own process: collective
    calls meet. Returns the results in order; re-raises the first exception."""
    import threading

    results, errors = [None] * len(calls), [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def on_all_ranks(workers: list, method: str, *args, **kwargs) -> list:
    """worker.method(*args, **kwargs) on every rank at once (the collective_rpc of vLLM)."""
    return on_ranks(workers, [lambda w=w: getattr(w, method)(*args, **kwargs) for w in workers])


def on_ranks(workers: list, calls: list) -> list:
    """calls[r]() for every rank r at once, as vLLM's collective_rpc with the deltasync plugin
    runs them: a failure a rank kept (deltasync/vllm/rank_failures.py) is raised once every rank
    has returned."""
    from deltasync.vllm import rank_failures

    results = on_threads(calls)
    rank_failures.raise_first([rank_failures.take(w) for w in workers])
    return results


def make_workers(worker_cls, config: "Config", tp_size: int, **model_kwargs) -> list:
    """One worker per rank, each with its shard of a fresh stand-in model and its group."""
    groups = tp_groups(tp_size)
    return [worker_cls(StandinForCausalLM(config, TP(r, tp_size), **model_kwargs), rank=r, group=groups[r])
            for r in range(tp_size)]


def make_worker_class(extension_cls):
    """vLLM mixes the extension class into its worker class; so do we."""
    return type("StandinWorkerWithExtension", (StandinWorker, extension_cls), {})


def reference_runtime_params(config: Config, tp: TP, hf_state: dict[str, torch.Tensor],
                             dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """What vLLM's own full reload (load_weights of every HF tensor) puts into a rank's params."""
    model = StandinForCausalLM(config, tp, dtype)
    model.load_weights(list(hf_state.items()))
    return {n: p.detach().clone() for n, p in model.named_parameters()}
