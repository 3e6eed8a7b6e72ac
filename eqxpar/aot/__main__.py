"""`python -m eqxpar.aot`: see `eqxpar.aot.main`."""

import sys

from . import main

sys.exit(main())
