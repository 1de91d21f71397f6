"""Every failure to reach or read the Hugging Face hub ends in one `selfspec: error:` line naming the model id, what
failed and the way out: no DNS, connection refused, a time-out, a gated model (401/403), no such id (404), the hub
down (5xx), a download cut off halfway, a cached snapshot a cut-off download left without weights. The hub stands in
at huggingface_hub's own HTTP client (set_client_factory with an httpx2 MockTransport) or, for the download itself,
as the error snapshot_download raises; the run.py test points HF_ENDPOINT at a loopback port that refuses."""

import hashlib
import os

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import file_download
from huggingface_hub.errors import XetDownloadError

from selfspec import cli
from selfspec.errors import SelfspecError
from selfspec.models import checkpoints
from selfspec.models.loading import load_model
from selfspec.models.tiny import byte_tokenizer, tiny_model

from helpers import cfg, run_py

REPO = "some-org/some-model"
OFFLINE_WAY_OUT = "set HF_HUB_OFFLINE=1 and model.path=<folder>"


@pytest.fixture
def hub(monkeypatch):
    """Online, with huggingface_hub's HTTP client answered by `hub.answer(request)` (a response, or an httpx2 error
    raised as a failing network raises it)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    stand_in = type("Hub", (), {"answer": None, "requests": []})()

    def answer(request):
        stand_in.requests.append(request)
        return stand_in.answer(request)

    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(answer)))
    yield stand_in
    huggingface_hub.set_client_factory(huggingface_hub.utils._http.default_client_factory)


def run_py_error(capsys, settings) -> str:
    """What run.py prints when loading the model fails: its one stderr line (after checking it ends the run)."""
    with pytest.raises(SelfspecError) as error:
        load_model(settings)
    capsys.readouterr()  # the download's own line, where it began
    with pytest.raises(SystemExit):
        cli.fail(str(error.value))
    printed = capsys.readouterr().err
    assert printed.count("\n") == 1 and str(error.value) == printed.removeprefix("selfspec: error: ").strip(), printed
    return printed


def raising(error):
    def fail(*args, **kwargs):
        raise error
    return fail


def status(code, **headers):
    return lambda request: httpx2.Response(code, headers=headers, json={"error": "from the stand-in hub"})


@pytest.mark.parametrize("answer, parts", [
    (raising(httpx2.ConnectError("[Errno -2] Name or service not known")),
     ["could not be reached (ConnectError: [Errno -2] Name or service not known)", OFFLINE_WAY_OUT]),
    (raising(httpx2.ConnectError("[Errno 111] Connection refused")),
     ["could not be reached (ConnectError: [Errno 111] Connection refused)", OFFLINE_WAY_OUT]),
    (raising(httpx2.ConnectTimeout("timed out")),
     ["could not be reached (ConnectTimeout: timed out); raise HF_HUB_ETAG_TIMEOUT=<seconds>", OFFLINE_WAY_OUT]),
    (raising(httpx2.ReadTimeout("")),
     ["could not be reached (ReadTimeout: no message); raise HF_HUB_ETAG_TIMEOUT=<seconds>", OFFLINE_WAY_OUT]),
    (status(401, **{"X-Error-Code": "GatedRepo"}), [f"is gated: accept its terms on https://huggingface.co/{REPO}",
                                                    "hf auth login"]),
    (status(403, **{"X-Error-Code": "GatedRepo"}), ["is gated", "hf auth login"]),
    (status(403), ["the Hugging Face hub refused", "(HTTP 403): log in with access to it (hf auth login",
                   OFFLINE_WAY_OUT]),
    (status(404, **{"X-Error-Code": "RepoNotFound"}), ["is neither a local directory nor a model on the Hugging Face "
                                                       "hub; check the id", "model.path=<folder>"]),
    (status(503), ["could not be reached (HTTP 503)", OFFLINE_WAY_OUT]),
], ids=["dns", "refused", "connect-timeout", "read-timeout", "gated-401", "gated-403", "forbidden", "no-such-id",
        "hub-down"])
def test_each_way_the_hub_fails_ends_in_one_line_with_the_model_id_and_the_way_out(hub, capsys, tmp_path,
                                                                                   monkeypatch, answer, parts):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub.answer = answer
    printed = run_py_error(capsys, cfg("hub", path=REPO))
    assert f"model.path={REPO!r}" in printed and all(part in printed for part in parts), printed
    asked = [request for request in hub.requests if f"/api/models/{REPO}" in str(request.url)]
    assert asked and asked[0].extensions["timeout"]["connect"] == huggingface_hub.constants.HF_HUB_ETAG_TIMEOUT


def test_an_id_the_hub_cannot_hold_is_no_model(hub, capsys):
    hub.answer = status(200)
    printed = run_py_error(capsys, cfg("hub", path="not/a/hub/id"))
    assert "model.path='not/a/hub/id' is neither a local directory nor a model on the Hugging Face hub" in printed
    assert hub.requests == []


@pytest.mark.parametrize("error", [
    httpx2.RemoteProtocolError("peer closed connection without sending complete message body"),  # after its retries
    httpx2.ReadTimeout("The read operation timed out"),
    httpx2.ReadError("[Errno 104] Connection reset by peer"),
    OSError("Consistency check failed: file should be of size 2147483648 but has size 1048576 (model.safetensors)."),
    XetDownloadError("connection lost"),
])
def test_a_download_cut_off_halfway_says_to_run_again(monkeypatch, capsys, error):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(checkpoints.HfApi, "model_info", lambda self, repo, **options: type("Info", (), {
        "config": {"model_type": "llama"}, "siblings": []})())
    monkeypatch.setattr(checkpoints, "snapshot_download", raising(error))
    printed = run_py_error(capsys, cfg("hub", path=REPO))
    assert printed.startswith(f"selfspec: error: the download of model.path={REPO!r} from the Hugging Face hub was "
                              f"cut off ({type(error).__name__}: ")
    assert "run again to continue it (the files already downloaded stay in the Hugging Face cache)" in printed
    assert ("raise HF_HUB_DOWNLOAD_TIMEOUT=<seconds>" in printed) == isinstance(error, httpx2.TimeoutException)


class CutOff(httpx2.SyncByteStream):
    """A file's body that stops halfway, as a dropped connection ends it."""

    def __init__(self, data: bytes):
        self.data = data

    def __iter__(self):
        yield self.data[:len(self.data) // 2]
        raise httpx2.RemoteProtocolError("peer closed connection without sending complete message body")


class ServedCheckpoint:
    """The hub's answers about REPO, a tiny Llama checkpoint, for model_info and snapshot_download; the bodies of
    the files in `cut` stop halfway."""

    def __init__(self, folder, cut=()):
        tiny_model("llama", num_layers=2, hidden_size=32).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
        self.files, self.cut, self.sha = {f.name: f.read_bytes() for f in folder.iterdir()}, set(cut), "a" * 40

    def __call__(self, request):
        path = request.url.path
        if path.startswith(f"/api/models/{REPO}/tree/"):
            return httpx2.Response(200, json=[{"type": "file", "path": name, "size": len(data),
                                               "oid": hashlib.sha1(data).hexdigest()}
                                              for name, data in self.files.items()])
        if path.startswith(f"/api/models/{REPO}"):  # model_info, and repo_info at a revision
            return httpx2.Response(200, json={"id": REPO, "sha": self.sha, "config": {"model_type": "llama"},
                                              "siblings": [{"rfilename": name, "size": len(data)}
                                                           for name, data in self.files.items()]})
        name = path.rpartition("/")[2]  # /<repo>/resolve/<sha>/<name>
        data = self.files[name]
        headers = {"X-Repo-Commit": self.sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                   "Content-Length": str(len(data))}
        if request.method == "GET" and name in self.cut:
            return httpx2.Response(200, headers=headers, stream=CutOff(data))
        return httpx2.Response(200, headers=headers, content=b"" if request.method == "HEAD" else data)


def test_a_download_the_network_cuts_off_ends_in_one_line_and_the_next_run_finishes_it(hub, tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(file_download.time, "sleep", lambda seconds: None)  # between the hub's own retries
    hub.answer = ServedCheckpoint(tmp_path / "checkpoint", cut={"model.safetensors"})
    printed = run_py_error(capsys, cfg("hub", path=REPO))
    assert printed.startswith(f"selfspec: error: the download of model.path={REPO!r} from the Hugging Face hub was "
                              f"cut off (RemoteProtocolError: peer closed connection without sending complete "
                              f"message body); run again to continue it")
    snapshot = tmp_path / "hub" / "models--some-org--some-model" / "snapshots" / hub.answer.sha
    finished = {file.name for file in snapshot.iterdir()}
    assert "model.safetensors" not in finished and not list((tmp_path / "hub").rglob("*.incomplete"))
    hub.answer.cut, hub.requests[:] = set(), []
    assert load_model(cfg("hub", path=REPO)).model.config.model_type == "llama"
    fetched = {r.url.path.rpartition("/")[2] for r in hub.requests if r.method == "GET" and "/resolve/" in r.url.path}
    assert fetched == set(hub.answer.files) - finished  # what the first run finished stayed in the cache


def cached_snapshot(tmp_path, monkeypatch, weights: bool):
    """REPO in a Hugging Face cache under tmp_path: a checkpoint, or (weights=False) its config and tokenizer only."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--some-org--some-model"
    snapshot = repo / "snapshots" / "abc123"
    tiny_model("llama", num_layers=2, hidden_size=32).save_pretrained(snapshot)
    byte_tokenizer().save_pretrained(snapshot)
    if not weights:
        (snapshot / "model.safetensors").unlink()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return snapshot


def test_a_snapshot_a_cut_off_download_left_says_to_finish_it_offline(tmp_path, monkeypatch, capsys):
    cached_snapshot(tmp_path, monkeypatch, weights=False)
    printed = run_py_error(capsys, cfg("hub", path=REPO))
    assert f"model.path={REPO!r}: its snapshot in the local Hugging Face cache" in printed
    assert "lacks weights, as a cut-off download leaves it; run again without HF_HUB_OFFLINE" in printed


def test_a_snapshot_a_cut_off_download_left_is_downloaded_again_online(hub, tmp_path, monkeypatch, capsys):
    cached_snapshot(tmp_path, monkeypatch, weights=False)
    hub.answer = raising(httpx2.ConnectError("[Errno 111] Connection refused"))
    assert "could not be reached (ConnectError" in run_py_error(capsys, cfg("hub", path=REPO))
    assert hub.requests  # the hub was asked for the rest, not the snapshot loaded without weights


def test_a_sharded_snapshot_with_a_shard_missing_lacks_weights(tmp_path, monkeypatch):
    snapshot = cached_snapshot(tmp_path, monkeypatch, weights=True)
    assert checkpoints._has_weights(snapshot)
    (snapshot / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors", '
                                                           '"b": "model-00002-of-00002.safetensors"}}')
    (snapshot / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert not checkpoints._has_weights(snapshot)


@pytest.mark.slow  # a run.py subprocess
def test_run_py_with_the_hub_unreachable_ends_in_one_line_and_no_traceback(tmp_path):
    env = {name: value for name, value in os.environ.items() if name != "HF_HUB_OFFLINE"}
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_ETAG_TIMEOUT": "2",
            "HF_HUB_DOWNLOAD_TIMEOUT": "2"}  # port 9 (discard) refuses on loopback
    result = run_py("model=hf", f"model.path={REPO}", "logger=none", out_dir=tmp_path / "run", env=env, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"selfspec: error: model.path={REPO!r} is not in the local Hugging Face cache and the hub at "
        f"http://127.0.0.1:9 could not be reached (ConnectError: [Errno 111] Connection refused); "
        f"{OFFLINE_WAY_OUT} of a copy made elsewhere"]
