"""`python -m selfspec.figures [--outputs outputs] [--out outputs/figures]`, the documented form: forwards to
selfspec/plots/figures.py."""

from selfspec.plots.figures import main

if __name__ == "__main__":
    main()
