"""Where cartridge files come from: a local path, Hugging Face, S3 or Weights & Biases, cached on disk.

Each source returns a local file (and the manifest beside it when the source has one). Remote files are cached
under `cache_dir/<source>/<sanitised id>/`; a cached copy is reused unless `force_redownload`. Ids never become
paths as given: they are reduced to a safe name plus a short hash, so `../../etc` cannot escape the cache.
The remote clients are optional extras, imported only when their source is used.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from final.cartridges.manifest import MANIFEST_SUFFIX
from final.errors import CartridgeError, CartridgeSourceError
from final.protocol.bodies import CARTRIDGE_SOURCES

SOURCES = CARTRIDGE_SOURCES  # final.protocol.bodies: the sources a request may name
# Hugging Face repos are searched for these names (in order) when no `path` names the file.
HF_DEFAULT_FILES = ("cartridge.pt", "cartridge.safetensors", "cache_last.pt")
# Tokasaurus' geoff/cartridges branch: a bare W&B id is a run of this entity/project
WANDB_DEFAULT_PROJECT = "hazy-research/cartridges"
RUN_CONFIG = "config.yaml"  # the cartridges repo's run config, saved beside the cache files
_EXTRAS = {"boto3": "s3", "huggingface_hub": "hf", "wandb": "wandb"}


@dataclass(frozen=True)
class Fetched:
    path: Path
    manifest: Path | None
    config: Path | None = None  # the run's config.yaml, when the source has one (final.cartridges.positions)


def default_cache_dir() -> Path:
    return Path(os.environ.get("FINAL_CACHE", "~/.cache/final")).expanduser() / "cartridges"


def safe_name(text: str, max_len: int = 80) -> str:
    """A file-name-safe form of an id: only [A-Za-z0-9._-], no leading dot, plus a hash of the original."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[:max_len] or "cartridge"
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def fetch(source: str, cartridge_id: str, path: str | None = None, *, cache_dir: str | Path | None = None,
          force_redownload: bool = False) -> Fetched:
    """Return the local cartridge file for `{id, source, path}` (downloading into the cache if needed)."""
    if source not in SOURCES:
        raise CartridgeError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}", file=cartridge_id,
                             field="source")
    if source == "local":
        return _local(path or cartridge_id)
    if source == "wandb":
        cartridge_id = wandb_run_id(cartridge_id)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return {"huggingface": _huggingface, "s3": _s3, "wandb": _wandb}[source](cartridge_id, path, root,
                                                                           force_redownload)


