"""make gpu-check on the CPU: --quick checks every strategy against plain decoding and times every model shape cut
to 2 layers; without CUDA, --device cuda ends in one line."""

import json

import pytest
import torch

from selfspec import gpu_check
from selfspec.decoding.strategies import REGISTRY


@pytest.mark.usefixtures("one_thread")
def test_quick_check_on_the_cpu_writes_both_tables(tmp_path, capsys):
    gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["quick"] and report["skip_ratios"] == [0.45, 0.5] and report["stage_seconds"]["lossless"] > 0
    lossless = report["lossless"]
    assert [row["strategy"] for row in lossless] == list(REGISTRY)
    assert all(row["equal"] == row["prompts"] == len(gpu_check.TEXTS) for row in lossless)
    drafting = [row for row in lossless if row["strategy"] not in ("plain", "hf_generate", "hf_generate_stock")]
    assert all(row["drafted"] > 0 for row in drafting)  # each one drafted, so matching plain says something
    costs = report["costs"]
    assert [c["shape"] for c in costs] == ["SmolLM2-135M", "Llama-2-7B", "Llama-2-13B"]
    assert [(c["layers"], c["hidden"]) for c in costs] == [(2, 576), (2, 512), (2, 640)]
    for c in costs:
        assert len(c["verify_ms"]) == gpu_check.MAX_Q and c["verify_ratio"][0] == 1.0
        assert all(ms > 0 for ms in c["verify_ms"]) and set(c["draft_ratio"]) == {"0.45", "0.5"}
        assert all(0 < ratio < 2 for ratio in c["draft_ratio"].values())
    markdown = (tmp_path / "gpu_check.md").read_text()
    for table in (gpu_check.lossless_table, gpu_check.costs_table):
        assert table([]).splitlines()[0] in markdown and table([]).splitlines()[0] in printed
    assert "| Llama-2-13B (2 layers, hidden 640) |" in printed


def test_spread_skip_takes_the_ratio_of_both_sublayer_kinds_after_the_first_layer():
    skip = gpu_check.spread_skip(0.45, 40)
    assert len(skip.attn) == len(skip.mlp) == 18 and 0 not in skip.attn and max(skip.attn) < 40
    assert gpu_check.spread_skip(0.5, 2).attn == (1,)


def test_cuda_absent_ends_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--out", str(tmp_path)])  # --device cuda, the default
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("selfspec: error: --device cuda: CUDA is not available here") and "--device cpu" in err
    assert not list(tmp_path.iterdir())
