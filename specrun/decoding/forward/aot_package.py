"""AOTInductor packages in the specrun cache: compiled once per machine and model, then loaded by any later process in
about a second. The 4-bit draft's graph (drafters/ring_package.py) and the compiled layers (compiled.py) are packages.

A package is named by whatever changes what it computes or where it runs (name()); load()
returns its callable or None, write() compiles and puts it in place atomically, then prunes packages long unused. A
package may keep its model's weights apart (shared): it then holds only what the compile derived from them (packed
copies), and load() hands it the model's own tensors, uncopied.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import torch

ABANDONED = 3600  # seconds after which a build's temporary file is a killed process's leftover
KEEP = 8  # packages a folder keeps whatever their age (the latest loaded or built: several models, thread counts)
STALE = 14 * 86400  # seconds unused after which a package past the KEEP newest goes (a new specrun, weights or torch
# names new packages; ~90 MB to ~1 GB each on smollm2, gigabytes on larger models)
SAMPLE = 1 << 14  # bytes hashed at each of 64 places of a large weight (all of a small one)
APART = {"aot_inductor.package_constants_in_so": False,  # the weights as files of the package, not in its library:
         "aot_inductor.package_constants_on_disk_format": "pickle_weights"}  # write() drops the shared ones


def host() -> str:
    """The CPU's features, which inductor compiles for (a package built for AVX-512 must not load on AVX2): Linux's
    flags line, else what the platform and ATen's dispatch say; and ATen's capability where set (ATEN_CPU_CAPABILITY
    narrows the instructions inductor and ATen use on the same CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.strip() for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    flags = flags or f"{platform.machine()} {platform.processor()} {torch.backends.cpu.get_cpu_capability()}"
    return f"{flags}\0{os.environ.get('ATEN_CPU_CAPABILITY', '')}"


def name(prefix: str, tag: str, folder: Path, sources: tuple[str, ...], module: torch.nn.Module, *parts) -> str:
    """`prefix-tag-<hash>.pt2`, the hash of what a package of module computes with and where it runs: the sources its
    trace reads (paths under folder), parts (shapes and constants, by repr), torch and transformers, the CPU's
    features and the threads its loops are compiled for (inductor fixes them at compile time), and module's tensors
    (a large one sampled at 64 places)."""
    import transformers

    h = hashlib.sha256()
    for src in sources:
        h.update((folder / src).read_bytes())
    h.update(repr((torch.__version__, transformers.__version__, host(), torch.get_num_threads(), *parts)).encode())
    for key, t in module.state_dict().items():
        raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        h.update(f"{key}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
        if raw.size <= 64 * SAMPLE:
            h.update(raw.tobytes())
        else:
            for i in range(64):
                at = i * (raw.size - SAMPLE) // 63
                h.update(raw[at : at + SAMPLE].tobytes())
    return f"{prefix}-{tag}-{h.hexdigest()[:20]}.pt2"


def act_id(act) -> str:
    """An activation's identity that stays the same across processes (a function's repr holds its address)."""
    return repr(act) if isinstance(act, torch.nn.Module) else f"{act.__module__}.{act.__qualname__}"


def load(where: Path, shared: dict[str, torch.Tensor] | None = None, pool: dict | None = None):
    """The package's callable, or None where there is none or where the file is damaged (removed, to be built again).
    A sound file that does not load here raises (the caller decides: the draft drafts eagerly, compile_layers auto
    runs the eager layers): another process, or host, may load it. shared: the tensors of a package built with them
    apart, by constant name; pool: the derived constants of packages loaded before (filled here), one copy of each in
    memory where two packages derived the same."""
    if not where.is_file():
        return None
    with _pinned(where) as path:  # its library and its constants from one file, whatever a builder renames meanwhile
        if path is None:
            return None
        try:
            fn = torch._inductor.aoti_load_package(str(path))
            if shared is not None:
                fn.load_constants(_constants(path, shared, pool), check_full_update=True, user_managed=True)
        except Exception:
            if _sound(path):
                raise
            with contextlib.suppress(OSError):
                if os.path.samefile(path, where):  # not a sound one put in place meanwhile
                    where.unlink()
            return None
    with contextlib.suppress(OSError):  # its time of last use, which prune() reads
        os.utime(where)
    return fn


@contextlib.contextmanager
def _pinned(where: Path):
    """A private hard link to the file at where (None: gone), removed after; where itself where links fail. Its name
    ends .pt2, as torch's loader asks (else it warns on stderr)."""
    link = where.parent / f".{where.name}.{os.getpid()}.{time.monotonic_ns()}.load.pt2"
    try:
        os.link(where, link)
    except FileNotFoundError:
        yield None
        return
    except OSError:
        yield where
        return
    try:
        yield link
    finally:
        link.unlink(missing_ok=True)


def _weights_config(archive) -> tuple[str, dict]:
    """The weights_config.json of a package's archive: its record name and {constant: [file, shape, stride, offset]}."""
    name = next(n for n in archive.get_file_names() if n.endswith("weights_config.json"))
    return name, json.loads(archive.read_string(name))


def _constants(where: Path, shared: dict[str, torch.Tensor], pool: dict | None) -> dict[str, torch.Tensor]:
    """Every constant of a package built with weights apart: the shared ones as given, the rest from its files (or the
    pool's equal tensor)."""
    from torch.export.pt2_archive._package import PT2ArchiveReader

    out = {}
    with PT2ArchiveReader(str(where)) as archive:
        for name, (file, shape, stride, offset) in _weights_config(archive)[1].items():
            t = shared.get(name)
            if t is None:
                t = torch.load(io.BytesIO(archive.read_bytes(f"data/weights/{file}"))).as_strided(shape, stride, offset)
                t = t if pool is None else _pooled(pool, t)
            elif tuple(t.shape) != tuple(shape):
                raise ValueError(f"package {where.name}: constant {name} is {tuple(shape)}, the model's {tuple(t.shape)}")
            out[name] = t
    return out


def _pooled(pool: dict, t: torch.Tensor) -> torch.Tensor:
    """The pool's tensor equal to t (same shape, strides, dtype and values), else t, added to the pool."""
    flat = t.detach().reshape(-1)
    key = (tuple(t.shape), t.stride(), t.dtype, flat[:: max(1, flat.numel() // 64)].float().sum().item())
    for other in pool.setdefault(key, []):
        if torch.equal(other, t):
            return other
    pool[key].append(t)
    return t


def _drop_shared(built: str, out: str, shared: dict[str, torch.Tensor]) -> None:
    """Copy the package at built to out without the files of the shared constants (the model holds them)."""
    from torch.export.pt2_archive._package import PT2ArchiveReader, PT2ArchiveWriter

    with PT2ArchiveReader(built) as archive, PT2ArchiveWriter(out) as copy:
        files: dict[str, list[str]] = {}  # a file's constants (torch stores views of one storage in one file)
        for name, (file, *_) in _weights_config(archive)[1].items():
            files.setdefault(f"data/weights/{file}", []).append(name)
        drop = {f for f, names in files.items() if all(n in shared for n in names)}
        for n in archive.get_file_names():  # the writer adds its own format, version and serial records
            if n not in drop and n not in ("archive_format", "archive_version") and not n.startswith(".data/"):
                copy.write_bytes(n, archive.read_bytes(n))


def prune(folder: Path, prefix: str, now: float | None = None) -> list[Path]:
    """Remove the packages `prefix-*.pt2` in folder unused (not loaded nor built) for STALE seconds, past the KEEP most
    recently used; returns those removed. One another process has open stays readable to it (POSIX unlink); one removed
    before it opened it is built again. Marking use needs write access: the cache is its user's own (SPECRUN_CACHE)."""
    now = time.time() if now is None else now
    used = []
    for f in folder.glob(f"{prefix}-*.pt2"):
        with contextlib.suppress(OSError):
            used.append((f.stat().st_mtime, f))
    removed = []
    for mtime, f in sorted(used, reverse=True)[KEEP:]:
        if now - mtime > STALE:
            with contextlib.suppress(OSError):
                f.unlink()
                removed.append(f)
    return removed


@contextlib.contextmanager
def _building(program, options: dict):
    """Held while a program is compiled and packaged: one build of a graph at a time among the processes that share
    inductor's cache. Inductor writes a graph's generated files (its library, its JSON) at one path of that cache, under
    its own lock, but packages them after releasing it: a second process compiling the same graph meanwhile rewrote a
    file the first was packaging (an empty JSON in the package). Keyed by the graph (its code, shapes and options), so
    models of one architecture build one at a time and other graphs in parallel."""
    from filelock import FileLock
    from torch._inductor.codecache import get_lock_dir

    key = hashlib.sha256(repr((str(program), sorted(options.items()))).encode()).hexdigest()[:20]
    with FileLock(os.path.join(get_lock_dir(), f"specrun-build-{key}.lock")):  # get_lock_dir makes the folder
        yield


def _sound(where: Path) -> bool:
    try:
        with zipfile.ZipFile(where) as z:
            return z.testzip() is None
    except (OSError, zipfile.BadZipFile):
        return False


def write(program, options: dict, where: Path, prefix: str, shared: dict[str, torch.Tensor] | None = None,
          pool: dict | None = None):
    """Compile the exported program ahead of time with inductor's options (the shared tensors kept apart), load it, and
    only then put it in place atomically (concurrent builders: the last rename wins); builds a process killed left
    behind (temporary files and load()'s links), and packages long unused, are removed. Returns the loaded callable."""
    where.parent.mkdir(parents=True, exist_ok=True)
    for old in where.parent.glob(f".{prefix}-*"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_ctime > ABANDONED:  # a link's ctime is when it was made
                old.unlink()
    tmps = []
    try:
        for _ in range(1 if shared is None else 2):
            fd, tmp = tempfile.mkstemp(prefix=f".{where.name}.", suffix=".pt2", dir=where.parent)
            os.close(fd)
            tmps.append(tmp)
        with warnings.catch_warnings(), _building(program, options):
            warnings.simplefilter("ignore", FutureWarning)  # torch's own notices from inside the packaging
            torch._inductor.aoti_compile_and_package(program, package_path=tmps[0],
                                                     inductor_configs={**options, **(APART if shared is not None else {})})
        if shared is not None:
            _drop_shared(tmps[0], tmps[1], shared)
        final = Path(tmps[-1])
        fn = load(final, shared, pool)  # raises where it does not load: nothing put in place
        if fn is None:
            raise RuntimeError(f"the package just built for {where.name} is damaged")
        os.chmod(final, 0o644)  # mkstemp makes it private
        os.replace(final, where)
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
    prune(where.parent, prefix)
    return fn
