"""``python -m grabkit``: the grabkit command line (see ``grabkit.cli``)."""

from grabkit.cli import main

raise SystemExit(main())
