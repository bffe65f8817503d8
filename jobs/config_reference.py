"""Print the configuration reference: ``python -m jobs.config_reference > docs/configuration.md``.

The reference is generated from the config models' JSON schema and this job's own defaults
(:func:`raytrec.config.file_docs.reference_markdown`), and ``tests/unit/test_config_docs.py`` fails
when the committed file differs from this output.
"""

from __future__ import annotations

import sys

from jobs.train import JOB_DEFAULTS
from raytrec.config.file_docs import reference_markdown


def main() -> int:
    sys.stdout.write(reference_markdown(job_defaults=JOB_DEFAULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
