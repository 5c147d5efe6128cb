"""Every entry point that takes tensors refuses what it cannot read or write as numel() elements at
data_ptr() -- the publisher, the subscriber, the torch ops and the vLLM receiver, through one
check (torch_ext/src/tensor_checks.cpp) -- with one line naming the tensor and the reason, and
never reads or writes past a tensor's storage. One test per kind; the DTensor one runs FSDP2's
fully_shard on 2 real gloo ranks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import deltasync
from deltasync.errors import InvalidArgumentError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import vllm_standin as vs  # noqa: E402

from deltasync.vllm import DeltaWorkerExtension  # noqa: E402


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"embed": torch.randn(16, 8, generator=g).to(torch.bfloat16), "norm": torch.randn(8, generator=g)}


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text.strip(), text
    return text


def refused(what, tensors: dict, match: str, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    with pytest.raises(InvalidArgumentError, match=match) as err:
        if what == "publisher":
            deltasync.DeltaPublisher(tensors, store)
        else:
            deltasync.DeltaSubscriber(tensors, store)
    return one_line(err)


def _transposed(w):
    w["embed"] = w["embed"].t()


def _all_meta(w):
    for n in w:
        w[n] = w[n].to("meta")


def _sparse(w):
    w["norm"] = w["norm"].to_sparse()


def _quantized(w):
    w["norm"] = torch.quantize_per_tensor(w["norm"], 0.1, 0, torch.qint8)


def _one_on_meta(w):
    w["norm"] = w["norm"].to("meta")


# One case per kind of tensor refused: how the weights are spoiled, and the refusal's line.
KINDS = [
    pytest.param(_transposed, r"deltasync\.Delta\w+: tensor embed is not contiguous$", id="non-contiguous"),
    pytest.param(_all_meta, r"tensor embed is a meta tensor \(it has no data\)", id="meta"),
    pytest.param(_sparse, r"tensor norm has layout Sparse; deltasync needs dense \(strided\) tensors", id="sparse"),
    pytest.param(_quantized, r"tensor norm is quantized \(QInt8\)", id="quantized"),
    pytest.param(_one_on_meta, r"tensor norm is on meta, tensor embed on cpu; all tensors must live on one device",
                 id="another-device-than-its-peers"),
]


@pytest.mark.parametrize("what", ["publisher", "subscriber"])
@pytest.mark.parametrize("spoil, match", KINDS)
def test_refused_tensor_kind(what, spoil, match, tmp_path):
    w = weights()
    spoil(w)
    refused(what, w, match, tmp_path)


def test_freed_storage_is_never_read_or_written(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    w = weights()
    with deltasync.DeltaPublisher(w, store) as pub:
        pub.publish(1)
        replica = {n: torch.zeros_like(t) for n, t in w.items()}
        sub = deltasync.DeltaSubscriber(replica, store)
        w["norm"].untyped_storage().resize_(0)  # what FSDP does to an unsharded parameter it frees
        with pytest.raises(InvalidArgumentError, match=r"tensor norm needs 32 bytes of its storage, which holds 0") as err:
            pub.publish(2)
        one_line(err)
        replica["norm"].untyped_storage().resize_(0)
        with pytest.raises(InvalidArgumentError, match=r"DeltaSubscriber: tensor norm needs 32 bytes of its storage, which holds 0"):
            sub.update()
    # The torch ops: neither the diff nor the patch touches a freed storage.
    shadow = torch.zeros(8)
    with pytest.raises(RuntimeError, match=r"tensor current\[0\] needs 32 bytes of its storage, which holds 0"):
        deltasync.ops.encode([w["norm"]], [shadow])
    with pytest.raises(RuntimeError, match=r"tensor targets\[0\] needs 32 bytes of its storage, which holds 0"):
        deltasync.ops.apply([w["norm"]], torch.tensor([1]), torch.zeros(4, dtype=torch.uint8), torch.tensor([1]))


def test_a_dtype_other_than_the_one_published(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    model = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    with deltasync.DeltaPublisher(model, store) as pub:
        pub.publish(1)
        model.weight.data = model.weight.data.float()  # the trainer switched the parameter to float32
        with pytest.raises(InvalidArgumentError, match=r"DeltaPublisher\.publish: tensor weight has dtype F32, published as BF16") as err:
            pub.publish(2)
        one_line(err)
    # A subscriber whose tensor has another dtype than the published one writes nothing.
    replica = torch.nn.Linear(8, 4, bias=False)  # float32
    before = replica.weight.detach().clone()
    sub = deltasync.DeltaSubscriber(replica, store)
    with pytest.raises(deltasync.errors.DeltaSyncError, match=r"weight") as err:
        sub.update()
    one_line(err)
    assert "BF16" in str(err.value) and "F32" in str(err.value)
    assert torch.equal(replica.weight.detach(), before)
    # ... nor one whose tensor changed dtype after it was made.
    replica = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    sub = deltasync.DeltaSubscriber(replica, store)
    replica.weight.data = replica.weight.data.float()
    with pytest.raises(InvalidArgumentError, match=r"tensor weight has dtype F32, BF16 when the subscriber was made"):
        sub.update()


def test_a_size_that_changed_since_the_shadow_was_taken(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    model = torch.nn.Linear(8, 4, bias=False)
    with deltasync.DeltaPublisher(model, store) as pub:
        pub.publish(1)
        model.weight.data = torch.zeros(5, 8)  # a resized vocabulary, say
        with pytest.raises(InvalidArgumentError, match=r"tensor weight has shape \[5, 8\], shape \[4, 8\] when the shadow was taken") as err:
            pub.publish(2)
        one_line(err)
        model.weight.data = torch.zeros(4, 8)
    replica = torch.nn.Linear(8, 4, bias=False)
    sub = deltasync.DeltaSubscriber(replica, store)
    replica.weight.data = torch.zeros(4, 9)
    with pytest.raises(InvalidArgumentError, match=r"tensor weight has shape \[4, 9\], shape \[4, 8\] when the subscriber was made"):
        sub.update()
    # The ops: a shadow of another size than its tensor.
    with pytest.raises(RuntimeError, match=r"shadow has 9 elements, current has 8"):
        deltasync.ops.encode([torch.zeros(8)], [torch.zeros(9)])


def test_the_vllm_receiver_refuses_a_parameter_whose_storage_was_freed(tmp_path):
    config = vs.Config()
    trainer = vs.HFModel(config, seed=0)
    store = f"file://{tmp_path / 'bucket'}"
    Worker = vs.make_worker_class(DeltaWorkerExtension)
    workers = vs.make_workers(Worker, config, 1)
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        pub.flush()
        vs.on_all_ranks(workers, "deltasync_init", store)
        with torch.no_grad():
            trainer.model.norm.weight.view(torch.int16)[5] += 1
        pub.publish(1)
    param = dict(workers[0].model_runner.model.named_parameters())["model.norm.weight"]
    param.untyped_storage().resize_(0)
    with pytest.raises(InvalidArgumentError, match=r"vllm receiver: tensor model\.norm\.weight needs \d+ bytes of its storage, which holds 0"):
        vs.on_all_ranks(workers, "deltasync_update")


DTENSOR_RANK = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    import deltasync
    from deltasync.errors import InvalidArgumentError

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    print("param type", type(next(model.parameters())).__name__, flush=True)
    try:
        with deltasync.DeltaPublisher(model, store=sys.argv[1] + str(dist.get_rank())) as pub:
            pub.publish(0)
        print("PUBLISHED", flush=True)
    except InvalidArgumentError as e:
        print("REFUSED", e, flush=True)
    pub = deltasync.ShardedDeltaPublisher(model, store=sys.argv[1] + "-sharded")
    pub.publish(0)
    print("SHARDED PUBLISHED", flush=True)
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh2 = init_device_mesh("cpu", (1, dist.get_world_size()))
    w = distribute_tensor(torch.zeros(4, 4, dtype=torch.bfloat16), mesh2, [Replicate(), Replicate()])
    try:
        deltasync.ShardedDeltaPublisher({"w": w}, store=sys.argv[1] + "-mesh2")
    except ValueError as e:
        print("SHARDED REFUSED", e, flush=True)
    sys.path.append(sys.argv[2])
    from rank_exit import leave  # together, and without Python's finalization (tests/python/rank_exit.py)
    leave()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_dtensor_parameters_are_refused_by_the_plain_publisher_and_taken_by_the_sharded_one(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(DTENSOR_RANK)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), f"file://{tmp_path}/store", str(HERE)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out}"
        assert "param type DTensor" in out, out
        refusal = [line for line in out.splitlines() if line.startswith("REFUSED")]
        assert refusal == ["REFUSED deltasync.DeltaPublisher: tensor 0.weight is a DTensor (a tensor subclass), not a plain "
                           "tensor: pass plain tensors here; a sharded trainer (DTensor, FSDP2 fully_shard) publishes its "
                           "shards with deltasync.ShardedDeltaPublisher on every rank"], out
        # The sharded path takes them; what it cannot place (a 2-D mesh) is still refused.
        assert "SHARDED PUBLISHED" in out, out
        assert ("SHARDED REFUSED deltasync.ShardedDeltaPublisher: tensor w is on a 2-D device mesh; shard-local publish "
                "takes 1-D meshes (FSDP2, or TP on one dimension)") in out, out


def test_the_ops_refuse_sparse_and_quantized_tensors_with_one_line():
    sparse = torch.randn(4).to_sparse()
    with pytest.raises(RuntimeError, match=r"deltasync: tensor current\[0\] has layout Sparse") as err:
        deltasync.ops.encode([sparse], [torch.zeros(4)])
    one_line(err)
    quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(RuntimeError, match=r"deltasync: tensor tensors\[0\] is quantized \(QInt8\)") as err:
        deltasync.ops.digest([quantized])
    one_line(err)
