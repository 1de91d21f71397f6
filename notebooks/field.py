# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The field on Spec-Bench's task types
#
# Every self-speculative and training-free method against plain decoding, in the shape of Spec-Bench's leaderboard:
# speedup per task type, mean accepted tokens, overall speedup and whether every greedy output equalled plain's.
#
# Records: `python run.py experiment=field` (all figures: `make figures`). Without them this notebook reads the
# shipped sample in `notebooks/sample_records/`: a tiny random Llama's run, which shows the layout, not speedups.

# %% tags=["parameters"]
RECORDS = None  # a run folder; None: the latest outputs/experiments/field/*, else the sample

# %%
# %matplotlib inline
from selfspec.evaluation.field import field_table
from selfspec.plots import plot_field_speedups
from selfspec.records.runs import find_records, load_runs

path = find_records("field", RECORDS)
(run,) = load_runs(path)
print(f"{run.model}, records from {path}\n")
print(field_table(run.records, greedy=run.sampling_label == "greedy"))

# %%
plot_field_speedups(run.records, greedy=run.sampling_label == "greedy", model=run.model, date=run.date)
