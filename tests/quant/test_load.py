"""quant/load.load_model: a quantized checkpoint goes through model/load.load_model's checks too."""

import copy

import pytest
from tokenizers import Tokenizer, models

from seekforge.errors import UserError
from seekforge.quant.calibrate import quantize_model
from seekforge.quant.checkpoint import save_compressed
from seekforge.quant.linear import QuantLinear
from seekforge.quant.load import load_model
from seekforge.quant.recipe import Recipe


def test_a_quantized_checkpoint_with_the_wrong_tokenizer_is_refused(tiny, tmp_path):
    """The quantized path used to skip the tokenizer-fits check: ids past vocab_size then failed inside the
    embedding, mid-request."""
    model = copy.deepcopy(tiny)
    quantize_model(model, Recipe(scheme="w8a8-dynamic"), progress=False)
    save_compressed(model, tmp_path)
    loaded, _ = load_model(str(tmp_path))
    assert isinstance(loaded.layers[0].self_attn.q_a_proj, QuantLinear)
    words = {f"w{i}": i for i in range(tiny.cfg.vocab_size + 1)}
    Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match=f"has {tiny.cfg.vocab_size + 1} tokens but the model"):
        load_model(str(tmp_path))
