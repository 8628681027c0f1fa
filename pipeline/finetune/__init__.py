"""Fine-tuning on a task: the run (`make finetune`), evaluation and prediction of a fine-tuned run,
the task LightningModule and its heads on a pretrained backbone, task metrics, the non-neural
baselines, and the results record.

Imports `pipeline.run`, `pipeline.training`, `pipeline.checkpoint`.
"""
