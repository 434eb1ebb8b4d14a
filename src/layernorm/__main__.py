"""``python -m layernorm`` runs the ``layernorm`` command (see :mod:`layernorm.cli`)."""

from .cli import main

raise SystemExit(main())
