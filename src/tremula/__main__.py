"""`python -m tremula` runs the command-line interface."""

from tremula.cli import main

main()
