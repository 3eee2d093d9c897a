"""The jobs, as modules of the installed package (no source checkout needed).

Each job module has `main(argv) -> int` and runs as `python -m varadhi.jobs.<name>`; the
`varadhi-job <name> [job options]` console script runs any of them (`varadhi-job --help` lists
them). For `spark-submit`, which takes a file, pass the installed module's file
(`python -c 'import varadhi.jobs.shard as m; print(m.__file__)'`) or, in a checkout, the thin
`jobs/*.py` entry points. `varadhi.jobs.runner` holds what every job shares: the entry point that
turns an error into one line on stderr and its exit code (each job's `main` is one, so every way
of starting a job ends alike), the common options and settings, the Spark session whose jobs
SIGINT/SIGTERM cancel, and logging. No job imports `varadhi.cli`, even through another module.

This package imports nothing itself, so `python -m varadhi.jobs.<name>` runs without runpy's
double-import warning.
"""
