"""``python -m bench``: see :mod:`bench`."""
import sys

from . import main

sys.exit(main())
