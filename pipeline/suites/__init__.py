"""Many measurements read as one answer: `make glue` (pretrained vs from-scratch twin vs
baselines) with its record (`record.py`, glue_suite.json) and its fine-tunes run one at a time
or side by side (`runners.py`), `make evaluate-lm suite=blimp` (the
model vs its twin, an n-gram model of its corpus and the paper's models), suite summaries,
multirun sweeps and seed statistics.

Imports `pipeline.pretrain`, `pipeline.infer` and below.
"""
