"""Checkpoints: `source` resolves any `ckpt=` / `resume=` value into one `CheckpointSource` and
reads it (each file once per command; both folder rules side by side); `load` builds every model
from one (pretrained, backbone, fine-tuned; Lightning files and HF folders) with one meta-device
builder; `head` is a fine-tuned checkpoint's task head; `record` the entries written into each
file; `saving` the callbacks that save them atomically; `interrupt` the handler that saves one
on a stop signal.

Imports `pipeline.run` and `pipeline.training`.
"""
