"""`python -m specter.cli`: the `specter` command."""
import sys

from . import main

sys.exit(main())
