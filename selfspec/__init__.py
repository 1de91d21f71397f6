"""selfspec: self-speculative decoding over transformers models. The Python API: `SelfSpeculativeDecoder`
(decoder.py); imported on first use, so `import selfspec.<module>` (and run.py --help) stays light."""

API = {"SelfSpeculativeDecoder": "selfspec.decoder", "Completion": "selfspec.decoder",
       "DEFAULT_DRAFT": "selfspec.decoder", "Chunk": "selfspec.streaming", "DecodingStats": "selfspec.streaming"}


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module 'selfspec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(API[name]), name)
