"""``python -m torch_nbdebug TOOL [options] script.py [args]`` (see torch_nbdebug.cli)."""
import sys

from torch_nbdebug.cli import main

if __name__ == "__main__":
    sys.exit(main())
