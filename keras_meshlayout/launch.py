"""Run a script in several local processes: `python -m keras_meshlayout.launch -n 2 script.py`.

See `python -m keras_meshlayout.launch --help`. Each process should call
`kml.initialize()` first; the launcher gives it the coordinator, its rank and
its emulated CPU devices.
"""

import sys

from .runtime._launch import main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
