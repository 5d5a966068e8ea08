"""``python -m kvxfer_router``: see :mod:`kvxfer_router.cli`."""

import sys

from .cli import main

sys.exit(main())
