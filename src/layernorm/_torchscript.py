"""A clear error for ``torch.jit.script`` on this library's modules.

TorchScript compiles Python source into its own language: it cannot call the custom ops' Python
implementations nor the argument checks written in plain Python, so scripting one of these modules
used to fail deep inside TorchScript's frontend with a message about a type annotation.
``torch.jit.script`` calls ``__prepare_scriptable__`` on every module of a model before compiling
it, which is where the user is told what to use instead.
"""

from __future__ import annotations

from typing import NoReturn


class NotScriptable:
    """Mixin for ``nn.Module`` subclasses that ``torch.jit.script`` cannot compile."""

    def __prepare_scriptable__(self) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} cannot be compiled by torch.jit.script (TorchScript cannot "
            "run this library's Python checks and custom ops); use torch.compile, "
            "torch.export.export or torch.jit.trace instead"
        )
