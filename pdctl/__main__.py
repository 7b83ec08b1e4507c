"""`python -m pdctl` runs the command line."""

from pdctl.cli.app import main

main()
