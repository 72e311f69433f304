"""``python -m gyre.services.cli ARGS``: the ``gyre`` command (``services.cli.main``) without the installed script."""

import sys

from gyre.services.cli.main import main

sys.exit(main())
