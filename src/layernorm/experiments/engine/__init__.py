"""What runs experiments: the registry, the runner, the two training loops, their checkpoint
files, atomic file writes and data parallelism. Imports nothing else of
:mod:`layernorm.experiments`."""
