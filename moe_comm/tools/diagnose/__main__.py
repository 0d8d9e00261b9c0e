"""``python -m moe_comm.tools.diagnose OPTS_JSON OUT_DIR``: run ``profile_main`` (how it re-launches itself
inside a network namespace for an emulated link)."""
import sys

from moe_comm.tools.diagnose.run import main

if __name__ == "__main__":
    sys.exit(main())
