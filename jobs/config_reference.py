"""Print the configuration reference: ``python -m jobs.config_reference > docs/configuration.md``.

The reference is generated from the config classes
(:func:`raytrec.config_file_docs.reference_markdown`), and ``tests/test_config_docs.py`` fails
when the committed file differs from this output.
"""

from __future__ import annotations

import sys

from raytrec.config_file_docs import reference_markdown


def main() -> int:
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
