"""spark-submit entry point for `varadhi.jobs.feeder` (see its --help): the job itself lives in the
package, so an installed wheel runs it as `varadhi-job feeder` or `python -m varadhi.jobs.feeder`."""

import sys

from varadhi.jobs.feeder import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
