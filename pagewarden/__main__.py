"""``python -m pagewarden``: the same command line as ``pagewarden``."""

import sys

from pagewarden.cli import main

# The guard matters: the engine-core process is spawned, and spawning re-imports the
# parent's main module (as ``__mp_main__``), which must not run the command again.
if __name__ == "__main__":
    sys.exit(main())
