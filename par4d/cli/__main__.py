"""``python -m par4d.cli``: how launchers and the emulated cluster start a par4d command on each rank."""

import sys

from par4d.cli import main

sys.exit(main())
