"""selfspec: self-speculative decoding over transformers models. The Python API: `SelfSpeculativeDecoder`
(decoder.py); imported on first use, so `import selfspec.<module>` (and run.py --help) stays light."""

API = {"SelfSpeculativeDecoder": "selfspec.api.decoder", "Completion": "selfspec.api.decoder",
       "DEFAULT_DRAFT": "selfspec.api.decoder", "Chunk": "selfspec.api.streaming", "DecodingStats": "selfspec.api.streaming"}


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module 'selfspec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(API[name]), name)
