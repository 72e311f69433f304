"""Driver entry for ``ray submit``: run a gyre recipe on the Ray cluster this script lands on.

    ray submit deploy/local-cluster.yaml deploy/ray_entry.py -- RECIPE [--set KEY=VALUE ...]
    python deploy/ray_entry.py RECIPE [--set KEY=VALUE ...]        # on a cluster node

``ray submit`` copies this file to the head's ``~`` and runs it with the head's ``python``, which must be
the one gyre is installed in (the cluster yaml's setup commands put gyre's venv first on PATH). It is
``gyre run RECIPE --set ...`` with ``ray.address=auto`` forced, so the run joins the cluster (found through
``RAY_ADDRESS`` or the last ``ray start`` on this node) instead of starting a private head. A relative
RECIPE, and the relative ``model``/``run_dir`` inside it, resolve from the gyre checkout, as ``gyre run``
started there would. Exit status: 0 done, 2 bad arguments or recipe (the message names the bad value).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

USAGE = "usage: ray_entry.py RECIPE [--set KEY=VALUE ...]"


def gyre_checkout() -> Path | None:
    """The gyre source checkout the installed ``gyre`` package lives in, or ``None`` (a wheel install)."""
    import gyre

    root = Path(gyre.__file__).resolve().parents[1]
    return root if (root / "deploy" / "recipes").is_dir() else None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print(f"{USAGE}\nerror: expected a recipe path first, got {repr(args[0]) if args else 'nothing'}",
              file=sys.stderr)
        return 2
    try:
        from gyre.services.cli.main import main as gyre_main
    except ImportError as exc:
        print(f"error: {sys.executable} cannot import gyre ({exc}); run this script with the python of "
              "gyre's venv (put it first on the head's PATH)", file=sys.stderr)
        return 2
    recipe, overrides = args[0], args[1:]
    checkout = gyre_checkout()
    if not Path(recipe).is_absolute() and checkout is not None:
        recipe = str(Path(recipe).expanduser().resolve() if Path(recipe).expanduser().exists()
                     else checkout / recipe)
        os.chdir(checkout)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return gyre_main(["run", recipe, *overrides, "--set", "ray.address=auto"])


if __name__ == "__main__":
    sys.exit(main())
