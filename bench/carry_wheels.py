"""Make .whl/: the wheels that travel with the working tree to a lent GPU machine (docs/gpu-check.md), within its
64 MiB limit. flashinfer's wheel (62 MB) is rewritten without the kernel sources of features specrun does not call.

    python bench/carry_wheels.py            # then: make gpu-check there (it installs .whl/*.whl with --no-index)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = ["flashinfer-python==0.7.2.post1", "apache-tvm-ffi==0.1.15.post2"]  # flashinfer's one import-time need there
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]
LIMIT = 64 * 2**20  # what travels: the tree and the carried paths together
CSRC = "flashinfer/data/csrc/"
# kernel sources the batch prefill/decode JIT modules never read (they use csrc's top-level files and the headers)
DROP_DATA = ("flashinfer/experimental/", "flashinfer/moe_ep/kernel_src/", "flashinfer/fused_moe/backends/")


def download(out: Path, python: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "-d", str(out)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + WHEELS, check=True)


def keep(name: str) -> bool:
    if name.startswith(CSRC) and "/" in name[len(CSRC):]:
        return name[len(CSRC):].startswith(("nv_internal/", "fmha_v2/"))
    return name.endswith(".py") or not name.startswith(DROP_DATA)


def trim(wheel: Path) -> None:
    """Rewrite the wheel in place without the dropped files; RECORD lists exactly what is left, with its hashes."""
    src = zipfile.ZipFile(wheel)
    record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
    rows, tmp = [], wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if info.filename == record or not keep(info.filename):
                continue
            data = src.read(info)
            dst.writestr(info, data)
            if not info.is_dir():
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append(f"{info.filename},sha256={digest},{len(data)}")
        dst.writestr(record, "\n".join(rows + [f"{record},,"]) + "\n")
    src.close()
    tmp.replace(wheel)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / ".whl")
    ap.add_argument("--python", default="3.12", help="The GPU machine's Python (its torch venv): 3.12.")
    args = ap.parse_args()
    args.out.mkdir(exist_ok=True)
    download(args.out, args.python)
    for wheel in args.out.glob("flashinfer_python-*.whl"):
        trim(wheel)
    carried = sum(p.stat().st_size for p in args.out.glob("*.whl"))
    tree = int(subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.count(b"\0"))
    sizes = {p.name: f"{p.stat().st_size / 2**20:.1f} MiB" for p in sorted(args.out.glob("*.whl"))}
    print(f"{sizes}; carried {carried / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} (plus the tree's {tree} files)")
    return 0 if carried < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
