"""Pretraining batches streamed from the corpus, tokenized on the fly by the loader's workers, with an exact resumable position."""
