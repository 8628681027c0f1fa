"""Pretraining: the config checks of a pretraining run, the run itself (`make pretrain`), its
LightningModules, the time budget, corpus-initialised embeddings and output bias, and the probes
that score the model during training (they fit task heads, so this package may import
`pipeline.finetune`).

Imports `pipeline.run`, `pipeline.training`, `pipeline.checkpoint`, `pipeline.finetune`.
"""
