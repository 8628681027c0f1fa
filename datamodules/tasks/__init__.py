"""Fine-tuning tasks: their definitions and labels, reading their files, long texts in windows, batches, and their texts as a corpus."""
