"""Where raw documents come from: local files, Hugging Face datasets, the embedded corpus, weighted mixtures of sources; sentence splitting."""
