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
# # Greedy decoding vs sampling
#
# Self-speculative decoding stays lossless when sampling (speculative rejection sampling), but a sampled draft
# token is accepted less often than a greedy one matches. Acceptance, tokens per verification step and speedup
# for each sampling setting of the sweep.
#
# Records: `python run.py -m experiment=sampling` (all figures: `make figures`). Without them this notebook
# reads the shipped sample (SmolLM2 smoke runs) in `notebooks/sample_records/`.

# %% tags=["parameters"]
RECORDS = None  # a sweep folder; None: the latest outputs/experiments/sampling/*, else the sample

# %%
# %matplotlib inline
from selfspec.plots import plot_sampling
from selfspec.records.runs import find_records, load_runs

path = find_records("sampling", RECORDS)
runs = load_runs(path)
print(f"{len(runs)} runs of {runs[0].model} from {path}: {', '.join(run.sampling_label for run in runs)}")

# %%
plot_sampling(runs, model=runs[0].model, date=runs[0].date)
