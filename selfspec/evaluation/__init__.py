"""The evaluation task behind `python run.py`: the run (task.py), the interleaved strategy loop (evaluate.py), the
summary (summarize.py) and Spec-Bench answer files (spec_bench.py)."""
