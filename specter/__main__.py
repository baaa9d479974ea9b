"""`python -m specter`: the `specter` command."""
import sys

from .console import main

sys.exit(main())
