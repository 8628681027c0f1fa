"""Many fine-tunes read as one answer: `make glue` (pretrained vs from-scratch twin vs baselines),
suite summaries, multirun sweeps and seed statistics.

Imports `pipeline.finetune` and below.
"""
