"""``python -m kvbridge``: the ``kvbridge`` command (:func:`kvbridge.tools.cli.main`).

The same CLI as the console script, for environments where the script is not on ``PATH``.
The library never imports this module.
"""

from kvbridge.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
