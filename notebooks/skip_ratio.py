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
# # How much to skip: share of sublayers skipped vs acceptance and speedup
#
# Seeded random skip sets of 10..50% of the attention and MLP sublayers (two draws per size): skipping more
# makes each draft step cheaper and each draft token less likely to be accepted.
#
# Records: `python run.py -m experiment=skip_ratio` (all figures: `make figures`). Without them this notebook
# reads the shipped sample (SmolLM2 smoke runs) in `notebooks/sample_records/`.

# %% tags=["parameters"]
RECORDS = None  # a sweep folder; None: the latest outputs/experiments/skip_ratio/*, else the sample

# %%
# %matplotlib inline
from selfspec.plots import plot_skip_ratio
from selfspec.records.runs import find_records, load_runs

path = find_records("skip_ratio", RECORDS)
runs = load_runs(path)
print(f"{len(runs)} runs of {runs[0].model} from {path}")
for run in runs:
    print(f"{run.skip_set or run.path.name}: {run.skipped_fraction:.0%} skipped")

# %%
plot_skip_ratio(runs, model=runs[0].model, date=runs[0].date)
