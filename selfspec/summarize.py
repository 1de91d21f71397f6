"""`python -m selfspec.summarize <run dir>`, the documented form: forwards to selfspec/evaluation/summarize.py."""

from selfspec.evaluation.summarize import main

if __name__ == "__main__":
    main()
