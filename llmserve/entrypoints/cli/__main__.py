"""`python -m llmserve.entrypoints.cli`: the `llmserve` command."""

import sys

from llmserve.entrypoints.cli import main

sys.exit(main())
