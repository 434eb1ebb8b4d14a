"""What is drawn from saved records: statistics and verdicts, per-seed summaries, tables,
figures and the report. Imports only :mod:`~layernorm.experiments.engine.registry` and
:mod:`~layernorm.experiments.engine.io` of the engine; never trains."""
