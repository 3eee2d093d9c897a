"""spark-submit entry point for `varadhi.jobs.replay` (see its --help): the job itself lives in the
package, so an installed wheel runs it as `varadhi-job replay` or `python -m varadhi.jobs.replay`."""

import sys

from varadhi.jobs.replay import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
