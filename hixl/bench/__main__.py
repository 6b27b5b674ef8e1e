"""``python -m hixl.bench`` runs ``hixl bench``."""

import sys

from .cli import main

sys.exit(main())
