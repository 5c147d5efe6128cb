"""Child of test_subscriber_memory / benchmarks/pull_memory.py: a DeltaSubscriber over host
tensors shaped like MODEL loads STORE's newest version; prints one JSON line with the peak
memory the update added (VmHWM after the update minus VmRSS before it: the peak is reset with
/proc/self/clear_refs once the weights are resident), whether it succeeded, and whether every
tensor then equals MODEL's bits / still holds its bits from before (SHA-256 of all weights).

  python subscriber_memory_child.py STORE MODEL"""
import hashlib
import json
import sys

import torch
from safetensors import safe_open

import deltasync


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def weights_sha(weights):
    h = hashlib.sha256()
    for t in weights.values():
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def main():
    store, model = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(1)
    with safe_open(model, "pt") as st:
        names = list(st.keys())
        shapes = {n: st.get_slice(n).get_shape() for n in names}
    # Bits of their own (not the model's), resident before the peak is reset.
    weights = {n: torch.randint(-2**15, 2**15, shapes[n], dtype=torch.int16, generator=g).view(torch.bfloat16) for n in names}
    before = weights_sha(weights)
    sub = deltasync.DeltaSubscriber(weights, "file://" + store)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    resident = status("VmRSS")
    error = None
    try:
        sub.update()
    except Exception as e:  # noqa: BLE001 (reported to the parent, which asserts on it)
        error = str(e)
    extra = status("VmHWM") - resident
    equal = True
    with safe_open(model, "pt") as st:
        for n in names:
            equal = equal and torch.equal(st.get_tensor(n).view(torch.int16), weights[n].view(torch.int16))
    print(json.dumps({"extra": extra, "error": error, "equal_to_model": equal, "unchanged": weights_sha(weights) == before,
                      "version": sub.version}))


if __name__ == "__main__":
    main()
