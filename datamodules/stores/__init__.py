"""Token stores: a corpus tokenized once into memory-mapped arrays, built by one process or many, and the fingerprints a resume compares."""
