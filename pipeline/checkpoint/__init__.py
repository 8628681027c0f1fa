"""Checkpoints: resolving any `ckpt=` / `resume=` value into one `CheckpointSource`, reading and
loading it (Lightning files, HF folders, fine-tuned runs), the callbacks that save them atomically, the
record written into each file, and the interrupt handler that saves one on a stop signal.

Imports `pipeline.run` and `pipeline.training`.
"""
