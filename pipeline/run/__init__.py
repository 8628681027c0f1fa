"""What every command shares before any training: the error classes, config checks common to all
commands, the command-line plumbing (overrides from make, user errors as one line), how a process was
launched (run stamp, rank), run folders and their locks, and the model-family registry.

Imports nothing else from `pipeline/`.
"""
