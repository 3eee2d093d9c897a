"""spark-submit entry point for `varadhi.jobs.shard` (see its --help): the job itself lives in the
package, so an installed wheel runs it as `varadhi-job shard` or `python -m varadhi.jobs.shard`."""

import sys

from varadhi.jobs.shard import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
