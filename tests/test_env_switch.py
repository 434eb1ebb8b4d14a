"""The environment switches read on every call (``LAYERNORM_CPU_COMPILE``): they follow every
change of the environment, by ``os.environ`` and by ``monkeypatch``, through CPython's store and
through a mapping without one."""

from __future__ import annotations

import os

import pytest
import torch

import layernorm.functional as LF
from layernorm.kernels.cpu import _env, _native, rnn

NAME = "LAYERNORM_TEST_OFF_SWITCH"


class PlainEnviron(dict):
    """A mapping with no encoded store of its own (as on a Python without ``os._Environ``)."""


@pytest.mark.parametrize("plain", [False, True], ids=["os.environ", "plain mapping"])
def test_off_switch_follows_the_environment(plain, monkeypatch):
    environ = PlainEnviron() if plain else os.environ
    monkeypatch.delitem(environ, NAME, raising=False)
    off = _env.off_switch(NAME, environ)
    assert not off()
    for value, expected in (("0", True), ("1", False), ("", False), ("00", False), ("0", True)):
        if plain:
            environ[NAME] = value
        else:
            monkeypatch.setenv(NAME, value)
        assert off() is expected, value
    del environ[NAME]
    assert not off()


def test_compile_switch_turns_the_kernels_off_mid_process(monkeypatch):
    if not _native.enabled():
        pytest.skip("the fused kernels are not built here")
    x = torch.randn(4, 16)
    assert rnn.available(x) == (rnn._library() is not None)
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    assert not _native.enabled() and not rnn.available(x)
    torch.testing.assert_close(LF.layer_norm(x, 16), torch.nn.functional.layer_norm(x, (16,)))
    monkeypatch.delenv(_native.ENV_SWITCH)
    assert _native.enabled()
