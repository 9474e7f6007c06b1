"""`seekforge eval` refuses sizes it cannot measure with one line, before any forward pass."""

import pytest

from seekforge.cli import main


@pytest.mark.parametrize("flags, says", [
    (["--num-samples", "0"], "--num-samples 0: perplexity needs at least 1 sample"),
    (["--seq-len", "1000000"], "--seq-len 1000000: the model's context is 1 to 512 tokens"),
    (["--seq-len", "0"], "--seq-len 0: the model's context is 1 to 512 tokens"),
    (["--num-questions", "-1"], "--num-questions -1: pass 0 to skip"),
])
def test_eval_refuses_sizes_it_cannot_measure(capsys, flags, says):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", "tiny", "--num-questions", "0", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
