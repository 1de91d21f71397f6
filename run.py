"""selfspec entry point: `python run.py [group=option ...]` (see conf/config.yaml and the README); the same as the
`selfspec` console command (selfspec/cli.py)."""

from selfspec.cli import main

if __name__ == "__main__":
    main()
