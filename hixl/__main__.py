"""``python -m hixl`` runs the ``hixl`` command."""

import sys

from .cli import main

sys.exit(main())
