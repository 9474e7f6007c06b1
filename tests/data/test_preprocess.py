"""`seekforge preprocess` end to end: JSONL/text in, Megatron files out, same tokens as tokenizing
directly, identical output for any worker count."""

import json

import pytest

from seekforge.cli import main
from seekforge.data.dataset import build_datasets
from seekforge.data.indexed import IndexedDataset
from seekforge.data.preprocess import preprocess
from seekforge.model.tokenizer import ByteTokenizer

TEXTS = [f"Document {i}: {'héllo wörld ' * (i % 5)}the end." for i in range(600)]  # > 2 chunks


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)]
    lines.insert(3, "")  # blank lines are skipped, not documents
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_end_to_end(tmp_path, corpus, capsys):
    main(["preprocess", "--input", str(corpus), "--tokenizer", "byte", "--output-prefix", str(tmp_path / "out"),
          "--workers", "2"])
    printed = capsys.readouterr().out
    assert "600 documents" in printed and "out_text_document.bin" in printed

    tokenizer = ByteTokenizer()
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert len(ds) == len(TEXTS) and ds.dtype.__name__ == "uint16"
    for i, text in enumerate(TEXTS):
        assert ds[i].tolist() == tokenizer.encode(text) + [tokenizer.eos_token_id]
    # and the trainer can read it
    train, valid, _ = build_datasets(str(tmp_path / "out_text_document"), tokenizer, 32, 0, (100, 8, 0), "969,30,1")
    assert len(train) >= 100 and len(valid) >= 8


def test_workers_do_not_change_output(tmp_path, corpus):
    one = preprocess(corpus, "byte", str(tmp_path / "one"), workers=1, progress=False)
    two = preprocess(corpus, "byte", str(tmp_path / "two"), workers=2, progress=False)
    assert one["tokens"] == two["tokens"]
    for a, b in zip(one["files"], two["files"], strict=True):
        assert open(a, "rb").read() == open(b, "rb").read()


def test_text_input_without_eod(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\nsecond line\n")
    summary = preprocess(path, "byte", str(tmp_path / "t"), append_eod=False, progress=False)
    ds = IndexedDataset(summary["prefix"])
    assert [bytes(ds[i].astype("uint8")).decode() for i in range(len(ds))] == ["first line", "second line"]


def test_bad_input_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        preprocess(path, "byte", str(tmp_path / "b"), workers=2, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]  # no temporaries, no half-written pair
    path.write_text('{"content": "ok"}\n')
    with pytest.raises(ValueError, match=r"no 'text' field \(has \['content'\]\); pass --json-key"):
        preprocess(path, "byte", str(tmp_path / "b"), progress=False)
    path.write_text('{"text": 123}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: the 'text' field is a int, not text"):
        preprocess(path, "byte", str(tmp_path / "b"), progress=False)
    path.write_text('\n{"text": ""}\n')
    with pytest.raises(ValueError, match=r"holds no documents"):
        preprocess(path, "byte", str(tmp_path / "b"), progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


def test_hf_tokenizer(tmp_path, corpus):
    """A tokenizer.json directory works in the workers, and its EOS ends each document."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))

    summary = preprocess(corpus, str(tmp_path), str(tmp_path / "hf"), workers=2, progress=False)
    ds = IndexedDataset(summary["prefix"])
    eos = tokenizer.token_to_id("</s>")
    assert len(ds) == len(TEXTS)
    for i in (0, 7, 599):
        assert ds[i].tolist() == tokenizer.encode(TEXTS[i], add_special_tokens=False).ids + [eos]


@pytest.mark.parametrize("workers", [1, 2])
def test_non_utf8_input_is_one_line_naming_the_place(tmp_path, capsys, workers):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\nsecond caf\u00e9 line\n".encode("latin-1"))  # é is the byte 0xe9
    with pytest.raises(SystemExit) as exit_info:
        main(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "out"),
              "--workers", str(workers)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]  # after the progress bar
    assert "Traceback" not in err and message.startswith("seekforge preprocess: error: ")
    assert f"{path}:2: not UTF-8 (byte 0xe9 at offset 21)" in message and "iconv" in message
    assert [p.name for p in tmp_path.iterdir()] == ["latin1.txt"]


def test_worker_errors_are_one_line_too(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"  # the pool re-raises a worker's error from its own code
    path.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(SystemExit):
        main(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "out"), "--workers", "2"])
    assert "Traceback" not in capsys.readouterr().err
