"""`task=serve` (`make serve`): serve the configured model and strategy over an OpenAI-compatible HTTP API and a page
(app.py; request bodies in schemas.py, the decoding batch in batcher.py, the queue beyond it in queue.py, the page
in static/index.html; large buffers given back when freed in memory.py; the load test of `make serve-bench` in
bench.py, the soak of `make soak` in soak.py)."""

import ipaddress
import warnings
from pathlib import Path

from selfspec.errors import SelfspecError, SelfspecWarning
from selfspec.records.run_dir import check_output_dir
from selfspec.settings import RunSettings, ServeSettings


def serve(settings: RunSettings, out_dir: Path) -> None:
    """Load the model once, build the served strategy and plain decoding over it, and serve until interrupted."""
    try:
        import uvicorn

        from selfspec.serve.app import make_app
        from selfspec.serve.batcher import pool_sizes
    except ImportError as missing:
        raise SelfspecError(f"task=serve needs the serve extra ({missing.name} is missing): "
                            f"pip install -e '.[serve]'") from None
    from selfspec.api.decoder import STRATEGIES, SelfSpeculativeDecoder
    from selfspec.models.loading import load_model
    from selfspec.serve.memory import give_back_large_buffers

    if settings.serve.strategy not in STRATEGIES:
        raise SelfspecError(f"serve.strategy={settings.serve.strategy!r} is not allowed; "
                            f"allowed: {', '.join(STRATEGIES)}")
    warn_if_open(settings.serve)
    # Before the model loads: a server whose run folder (its log) is read-only fails at once, not after a request.
    check_output_dir(out_dir)
    give_back_large_buffers()  # freed large buffers leave the heap unfragmented (serve/memory.py)
    loaded = load_model(settings.model)
    draft_model = load_model(settings.draft_model).model if settings.draft_model else None
    name = settings.serve.strategy
    decoders = {name: SelfSpeculativeDecoder(loaded.model, loaded.tokenizer, settings.skip, settings.draft, name,
                                             draft_model, settings.kangaroo,
                                             settings.searched_skip if name == "self_spec_searched" else None),
                "plain": SelfSpeculativeDecoder(loaded.model, loaded.tokenizer, strategy="plain")}
    if settings.warmup:  # the first forward pays for lazy initialisation; not the first request
        for decoder in decoders.values():
            decoder.generate("Hello", max_new_tokens=4)
    print(f"selfspec: measuring verify costs for batches of {pool_sizes(settings.serve.max_batch)} rows "
          f"(each size's cost-aware exit prices its own verify) ...", flush=True)
    app = make_app(decoders, loaded.name, settings.serve, settings.sampling, settings.constraints)
    host, port = settings.serve.host, settings.serve.port
    print(f"selfspec: serving {loaded.name} ({settings.serve.strategy}) on http://{host}:{port} "
          f"(page: /, API: /v1/chat/completions, /v1/completions)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def warn_if_open(serve: ServeSettings) -> None:
    """One `selfspec: warning:` line when the server listens beyond this machine and no API key guards it."""
    if not serve.api_key and not loopback(serve.host):
        warnings.warn(f"serve.host={serve.host!r} takes requests from other machines and serve.api_key is not set: "
                      f"anyone who reaches port {serve.port} can use the model; set serve.api_key=<secret>, or "
                      f"serve.host=127.0.0.1 to serve this machine only", SelfspecWarning, stacklevel=2)


def loopback(host: str) -> bool:
    """Whether `host` is this machine only: localhost, 127.0.0.0/8 or ::1 (0.0.0.0 and :: are every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False
