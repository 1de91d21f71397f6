"""Training the small trained drafts, the feature head and the Kangaroo adapter (train_draft.py), on the model's own
generations (draft_data.py)."""
