"""Every error class the pipeline raises for a user to read, in one place, so that any module (and
the CLI, which prints them as one line) can name them without importing what raises them.

The message of each names the offending value and a fix that works when pasted.
"""


class ConfigError(ValueError):
    """A config value is missing or invalid; the message names the key and the fix."""


class RunFolderBusyError(ConfigError):
    """Another process holds the run folder's lock."""


class UnknownFamilyError(KeyError):
    """No registered family matches a name, config or model."""

    def __str__(self) -> str:  # KeyError quotes its message; this one is a sentence
        return str(self.args[0])


class CheckpointLoadError(ValueError):
    """A trained model could not be loaded; the message names the path and the fix."""


class DamagedCheckpointError(CheckpointLoadError):
    """A checkpoint file whose bytes are readable but are not a whole checkpoint (truncated,
    corrupt): damaged for good, unlike a file the system failed to read (EIO, a lost NFS
    mount), which may read on the next try."""


class WrongFamilyError(CheckpointLoadError):
    """The model is of the other family (a BERT where a GPT is needed, or the reverse)."""


class DiskFullError(OSError):
    """A file could not be written for want of space (ENOSPC, a quota, or torch's own error
    for it); the message names the file system, the space the file needed and what is intact."""


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class ResultsError(ValueError):
    """A record of results that cannot be read: a fine-tuning run's results.json, an
    eval_<task>.json, a suite task's baselines.json or a sweep_summary.json."""


class SuiteRecordError(ValueError):
    """A suite folder's record (glue_suite.json) that cannot be read."""


class FineTuneCrashError(RuntimeError):
    """A fine-tune that `make glue jobs=N` ran in a process of its own ended on an unexpected
    error, or without a word (killed): that process printed its traceback or log; this error
    names the fine-tune in one line."""


class PeerLostError(RuntimeError):
    """A process of a multi-process run lost another (killed, crashed, its node down or cut
    off): the message names both processes and what was seen; the run's checkpoints are
    intact, and resume=auto on every node continues it."""
