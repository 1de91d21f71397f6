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
# # Skip-set search with Optuna
#
# Each trial picks which attention and MLP sublayers the draft skips and decodes the search prompts with it.
# Below: the objective per trial with the best so far, skipped share against tokens per verification step (with
# the Pareto front), and the best skip mask, which the run then evaluates against plain decoding.
#
# Records: `python run.py experiment=search_history` (all figures: `make figures`). Without them this notebook
# reads the shipped sample (SmolLM2 smoke runs) in `notebooks/sample_records/`.

# %% tags=["parameters"]
RECORDS = None  # a search run folder; None: the latest outputs/experiments/search_history/*, else the sample

# %%
# %matplotlib inline
from selfspec.plots import plot_pareto_front, plot_search_history, plot_skip_mask
from selfspec.records.runs import find_records, load_search

path = find_records("search_history", RECORDS)
search = load_search(path)
print(f"{len(search.trials)} trials of {search.model} from {path}; objective: {search.objective}")

# %%
plot_search_history(search.trials, objective=search.objective, model=search.model, date=search.date)

# %%
plot_pareto_front(search.trials, chosen=search.best_trial, model=search.model, date=search.date)

# %%
plot_skip_mask(search.best, search.num_layers, title="Best skip mask of the search", model=search.model,
               date=search.date)
