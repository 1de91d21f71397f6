"""What runs leave behind: per-prompt records and their summary (prompt_records.py), the run folder (run_dir.py),
run folders read back typed (runs.py) and W&B (wandb_logger.py)."""
