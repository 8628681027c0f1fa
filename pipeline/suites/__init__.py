"""Many fine-tunes read as one answer: `make glue` (pretrained vs from-scratch twin vs baselines),
its record (`record.py`, glue_suite.json), suite summaries, multirun sweeps and seed statistics.

Imports `pipeline.finetune` and below.
"""
