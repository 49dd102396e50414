"""``python -m compare``: the main job (see ``compare.cli`` and ``python -m compare --help``)."""

import sys

try:
    from compare.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch loads: one line, like the CLI's own
    print("python -m compare: interrupted (Ctrl-C); nothing written", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
