"""``python -m pagewarden``: the same command line as ``pagewarden``."""

import sys

from pagewarden.cli import main

sys.exit(main())
