"""spark-submit entry point for `varadhi.jobs.smoke_count` (see its --help): the job itself lives in the
package, so an installed wheel runs it as `varadhi-job smoke_count` or `python -m varadhi.jobs.smoke_count`."""

import sys

from varadhi.jobs.smoke_count import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
