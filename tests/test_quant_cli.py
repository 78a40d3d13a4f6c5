"""The quantization flags of pagedkern-serve: --quantization, --kv-cache-dtype, --ignore-eos;
the model line of --stats names the modes; bad values exit with status 2."""

from __future__ import annotations

import pytest

from pagedkern.serving.cli import main


def test_flags_reach_the_engine_and_stats_name_them(capsys):
    argv = ["--model", "synthetic:tiny", "--raw", "--num-blocks", "16", "--max-tokens", "7"]
    argv += ["--quantization", "int8", "--kv-cache-dtype", "fp8", "--ignore-eos", "--stats"]
    assert main([*argv, "a b c"]) == 0
    err = capsys.readouterr().err
    assert "weights int8" in err and "KV cache fp8" in err
    assert ": 7 tokens" in err  # --ignore-eos: exactly max-tokens tokens


@pytest.mark.parametrize("flag,value", [("--quantization", "int3"), ("--kv-cache-dtype", "fp16")])
def test_bad_values_exit_2(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "synthetic:tiny", flag, value, "hi"])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
