"""The parts of a Lightning training run that do not depend on the task: optimizers (AdamW groups,
Muon), learning-rate schedules, precision, distributed strategies, loggers, generic callbacks, and
the one adapter to Lightning internals.

Imports `pipeline.run` only.
"""
