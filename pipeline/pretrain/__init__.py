"""Pretraining: the config checks of a pretraining run, the run itself (`make pretrain`), its
LightningModules and the registry records of the families they train (`families.py`: BERT,
GPT), the time budget, corpus-initialised embeddings and output bias, the probes
that score the model during training (the GLUE probes fit task heads, so this package may import
`pipeline.finetune`; the BLiMP probe scores sentences as `pipeline.infer` does), and the
training documents of a finished run read back from its config.

Imports `pipeline.run`, `pipeline.training`, `pipeline.checkpoint`, `pipeline.infer`,
`pipeline.finetune`.
"""
