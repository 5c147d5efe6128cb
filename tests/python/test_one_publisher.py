"""One publisher: `deltasync publish` (the CLI over checkpoint files) and DeltaPublisher (Python
over live tensors) are the same C++ Publisher, so for the same weights and versions they write
byte-identical anchor and delta objects (keys differ only in their random nonce)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import deltasync


def versions(seed: int, steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (96, 32), "layers.0.mlp.weight": (64, 32), "layers.0.norm.weight": (32,), "lm_head.weight": (96, 32)}
    # Names sorted: safetensors' writer orders same-dtype tensors by name, the CLI takes file order.
    v = {n: torch.randint(-2**15, 2**15, shapes[n], generator=g, dtype=torch.int16).view(torch.bfloat16) for n in sorted(shapes)}
    out = [v]
    for _ in range(steps):
        v = {n: t.clone() for n, t in v.items()}
        for t in v.values():
            flat = t.view(-1).view(torch.int16)
            pos = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
            flat[pos] ^= 3
        out.append(v)
    return out


def objects(store_dir: Path) -> dict[str, bytes]:
    """Anchor parts and deltas by version (the nonce dropped from the key)."""
    out = {}
    for p in sorted((store_dir / "deltas").glob("*.safetensors")):
        out["delta " + p.name.split("-")[0]] = p.read_bytes()
    for part in sorted((store_dir / "anchors").glob("*/*.safetensors")):
        out["anchor " + part.parent.name.split("-")[0] + "/" + part.name] = part.read_bytes()
    return out


@pytest.mark.parametrize("fmt", ["compact", "trl", "trl-idx"])
def test_cli_and_python_publishers_write_the_same_bytes(run_cli, tmp_path, fmt):
    weights = versions(7, 3)
    cli_store, py_store = tmp_path / "cli", tmp_path / "py"
    for v, w in enumerate(weights):
        ckpt = tmp_path / f"v{v}.safetensors"
        save_file(w, str(ckpt))
        run_cli("publish", str(ckpt), "--store", f"file://{cli_store}", "--version", str(v), "--state",
                str(tmp_path / "state"), "--anchor-every", "2", "--format", fmt, "--quiet")
    live = {n: t.clone() for n, t in weights[0].items()}
    with deltasync.DeltaPublisher(live, store=f"file://{py_store}", anchor_every=2, format=fmt) as pub:
        for v, w in enumerate(weights):
            for n, t in live.items():
                t.copy_(w[n])
            pub.publish(v)
            pub.flush()
    cli, py = objects(cli_store), objects(py_store)
    assert sorted(cli) == sorted(py) == ["anchor 00000000000000000000/part-00000.safetensors",
                                         "anchor 00000000000000000002/part-00000.safetensors",
                                         "delta 00000000000000000001", "delta 00000000000000000002",
                                         "delta 00000000000000000003"]
    for key in cli:
        assert cli[key] == py[key], key
