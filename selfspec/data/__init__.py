"""Prompt sets: the shipped ones and HumanEval (prompt_sets.py), public prompt-file formats (formats.py), prompt
lengths against the context window (lengths.py) and multi-turn conversations (conversation.py)."""