def _import(module: str, source: str, cid: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CartridgeError(f"source {source!r} needs the {module} package: pip install 'final[{_EXTRAS[module]}]' "
                             f"(or pip install {module})", file=cid, field="source") from None


def sanitize_cartridge_id(cartridge_id: str) -> str:
    """Tokasaurus' (geoff/cartridges, tokasaurus/utils.py) folder name for a cartridge id: slashes -> '-',
    `:|*?<>"'` and control characters -> '_', every run of dots -> '_', runs of '_'/'-' -> one '_'. Its fallback
    for an id with nothing left hashes with Python's salted hash(); ours is a stable sha256 prefix."""
    if not cartridge_id or not cartridge_id.strip():
        raise CartridgeError("a cartridge id cannot be empty", field="id")
    out = cartridge_id.replace("/", "-").replace("\\", "-")
    out = re.sub(r'[:|*?<>"\'\x00-\x1f\x7f]', "_", out)
    out = re.sub(r"\.+", "_", out)
    out = re.sub(r"[_-]{2,}", "_", out.strip())
    if not out or out == "_":
        out = f"sanitized_{int(hashlib.sha256(cartridge_id.encode()).hexdigest(), 16) % 1000000}"
    return out


# The file a cartridge folder stands for: Tokasaurus' cartridge.pt, ours, the cartridges repo's cache_last.pt.
FOLDER_FILES = ("cartridge.pt", "cartridge.safetensors", "cache_last.pt")


def folder_file(folder: Path) -> Path | None:
    return next((folder / n for n in FOLDER_FILES if (folder / n).is_file()), None)


def _local(path: str) -> Fetched:
    p = Path(path).expanduser()
    if p.is_dir() and folder_file(p) is not None:  # a cartridge folder (Tokasaurus' local layout, a run's folder)
        p = folder_file(p)
    if not p.is_file():
        raise CartridgeError("file does not exist" if not p.exists() else "is not a regular file", file=str(p),
                             field="path")
    m = p.with_name(p.name + MANIFEST_SUFFIX)
    config = p.parent / RUN_CONFIG
    return Fetched(p, m if m.is_file() else None, config if config.is_file() else None)


def _cached(root: Path, source: str, cid: str, filename: str, force: bool,
            download: Callable[[Path], None]) -> tuple[Path, bool]:
    """Download once into root/source/safe(id)/safe(filename), atomically (temp file + rename).

    Returns the file and whether it was downloaded now (False: a cache hit, no network used).
    """
    folder = root / source / safe_name(cid)
    target = folder / re.sub(r"[^A-Za-z0-9._-]+", "_", Path(filename).name).lstrip(".")
    if target.is_file() and not force:
        return target, False
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=folder)
    os.close(fd)
    try:
        download(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target, True


# ---- S3 ------------------------------------------------------------------------------------------------
def parse_s3(uri: str, cid: str) -> tuple[str, str]:
    m = re.match(r"^s3://([^/]+)/(.+)$", uri)
    if not m:
        raise CartridgeError(f"expected s3://bucket/key, got {uri!r}", file=cid, field="id")
    return m.group(1), m.group(2)


def _s3(cid: str, path: str | None, root: Path, force: bool) -> Fetched:
    boto3 = _import("boto3", "s3", cid)
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, key = parse_s3(path or cid, cid)
    client = boto3.client("s3")  # endpoint, region and credentials from the usual AWS env/config

    def get(k: str) -> Callable[[Path], None]:
        return lambda tmp: client.download_file(bucket, k, str(tmp))

    where = f"{bucket}/{key}"
    try:
        file, fresh = _cached(root, "s3", where, key, force, get(key))
        manifest = file.with_name(file.name + MANIFEST_SUFFIX)
        if fresh:  # the manifest travels with the file: refresh it (or learn it is gone) on every download
            manifest.unlink(missing_ok=True)
            try:
                _cached(root, "s3", where, manifest.name, True, get(key + MANIFEST_SUFFIX))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code", "") not in ("404", "NoSuchKey"):
                    file.unlink()  # never leave a cached file whose manifest we could not check
                    raise
            except BaseException:
                file.unlink()
                raise
    except NoCredentialsError:
        raise CartridgeError("no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)",
                             file=cid, field="source") from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        what = "does not exist" if code in ("404", "NoSuchKey", "NoSuchBucket") else f"cannot be read ({code})"
        raise CartridgeError(f"s3://{bucket}/{key} {what}: {exc}", file=cid, field="id") from None
    except BotoCoreError as exc:  # connection, endpoint and read failures
        raise CartridgeSourceError(f"S3 download failed: {exc}", file=cid, source="s3") from None
    return Fetched(file, manifest if manifest.is_file() else None)


# ---- Hugging Face ----------------------------------------------------------------------------------------
def _huggingface(cid: str, path: str | None, root: Path, force: bool) -> Fetched:
    hub = _import("huggingface_hub", "huggingface", cid)
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.errors import RepositoryNotFoundError

    repo, parts = cid, cid.split("/")
    if len(parts) > 2 and path is None:  # "org/name/file/in/repo.pt": repo ids have exactly one slash
        repo, path = "/".join(parts[:2]), "/".join(parts[2:])
    cache = root / "huggingface"  # huggingface_hub's own cache layout (models--org--name/...)
    unreachable = []

    def download(filename: str) -> Path | None:
        try:
            return Path(hub.hf_hub_download(repo, filename, cache_dir=str(cache), force_download=force))
        except LocalEntryNotFoundError:  # offline (or hub unreachable) and not cached
            unreachable.append(filename)
            return None
        except EntryNotFoundError:
            return None
        except HFValidationError as exc:
            raise CartridgeError(f"not a valid Hugging Face repo id: {exc}", file=cid, field="id") from None
        except RepositoryNotFoundError:
            raise CartridgeError("Hugging Face repository not found (or private without a token)", file=cid,
                                 field="id") from None
        except OSError as exc:  # HTTP and connection errors subclass OSError
            raise CartridgeSourceError(f"Hugging Face download failed: {exc}", file=cid, source="huggingface") \
                from None

    names = [path] if path else list(HF_DEFAULT_FILES)
    for filename in names:
        file = download(filename)
        if file is not None:
            return Fetched(file, download(filename + MANIFEST_SUFFIX), download(RUN_CONFIG))
        if unreachable and not _hf_offline():  # the hub did not answer (after its own retries): no more names
            break
    if unreachable and not _hf_offline():  # not a missing file: the hub did not answer
        raise CartridgeSourceError(f"the Hugging Face hub ({os.environ.get('HF_ENDPOINT', 'huggingface.co')}) is "
                                   f"unreachable and {names[0]} is not in the local cache", file=cid,
                                   source="huggingface")
    why = (" in the local Hugging Face cache, and the hub is offline (HF_HUB_OFFLINE)"
           if unreachable else " in the Hugging Face repo")
    raise CartridgeError(f"none of {names} found{why}", file=cid,
                         field="path" if path else "id")


def _hf_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


# ---- Weights & Biases --------------------------------------------------------------------------------------
def wandb_run_id(cid: str) -> str:
    """A bare run id is a run of hazy-research/cartridges, as Tokasaurus' branch resolves it."""
    return f"{WANDB_DEFAULT_PROJECT}/{cid}" if "/" not in cid else cid


def latest_wandb_cache_file(names: list[str]) -> str | None:
    """The cartridges repo saves `cache-step{N}.pt` / `cache-epoch{N}.pt` to the run; pick the highest N."""
    found = [(int(m.group(2)), n) for n in names if (m := re.fullmatch(r"cache-(epoch|step)(\d+)\.pt", n))]
    if found:
        return max(found)[1]
    return "cache_last.pt" if "cache_last.pt" in names else None


def _wandb(cid: str, path: str | None, root: Path, force: bool) -> Fetched:
    wandb = _import("wandb", "wandb", cid)
    parts = cid.split("/")
    run_path = cid
    if len(parts) > 3 and path is None:  # "entity/project/run_id/file.pt"
        run_path, path = "/".join(parts[:3]), "/".join(parts[3:])
    try:
        run = wandb.Api().run(run_path)
        files = {f.name: f for f in run.files()}
    except Exception as exc:  # wandb raises its own CommError/ValueError family (a missing run too)
        raise CartridgeSourceError(f"cannot open the W&B run {run_path}: {type(exc).__name__}: {exc}", file=cid,
                                   source="wandb") from None
    name = path or latest_wandb_cache_file(sorted(files))
    if name is None or name not in files:
        raise CartridgeError(f"no cartridge file {name or 'cache-step*.pt'} in the run's files", file=cid,
                             field="path" if path else "id")

    def download(member: str) -> Callable[[Path], None]:
        def into(tmp: Path) -> None:
            with tempfile.TemporaryDirectory(dir=tmp.parent) as d:
                files[member].download(root=d, replace=True)
                os.replace(Path(d) / member, tmp)
        return into

    file, fresh = _cached(root, "wandb", cid, name, force, download(name))
    config = file.with_name(RUN_CONFIG)
    if RUN_CONFIG in files and (fresh or not config.is_file()):  # the run's config travels with its file
        _cached(root, "wandb", cid, RUN_CONFIG, True, download(RUN_CONFIG))
    return Fetched(file, None, config if config.is_file() else None)
