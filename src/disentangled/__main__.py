"""`python -m disentangled ...`: the same as the `disentangled` console command."""

import sys

from .cli import main

sys.exit(main())
