"""`python -m baton_cli ...` is the `baton` command."""

import sys

from baton_cli.main import main

sys.exit(main())
