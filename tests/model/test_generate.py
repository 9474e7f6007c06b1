import json
import subprocess
import sys

import pytest
import torch

from seekforge.config import preset
from seekforge.model.generate import generate, sample_next
from seekforge.model.model import build_model
from seekforge.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_greedy_cached_generate_equals_full_recompute():
    model = build_model(preset("tiny")).eval()
    prompt = [5, 17, 300, 2, 99]
    new = generate(model, prompt, max_new_tokens=12)
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert new == ids[len(prompt):]


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert sample_next(logits).item() == 3
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=g)) for _ in range(50)}
    assert draws <= {2, 3}
    draws = {int(sample_next(logits, 1.0, top_p=0.5, generator=g)) for _ in range(50)}
    assert draws == {3}  # p(3) = 0.64 ≥ 0.5 alone


def test_seeded_sampling_is_reproducible():
    model = build_model(preset("tiny")).eval()
    a = generate(model, [1, 2, 3], 10, temperature=1.0, top_p=0.9, seed=7)
    b = generate(model, [1, 2, 3], 10, temperature=1.0, top_p=0.9, seed=7)
    assert a == b


def test_prompt_too_long_is_a_clear_error():
    model = build_model(preset("tiny")).eval()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, [1] * 500, max_new_tokens=100)


def test_byte_tokenizer_roundtrip_and_chat():
    tok = load_tokenizer("byte")
    assert tok.decode(tok.encode("héllo ✓", add_bos=True)) == "héllo ✓"
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert text == "User: 2+2?\nAssistant:"


def test_hf_tokenizer_json_with_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template}))
    tok = HFTokenizer(tmp_path)
    assert tok.encode("hello world", add_bos=True) == [0, 2, 3]
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "<s>hello "
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFTokenizer(tmp_path / "missing")
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_generate_cli_on_a_preset():
    out = subprocess.run([sys.executable, "-m", "seekforge", "generate", "--model", "tiny", "--prompt", "Hi",
                          "--max-new-tokens", "4"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("Hi") and "tokens/s" in out
    err = subprocess.run([sys.executable, "-m", "seekforge", "generate", "--model", "nope"],
                         capture_output=True, text=True)
    assert err.returncode == 2 and "neither a preset" in err.stderr
