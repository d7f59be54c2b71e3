"""``python -m attnchecker``: the ``attnchecker`` command."""

from attnchecker.cli import main

raise SystemExit(main())
