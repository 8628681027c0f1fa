"""`python -m pipeline.report RUN[,RUN2,...] [--out DIR]`, which `make report` runs."""

import sys

from pipeline.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
