"""CartridgeService: the one object the inference engine and the server talk to about cartridges.

load = fetch (sources) -> checksum (manifest) -> safe load (format) -> validate vs manifest and model -> store
admission (may evict) -> engine.load_cartridge. The engine is anything with `load_cartridge(id, keys, values)`
and `unload_cartridge(id)`: the embedded engine, or the SGLang backend's injector.

Requests name cartridges by id (`generate(..., cartridge=...)`) or by Tokasaurus spec (`{id, source,
force_redownload}`: `ensure` loads them on demand); `using(ids)` holds references while a request runs so the
store never evicts a cartridge under it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from final.cartridges.format import CartridgeKV, load_cartridge
from final.cartridges.manifest import (MANIFEST_SUFFIX, ModelShape, check_matches_manifest, check_matches_model,
                                       read_manifest, verify_checksum)
from final.cartridges.positions import DEFAULT_POSITIONS, check_positions, detect_positions, to_after_prefix
from final.cartridges.sources import Fetched, fetch
from final.cartridges.store import CartridgeStore, StoreMetrics
from final.errors import CartridgeError, CartridgeSourceError
from final.protocol.cartridge_spec import REQUEST_CARTRIDGE_KEYS, check_cartridge_name, check_cartridge_spec

logger = logging.getLogger(__name__)

SPEC_KEYS = REQUEST_CARTRIDGE_KEYS


class CartridgeService:
    def __init__(self, engine: Any, model: Any = None, *, cache_dir: str | Path | None = None,
                 budget_bytes: int | None = None, allow_nonfinite: bool = False, fetch_timeout_s: float | None = None):
        """`model`: what cartridges must match (ModelSpec, HF config, model folder); defaults to engine.spec.
        fetch_timeout_s: how long a load waits for a remote source (limits.cartridge_fetch_s; None: no bound)."""
        self.engine = engine
        # a model folder (its config.json) for the RoPE of `positions: from_zero` cartridges
        self.model_dir = model if isinstance(model, (str, Path)) else getattr(engine, "model_path", None)
        self.fetch_timeout_s = fetch_timeout_s
        self._downloads: dict[tuple, concurrent.futures.Future] = {}  # remote fetches in flight, shared by callers
        self._downloads_lock = threading.Lock()
        shape = ModelShape.of(model if model is not None else engine.spec)
        max_len = getattr(engine, "max_model_len", None)
        if isinstance(max_len, int) and max_len < shape.max_context:
            shape = ModelShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, max_len)
        self.model = shape
        self.cache_dir = cache_dir
        self.allow_nonfinite = allow_nonfinite
        self.store = CartridgeStore(budget_bytes, on_evict=self._evicted)
        self._load_lock = threading.RLock()  # using() holds it across ensure + acquire
        # A cartridge is a KV cache made by one set of base weights. weights_version counts the engine's updates;
        # retired: cartridges unloaded by an update (id -> (the version they were made for, the update's)), refused
        # by requests until loaded again explicitly (load_cartridge: the caller says the file fits the new weights)
        self.weights_version = 0
        self._retired: dict[str, tuple[int, int]] = {}

    # ---- loading -------------------------------------------------------------------------------------------
    def load(self, id: str | None = None, source: str = "local", path: str | None = None,  # noqa: A002
             force_redownload: bool = False, pin: bool = False, allow_nonfinite: bool | None = None,
             positions: str | None = None, explicit: bool = True) -> str:
        """Load a cartridge (or find it resident) and return its id.

        `local`: the file is `path`, or `id` when no path is given (Tokasaurus passes the path as the id); a
        folder stands for its cartridge.pt, cartridge.safetensors or cache_last.pt.
        `huggingface`: `id` is the repo ("org/name", files cartridge.pt|.safetensors or cache_last.pt) or
        "org/name/file/in/repo.pt"; `path` names the file instead. `s3`: `id` (or `path`) is s3://bucket/key.
        `wandb`: `id` is entity/project/run_id[/file] or a bare run id of hazy-research/cartridges (as Tokasaurus);
        default file: the latest cache-step*.pt of the run.
        `positions`: after_prefix | from_zero (final.cartridges.positions); None: the manifest's, else what the
        run's config.yaml beside the file says, else after_prefix.
        `explicit`: False for a request's on-demand load, which a cartridge retired by a weight update refuses.
        The download and the file's checks run outside the service's lock: a slow source holds up no other load.
        """
        cid = id or path
        if not isinstance(cid, str) or not cid:
            raise CartridgeError("needs an id or a path", field="id")
        check_cartridge_name(cid, "id" if id else "path")  # before a name meets the filesystem or a download
        if id and path is not None:
            check_cartridge_name(path, "path")
        if positions is not None:
            check_positions(positions, file=cid)
        if not explicit:
            self.check_current(cid)
        with self._load_lock:
            if not force_redownload and self.store.lookup(cid) is not None:
                if pin:
                    self.store.pin(cid)
                return cid
        with os_errors(cid):
            fetched = self._fetch(source, cid, path, force_redownload)
            stamp = local_stamp(fetched.path) if source == "local" else None  # before the read (see local_stamp)
            nonfinite = self.allow_nonfinite if allow_nonfinite is None else allow_nonfinite
            cart, manifest = self.read(fetched.path, fetched.manifest, allow_nonfinite=nonfinite)
            cart, positions = self.as_served(cart, manifest, positions, fetched.config, str(fetched.path))
        with self._load_lock:
            return self._admit(cid, cart, pin=pin, info={"source": source, "path": str(fetched.path),
                                                           "positions": positions, "stamp": stamp,
                                                           "manifest": manifest.__dict__ if manifest else None})

    def _fetch(self, source: str, cid: str, path: str | None, force: bool) -> Fetched:
        """fetch(), for a remote source on its own thread and waited for at most fetch_timeout_s. One download
        per file at a time: callers asking for one already under way wait for it. A download past the bound
        finishes (or fails) in the background, into the cache."""
        if source == "local":
            return fetch(source, cid, path, cache_dir=self.cache_dir)
        key = (source, cid, path)
        with self._downloads_lock:
            future = self._downloads.get(key)
            if future is None:
                future = concurrent.futures.Future()
                self._downloads[key] = future
                threading.Thread(target=self._download, args=(future, key, force), daemon=True,
                                 name=f"final-cartridge-fetch-{source}").start()
        try:
            return future.result(timeout=self.fetch_timeout_s)
        except concurrent.futures.TimeoutError:
            raise CartridgeSourceError(f"no cartridge file within {self.fetch_timeout_s:g} s "
                                       "(limits.cartridge_fetch_s); the download goes on in the background",
                                       file=cid, source=source, reason="timeout") from None

    def _download(self, future: concurrent.futures.Future, key: tuple, force: bool) -> None:
        source, cid, path = key
        try:
            future.set_result(fetch(source, cid, path, cache_dir=self.cache_dir, force_redownload=force))
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            future.set_exception(exc)
        finally:
            with self._downloads_lock:
                self._downloads.pop(key, None)

    def read(self, file: str | Path, manifest_file: str | Path | None = None, *,
             allow_nonfinite: bool = False) -> tuple[CartridgeKV, Any]:
        """Checksum, load and validate a cartridge file against its manifest (if any) and the model."""
        name = str(file)
        manifest = None
        if manifest_file is not None:
            manifest = read_manifest(manifest_file)
            if Path(file).exists():
                verify_checksum(file, manifest)
        cart = load_cartridge(file, allow_nonfinite=allow_nonfinite)
        if manifest is not None:
            check_matches_manifest(cart, manifest, name)
        check_matches_model(cart, self.model, name)
        return cart, manifest

    def as_served(self, cart: CartridgeKV, manifest: Any, positions: str | None, config: Any,
                  name: str) -> tuple[CartridgeKV, str]:
        """A file's cartridge in the convention the engine serves (after_prefix), and the convention it was in:
        the caller's choice, else the manifest's, else the run's config.yaml beside it, else after_prefix."""
        positions = positions or (manifest.positions if manifest else None) or detect_positions(config) \
            or DEFAULT_POSITIONS
        return to_after_prefix(cart, positions, self.model_dir, name), positions

    def read_served(self, file: str | Path, *, positions: str | None = None) -> CartridgeKV:
        """A local file (or run folder) as load() would serve it: checked, positions applied, not admitted."""
        if positions is not None:
            check_positions(positions, file=str(file))
        with os_errors(str(file)):
            fetched = self._fetch("local", str(file), str(file), False)
            cart, manifest = self.read(fetched.path, fetched.manifest)
            return self.as_served(cart, manifest, positions, fetched.config, str(fetched.path))[0]

    def add(self, cartridge_id: str, cart: CartridgeKV, *, pin: bool = False) -> str:
        """Serve an in-memory cartridge (e.g. one just built from text)."""
        check_matches_model(cart, self.model, cartridge_id)
        with self._load_lock:
            return self._admit(cartridge_id, cart, pin=pin, info={"source": "memory"})

    def _admit(self, cid: str, cart: CartridgeKV, *, pin: bool, info: dict) -> str:
        # Admission first (it may evict to make room), then the engine; undo the admission if the engine refuses.
        existed = self.store.get(cid) is not None
        self.store.put(cid, cart.nbytes, pin=pin, info={**info, "weights_version": self.weights_version})
        try:
            self.engine.load_cartridge(cid, cart.keys, cart.values)
        except BaseException:
            if not existed:
                self.store.remove(cid)
            raise
        self._retired.pop(cid, None)
        logger.info("cartridge %s loaded: %d tokens, %d bytes", cid, cart.num_tokens, cart.nbytes)
        return cid

    def unload(self, cartridge_id: str) -> bool:
        """Remove a cartridge; requests already running with it finish normally."""
        with self._load_lock:
            known = self.store.remove(cartridge_id)
            return bool(self.engine.unload_cartridge(cartridge_id)) or known

    # ---- weight updates ------------------------------------------------------------------------------------
    def weights_changed(self, version: int, keep: bool = False) -> list[str]:
        """The engine now serves weights `version`. keep=False: every resident cartridge (made for the old
        weights) is unloaded and refused by requests until it is loaded again explicitly; keep=True: they stay,
        served stale (their entries say since which version). Returns the ids retired or kept."""
        with self._load_lock:
            ids = self.store.ids()
            for cid in ids:
                entry = self.store.get(cid)
                made_for = entry.info.get("weights_version", 0) if entry is not None else self.weights_version
                if keep:
                    entry.info.setdefault("stale_since", version)
                    continue
                self._retired[cid] = (made_for, version)
                self.store.remove(cid)
                self.engine.unload_cartridge(cid)
            self.weights_version = version
            return ids

    def retired_ids(self) -> list[str]:
        """Cartridges a weight update unloaded: requests naming them get check_current's error, not "unknown"."""
        return list(self._retired)

    def check_current(self, cartridge_id: str) -> None:
        """Refuse a cartridge that a weight update retired (see weights_changed)."""
        if cartridge_id in self._retired:
            made_for, update = self._retired[cartridge_id]
            raise CartridgeError(
                f"was made for weights version {made_for} and was unloaded when the weights were updated (version "
                f"{update}): rebuild it for the new weights and load it again (load_cartridge), or update with "
                "keep_cartridges=True to keep serving it stale", file=cartridge_id, field="weights_version")

    def _evicted(self, cartridge_id: str) -> None:
        logger.info("cartridge %s evicted (LRU, over budget)", cartridge_id)
        self.engine.unload_cartridge(cartridge_id)

    # ---- requests ------------------------------------------------------------------------------------------
    def ensure(self, specs: Iterable[Mapping[str, Any] | str], *, refresh: bool = True) -> tuple[str, ...]:
        """Load on demand the cartridges a request names (Tokasaurus specs or ids); return their ids in order.
        refresh=False: a resident cartridge is used as it is, whatever force_redownload says."""
        ids = []
        for i, spec in enumerate(specs):
            if isinstance(spec, str):
                self.check_current(spec)
                if spec not in self.store:
                    raise CartridgeError("unknown cartridge id; load it first or pass {id, source}", file=spec,
                                         field=f"cartridges[{i}]")
                ids.append(spec)
                continue
            args = parse_spec(spec, f"cartridges[{i}]")
            if not refresh:
                args["force_redownload"] = False
            elif args.get("force_redownload") and args["source"] == "local":
                args["force_redownload"] = self._stale(args)
            ids.append(self.load(**args, explicit=False))
        return tuple(ids)

    def _stale(self, args: dict[str, Any]) -> bool:
        """A request's force_redownload on a local file means "the newest file, as asked": False when the
        resident copy was read from the file as it is now (local_stamp) with the positions the request names, so
        an unchanged file is not read again."""
        entry = self.store.get(args.get("id") or args.get("path"))
        if entry is None or args.get("positions") not in (None, entry.info.get("positions")):
            return True
        try:  # the file a folder stands for now (its cartridge.pt may have appeared, cache_last.pt moved)
            file = fetch("local", args.get("id") or args["path"], args.get("path")).path
        except CartridgeError:
            return True  # load() says why
        stamp = local_stamp(file)
        return stamp is None or entry.info.get("stamp") != stamp

    @contextlib.contextmanager
    def using(self, items: Iterable[Any]) -> Iterator[tuple[str, ...]]:
        """Hold a reference on every cartridge of a request for its duration.

        `items`: ids, Tokasaurus specs ({id, source, ...}, loaded on demand), or one tuple of those per row.
        Loading happens first, outside the lock (a download blocks no other request); then the references are
        taken under the lock, together with a reload of any cartridge evicted in between.
        """
        flat = [c for item in items for c in ((item,) if isinstance(item, (str, Mapping)) else tuple(item or ()))]
        self.ensure(flat)  # downloads and file checks, outside the lock
        with self._load_lock:  # resident now (one evicted meanwhile comes back from its local file)
            held = self.store.acquire(self.ensure(flat, refresh=False))
        try:
            yield held
        finally:
            self.store.release(held)

    def pin(self, cartridge_id: str) -> None:
        self.store.pin(cartridge_id)

    def unpin(self, cartridge_id: str) -> None:
        self.store.unpin(cartridge_id)

    def ids(self) -> list[str]:
        return self.store.ids()

    def metrics(self) -> StoreMetrics:
        return self.store.metrics()


