"""Run a command as this process's child; write the child's peak RSS (kB) to a file and exit
with the child's status.

    python -I -S bench/rss.py PEAK_FILE COMMAND [ARGS...]

Why a go-between: on Linux a new process's `ru_maxrss` starts at its parent's peak (the forked
copy of the parent's memory counts until `exec`), so a benchmark process holding models in
memory would measure itself in its children. This process is small (no site packages, standard
library only), so what its child reports is the child's own.
"""

import os
import sys


def main() -> int:
    peak_file, command = sys.argv[1], sys.argv[2:]
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)  # only reached when exec failed
    _, status, usage = os.wait4(pid, 0)
    with open(peak_file, "w") as handle:
        handle.write(f"{usage.ru_maxrss}\n")
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
