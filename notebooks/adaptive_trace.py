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
# # The adaptive threshold over decoding steps
#
# Draft & Verify's adaptive draft exit raises the threshold while the acceptance rate is under its target and
# lowers it otherwise; one policy carries its state across consecutive prompts. Below: the threshold and the
# acceptance rate over every verification step, then how many draft tokens each step accepted.
#
# Records: `python run.py experiment=adaptive_trace` (all figures: `make figures`). Without them this notebook
# reads the shipped sample (SmolLM2 smoke runs) in `notebooks/sample_records/`.

# %% tags=["parameters"]
RECORDS = None  # a run folder; None: the latest outputs/experiments/adaptive_trace/*, else the sample

# %%
# %matplotlib inline
from selfspec.plots import plot_accepted_histogram, plot_adaptive_trace
from selfspec.records.runs import find_records, load_runs

path = find_records("adaptive_trace", RECORDS)
(run,) = load_runs(path)
print(f"{len(run.records)} records of {run.model} from {path}; draft exit: {run.draft_policy}, threshold "
      f"{run.draft_threshold}, target acceptance {run.target_acceptance}")

# %%
plot_adaptive_trace(run.records, target_acceptance=run.target_acceptance, model=run.model, date=run.date)

# %%
plot_accepted_histogram(run.records, model=run.model, date=run.date)
