"""`python -m pipeline.commands.pretrain`, killed (SIGKILL, as by the OOM killer or a node
lost) in the middle of its end-of-run Hugging Face export: once the export's weights file is
half written, the process kills itself.

    python -m tests.pipeline.killed_export_pretrain model=gpt-tiny ...
"""

import os
import runpy
import signal

import models.hf


def _half_written_then_killed(tensors, filename, metadata=None) -> None:
    with open(filename, "wb") as handle:
        handle.write(b"\0" * 1000)
        handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    models.hf.save_file = _half_written_then_killed
    runpy.run_module("pipeline.commands.pretrain", run_name="__main__")
