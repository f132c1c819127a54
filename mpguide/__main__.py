import os
import sys
import threading
from contextlib import suppress

from mpguide.cli import main

status = main()
others = [t for t in threading.enumerate() if t is not threading.main_thread()]
if any(t.is_alive() and not t.daemon for t in others):
    # The reader's code left a thread running: the report is written, so the command ends.
    for stream in (sys.stdout, sys.stderr):
        with suppress(AttributeError, OSError, ValueError):
            stream.flush()
    os._exit(status)
sys.exit(status)
