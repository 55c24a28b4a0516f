"""`python -m freescale.jobs.workflow`: `freescale pipeline` run as a module, as before the pipeline's parts
moved into this package."""
import sys

from freescale.jobs.workflow.run import main
from freescale.runtime.job_errors import run_job

sys.exit(run_job("pipeline", lambda: main(sys.argv[1:])))
