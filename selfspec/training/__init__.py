"""Training the small trained drafts: the Kangaroo adapter (kangaroo.py)."""
