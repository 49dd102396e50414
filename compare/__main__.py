"""``python -m compare``: the main job (see ``compare.cli`` and ``python -m compare --help``)."""

import sys

from compare.cli import main

sys.exit(main())
