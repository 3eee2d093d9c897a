"""spark-submit entry point for `varadhi.jobs.outbox_relay` (see its --help): the job itself lives in the
package, so an installed wheel runs it as `varadhi-job outbox_relay` or `python -m varadhi.jobs.outbox_relay`."""

import sys

from varadhi.jobs.outbox_relay import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
