"""`python -m selfspec ...`: the `selfspec` console command (selfspec/cli.py)."""

from selfspec.cli import main

if __name__ == "__main__":
    main()
