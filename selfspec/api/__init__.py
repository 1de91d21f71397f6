"""The Python API: `SelfSpeculativeDecoder` (decoder.py) and its streamed chunks (streaming.py)."""
