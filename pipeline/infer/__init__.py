"""Using a trained model without training it: generation (GPT), mask filling (BERT), LM scoring
(bits per byte), sentence scores (log-probability, pseudo-log-likelihood), BLiMP's minimal pairs
and their accuracies, and the Kneser-Ney n-gram model they are compared with.

Imports `pipeline.run` and `pipeline.checkpoint`.
"""
