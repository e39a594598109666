"""`python -m flare`: prints flare.show_config() and runs flare.self_check(); exits 1 if the check fails.

  python -m flare             configuration and the self-check
  python -m flare --config    configuration only
"""

import sys

from ._config import self_check, show_config


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    unknown = [a for a in argv if a != "--config"]
    if unknown:
        print(f"python -m flare: unknown argument {unknown[0]!r} (try --help)", file=sys.stderr)
        return 2
    show_config()
    if "--config" in argv:
        return 0
    print()
    return 0 if self_check() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
