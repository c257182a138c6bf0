"""The command line: `jaxquant demo` runs end to end and its numbers are sane."""

import subprocess
import sys

import pytest

from jaxquant import _cli, _demo


def test_demo_table_runs_quantized_model():
    out = subprocess.run([sys.executable, "-m", "jaxquant", "demo", "--steps", "150"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    names = {(fmt, gran) for fmt, gran, _ in _demo.CONFIGS}
    rows = {}
    for line in out.splitlines():
        key = (line[:14].strip(), line[15:27].strip())
        if key in names:
            rows[key] = line[27:].split()
    assert set(rows) == names, out
    loss = {k: float(v[-1]) for k, v in rows.items()}
    ratio = {k: float(v[1]) for k, v in rows.items()}
    base = loss[("float32", "-")]
    assert abs(loss[("int8", "per-channel")] - base) < 0.01 * base
    assert loss[("int2", "block 16")] > loss[("int4", "block 32")] > base
    assert 0.25 < ratio[("int8", "per-channel")] < 0.26
    assert 0.12 < ratio[("int4", "per-channel")] < 0.135


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["demo", "--steps", "0"])
    assert e.value.code == 2
    assert "--steps must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli.main([])
