"""Pretraining objectives and their batches: MLM masking and NSP pairs (BERT), packed windows (GPT), sharding, resumable batch datasets and loaders."""
