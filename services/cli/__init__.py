"""The ``gyre`` command line (``main``; ``python -m gyre.services.cli``) and what only its commands use: export,
standalone eval, the run checker (``gyre check``) and the generated reference docs."""
