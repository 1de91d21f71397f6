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
# # Draft-exit threshold: fixed vs adaptive
#
# Acceptance rate, tokens per verification step and speedup over plain decoding for fixed draft-exit thresholds
# 0.0..1.0 and for Draft & Verify's adaptive threshold started at the same values.
#
# Records: `python run.py -m experiment=threshold_sweep` (all figures: `make figures`). Without them this
# notebook reads the shipped sample (SmolLM2 smoke runs) in `notebooks/sample_records/`.

# %% tags=["parameters"]
RECORDS = None  # a sweep folder; None: the latest outputs/experiments/threshold_sweep/*, else the sample

# %%
# %matplotlib inline
from selfspec.plots import plot_threshold_sweep
from selfspec.records.prompt_records import summarize
from selfspec.records.runs import find_records, load_runs

path = find_records("threshold_sweep", RECORDS)
runs = load_runs(path)
print(f"{len(runs)} runs of {runs[0].model} from {path}")

# %%
for run in runs:
    row = summarize(run.records)["self_spec"]
    print(f"{run.draft_policy:>9} {run.draft_threshold:.2f}: acceptance {row['acceptance_rate']:.3f}, "
          f"{row['mean_accepted_tokens']:.2f} tokens/step, speedup {row['speedup']:.2f}x")

# %%
plot_threshold_sweep(runs, model=runs[0].model, date=runs[0].date)
