"""`python -m specter`: the `specter` command."""
import sys

from .cli import main

sys.exit(main())
