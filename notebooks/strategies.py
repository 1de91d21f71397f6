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
# # Strategies across prompt categories
#
# Plain decoding against self-speculative decoding with the fixed, threshold and adaptive draft exits: the
# benchmark table, the speedup per prompt category (a dot per prompt), and accepted draft tokens per step.
#
# Records: `python run.py experiment=strategies` (all figures: `make figures`). Without them this notebook
# reads the shipped sample (SmolLM2 smoke runs) in `notebooks/sample_records/`.

# %% tags=["parameters"]
RECORDS = None  # a run folder; None: the latest outputs/experiments/strategies/*, else the sample

# %%
# %matplotlib inline
from selfspec.plots import plot_accepted_histogram, plot_strategy_speedups
from selfspec.records.prompt_records import markdown_table, summarize
from selfspec.records.runs import find_records, load_runs

path = find_records("strategies", RECORDS)
(run,) = load_runs(path)
print(f"{run.model}, records from {path}\n")
print(markdown_table(summarize(run.records)))

# %%
plot_strategy_speedups(run.records, model=run.model, date=run.date)

# %%
plot_accepted_histogram(run.records, model=run.model, date=run.date)