@contextlib.contextmanager
def os_errors(cid: str) -> Iterator[None]:
    """What the OS refuses while a cartridge is fetched and read (a file made unreadable, one that vanishes between
    the checks and the read, a folder on the way that cannot be searched) is the caller's CartridgeError naming the
    cartridge, never an OSError: a server would answer it with a 500 and the file's absolute path."""
    try:
        yield
    except OSError as exc:
        why = exc.strerror or type(exc).__name__  # strerror: the reason without the file name
        raise CartridgeError(f"cannot read the file: {why}", file=cid, field="path") from None


def local_stamp(file: str) -> tuple | None:
    """What changes when a local cartridge file (or the manifest beside it) is rewritten: inode, size, mtime and
    ctime in ns. A request's `force_redownload: true` on a local file (`ensure`) reloads it only when this differs,
    so a cartridge trained between steps is seen at the next request and an unchanged one is not re-read (seed
    000's on-policy loop sends force_redownload with every request); an explicit load() always reads. Taken before the read: a write racing the read changes it again, and the
    next request reloads. None when the file cannot be stat'ed (fetch then says why)."""
    path = Path(file).expanduser()
    stamps = []
    for p in (path, path.with_name(path.name + MANIFEST_SUFFIX)):
        try:
            st = p.stat()
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            stamps.append(None)
    return tuple(stamps) if stamps[0] is not None else None


def parse_spec(spec: Mapping[str, Any], where: str = "cartridges") -> dict[str, Any]:
    """Validate one `{id, source, force_redownload, path}` dict (seed 000's shape) into load() arguments."""
    out = check_cartridge_spec(dict(spec) if isinstance(spec, Mapping) else spec, where, SPEC_KEYS, request=True)
    out.setdefault("source", "local")
    return out
