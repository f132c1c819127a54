import sys

from mpguide.cli import main

sys.exit(main())
