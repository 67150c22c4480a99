"""`python -m fusec ...` is the `fusec` command (fusec/cli.py)."""
import sys

from fusec.cli import main

sys.exit(main())
