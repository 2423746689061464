"""`mobizo export` and `mobizo replay` from the command line: bad arguments exit 2 naming the argument."""

import json

import pytest
import torch

from mobizo.cli import main
from shared.adapter import save_adapter
from shared.train_log import log_line, log_record


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"--q": "3"}, "--q"),
        ({"--seq-len": "1"}, "--seq-len"),
        ({"--task": "nope"}, "--task"),
        ({"--out": "prog.bin"}, "--out"),
        ({"--targets": "q_proj,zzz"}, "--targets"),
        ({"--quantize": "8da4w", "--group-size": "48"}, "--group-size"),
    ],
)
def test_export_bad_arguments_exit_2(tiny_model_dir, tmp_path, capsys, change, flag):
    args = {
        "--model": str(tiny_model_dir),
        "--task": "sst2",
        "--q": "2",
        "--batch-size": "4",
        "--seq-len": "32",
        "--out": str(tmp_path / "p.pte"),
    } | change
    argv = ["export"] + [x for kv in args.items() for x in kv]
    if flag == "--out":
        argv[argv.index("--out") + 1] = str(tmp_path / change["--out"])
    assert main(argv) == 2
    assert flag in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_export_missing_model_exits_2(tmp_path, capsys):
    assert (
        main(
            [
                "export",
                "--model",
                str(tmp_path),
                "--task",
                "sst2",
                "--q",
                "1",
                "--batch-size",
                "1",
                "--seq-len",
                "8",
                "--out",
                str(tmp_path / "p.pte"),
            ]
        )
        == 2
    )
    assert "--model" in capsys.readouterr().err


def _adapter(path, b):
    a = {"m.layers.0.q_proj": torch.ones(2, 3)}
    return save_adapter(path, a, {"m.layers.0.q_proj": b}, 2, 4.0, ("q_proj",), "tiny")


def test_replay_rebuilds_and_compares(tmp_path, capsys):
    from shared.replay import replay

    init = _adapter(tmp_path / "init", torch.zeros(5, 2))
    log = tmp_path / "log.jsonl"
    log.write_text("".join(log_line(log_record(k, 100 + k, 0.1, 1e-2, [0.5 * k, -1.0], [1.0] * 4)) for k in range(3)))
    expected = replay(torch.zeros(10), [json.loads(line) for line in log.read_text().splitlines()])
    _adapter(tmp_path / "device", expected.reshape(5, 2))
    assert (
        main(
            [
                "replay",
                "--init",
                str(init),
                "--log",
                str(log),
                "--out",
                str(tmp_path / "out"),
                "--compare",
                str(tmp_path / "device"),
            ]
        )
        == 0
    )
    assert "identical" in capsys.readouterr().out
    _adapter(tmp_path / "tampered", expected.reshape(5, 2) + 1e-6)
    assert (
        main(
            [
                "replay",
                "--init",
                str(init),
                "--log",
                str(log),
                "--out",
                str(tmp_path / "out2"),
                "--compare",
                str(tmp_path / "tampered"),
            ]
        )
        == 1
    )


def test_replay_bad_log_is_named(tmp_path, capsys):
    init = _adapter(tmp_path / "init", torch.zeros(5, 2))
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0}\n')
    assert main(["replay", "--init", str(init), "--log", str(log), "--out", str(tmp_path / "o")]) == 1
    assert "log.jsonl:1" in capsys.readouterr().err
    assert main(["replay", "--init", str(tmp_path / "none"), "--log", str(log), "--out", str(tmp_path / "o")]) == 2
