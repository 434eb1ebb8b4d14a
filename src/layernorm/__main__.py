"""``python -m layernorm`` runs the ``layernorm`` command (see :mod:`layernorm.cli`)."""

from .cli import main

if __name__ == "__main__":  # not when a worker process (spawn) imports this module
    raise SystemExit(main())
