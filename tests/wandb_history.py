"""Read back what an offline W&B run logged (wandb 0.31 ships no reader for run files)."""

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7  # crc32 (4), length (2), type (1); the file itself starts with a 7-byte W&B header


def records(path: Path):
    data = Path(path).read_bytes()
    pos, payload = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # too little room left in this block for a record header
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def history(run_dir: Path) -> list[dict]:
    """One dict per logged row: {key: value}."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_group(run_dir: Path) -> str:
    """The group the run was started in (wandb.init(group=...))."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    return next(r.run.run_group for r in records(path) if r.WhichOneof("record_type") == "run")


def artifacts(run_dir: Path) -> dict[str, dict]:
    """{name: {"type", "files": {path: digest}, "metadata"}} of each artifact the run logged."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    return {r.artifact.name: {"type": r.artifact.type,
                              "files": {e.path: e.digest for e in r.artifact.manifest.contents},
                              "metadata": json.loads(r.artifact.metadata or "null")}
            for r in records(path) if r.WhichOneof("record_type") == "artifact"}
