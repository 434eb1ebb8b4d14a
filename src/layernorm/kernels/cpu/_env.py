"""Environment switches read on every call, at the cost of a dictionary lookup.

``os.environ.get`` encodes the key and decodes the value on every call: half a microsecond, a
tenth of the Python a per-token norm call has left. CPython's ``os.environ`` keeps its entries,
encoded, in a dictionary of its own (``_data``) that every write through ``os.environ`` updates
(pytest's ``monkeypatch.setenv`` too), so a switch reads that with its key encoded once; where a
Python has no such store, ``os.environ.get``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping


def off_switch(name: str, environ: MutableMapping[str, str] = os.environ) -> Callable[[], bool]:
    """A function telling whether the environment variable ``name`` is ``"0"`` at the time of
    each call (unset or any other value: ``False``)."""
    store = getattr(environ, "_data", None)
    encode_key = getattr(environ, "encodekey", None)
    encode_value = getattr(environ, "encodevalue", None)
    if isinstance(store, dict) and callable(encode_key) and callable(encode_value):
        get, key, off = store.get, encode_key(name), encode_value("0")
        return lambda: get(key) == off
    return lambda: environ.get(name) == "0"


#: The switch of every fused C kernel, the norms' and the recurrent layers': ``"0"`` runs
#: PyTorch's ops instead. Read on every call, so that a process can turn it off and on.
COMPILE_SWITCH = "LAYERNORM_CPU_COMPILE"
compile_switched_off = off_switch(COMPILE_SWITCH)
