"""Using a trained model without training it: generation (GPT), mask filling (BERT), LM scoring
(bits per byte).

Imports `pipeline.run` and `pipeline.checkpoint`.
"""
