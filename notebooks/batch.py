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
# # Batch size against speed
#
# Plain decoding and the lossless drafting strategies decode the same prompts 1, 2, 4 and 8 at a time (each row
# drafts on its own, one forward verifies every row). The table and the first figure compare each strategy with
# plain decoding at the same batch size; the second shows the aggregate throughput: all tokens over the batches'
# wall times, each batch counted once.
#
# Records: `python run.py -m experiment=batch` (all figures: `make figures`). Without them this notebook reads the
# shipped sample (SmolLM2 smoke runs) in `notebooks/sample_records/`.

# %% tags=["parameters"]
RECORDS = None  # a sweep folder; None: the latest outputs/experiments/batch/*, else the sample

# %%
# %matplotlib inline
from selfspec.plots import batch_table, plot_batch_speedup, plot_batch_throughput
from selfspec.records.runs import find_records, load_runs

path = find_records("batch", RECORDS)
runs = load_runs(path)
print(f"{len(runs)} runs of {runs[0].model} from {path}\n")
print(batch_table(runs))

# %%
plot_batch_speedup(runs, model=runs[0].model, date=runs[0].date)

# %%
plot_batch_throughput(runs, model=runs[0].model, date=runs[0].date)
